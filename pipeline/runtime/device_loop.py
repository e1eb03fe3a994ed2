"""Run a canvas round's denoise steps as device work only, replaying one CUDA graph per round.

Between two host checks nothing in a denoise step depends on the host: the rows, their positions, masks
and past K/V are fixed for the round (they change only when a causal pass writes the cache or a row
leaves), and all sampler state lives in device tensors. So the first step of a round runs eagerly (on a
side stream, which is also the warm-up CUDA graphs need), the second is captured, and every later step
is a single `graph.replay()`: no per-kernel launch overhead and no host round-trip per step. A capture
that fails (`graph_safe` is a prediction: a library call that CUDA refuses while a stream captures)
leaves the loop eager for good, and the step runs eagerly instead: the server keeps serving, slower. Out
of memory, or a CUDA error that leaves the GPU unusable, is the step's failure instead, raised.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pipeline.runtime.backends import KV, Masks
from pipeline.runtime.device_errors import out_of_memory, unusable

log = logging.getLogger(__name__)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the calling thread's current CUDA device for the block (nothing off CUDA). CUDA's current
    device is per host thread, and what a runtime step does not place by its tensors goes to it: Triton's
    launches, new streams, the current stream a CUDA graph captures. A server steps its runtime on a worker
    thread of its own, whose current device is 0 whatever GPU the model was loaded on."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class DenoiseRound:
    slots: torch.Tensor  # [B] cache rows in flight
    slot_list: list[int]
    positions: torch.Tensor  # [B, L]
    masks: Masks
    past: KV
    # the rows (indices into `slots`) whose requests want log-probabilities, and the most top alternatives
    # any of them asks for: fixed for the round like the rest, so a captured step records them too
    logprob_rows: torch.Tensor | None = None
    logprob_k: int = 0
    graph: torch.cuda.CUDAGraph | None = field(default=None, repr=False)
    eager_steps: int = 0


class DeviceLoop:
    def __init__(self, device: torch.device, graphs: bool) -> None:
        self.graphs = graphs and device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.captures = 0  # graphs captured (one per round): for tests and benchmarks
        # what a round pays before its replays, in host seconds (the launches of its eager step, the capture
        # with the graph's instantiation), summed over rounds: a benchmark sets it beside the replays
        self.warmups, self.warmup_s, self.capture_s = 0, 0.0, 0.0
        self.capture_error: str | None = None  # why a capture failed and the loop went eager
        # the latest captured graph, held so the shared pool always has a user: once every graph that
        # used a pool is freed (a round ends), torch 2.11's allocator refuses a new capture into it
        # ("use_count > 0" internal assert, seen on an H200). Rounds replay only their own graph, in
        # capture order, so keeping the last one alive reserves no memory beyond what the pool holds.
        self._last_graph: torch.cuda.CUDAGraph | None = None
        # the streams eager warm-up steps and captures run on, made on the loop's device at its first round.
        # One each for the loop's life: the caching allocator reuses a freed block only on the stream that
        # allocated it, and `torch.cuda.Stream()` hands out 32 streams in turn, so a new warm-up stream per
        # round would allocate the step's tensors anew and keep up to 32 cached copies of them
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    def run(self, rnd: DenoiseRound, step: Callable[[], None]) -> None:
        if not self.graphs:
            step()
            return
        side, capture = self._streams = self._streams or (torch.cuda.Stream(), torch.cuda.Stream())
        if rnd.graph is None and rnd.eager_steps == 0:
            t0 = time.perf_counter()
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):
                    step()
            finally:  # a failed step's queued kernels finish before the next request's work is ordered after
                torch.cuda.current_stream().wait_stream(side)
            rnd.eager_steps += 1
            self.warmups, self.warmup_s = self.warmups + 1, self.warmup_s + time.perf_counter() - t0
            return
        if rnd.graph is None:
            stream = torch.cuda.current_stream()
            stream.synchronize()  # as `torch.cuda.graph` does first: the time below is the capture's own
            t0 = time.perf_counter()
            try:
                graph = self._capture(step, stream, capture)
            except Exception as e:  # nothing ran on the device
                undo_failed_capture(stream, self.pool)
                cause = refused_capture(e, stream.device)
                self.graphs, self.capture_error = False, f"{type(cause).__name__}: {cause}"
                log.warning(f"dgpipe: CUDA graph capture failed ({self.capture_error}); denoise steps run "
                            "eagerly from now on (slower): report the GPU, torch and Triton versions")  # fmt: skip
                step()  # this step, eagerly, and every later one
                return
            rnd.graph = self._last_graph = graph
            self.captures, self.capture_s = self.captures + 1, self.capture_s + time.perf_counter() - t0
        rnd.graph.replay()

    def _capture(
        self, step: Callable[[], None], stream: torch.cuda.Stream, capture: torch.cuda.Stream
    ) -> torch.cuda.CUDAGraph:
        """`step` captured on `capture` into a new graph of the loop's pool (recorded, not run), with `stream`
        current. A capture that ran out of memory is tried once more after emptying the allocator's cache:
        while a stream captures, the allocator frees no cached block to grow the graphs' pool (it does
        outside a capture), and `capturing` keeps the blocks earlier rounds cached."""
        try:
            return captured(step, self.pool, capture)
        except Exception as e:
            if not out_of_memory(capture_cause(e)):
                raise
        undo_failed_capture(stream, self.pool)
        torch.cuda.empty_cache()
        return captured(step, self.pool, capture)


def capture_cause(e: Exception) -> BaseException:
    """What failed inside a capture: the step's error where `capture_end` raised its "invalidated capture"
    over it, else `e`. Since torch 2.8 both are `torch.AcceleratorError` where CUDA refused a call, so the
    error's type does not tell the capture's refusal from a lost GPU: `unusable` does."""
    return e.__context__ or e


def refused_capture(e: Exception, device: torch.device) -> BaseException:
    """Why a capture failed, where the capture itself was refused (a CUDA error that leaves the context
    usable: graphs go off); the step's own failure (out of memory, a lost GPU) is raised instead, for the
    server to answer."""
    cause = capture_cause(e)
    if out_of_memory(cause) or unusable(device) is not None:
        if cause is e:
            raise e
        raise cause from e
    return cause


def captured(
    step: Callable[[], None], pool: tuple[int, int], stream: torch.cuda.Stream
) -> torch.cuda.CUDAGraph:
    """A new graph of `step`'s CUDA work, captured on `stream` into `pool`: recorded, not run."""
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, pool, stream):
        step()
    return graph


