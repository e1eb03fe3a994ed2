"""What a benchmark ran on and when, recorded in every result: the CPU, its cores and the load it shared
them with, threads, versions and the GPU."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo on Linux, where `platform.processor()` is empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """What a benchmark ran on and when: CPU, cores, the load it shared them with, threads, versions, GPU."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
