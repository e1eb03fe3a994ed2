"""The CUDA sampler kernels (pipeline/sampler/kernels/csrc/dg_sampler.cu), the source itself, run on the CPU.

No GPU runs here, and the kernels' oracle is the PyTorch sampler: this builds the kernel source with g++ against
a host emulation of the CUDA execution model (cuda_runtime.h, cuda_bf16.h beside this file: every thread of
a block a std::thread, `__syncthreads` a barrier, warp shuffles with CUDA's out-of-range rule, bf16 rounded to
nearest even as `__float2bfloat16_rn`) and runs kernel A then kernel B on a case written to a directory.
What it cannot show: CUDA's `expf`/`logf` differ from glibc's by an ulp or so, real concurrency, speed."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.sampler.reference import RowKeys

HERE = Path(__file__).parent
CSRC = Path(__file__).resolve().parents[3] / "pipeline" / "sampler" / "kernels" / "csrc"
MARKER = "// ---- host launchers"  # dg_sampler.cu: device code above it, `<<<>>>` launchers below


def compiler() -> str | None:
    return shutil.which("g++")


def build(out_dir: Path, source: Path = CSRC / "dg_sampler.cu") -> Path:
    """The driver binary for `source`'s device code (everything above MARKER)."""
    text = source.read_text()
    at = text.find(MARKER)
    if at < 0:  # a refactor of the .cu must keep the marker, or this test would run nothing of it
        raise RuntimeError(f"{source}: no {MARKER!r} line between the kernels and their launchers")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels_only.cu").write_text(text[:at])
    binary = out_dir / "driver"
    # -fno-strict-aliasing: the kernels load bf16 and fp32 vectors through reinterpreted pointers, as CUDA
    # code does and nvcc compiles as meant; g++ -O2 may assume those loads alias nothing (wrong samples)
    cmd = [compiler() or "g++", "-std=c++20", "-O2", "-fno-strict-aliasing", "-pthread", f"-I{out_dir}",
           f"-I{HERE}", f"-I{source.parent}", str(HERE / "driver.cpp"), "-o", str(binary)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:  # g++'s own message: a construct of the .cu that the emulation lacks, or a C++ error
        raise RuntimeError(f"g++ could not build the emulation of {source}:\n{done.stderr[-4000:]}")
    return binary


@dataclass
class Case:
    """One launch pair's inputs, as `gpu_sampler.sample_step_cuda` takes them."""

    logits: torch.Tensor  # [B, L, V] fp32 or bf16
    temperature: torch.Tensor  # [B]
    keys: RowKeys
    bound: torch.Tensor  # [B]
    prev: torch.Tensor  # [B, L] the previous argmax canvas
    conf: torch.Tensor  # [B] confidence thresholds
    template: torch.Tensor | None = None  # [B, L], -1 free
    table: torch.Tensor | None = None  # [M, V] bool allowed sets
    index: torch.Tensor | None = None  # [B, L], -1 free
    stable_in: torch.Tensor | None = None  # [B] steps the canvas has held so far (None: 0)
    stab_k: torch.Tensor | None = None  # [B] steps it must hold to stop (None: 1)


def stable_in(case: Case) -> torch.Tensor:
    return (
        torch.zeros(len(case.logits), dtype=torch.long) if case.stable_in is None else case.stable_in.long()
    )


def stab_k(case: Case) -> torch.Tensor:
    return torch.ones(len(case.logits), dtype=torch.long) if case.stab_k is None else case.stab_k.long()


def run(binary: Path, case: Case, work: Path, force_scalar: bool = False) -> dict[str, torch.Tensor]:
    """Kernel A then kernel B on `case`; their outputs (probs as bf16, entropy/argmax after kernel B)."""
    b, length, vocab = case.logits.shape
    bf16 = case.logits.dtype == torch.bfloat16
    masks = 0 if case.table is None else case.table.shape[0]
    work.mkdir(parents=True, exist_ok=True)
    meta = f"{b} {length} {vocab} {int(bf16)} {masks} {int(case.template is not None)} 1\n"
    (work / "meta.txt").write_text(meta)
    raw = case.logits.contiguous().view(torch.int16) if bf16 else case.logits.contiguous().float()
    files = {
        "logits": raw, "temperature": case.temperature.float(), "bound": case.bound.float(),
        "conf": case.conf.float(), "prev": case.prev.long(), "stable_in": stable_in(case),
        "stab_k": stab_k(case),
        **{k: getattr(case.keys, k).long() for k in ("seed", "request", "canvas", "step")},
    }  # fmt: skip
    if masks:
        files |= {"mask_table": case.table.to(torch.uint8), "mask_index": case.index.long()}
    if case.template is not None:
        files["template"] = case.template.long()
    for name, t in files.items():
        t.contiguous().numpy().tofile(work / f"{name}.bin")
    subprocess.run([str(binary), str(work), "1" if force_scalar else "0"], check=True)

    def read(name: str, dtype, shape) -> torch.Tensor:
        return torch.from_numpy(np.fromfile(work / f"out_{name}.bin", dtype=dtype).reshape(shape))

    n = (b, length)
    return {
        "entropy": read("entropy", np.float32, n), "max_prob": read("max_prob", np.float32, n),
        "argmax": read("argmax", np.int64, n), "sample": read("sample", np.int64, n),
        "kept": read("kept", np.uint8, n).bool(), "canvas": read("canvas", np.int64, n),
        "stable": read("stable", np.int64, (b,)), "stop": read("stop", np.uint8, (b,)).bool(),
        "probs": read("probs", np.int16, (b, length, vocab)).view(torch.bfloat16),
    }  # fmt: skip
