"""A CUDA graph's replay, stood in for on the CPU: what a captured denoise step reads and writes, replayed.

A CUDA graph records a step's kernels with the addresses they read and write, and its scalar arguments;
`replay()` runs those kernels again and nothing else: no Python, no host decision, no new tensor a later
step hands in. Each replay writes the same memory the capture allocated, so a tensor made inside the step
and kept by the host after it holds each replay's values. A runtime is graph-safe only if each step of a
round reads its inputs from the same storages, updated in place, and the host reads what the step wrote
from the storages the step writes. Running the step again eagerly (the CPU tests' usual stand-in) cannot
show a break of that rule: the Python runs again and finds the new tensors. `StepRecording` records the
step at the level of aten ops (each op, its constant arguments, the very tensors it reads from outside the
step), and `replay()` runs that op list writing each result into the tensor the recording made, as the
graph would.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
# ops whose result the host must read before it can go on: a capture refuses them (a CUDA graph cannot wait
# for the host). `.tolist()` and the like read memory without an aten op and cannot be seen here.
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
              aten.equal.default, aten._unique2.default, aten.masked_select.default}  # fmt: skip


def reads_host(func, leaves: list) -> bool:
    """Whether an op needs the host to read a result first: one of `HOST_READS`, or indexing by a bool mask
    (the number of rows it keeps is known only on the host)."""
    bool_index = func is aten.index.Tensor and any(
        isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in leaves[1:]
    )
    return func in HOST_READS or bool_index


class StepRecording(TorchDispatchMode):
    """The aten ops one step ran, each with its arguments: an intermediate of the step by where it was
    made, any other tensor as itself (its storage), anything else as the constant it was; and the tensors
    it made, held, so that no id is reused while recording and a replay can write into them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, list[tuple[str, Any]], list[torch.Tensor | None]]] = []
        self.made: dict[int, tuple[int, int]] = {}  # id of a tensor the step made -> (op, output)
        self.host_reads: list[str] = []  # what a capture would refuse

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        refs = [
            ("made", self.made[id(a)]) if isinstance(a, torch.Tensor) and id(a) in self.made else ("given", a)
            for a in leaves
        ]
        out = func(*args, **kwargs)
        if reads_host(func, leaves):
            self.host_reads.append(str(func))
        given = {id(a) for a in leaves if isinstance(a, torch.Tensor)}
        made: list[torch.Tensor | None] = []
        for j, o in enumerate(tree_flatten(out)[0]):
            fresh = isinstance(o, torch.Tensor) and id(o) not in given  # an in-place op returns its input
            if fresh:
                self.made[id(o)] = (len(self.ops), j)
            made.append(o if fresh else None)
        self.ops.append((func, spec, refs, made))
        return out

    def replay(self) -> None:
        """Run the recorded ops again: each reads the tensors it read when recorded (those the step made as
        the recording holds them), and each result that is not a view lands in the tensor the recording
        made, as a graph's replay writes the memory its capture allocated."""
        for func, spec, refs, made in self.ops:
            leaves = [self.ops[r[0]][3][r[1]] if kind == "made" else r for kind, r in refs]
            args, kwargs = tree_unflatten(leaves, spec)
            for new, recorded in zip(tree_flatten(func(*args, **kwargs))[0], made, strict=True):
                if (
                    recorded is not None and not recorded._is_view()
                ):  # a view already shares its base's memory
                    recorded.copy_(new)


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
