"""Locate files that ship beside the code: YAML configs and the embedded model."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from pipeline.errors import DgpipeError

PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_MODEL = PACKAGE_DIR / "models" / "sudoku-tiny"


def configs_dir() -> Path:
    """`configs/` of a source checkout, else the copy installed under <prefix>/share/dgpipe."""
    for cand in (PACKAGE_DIR.parent / "configs", Path(sys.prefix) / "share" / "dgpipe" / "configs"):
        if cand.is_dir():
            return cand
    raise DgpipeError("configs/ directory not found", "run from a dgpipe checkout or reinstall dgpipe")


def load_yaml(kind: str, name: str) -> dict:
    """configs/<kind>/<name>.yaml, or `name` itself when it is a path to a YAML file."""
    path = Path(name)
    if not path.is_file():
        path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))
        raise DgpipeError(f"unknown {kind[:-1]} '{name}'", f"choose one of: {', '.join(known)}")
    with open(path) as fh:
        return yaml.safe_load(fh)
