"""No module imports a later stage of the data path, at module level or lazily (parsed, not imported).

Order: foundation < model < sampler < runtime < demo < quantize < onnx < engine < serving/model_repo <
deploy; the orchestrators (build, bench, cli, doctor) may import anything and nothing may import them.
Checked here for the checkpoint-to-export stages; the later stages are listed in ORDER so extending
CHECKED is one line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = [
    ("pipeline.errors", "pipeline.atomic", "pipeline.resources", "pipeline.targets", "pipeline.builddir"),
    ("pipeline.model", "pipeline.models"),
    ("pipeline.sampler",),
    ("pipeline.runtime",),
    ("pipeline.demo",),
    ("quantize",),
    ("pipeline.onnx",),
    ("pipeline.engine",),
    ("pipeline.serving", "model_repo"),
    ("pipeline.deploy",),
]
ORCHESTRATORS = ("pipeline.build", "pipeline.bench", "pipeline.cli", "pipeline.doctor")
CHECKED = (
    "pipeline/model",
    "pipeline/sampler",
    "pipeline/runtime",
    "pipeline/demo",
    "quantize",
    "pipeline/onnx",
)


def _within(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _stage(mod: str) -> int | None:
    if _within(mod, ORCHESTRATORS):
        return len(ORDER)
    return next((i for i, group in enumerate(ORDER) if _within(mod, group)), None)


def test_no_module_imports_a_later_stage():
    bad = []
    for folder in CHECKED:
        for f in sorted((ROOT / folder).rglob("*.py")):
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            own = _stage(mod)
            assert own is not None and own < len(ORDER), mod
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    other = _stage(name)
                    if other is not None and other > own:
                        bad.append(f"{f.relative_to(ROOT)}:{node.lineno} {mod} imports {name}")
    assert not bad, "\n".join(bad)
