"""Which sampler a PyTorch runtime takes: the fused CUDA kernels on a GPU where they can run, else the
PyTorch sampler, with the reason logged (a GPU host without ninja serves, it does not fail its first step)."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.runtime.backends import uses_fused_sampler
from pipeline.sampler import reference
from pipeline.sampler.kernels import gpu_sampler

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class SharedDraws:
    """A draw source other than the counter RNG the kernels draw from (as tests sharing draws with
    transformers use)."""

    def initial_canvas(self, keys, length, vocab):
        raise NotImplementedError

    categorical = renoise = initial_canvas


def answer(monkeypatch: pytest.MonkeyPatch, reason: str | None) -> list[int]:
    asked: list[int] = []
    monkeypatch.setattr(gpu_sampler, "cuda_sampler_unavailable", lambda: asked.append(1) or reason)
    return asked


def test_on_a_gpu_the_kernels_run_where_they_can(monkeypatch: pytest.MonkeyPatch):
    asked = answer(monkeypatch, None)
    assert uses_fused_sampler(CUDA, reference.CounterDraws()) and asked == [1]


def test_where_they_cannot_the_pytorch_sampler_runs_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    answer(monkeypatch, "DgpipeError: building the CUDA sampler extension needs ninja (pip install ninja)")
    with caplog.at_level(logging.WARNING, logger="pipeline.runtime.backends"):
        assert not uses_fused_sampler(CUDA, reference.CounterDraws())
    (record,) = caplog.records
    assert "needs ninja (pip install ninja)" in record.getMessage()
    assert "the PyTorch sampler takes each step" in record.getMessage()


def test_the_cpu_and_other_draw_sources_take_the_pytorch_sampler_without_asking(
    monkeypatch: pytest.MonkeyPatch,
):
    asked = answer(monkeypatch, None)
    assert not uses_fused_sampler(CPU, reference.CounterDraws())
    assert not uses_fused_sampler(CUDA, SharedDraws())
    assert asked == []


def test_an_explicit_choice_is_kept_on_a_gpu_and_refused_elsewhere(monkeypatch: pytest.MonkeyPatch):
    asked = answer(monkeypatch, "no ninja")
    assert uses_fused_sampler(CUDA, reference.CounterDraws(), fused=True)
    assert not uses_fused_sampler(CUDA, reference.CounterDraws(), fused=False)
    assert not uses_fused_sampler(CPU, reference.CounterDraws(), fused=True)
    assert asked == []
