"""Wall-clock timing for the benchmarks: CUDA work is waited for (kernels launch asynchronously), and a
warm-up call comes first so allocation and autotuning never land in a sample."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up call."""
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)
