"""The devices a command runs on, named as torch names them: one grammar for every `--device`."""

from __future__ import annotations

import re

from pipeline.errors import DgpipeError

DEVICE_CHOICES = "cpu, cuda, cuda:N or auto"
_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")


def check_device(device: str) -> str:
    """`device` when dgpipe runs there (the CPU, a CUDA GPU, or `auto`: the first GPU if there is one), else
    a DgpipeError: torch would take `mps` or `meta` and fail later, deep in a load or in a served model."""
    if not _DEVICE.fullmatch(device):
        raise DgpipeError(f"--device {device}: not a device dgpipe runs on", f"choose {DEVICE_CHOICES}")
    return device
