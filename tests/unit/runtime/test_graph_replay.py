"""The runtime's denoise rounds replayed as a CUDA graph replays them, on the CPU (`tests._utils.graph_replay`):
each round's second step recorded op by op, every later step that recording run again with no scheduler
Python. Tokens, steps and log-probabilities must equal an eager run's, over rounds whose rows stop at
different steps, carry templates, ask for log-probabilities, and join and leave between rounds. The
runtime is set as on CUDA: random keys hashed on the device, the self-conditioning input computed on every
pass, and a sampler without host reads (the PyTorch reference: the CUDA sampler has none either)."""

from __future__ import annotations

import pytest
import torch

from pipeline.runtime import scheduler
from pipeline.runtime.scheduler import BlockDiffusionRuntime
from pipeline.sampler import rng
from tests._utils.graph_replay import mixed_requests as requests
from tests._utils.graph_replay import replayed_rounds
from tests._utils.tiny import build_tiny


def as_on_cuda(monkeypatch) -> BlockDiffusionRuntime:
    monkeypatch.setattr(rng, "HOST_KEY_ROWS", 0)  # key_hash's device form, not its host shortcut
    model = build_tiny(torch.float32, seed=5)
    model.cfg.eos_token_id = [999]
    rt = BlockDiffusionRuntime(model, max_batch=3, max_len=128, sync_every=4)
    rt.backend.cpu_fused = False  # the reference sampler: no host reads (the CPU's fused one has some)
    rt._last_pass = lambda slots, live: False  # what it answers off the CPU
    return rt


def outcome(results) -> list[tuple]:
    return [(r.tokens, r.steps_per_canvas, r.finish_reason, r.logprobs) for r in results]


def test_replayed_steps_give_the_eager_tokens_steps_and_logprobs(monkeypatch):
    eager = as_on_cuda(monkeypatch).generate(requests())
    rt = as_on_cuda(monkeypatch)
    counts = replayed_rounds(rt.loop)
    replayed = rt.generate(requests())
    assert counts["recorded"] >= 5 and counts["replayed"] >= 10 * counts["recorded"]
    assert {s for r in eager for s in r.steps_per_canvas} == {
        9,
        12,
    }  # rows that stop at other steps share rounds
    assert outcome(replayed) == outcome(eager)


def rebinding_amax(rt: BlockDiffusionRuntime) -> BlockDiffusionRuntime:
    """`rt` with a buffer the step reads and writes (`amax`) replaced by a copy between steps: eagerly the
    same values, but a replay keeps writing the buffer its recording read."""
    run = rt.loop.run

    def rebinding(rnd, step) -> None:
        run(rnd, step)
        rt.amax = rt.amax.clone()

    rt.loop.run = rebinding
    return rt


def test_a_buffer_rebound_between_steps_breaks_the_replay(monkeypatch):
    """The stand-in's own check: a runtime that hands a later step a new tensor where the recorded one read
    another (what a graph's replay never sees) gives other tokens under it, and the same ones eagerly."""
    eager = outcome(as_on_cuda(monkeypatch).generate(requests()))
    assert outcome(rebinding_amax(as_on_cuda(monkeypatch)).generate(requests())) == eager
    rt = as_on_cuda(monkeypatch)
    replayed_rounds(rt.loop)
    assert outcome(rebinding_amax(rt).generate(requests())) != eager


def test_a_host_read_inside_the_recorded_step_is_refused(monkeypatch):
    temperatures = scheduler.temperatures
    monkeypatch.setattr(
        scheduler, "temperatures", lambda s, *a: temperatures(torch.full_like(s, int(s.max())), *a)
    )
    rt = as_on_cuda(monkeypatch)
    replayed_rounds(rt.loop)
    with pytest.raises(AssertionError, match="reads the host"):
        rt.generate(requests())
