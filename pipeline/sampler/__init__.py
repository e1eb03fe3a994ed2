"""The denoising sampler: the plain-PyTorch reference step, counter-based RNG, and the fused CUDA kernels."""
