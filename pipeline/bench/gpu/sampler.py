"""Time the fused CUDA sampler step against the PyTorch sampler on a GPU (real vocabulary, canvas 256).

`python -m pipeline.bench.gpu.sampler --out DIR` prints a table and writes DIR/bench_gpu.json. Both sides
do the same work per step: sample_step + update_stability + should_stop (PyTorch) versus the two kernels
(entropy, argmax, Gumbel sample, bf16 softmax, acceptance, next canvas, stability, stop). Without a GPU it
exits with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from pipeline.errors import DgpipeError
from pipeline.sampler.reference import (
    CounterDraws,
    RowKeys,
    conditioning_softmax,
    sample_step,
    should_stop,
    update_stability,
)


def _time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median wall time of `fn` on the current stream, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_batch(batch: int, length: int, vocab: int, dtype: torch.dtype, iters: int) -> dict[str, object]:
    from pipeline.sampler.kernels.gpu_sampler import StepBuffers, sample_step_cuda

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(batch)
    scale = torch.logspace(0, 1.5, length, device=dev)[None, :, None]
    logits = (30 * torch.tanh(torch.randn(batch, length, vocab, device=dev, generator=gen) * scale / 30)).to(
        dtype
    )
    ids = torch.arange(batch, device=dev)
    keys = RowKeys(ids + 7, ids, torch.zeros_like(ids), torch.full_like(ids, 3))
    temp = torch.full((batch,), 0.6, device=dev)
    bound = torch.full((batch,), 0.1, device=dev)
    conf = torch.full((batch,), 0.005, device=dev)
    stab_k = torch.ones(batch, dtype=torch.long, device=dev)
    prev = torch.full((batch, length), -1, dtype=torch.long, device=dev)
    stable = torch.zeros(batch, dtype=torch.long, device=dev)
    buffers = StepBuffers.allocate(batch, length, vocab, dev)
    draws = CounterDraws()

    def kernel() -> object:
        return sample_step_cuda(logits, temp, bound, keys, None, prev, stable, stab_k, conf, out=buffers)

    def reference() -> (
        object
    ):  # the PyTorch path of a bf16 model: its self-conditioning softmax is of bf16(z)
        out = sample_step(logits, temp, bound, keys, draws, None)
        count = update_stability(stable, prev, out.argmax)
        probs = conditioning_softmax(logits.float() / temp[:, None, None], torch.bfloat16)
        return should_stop(count, stab_k, out.entropy, conf), probs.to(torch.bfloat16)

    kernel_ms = _time_ms(kernel, iters)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    reference_ms = _time_ms(reference, max(3, iters // 4))
    reference_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    kernel()
    torch.cuda.synchronize()
    kernel_peak = torch.cuda.max_memory_allocated() - base
    # bytes the kernels must move: logits read twice (stats pass, softmax pass) + bf16 probs written
    moved = 2 * logits.numel() * logits.element_size() + logits.numel() * 2
    return {
        "batch": batch,
        "canvas": length,
        "vocab": vocab,
        "logits_dtype": str(dtype).removeprefix("torch."),
        "kernel_ms": round(kernel_ms, 4),
        "torch_ms": round(reference_ms, 4),
        "speedup": round(reference_ms / kernel_ms, 2),
        "kernel_gb_per_s": round(moved / kernel_ms / 1e6, 1),
        "kernel_extra_mem_mb": round(kernel_peak / 2**20, 1),
        "torch_peak_mem_mb": round(reference_peak / 2**20, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for bench_gpu.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--canvas", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"bench_gpu: no CUDA GPU here (torch {torch.__version__}, CUDA {torch.version.cuda}); "
            "run it on a GPU machine",
            file=sys.stderr,
        )
        return 2
    try:
        from pipeline.sampler.kernels.build import load_torch_extension

        load_torch_extension()
        rows = [
            bench_batch(b, args.canvas, args.vocab, getattr(torch, args.dtype), args.iters)
            for b in args.batches
        ]
    except DgpipeError as e:
        print(f"bench_gpu: {e}", file=sys.stderr)
        return 2
    report = {
        "device": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "what": "one sampler step: kernels (2 launches) vs pipeline.sampler.reference (sample_step+stability+stop)",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']} (sm {report['capability']}), torch {report['torch']}, CUDA {report['cuda']}")
    print(f"{'batch':>5} {'kernel ms':>10} {'torch ms':>10} {'speedup':>8} {'GB/s':>8} {'torch MB':>9}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['kernel_ms']:>10} {r['torch_ms']:>10} {r['speedup']:>8} "
            f"{r['kernel_gb_per_s']:>8} {r['torch_peak_mem_mb']:>9}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
