"""TensorRT half of the pipeline: sampler plugin PTX, engine build + manifest, runtime wrapper (docs/engine.md)."""
