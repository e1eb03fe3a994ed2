"""dgpipe's own Triton kernels for the CUDA pass, where no vendor kernel does the job: the FP8 MoE GEMM for
few rows per expert (`moe`, with per-GPU tile tables in `moe_tiles`), the activations' one-pass quantization (`quant`), a layer's routing in two
launches (`routing`) and the network's element-wise chains as one launch each (`chains`).

Each module is importable without Triton or a GPU: its `@triton.jit` sources live in `jit/` (or, for
`moe`, in a function) and are imported on first launch, when Triton reads TRITON_INTERPRET. The load-time
probe (`pipeline.runtime.probe`) holds each kernel to its torch form on the GPU before a model uses it.
"""

from pipeline.runtime.kernels import chains, moe, moe_tiles, quant, routing

__all__ = ["chains", "moe", "moe_tiles", "quant", "routing"]
