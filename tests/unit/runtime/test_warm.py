"""The load's warm-up passes (`pipeline.runtime.warm`): which token counts it runs, and where it runs none.
What they compile on each GPU is traced in tests/unit/bench/gpu/test_trace.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime.compiled import COMPILED_ATTR
from pipeline.runtime.routed import RoutedExperts
from pipeline.runtime.scheduler import BlockDiffusionRuntime
from pipeline.runtime.warm import distinct_experts, warm_experts, warm_token_counts
from pipeline.serving.core.loading import Log, _warm
from tests._utils.tiny import build_tiny


def _routed_tiny():
    """The tiny model with its experts routed on the device on the Triton GEMM, as on Ada or RTX Blackwell."""
    model = build_tiny(torch.bfloat16)
    for layer in model.layers:
        layer.experts = RoutedExperts(layer.experts, triton=True)
    return model


def test_one_pass_per_gemm_path_at_the_fewest_tokens_that_take_it():
    """The tiny model routes each token to 2 of 4 experts: t tokens give t/2 rows per expert, which take the
    Triton GEMM's 16-row tile up to 8 rows, its 32-row tile up to 24 and its 64-row tile above."""
    assert warm_token_counts(build_tiny(torch.bfloat16), 4096) == []  # as loaded: one kernel at every size
    model = _routed_tiny()
    assert len(distinct_experts(model)) == 1  # every layer's experts decide alike
    assert warm_token_counts(model, 4096) == [1, 17, 49]
    assert warm_token_counts(model, 20) == [1, 17]  # no pass of the runtime is larger
    for layer in model.layers:
        layer.experts.triton = False
    assert warm_token_counts(model, 4096) == [1]  # torch's grouped GEMM at every size: one path


def test_nothing_runs_off_cuda():
    model = _routed_tiny()
    assert warm_experts(model, torch.device("cpu"), 4096) == []
    assert BlockDiffusionRuntime(model, max_batch=2).warm_kernels() == []


class _Failing:
    """A runtime whose warm-up runs out of GPU memory."""

    device = torch.device("cuda")

    def warm_kernels(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_failed_warm_up_is_logged_and_the_load_goes_on(monkeypatch):
    monkeypatch.setattr("pipeline.runtime.device_errors.unusable", lambda device: None)
    errors: list[str] = []
    _warm(_Failing(), Log(info=errors.append, error=errors.append))
    assert errors == [
        "dgpipe: compiling the experts' kernels ahead failed (OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 2.00 GiB); they compile when a pass first needs them"
    ]


def test_a_warm_up_that_loses_the_cuda_context_fails_the_load(monkeypatch):
    monkeypatch.setattr("pipeline.runtime.device_errors.unusable", lambda device: "AcceleratorError: lost")
    with pytest.raises(torch.OutOfMemoryError):
        _warm(_Failing(), Log(info=print, error=print))


def test_a_compiled_model_is_left_to_compile_on_first_use():
    model = _routed_tiny()
    setattr(model, COMPILED_ATTR, True)
    assert warm_token_counts(model, 4096) == [1, 17, 49]
    assert warm_experts(model, torch.device("cuda"), 4096) == []  # returns before touching the device
