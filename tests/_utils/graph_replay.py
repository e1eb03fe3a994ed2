"""A CUDA graph's replay, stood in for on the CPU: what a captured denoise step reads and writes, replayed.

A CUDA graph records a step's kernels with the addresses they read and write, and its scalar arguments;
`replay()` runs those kernels again and nothing else: no Python, no host decision, no new tensor a later
step hands in. A runtime is graph-safe only if each step of a round reads its inputs from the same storages,
updated in place, and leaves what the host reads after it in storages the host looks at. Running the step
again eagerly (the CPU tests' usual stand-in) cannot show a break of that rule: the Python runs again and
finds the new tensors. `StepRecording` records the step at the level of aten ops (each op, its constant
arguments, the very tensors it reads from outside the step), and `replay()` runs that op list with fresh
intermediates, as the graph would.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten


class StepRecording(TorchDispatchMode):
    """The aten ops one step ran, each with its arguments: an intermediate of the step by where it was
    made, any other tensor as itself (its storage), anything else as the constant it was."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, list[tuple[str, Any]]]] = []
        self.made: dict[int, tuple[int, int]] = {}  # id of an intermediate -> (op, output)
        self.alive: list[
            torch.Tensor
        ] = []  # holds the intermediates, so that no id is reused while recording
        self.host_reads: list[str] = []  # what a capture would refuse (a host sync inside the step)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        refs = [
            ("made", self.made[id(a)]) if isinstance(a, torch.Tensor) and id(a) in self.made else ("given", a)
            for a in leaves
        ]
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads.append(str(func))
        given = {id(a) for a in leaves if isinstance(a, torch.Tensor)}
        for j, o in enumerate(tree_flatten(out)[0]):
            if isinstance(o, torch.Tensor) and id(o) not in given:  # an in-place op returns its input
                self.made[id(o)] = (len(self.ops), j)
                self.alive.append(o)
        self.ops.append((func, spec, refs))
        return out

    def replay(self) -> None:
        outs: list[list[Any]] = []
        for func, spec, refs in self.ops:
            leaves = [outs[r[0]][r[1]] if kind == "made" else r for kind, r in refs]
            args, kwargs = tree_unflatten(leaves, spec)
            outs.append(tree_flatten(func(*args, **kwargs))[0])


def replayed_rounds(loop) -> collections.Counter:
    """Make `loop` (a runtime's `DeviceLoop`, told it has graphs) run each round as it does on CUDA: its first
    step eagerly, its second recorded (and run, as capture and first replay together are), every later
    one a replay of that recording. Returns the counts of recordings and replays, filled as it runs."""
    counts: collections.Counter = collections.Counter()

    def run(rnd, step: Callable[[], None]) -> None:
        if rnd.eager_steps == 0:
            rnd.eager_steps = 1
            step()
        elif rnd.graph is None:
            recording = StepRecording()
            with torch.no_grad(), recording:
                step()
            if recording.host_reads:
                raise AssertionError(f"the captured step reads the host: {recording.host_reads}")
            rnd.graph = recording
            counts["recorded"] += 1
        else:
            with torch.no_grad():
                rnd.graph.replay()
            counts["replayed"] += 1

    loop.graphs, loop.run = True, run
    return counts


def mixed_requests():
    """Requests whose rows share rounds but not their step counts (9 fixed steps, 12 adaptive ones), with
    templates, log-probabilities of 0-3 alternatives, and prompts from 1 to 18 tokens (tiny-model ids)."""
    from pipeline.model.config import SamplerConfig
    from pipeline.runtime.scheduler import Request

    fixed = SamplerConfig(max_denoising_steps=9, confidence_threshold=0.0)
    adaptive = SamplerConfig(max_denoising_steps=12, confidence_threshold=5.0, stability_threshold=1)
    template = [7, -1, 7, -1, -1, 9, -1, 10]
    return [
        Request([2, 5, 6], max_tokens=8, sampler=fixed, seed=1, request_id=0, logprobs=3),
        Request([2, 7] * 3, max_tokens=32, sampler=adaptive, seed=2, request_id=1),
        Request([9, 9, 3], max_tokens=32, sampler=fixed, seed=3, request_id=2, logprobs=2, template=template),
        Request([5], max_tokens=24, sampler=fixed, seed=4, request_id=3, logprobs=0),
        Request(list(range(2, 20)), max_tokens=16, sampler=adaptive, seed=5, request_id=4),
    ]
