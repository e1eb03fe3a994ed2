"""What a failed GPU step says about the device: out of memory (the request may be retried, the server goes
on), or a sticky CUDA error that leaves the process's CUDA context unusable (an illegal memory access, a
device-side assert: every later CUDA call fails, so the server must be restarted).

A sticky error is told apart by asking the device again: after one, `torch.cuda.synchronize` fails too
(CUDA's programming guide, "Error Checking": such errors "leave the process in an inconsistent state"
until it ends); after any other error it returns.
"""

from __future__ import annotations

import torch


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the GPU running out of memory: torch's own error, or a library's allocation failure
    that torch passes on as a RuntimeError (cuBLAS's CUBLAS_STATUS_ALLOC_FAILED, cuDNN's workspace)."""
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("out of memory" in text or "ALLOC_FAILED" in text)
    )


def device_failure(e: BaseException) -> bool:
    """Whether `e` came from the device rather than from the request: out of memory, or a CUDA error
    (`torch.AcceleratorError`). A caller that catches RuntimeError for its own errors lets these pass."""
    return out_of_memory(e) or isinstance(e, torch.AcceleratorError)


def unusable(device: torch.device) -> str | None:
    """Why `device` can run no more work in this process (a sticky CUDA error), or None. Asked after a
    failed step: a synchronize that fails too means the context is lost."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # whatever CUDA raised: the context is unusable
        return f"{type(e).__name__}: {e}"
    return None
