"""The `@triton.jit` sources of `pipeline.runtime.kernels`' modules, one module each; importing one needs
Triton (its wrapper imports it on first launch)."""
