"""The serving code stays in small pieces: the Triton model is a thin adapter over the serving core, and no
function in pipeline/serving grows into a god function holding every handler."""

from __future__ import annotations

import ast

from pipeline.resources import PACKAGE_DIR, TRITON_MODEL_SOURCE

ADAPTER_MAX_LINES = 150
FUNCTION_MAX_LINES = 60


def _span(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_triton_model_is_a_thin_adapter():
    tree = ast.parse(TRITON_MODEL_SOURCE.read_text())
    (model,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TritonPythonModel"]
    assert _span(model) <= ADAPTER_MAX_LINES


def long_functions(root) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _span(node) > FUNCTION_MAX_LINES:
                found.append(
                    f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({_span(node)} lines)"
                )
    return found


def test_no_function_in_serving_is_over_60_lines():
    assert long_functions(PACKAGE_DIR / "serving") == []
