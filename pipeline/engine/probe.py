"""What this machine runs plans with: the installed TensorRT's version and GPU 0's compute capability.

Runtime-side facts, shared by the engine build (which plan it can build here), `dgpipe engine check`,
`dgpipe doctor` and the Triton model (which plan it loads). Imports nothing of the build toolchain.
"""

from __future__ import annotations


def tensorrt_version() -> str | None:
    """The installed TensorRT's version, or None (the pip placeholder that cannot import counts as none)."""
    try:
        import tensorrt as trt
    except Exception:  # ImportError, or the placeholder wheel failing at import
        return None
    return getattr(trt, "__version__", None)


def gpu(index: int = 0) -> tuple[str, str] | None:
    """(compute capability "9.0", name) of GPU `index`, or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(index)
    return f"{p.major}.{p.minor}", p.name
