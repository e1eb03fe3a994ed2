"""Wall-clock timing for the benchmarks: CUDA work is waited for (kernels launch asynchronously), and a
warm-up call comes first so allocation and autotuning never land in a sample."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work: a CUDA time read without it measures kernel launches."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    """Seconds of one fn() call, the device's queued work before it excluded and its own included, and
    what it returned: a first call's cost (nothing warmed up), or a run too long to repeat."""
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls after one warm-up call."""
    fn()
    return statistics.median(seconds(fn, device)[0] for _ in range(repeats))
