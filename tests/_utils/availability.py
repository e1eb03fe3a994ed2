"""What this machine has, for skip conditions: TensorRT's Python API and a CUDA GPU."""

from __future__ import annotations


def has_tensorrt() -> bool:
    from pipeline.engine.probe import tensorrt_version

    return tensorrt_version() is not None


def has_cuda_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
