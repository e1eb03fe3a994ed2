"""Each limit default, the served model name and each default port is written once, in its own module
(pipeline/limits.py, pipeline/endpoints.py; the calibration default in quantize/defaults.py); every other use derives from there. Read from the sources'
syntax trees, so docstrings and comments may name a value while code may not spell it again."""

from __future__ import annotations

import ast
import re

import yaml

from pipeline import endpoints
from pipeline.limits import Limits
from pipeline.resources import PACKAGE_DIR, k8s_dir
from quantize.defaults import CALIB_SIZE

ROOT = PACKAGE_DIR.parent
LIMITS_FILE, ENDPOINTS_FILE = "pipeline/limits.py", "pipeline/endpoints.py"
OWN_FILES = {LIMITS_FILE, "quantize/defaults.py"}  # where the limits and the calibration default live
DEFAULTS = {**Limits().model_dump(), "calib_size": CALIB_SIZE}
PORTS = (endpoints.HTTP_PORT, endpoints.GRPC_PORT, endpoints.METRICS_PORT, endpoints.OPENAI_PORT)
PORT_IN_TEXT = re.compile(r":(" + "|".join(map(str, PORTS)) + r")\b")


def sources() -> dict[str, ast.AST]:
    files = [*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("quantize/*.py"), *ROOT.glob("model_repo/*.py")]
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted(files)}


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the constant nodes that are docstrings (documentation, not a use)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def named_defaults(tree: ast.AST) -> list[tuple[str, ast.expr, int]]:
    """(name, value, line) of every parameter default, annotated field default and keyword argument."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
                out.append((arg.arg, default, node.lineno))
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if default is not None:
                    out.append((arg.arg, default, node.lineno))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            out.append((node.target.id, node.value, node.lineno))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((node.arg, node.value, node.value.lineno))
    return out


def test_no_limit_default_is_spelled_outside_the_limits_module():
    spelled = [
        f"{path}:{line} {name}={value.value}"
        for path, tree in sources().items()
        if path not in OWN_FILES
        for name, value, line in named_defaults(tree)
        if name in DEFAULTS and isinstance(value, ast.Constant) and value.value == DEFAULTS[name]
    ]
    assert spelled == [], "use pipeline.limits.Limits (or quantize.defaults.CALIB_SIZE) instead"


def test_each_limit_default_is_written_once_in_the_limits_module():
    tree = sources()[LIMITS_FILE]
    fields = {
        node.target.id: node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value
    }
    for name, value in Limits().model_dump().items():
        default = fields[name].args[0]  # Field(DEFAULT, ...)
        assert isinstance(default, ast.Constant) and default.value == value, name


def test_ports_and_model_name_are_literals_only_in_the_endpoints_module():
    found: dict[str, list[str]] = {}
    for path, tree in sources().items():
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or id(node) in skip:
                continue
            v = node.value
            hit = (isinstance(v, int) and not isinstance(v, bool) and v in PORTS) or (
                isinstance(v, str) and PORT_IN_TEXT.search(v) is not None
            )
            if hit:
                found.setdefault(path, []).append(f"{node.lineno}: {v!r}")
        for name, value, line in named_defaults(tree):
            if name in ("model", "name") and isinstance(value, ast.Constant) and value.value == "dgpipe":
                found.setdefault(path, []).append(f"{line}: {name}={value.value!r}")
    assert {p: hits for p, hits in found.items() if p != ENDPOINTS_FILE} == {}
    assert len(found[ENDPOINTS_FILE]) == len(PORTS)  # each port once, as a number
    text = (ROOT / ENDPOINTS_FILE).read_text()
    assert text.count('"dgpipe"') == 1 and endpoints.MODEL_NAME == "dgpipe"


def test_kubernetes_objects_use_the_default_ports():
    """YAML cannot import: the Service and the containers are held to pipeline.endpoints here."""
    service = yaml.safe_load((k8s_dir() / "base" / "service.yaml").read_text())
    assert sorted(p["port"] for p in service["spec"]["ports"]) == sorted(PORTS)
    docs = list(yaml.safe_load_all((k8s_dir() / "base" / "deployment.yaml").read_text()))
    containers = next(d for d in docs if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
    ports = {p["name"]: p["containerPort"] for c in containers["containers"] for p in c.get("ports", [])}
    assert ports == {
        "http": endpoints.HTTP_PORT,
        "grpc": endpoints.GRPC_PORT,
        "metrics": endpoints.METRICS_PORT,
        "openai": endpoints.OPENAI_PORT,
    }
