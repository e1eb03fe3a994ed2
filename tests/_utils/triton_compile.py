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


def converts_to_e4m3_once(ptx: str, cc: int) -> bool:
    """Whether a kernel's PTX converts fp32 to E4M3 in one rounding (`cvt.rn.satfinite.e4m3x2.f32`), or, on
    sm_89 under Triton before 3.9, through fp16 rounded toward zero (`cvt.rz.f16.f32`, then
    `cvt.rn.satfinite.e4m3x2.f16x2`), which is exact on the E4M3 grid values `kernels.jit.quant.e4m3`
    converts. `ptx`: the PTX, or its instructions joined."""
    import triton

    if "cvt.rn.satfinite.e4m3x2.f32" in ptx:
        return "e4m3x2.f16x2" not in ptx
    before_3_9 = tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9)
    return cc == 89 and before_3_9 and "cvt.rn.satfinite.e4m3x2.f16x2" in ptx


def separate_roundings_missing(ptx: str) -> list[str]:
    """The PTX float instructions that would round a product and a sum together: any fp32 FMA, and any
    bf16/fp16 FMA that is not a lone multiply (addend -0.0) or a lone add (a factor of +-1.0), the forms sm_89,
    which has no bf16 `mul`/`add`, emulates those with."""
    constants = dict(re.findall(r"mov\.b16\s+(%rs\d+),\s*(0x[0-9A-Fa-f]+|0);", ptx))
    neg_zero = {r for r, v in constants.items() if v.upper() == "0X8000"}
    one = {r for r, v in constants.items() if v.upper() in ("0X3F80", "0XBF80", "0X3C00", "0XBC00")}
    bad = re.findall(r"\bfma\.\S*f32[^;]*;", ptx)
    for a, b, c in re.findall(r"\bfma\.rn\.(?:bf16|f16)\s+%rs\d+,\s*(%rs\d+),\s*(%rs\d+),\s*(%rs\d+);", ptx):
        if c not in neg_zero and a not in one and b not in one:
            bad.append(f"fma {a} {b} {c}")
    return bad
