"""CUDA kernels of the engine's own TensorRT plugins (csrc/) and their PyTorch references."""

from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
PLUGINS_SOURCE = CSRC / "dg_plugins.cu"  # sampler + MoE: the one PTX an engine embeds
