"""Benchmarks: in-process, full-size model, accuracy sweep, served throughput, and the GPU sampler."""
