"""A TensorRT engine of the tiny model, built in bf16 for this GPU's target, generates what the PyTorch
runtime generates with the same bf16 weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.limits import Limits
from pipeline.sampler.kernels.build import find_nvcc
from tests._utils.availability import has_cuda_gpu, has_tensorrt

needs_trt_gpu = pytest.mark.skipif(
    not (has_tensorrt() and has_cuda_gpu() and find_nvcc() is not None),
    reason="needs TensorRT >= 10.9, a CUDA GPU and nvcc (the sampler plugin's PTX; engine build + run)",
)


def device_target() -> str:
    """This GPU's dgpipe target, or skip naming the compute capability: plans and sm_XXa PTX load only on
    the compute capability they were built for, so there is no nearest target to fall back to."""
    from pipeline.engine.probe import gpu
    from pipeline.resources import config_names
    from pipeline.targets import target_for_compute_capability

    cc, name = gpu()  # type: ignore[misc]
    t = target_for_compute_capability(cc)
    if t is None:
        pytest.skip(f"{name} (cc {cc}) has no dgpipe target; targets: {', '.join(config_names('targets'))}")
    return t.name


@pytest.mark.gpu
@needs_trt_gpu
def test_engine_matches_pytorch_runtime(tmp_path: Path):
    """Build the tiny model's engine from a bf16 export (a strongly typed network: the graph's bf16 types
    run) and generate with both runtimes: same seeds, same counter RNG, same sampler kernels. bf16 GEMMs
    differ between TensorRT's and cuBLAS's tactics in the last bit, which can move a token whose entropy
    ties, so the bound is agreement on >= 90 % of generated tokens and steps within one per canvas."""
    import torch

    from pipeline.engine.build_engine import build, plan_build
    from pipeline.engine.probe import gpu
    from pipeline.engine.trt_backend import TensorRTBackend
    from pipeline.onnx.export import export_onnx
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from tests._utils.tiny import build_tiny

    target = device_target()
    model = build_tiny(torch.bfloat16)
    export_onnx(model, tmp_path / "onnx", precision="bf16")
    model = model.to("cuda")
    plan = plan_build(
        tmp_path / "onnx",
        target,
        "bf16",
        tmp_path,
        limits=Limits(max_batch=2, max_prompt=64, max_context=256),
    )
    manifest, built = build(plan)
    assert built and manifest.compute_capability == gpu()[0] and manifest.precision == "bf16"  # type: ignore[index]
    assert (plan.engine_dir / "model.plan").stat().st_size > 0
    _, again = build(plan)
    assert again is False  # up to date: kept
    backend = TensorRTBackend(plan.engine_dir, model.config)
    reqs = [Request(prompt_ids=[2, 5, 7], max_tokens=16, seed=3, request_id=1),
            Request(prompt_ids=[2, 9], max_tokens=12, seed=4, request_id=2)]  # fmt: skip
    trt_out = BlockDiffusionRuntime(backend, max_batch=2, max_len=256).generate(reqs)
    ref_out = BlockDiffusionRuntime(model, max_batch=2, max_len=256).generate(reqs)
    for ours, ref in zip(trt_out, ref_out, strict=True):
        assert len(ours.tokens) == len(ref.tokens)
        same = sum(a == b for a, b in zip(ours.tokens, ref.tokens))
        assert same >= 0.9 * len(ref.tokens), (ours.tokens, ref.tokens)
        assert all(abs(a - b) <= 1 for a, b in zip(ours.steps_per_canvas, ref.steps_per_canvas, strict=True))
