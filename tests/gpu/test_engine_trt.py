"""A TensorRT engine of the tiny model generates exactly what the PyTorch runtime generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.builddir import EngineLimits
from tests._utils.availability import has_cuda_gpu, has_tensorrt

needs_trt_gpu = pytest.mark.skipif(
    not (has_tensorrt() and has_cuda_gpu()),
    reason="needs TensorRT >= 10.8 and a CUDA GPU (engine build + run)",
)


@pytest.mark.gpu
@needs_trt_gpu
def test_engine_matches_pytorch_runtime(tmp_path: Path):
    """Build the tiny model's engine here and generate with both runtimes: same tokens for the same seed
    (fp32 graph, same counter RNG, same sampler kernels)."""
    from pipeline.engine.build_engine import build, plan_build
    from pipeline.engine.probe import gpu
    from pipeline.engine.trt_backend import TensorRTBackend
    from pipeline.onnx.export import export_onnx
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from tests._utils.tiny import build_tiny

    model = build_tiny()
    export_onnx(model, tmp_path / "onnx")
    model = model.to("cuda")
    cc = gpu()[0]
    target = {"9.0": "sm90", "10.0": "sm100", "12.0": "sm120"}[cc]
    plan = plan_build(tmp_path / "onnx", target, "bf16", tmp_path, limits=EngineLimits(2, 64, 256))
    manifest, built = build(plan)
    assert built and manifest.compute_capability == cc and (plan.engine_dir / "model.plan").stat().st_size > 0
    _, again = build(plan)
    assert again is False  # up to date: kept
    backend = TensorRTBackend(plan.engine_dir, model.config)
    reqs = [Request(prompt_ids=[2, 5, 7], max_tokens=16, seed=3, request_id=1),
            Request(prompt_ids=[2, 9], max_tokens=12, seed=4, request_id=2)]  # fmt: skip
    trt_out = BlockDiffusionRuntime(backend, max_batch=2, max_len=256).generate(reqs)
    ref_out = BlockDiffusionRuntime(model, max_batch=2, max_len=256).generate(reqs)
    assert [r.tokens for r in trt_out] == [r.tokens for r in ref_out]
    assert [r.steps_per_canvas for r in trt_out] == [r.steps_per_canvas for r in ref_out]
