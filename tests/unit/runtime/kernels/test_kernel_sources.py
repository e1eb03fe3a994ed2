"""Rules every Triton kernel's source keeps so that the Triton versions users' torch brings compute what the
tested one does (docs/engine.md, "The Triton that users' torch brings"): torch 2.11 brings Triton 3.6 and
torch 2.12 brings 3.7, whose unary minus on floats is 0 - x (+0.0 for +0.0, where torch's negation gives
-0.0), and which convert fp32 to E4M3 on sm_89 in two roundings. The kernels are held to torch's values bit
for bit, so they negate through `kernels.jit.quant.negated` and convert to E4M3 through
`kernels.jit.quant.e4m3` only."""

from __future__ import annotations

import ast

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent


def jit_functions() -> list[tuple[str, ast.FunctionDef]]:
    """(module path, function) for every `@triton.jit` function under pipeline/."""
    found = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                found.append((str(path.relative_to(ROOT)), node))
    return found


def test_the_kernels_are_found():
    modules = {m for m, _ in jit_functions()}
    assert modules == {
        f"pipeline/runtime/kernels/{m}.py" for m in ("moe", "jit/chains", "jit/quant", "jit/routing")
    }
    assert len(jit_functions()) >= 30


def test_no_kernel_negates_a_value_with_unary_minus():
    """`-x` on a tensor is 0 - x under Triton before 3.8; a constexpr or a literal is negated in Python."""
    negations = []
    for module, fn in jit_functions():
        constexprs = {
            a.arg for a in fn.args.args if a.annotation and "constexpr" in ast.unparse(a.annotation)
        }
        for node in ast.walk(fn):
            if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
                operand = node.operand
                if not (isinstance(operand, ast.Constant) or getattr(operand, "id", None) in constexprs):
                    negations.append(f"{module}: {fn.name}: {ast.unparse(node)}")
    assert negations == []


def test_every_e4m3_conversion_goes_through_the_grid():
    """Only `e4m3` names E4M3 as a type to convert to: it rounds to E4M3's grid in fp32 first."""
    named = [
        f"{module}: {fn.name}"
        for module, fn in jit_functions()
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute) and node.attr == "float8e4nv"
    ]
    assert named == ["pipeline/runtime/kernels/jit/quant.py: e4m3"]
