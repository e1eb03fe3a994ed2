"""CUDA kernels of the engine's own TensorRT plugins (csrc/) and their PyTorch references."""

from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
MOE_SOURCE = CSRC / "dg_moe.cu"
PLUGINS_SOURCE = CSRC / "dg_plugins.cu"  # sampler + MoE: the one PTX an engine embeds
