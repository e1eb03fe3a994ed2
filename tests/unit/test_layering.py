"""No module imports a later stage of the data path: model -> sampler -> runtime -> demo -> quantize ->
export (onnx) -> engine -> repository (serving) -> k8s (deploy). Orchestrators (`pipeline.build`, `pipeline.bench`, `pipeline.cli`, `pipeline.doctor`) may import
any stage; the foundation modules (errors, atomic writes, resources, targets, build layout) none.

An import is any way code gets a module: `import`/`from` statements at any depth (lazy ones inside functions
count), `importlib.import_module("pkg.mod")` / `__import__`, and "pkg.mod:attr" target strings. On top of the
climbing rule: no import circle anywhere (a lazy import that dodges one is still one), and every entry
point in pyproject.toml names a module and attribute that exist and have a place on the path.

Task knowledge stays behind the prompt format: outside `pipeline.demo`, only the demo's own commands import
it (the entry point in pyproject.toml is how everything else reaches the demo's format)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

from pipeline.resources import PACKAGE_DIR

ROOT = PACKAGE_DIR.parent
STAGES = {  # package prefix -> position on the data path
    "pipeline.errors": 0,
    "pipeline.atomic": 0,
    "pipeline.resources": 0,
    "pipeline.targets": 0,
    "pipeline.builddir": 0,
    "pipeline.limits": 0,
    "pipeline.endpoints": 0,
    "pipeline.stages": 0,
    "pipeline.threads": 0,
    "pipeline.devices": 0,
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


TARGET = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)$")  # "pkg.mod:attr", as entry points spell it
IMPORT_CALLS = {"import_module", "__import__"}


def imported_modules(source: str) -> list[tuple[str, int]]:
    """Every absolute import in a module, at any depth (lazy imports inside functions count too), string
    imports (`importlib.import_module("x")`, `__import__("x")`) and "module:attr" target strings."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports pkg.sub (a module) or takes sub from pkg: the deepest module named
            found += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in IMPORT_CALLS and isinstance(node.args[0].value, str):
                found.append((node.args[0].value, node.lineno))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = TARGET.match(node.value)
            if m:
                found.append((m.group(1), node.lineno))
    return found


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module the rules cover."""
    paths = [*root.glob("pipeline/**/*.py"), *root.glob("quantize/*.py"), *root.glob("model_repo/*.py")]
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted(paths)
    }


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (each name resolved to the deepest module it names)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for name, _ in imported_modules(path.read_text()):
            parts = name.split(".")
            for k in range(len(parts), 0, -1):
                target = ".".join(parts[:k])
                if target in modules:
                    if target != module:
                        edges.add(target)
                    break
        graph[module] = edges
    return graph


def import_circles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def entry_point_problems(root: Path) -> list[str]:
    """Every pyproject.toml entry point (scripts included) names a module of ours that defines the
    attribute at top level and has a place on the data path."""
    project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
    groups = {"scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    modules = module_files(root)
    problems = []
    for group, entries in groups.items():
        for name, target in entries.items():
            m = TARGET.match(target)
            where = f"pyproject.toml [{group}] {name} = {target!r}"
            if not m or m.group(1) not in modules:
                problems.append(f"{where}: no such module")
                continue
            tree = ast.parse(modules[m.group(1)].read_text())
            defined = {
                n.name
                for n in tree.body
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            } | {
                t.id
                for n in tree.body
                if isinstance(n, ast.Assign | ast.AnnAssign)
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Name)
            }
            if m.group(2) not in defined:
                problems.append(f"{where}: {m.group(1)} defines no {m.group(2)!r}")
            elif stage_of(m.group(1)) is None:
                problems.append(f"{where}: {m.group(1)} has no place on the data path")
    return problems


def later_stage_imports(root: Path) -> list[str]:
    problems = []
    for module, path in module_files(root).items():
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


# the demo's own commands (`dgpipe train`, `dgpipe eval sudoku`), and the constrained-decoding benchmark
DEMO_IMPORTERS = {"pipeline.cli.train", "pipeline.cli.eval", "pipeline.bench.guided"}


def demo_imports(root: Path) -> list[str]:
    """Imports of `pipeline.demo` (spelled any way `imported_modules` finds) from outside it and DEMO_IMPORTERS."""
    problems = []
    for module, path in module_files(root).items():
        if module in DEMO_IMPORTERS or stage_of(module) == STAGES["pipeline.demo"]:
            continue
        for name, line in imported_modules(path.read_text()):
            if name == "pipeline.demo" or name.startswith("pipeline.demo."):
                problems.append(f"{path.relative_to(root)}:{line} imports {name}")
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


def test_no_import_circle():
    assert import_circles(ROOT) == []


def test_entry_points_name_real_placed_targets():
    assert entry_point_problems(ROOT) == []


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


@pytest.mark.parametrize(
    ("module_path", "source"),
    [
        ("pipeline/runtime/x.py", "import importlib\nimportlib.import_module('pipeline.onnx.backend')\n"),
        ("pipeline/model/x.py", "def f():\n    return __import__('pipeline.runtime.session')\n"),
        ("pipeline/runtime/x.py", "SHIPPED = {'fmt': 'pipeline.demo.prompt_format:SudokuFormat'}\n"),
    ],
)
def test_the_rule_catches_a_string_import(tmp_path: Path, module_path: str, source: str):
    path = tmp_path / module_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert len(later_stage_imports(tmp_path)) == 1


@pytest.mark.parametrize(
    "sources",
    [
        {"a.py": "import quantize.b\n", "b.py": "from quantize.a import x\n"},  # module level
        {"a.py": "def f():\n    from quantize.b import y\n", "b.py": "import quantize.a\n"},  # lazy
        {
            "a.py": "import quantize.b\n",
            "b.py": "import importlib\nimportlib.import_module('quantize.c')\n",
            "c.py": "X = 'quantize.a:f'\n",
        },  # through a string import and a target string
    ],
)
def test_circles_are_found_however_the_import_is_spelled(tmp_path: Path, sources: dict[str, str]):
    (tmp_path / "quantize").mkdir()
    for name, source in sources.items():
        (tmp_path / "quantize" / name).write_text(source)
    assert import_circles(tmp_path) == [sorted(f"quantize.{n[:-3]}" for n in sources)]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ('sudoku = "pipeline.demo.nothere:Fmt"', "no such module"),
        ('sudoku = "pipeline.demo.fmt:Missing"', "defines no 'Missing'"),
        ('sudoku = "pipeline.nowhere.fmt:Fmt"', "no place on the data path"),
    ],
)
def test_entry_point_rule_catches_a_broken_target(tmp_path: Path, entry: str, problem: str):
    for d in ("pipeline/demo", "pipeline/nowhere"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "fmt.py").write_text("class Fmt:\n    pass\n")
    (tmp_path / "pyproject.toml").write_text(f'[project.entry-points."dgpipe.prompt_formats"]\n{entry}\n')
    problems = entry_point_problems(tmp_path)
    assert len(problems) == 1 and problem in problems[0], problems


def test_only_the_demos_own_commands_import_the_demo():
    assert demo_imports(ROOT) == []


@pytest.mark.parametrize(
    ("module_path", "source", "problem"),
    [
        (
            "pipeline/bench/x.py",
            "def f():\n    from pipeline.demo import sudoku\n",
            "pipeline/bench/x.py:2 imports pipeline.demo.sudoku",
        ),
        (
            "pipeline/cli/bench.py",
            "import pipeline.demo.evaluate\n",
            "pipeline/cli/bench.py:1 imports pipeline.demo.evaluate",
        ),
        (
            "quantize/x.py",
            "from pipeline.demo.sudoku import DEFAULT_GIVENS\n",
            "quantize/x.py:1 imports pipeline.demo.sudoku.DEFAULT_GIVENS",
        ),
        (
            "pipeline/runtime/x.py",
            "FMT = 'pipeline.demo.prompt_format:SudokuFormat'\n",
            "pipeline/runtime/x.py:1 imports pipeline.demo.prompt_format",
        ),
    ],
)
def test_the_demo_rule_catches_an_import_from_outside(
    tmp_path: Path, module_path: str, source: str, problem: str
):
    """Only the offender is reported: the demo importing itself and the demo's own commands are allowed."""
    allowed = {
        "pipeline/cli/train.py": "from pipeline.demo.sudoku import DEFAULT_GIVENS\n",
        "pipeline/demo/x.py": "from pipeline.demo import sudoku\n",
        module_path: source,
    }
    for rel, text in allowed.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert demo_imports(tmp_path) == [problem]