@contextlib.contextmanager
def capturing(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int], stream: torch.cuda.Stream
) -> Iterator[None]:
    """Capture the block's CUDA work on `stream` into `graph`, its memory from `pool`: what `torch.cuda.graph`
    does, less the `torch.cuda.empty_cache()` it calls before every capture. That hands every cached block
    back to the driver, and a runtime captures a graph every round, so each round's eager step would
    allocate its tensors through cudaMalloc again. Python's garbage collector is off while the stream
    captures: a collection there costs host time, and could free CUDA objects held in reference cycles
    mid-capture (vLLM and SGLang freeze it around their captures). The stream that was current is current
    again after, whatever the block or `capture_end` raised."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                yield
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()


def undo_failed_capture(stream: torch.cuda.Stream, pool: tuple[int, int]) -> None:
    """Undo what a failed capture into `pool` leaves, with `stream` current before it: before torch 2.12 a
    `capture_end` that raised left the caching allocator recording into the pool, which fails every later
    `empty_cache` and synchronize (pytorch/pytorch#180395); and `torch.cuda.graph` restores the stream only
    after `capture_end` returns (`capturing` restores it whatever happened). Ending the recording again
    where it was ended raises, which is fine."""
    torch.cuda.set_stream(stream)
    with contextlib.suppress(RuntimeError):
        torch._C._cuda_endAllocateToPool(stream.device.index, pool)
