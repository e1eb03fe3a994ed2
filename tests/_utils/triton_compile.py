"""Triton kernels compiled for GPUs on a machine without one: a script that compiles them (Triton's own
`triton.compile` for a `GPUTarget`) run outside the interpreter, and what their machine code says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def compiled_for_gpus(script: str, out_dir: Path) -> list[dict]:
    """Run `script` (it writes its cubins under argv[1] and prints a JSON list) with Triton compiling, not
    interpreting, and a cache of its own; its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(out_dir / "cache")
    run = subprocess.run([sys.executable, "-c", script, str(out_dir)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def spills(cubin: str) -> bool:
    """Whether a cubin spills registers: a local store or load (STL / LDL) in its SASS, read with the
    nvdisasm that ships with Triton. A cubin without an EXIT is no kernel at all: an error."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run([str(nvdisasm), cubin], capture_output=True, text=True, check=True).stdout
    assert "EXIT" in sass, cubin
    return bool(re.search(r"\b(STL|LDL)\b", sass))
