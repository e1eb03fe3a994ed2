"""Locate files that ship beside the code: YAML configs and the embedded model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from pipeline.errors import DgpipeError

PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_MODEL = PACKAGE_DIR / "models" / "sudoku-tiny"


TRITON_MODEL_SOURCE = PACKAGE_DIR.parent / "model_repo" / "dgpipe_model.py"


def _shipped_dir(name: str, marker: str) -> Path:
    """`name/` of a source checkout, else the copy installed under <prefix>/share/dgpipe."""
    for cand in (PACKAGE_DIR.parent / name, Path(sys.prefix) / "share" / "dgpipe" / name):
        if (cand / marker).exists():
            return cand
    raise DgpipeError(f"{name}/ directory not found", "run from a dgpipe checkout or reinstall dgpipe")


def cache_dir() -> Path:
    """Where commands write when not told: $DGPIPE_CACHE, else $XDG_CACHE_HOME/dgpipe, else ~/.cache/dgpipe."""
    if os.environ.get("DGPIPE_CACHE"):
        return Path(os.environ["DGPIPE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "dgpipe"
    return Path.home() / ".cache" / "dgpipe"


def configs_dir() -> Path:
    """YAML configs: models, precisions, targets, deploy."""
    return _shipped_dir("configs", "")


def k8s_dir() -> Path:
    """The kustomize tree: base, components and one overlay per node type."""
    return _shipped_dir("k8s", "base/kustomization.yaml")


def config_names(kind: str) -> list[str]:
    """The configs of one kind, sorted: configs/<kind>/*.yaml without the suffix (models, precisions, ...)."""
    return sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))


def load_yaml(kind: str, name: str) -> dict:
    """configs/<kind>/<name>.yaml, or `name` itself when it is a path to a YAML file."""
    path = Path(name)
    if not path.is_file():
        path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(config_names(kind))
        raise DgpipeError(f"unknown {kind[:-1]} '{name}'", f"choose one of: {known}")
    with open(path) as fh:
        try:
            raw = yaml.safe_load(fh)
        except yaml.YAMLError as e:
            raise DgpipeError(f"{path}: not valid YAML ({' '.join(str(e).split())})", "fix the file") from e
    if not isinstance(raw, dict):
        raise DgpipeError(
            f"{path}: expected a mapping of keys to values, found {type(raw).__name__}", "fix the file"
        )
    return raw
