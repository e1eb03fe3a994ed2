"""Fused CUDA kernels for the denoising loop (the sampler step); see csrc/ and build.py."""
