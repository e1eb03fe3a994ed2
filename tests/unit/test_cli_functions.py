"""The CLI stays thin: every function in pipeline/cli parses, calls one library function and prints, so
none grows past a screen. Long option lists shrink through shared Annotated option types."""

from __future__ import annotations

import ast

from pipeline.resources import PACKAGE_DIR

MAX_LINES = 60
CLI = PACKAGE_DIR / "cli"


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function, nested ones included, longer than `limit` lines (decorators and
    signature count: a 40-parameter command is as hard to read as a 40-line body)."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_check_counts_signature_and_body():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    assert long_functions(f"def f(\n    a: int,\n) -> None:\n{body}\n") == [("f", MAX_LINES + 3)]
    assert long_functions("def g() -> None:\n    pass\n") == []


def test_no_function_in_the_cli_is_over_60_lines():
    found = [
        f"{path.name}:{name} ({lines} lines)"
        for path in sorted(CLI.glob("*.py"))
        for name, lines in long_functions(path.read_text())
    ]
    assert not found, f"over {MAX_LINES} lines, move the work into the library: {found}"


def test_an_unexpected_error_maps_to_exit_1_with_its_type():
    """What `dgpipe build --json` reports for an error the CLI has no line for (a library's RuntimeError,
    an out-of-memory): exit 1, its type and text; the mapped ones keep theirs."""
    from pipeline.cli import errors
    from pipeline.errors import DgpipeError

    assert errors.mapped(RuntimeError("CUDA out of memory")) == (1, "error: RuntimeError: CUDA out of memory")
    assert errors.mapped(DgpipeError("bad", "fix it")) == (2, "error: bad (fix it)")
