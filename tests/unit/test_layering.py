"""No module imports a later stage of the data path: model -> sampler -> runtime -> demo -> quantize ->
export (onnx) -> engine -> repository (serving) -> k8s (deploy). Orchestrators (`pipeline.build`, `pipeline.bench`, `pipeline.cli`, `pipeline.doctor`) may import
any stage; the foundation modules (errors, atomic writes, resources, targets, build layout) none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
STAGES = {  # package prefix -> position on the data path
    "pipeline.errors": 0,
    "pipeline.atomic": 0,
    "pipeline.resources": 0,
    "pipeline.targets": 0,
    "pipeline.builddir": 0,
    "pipeline.stages": 0,
    "pipeline.threads": 0,
    "pipeline.model": 1,
    "pipeline.sampler": 2,
    "pipeline.runtime": 3,
    "pipeline.demo": 4,
    "quantize": 5,
    "pipeline.onnx": 6,
    "pipeline.engine": 7,
    "pipeline.serving": 8,
    "model_repo": 8,
    "pipeline.deploy": 9,
}
# may import any stage, and no stage may import them
ORCHESTRATORS = {"pipeline.build": 10, "pipeline.bench": 10, "pipeline.cli": 10, "pipeline.doctor": 10}


def stage_of(module: str) -> int | None:
    ranks = {**STAGES, **ORCHESTRATORS}
    for prefix in sorted(ranks, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return ranks[prefix]
    return None


def imported_modules(source: str) -> list[tuple[str, int]]:
    """Every absolute import in a module, at any depth (lazy imports inside functions count too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return found


def later_stage_imports(root: Path) -> list[str]:
    problems = []
    for path in sorted(
        [*root.glob("pipeline/**/*.py"), *root.glob("quantize/*.py"), *root.glob("model_repo/*.py")]
    ):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        own = stage_of(module)
        if own is None or module.startswith(tuple(ORCHESTRATORS)):
            continue
        for name, line in imported_modules(path.read_text()):
            other = stage_of(name)
            if other is not None and other > own:
                problems.append(
                    f"{path.relative_to(root)}:{line} (stage {own}) imports {name} (stage {other})"
                )
    return problems


def test_every_module_has_a_place_on_the_data_path():
    """A new package must be placed on the path (or named an orchestrator) for the rule to cover it."""
    unplaced = []
    for path in ROOT.glob("pipeline/**/*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module != "pipeline" and stage_of(module) is None:
            unplaced.append(module)
    assert not unplaced, f"modules with no stage: {sorted(unplaced)}"


def test_no_module_imports_a_later_stage():
    assert later_stage_imports(ROOT) == []


@pytest.mark.parametrize(
    ("module_path", "source"),
    [
        ("pipeline/runtime/x.py", "def f():\n    from pipeline.onnx.backend import OrtBackend\n"),
        ("quantize/x.py", "import pipeline.deploy.render\n"),
        ("pipeline/targets.py", "from pipeline.engine import select\n"),
    ],
)
def test_the_rule_catches_a_lazy_or_module_level_climb(tmp_path: Path, module_path: str, source: str):
    path = tmp_path / module_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert len(later_stage_imports(tmp_path)) >= 1
