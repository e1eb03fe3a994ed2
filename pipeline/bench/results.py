"""Where benchmark results go: one JSON file per run, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def save_result(out: Path, name: str, result: dict[str, Any]) -> Path:
    """Write out/name atomically; return its path."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, out / name)
    return out / name
