"""What this machine has, for skip conditions: TensorRT's Python API, a CUDA GPU, tritonserver."""

from __future__ import annotations

import pytest


def has_tensorrt() -> bool:
    from pipeline.engine.probe import tensorrt_version

    return tensorrt_version() is not None


def has_cuda_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def has_tritonserver() -> bool:
    from pipeline.serving.server import tritonserver_binary

    return tritonserver_binary() is not None


# the skip of every test that starts a real server
needs_tritonserver = pytest.mark.skipif(
    not has_tritonserver(), reason="needs tritonserver: pip install 'dgpipe[serve]'"
)
