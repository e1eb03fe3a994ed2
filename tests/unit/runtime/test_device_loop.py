"""The device-resident denoise loop: host checks every k passes, grouped-GEMM MoE, CUDA-graph replay.

On any machine: checking for finished canvases only every k passes must not change a single token or
step count (finished rows are frozen on the device), and the capturable grouped-GEMM MoE must equal the
per-expert loop. (The CUDA-graph replay test is tests/gpu/test_device_loop_cuda.py.)
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from pipeline.runtime.scheduler import BlockDiffusionRuntime
from tests._utils.generation import FIXED, generate, requests
from tests._utils.numerics import assert_within_reference_noise
from tests._utils.tiny import build_tiny


def same_results(a_list, b_list) -> None:
    for a, b in zip(a_list, b_list, strict=True):
        assert (a.tokens, a.steps_per_canvas, a.finish_reason) == (
            b.tokens,
            b.steps_per_canvas,
            b.finish_reason,
        )


def test_checking_every_k_passes_changes_nothing_fixed_steps():
    """4 requests on 3 slots (one joins later), mixed prompt lengths, several canvases each."""
    model = build_tiny(torch.float64)
    rt1, every = generate(model, requests(FIXED), sync_every=1)
    rt4, every4 = generate(model, requests(FIXED), sync_every=4)
    same_results(every, every4)
    assert rt4.passes["denoise"] > rt1.passes["denoise"]  # frozen rows rode along until the next check


def test_checking_every_k_passes_changes_nothing_adaptive():
    """The embedded model stops canvases at different steps; the result must not depend on k."""
    from pipeline.demo import sudoku
    from pipeline.demo import tokenizer as stok
    from pipeline.runtime.session import load_session

    session = load_session()
    prompts = [stok.sudoku_prompt_ids(p) for p, _ in sudoku.make_dataset(5, 6, (45, 61))]
    kw = {"max_batch": 4, "max_len": 512}
    _, every = generate(session.model, requests(session.sampler(), prompts), sync_every=1, **kw)
    _, every3 = generate(session.model, requests(session.sampler(), prompts), sync_every=3, **kw)
    same_results(every, every3)
    steps = {s for r in every for s in r.steps_per_canvas}
    assert len(steps) > 1, steps  # canvases really stopped at different steps


def test_grouped_gemm_moe_equals_the_expert_loop():
    """Grouped GEMM (fp32 only: torch's grouped_mm has no float64 kernel) vs the dense form (every expert on
    every token, zero weight where unrouted): its error against float64 dense is within 4x the fp32 dense
    form's own (tests/_utils/numerics.py); a token routed twice to one expert counts twice in both."""
    cfg = {"hidden_size": 64, "moe_intermediate_size": 32}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 64, generator=gen)
    scores = torch.randn(37, 4, generator=gen).softmax(-1)
    weights, index = torch.topk(scores, k=2, dim=-1)
    index[:5] = torch.tensor([0, 1])  # an expert that some tokens share, and (below) one left empty
    index[index == 3] = 2
    out = {}
    for dtype in (torch.float32, torch.float64):
        experts = build_tiny(dtype, text_config=cfg).layers[0].experts
        assert experts.num_experts == 4
        for grouped in (False, True) if dtype == torch.float32 else (False,):
            experts.grouped = grouped
            out[dtype, grouped] = experts(x.to(dtype), index, weights.to(dtype))
    oracle = out[torch.float64, False]
    assert oracle.abs().max() > 0.1
    assert_within_reference_noise("grouped MoE", out[torch.float32, True], oracle, out[torch.float32, False])


def test_a_runtime_steps_on_its_own_gpu_from_any_thread(monkeypatch):
    """CUDA's current device is per host thread: a server's worker thread starts on GPU 0. `on_device`
    makes the runtime's GPU current for a step (Triton launches, new streams and graph captures follow the
    current device), and off CUDA does nothing."""
    import contextlib
    import threading

    from pipeline.runtime import device_loop, scheduler

    entered: list[tuple[str, int | None]] = []

    @contextlib.contextmanager
    def current(device):
        entered.append((threading.current_thread().name, device.index))
        yield

    monkeypatch.setattr(torch.cuda, "device", current)
    worker = threading.Thread(
        target=lambda: device_loop.on_device(torch.device("cuda", 1)).__enter__(), name="w"
    )
    worker.start()
    worker.join()
    with device_loop.on_device(torch.device("cpu")):
        pass
    assert entered == [("w", 1)]

    steps: list[torch.device] = []
    monkeypatch.setattr(
        scheduler, "on_device", lambda device: steps.append(device) or contextlib.nullcontext()
    )
    rt, _ = generate(build_tiny(torch.float64), requests(FIXED), sync_every=1)
    assert len(steps) >= rt.passes["denoise"] and set(steps) == {rt.device}


def test_under_cuda_graphs_a_rounds_warm_up_runs_what_its_capture_runs(monkeypatch):
    """A round whose rows all start a canvas has no self-conditioning signal on its first step, which is
    the capture's eager warm-up. Under graphs it gets zeros instead of None, so the self-conditioning MLP
    (and its kernels) runs there first rather than inside the capture; its output is exactly zero, so the
    tokens are those of a run without graphs. (The steps run directly here: no GPU.)"""
    model = build_tiny(torch.float64)
    _, plain = generate(model, requests(FIXED), sync_every=4)
    seen: list[bool] = []
    forward = model.self_conditioning.forward
    monkeypatch.setattr(
        model.self_conditioning,
        "forward",
        lambda embeds, soft: seen.append(soft is None) or forward(embeds, soft),
    )
    rt = BlockDiffusionRuntime(model, max_batch=3, max_len=128, sync_every=4)
    rt.loop.graphs = True
    monkeypatch.setattr(rt.loop, "run", lambda rnd, step: step())
    same_results(plain, rt.generate(requests(FIXED)))
    assert seen and not any(seen)


class FakeCuda:
    """torch.cuda's streams, graphs and allocator calls as a capture meets them (no GPU here): the capture
    stream is current inside `torch.cuda.stream`; a call CUDA refuses inside the step invalidates the
    capture, so `capture_end` raises on the way out. Records the garbage collector's state as the step ran
    and every `empty_cache`."""

    def __init__(
        self,
        monkeypatch,
        refused: Exception | None,
        refusals: int | None = None,
        invalidates: bool | None = None,
    ) -> None:
        import contextlib
        import gc

        self.refused, self.refusals, self.calls, self.collecting = refused, refusals, [], []
        self.streams_made = 0
        # whether a refused call invalidates the capture (capture_end raises over it): CUDA's refusals do, an
        # allocation that fails before any CUDA call does not
        self.invalidates = (
            not isinstance(refused, torch.OutOfMemoryError) if invalidates is None else invalidates
        )
        self.in_capture = self.invalidated = False
        stream = lambda name: type("Stream", (), {"name": name, "device": torch.device("cuda", 0),
                                                  "wait_stream": lambda self, other: None,
                                                  "synchronize": lambda self: None})()  # fmt: skip
        self.default = stream("default")
        self.current = self.default

        @contextlib.contextmanager
        def stream_ctx(s):
            before, self.current = self.current, s
            try:
                yield
            finally:
                self.current = before

        fake = self

        class CUDAGraph:
            def capture_begin(self, pool=None):
                fake.calls.append(("capture_begin", pool))
                fake.in_capture, fake.invalidated = True, False

            def capture_end(self):
                fake.in_capture = False
                if fake.invalidated:
                    cuda_error = isinstance(fake.refused, torch.AcceleratorError)  # torch 2.8+: CUDA's errors
                    raise (torch.AcceleratorError if cuda_error else RuntimeError)(
                        "CUDA error: operation failed due to a previous error during capture"
                    )

            def replay(self):
                pass

        def set_stream(s):
            self.calls.append(("set_stream", s.name))
            self.current = s

        def end_allocate(device, pool):
            self.calls.append(("end_allocate", device, pool))

        def new_stream():
            self.streams_made += 1
            return stream("side")

        for name, value in {
            "graph_pool_handle": lambda: (0, 1), "Stream": new_stream,
            "current_stream": lambda: self.current, "stream": stream_ctx,
            "synchronize": lambda device=None: None, "CUDAGraph": CUDAGraph, "set_stream": set_stream,
            "empty_cache": lambda: self.calls.append(("empty_cache",)),
        }.items():  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)
        self.gc_enabled = gc.isenabled
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocate, raising=False)

    def step(self, ran: list[str]):
        def step() -> None:
            ran.append("capture" if self.in_capture else self.current.name)
            self.collecting.append(self.gc_enabled())
            time.sleep(0.002)
            if self.in_capture and self.refused is not None and self.refusals != 0:
                self.invalidated = self.invalidates
                self.refusals = None if self.refusals is None else self.refusals - 1
                raise self.refused

        return step


def test_a_round_counts_the_host_time_of_its_eager_step_and_its_capture(monkeypatch):
    """What a round pays before its replays, for `dgpipe bench gpu`'s canvases: one eager step and one
    capture per round, their host seconds summed; replays add nothing."""
    from pipeline.runtime import device_loop

    cuda = FakeCuda(monkeypatch, None)
    loop = device_loop.DeviceLoop(torch.device("cuda"), graphs=True)
    ran: list[str] = []
    for _ in range(2):
        rnd = device_loop.DenoiseRound(torch.zeros(1), [0], torch.zeros(1, 4), {}, None)
        for _ in range(4):
            loop.run(rnd, cuda.step(ran))
    assert ran == ["side", "capture"] * 2  # the replays run no Python step
    assert (loop.warmups, loop.captures) == (2, 2)
    assert loop.warmup_s >= 0.004 and loop.capture_s >= 0.004
    # one warm-up stream and one capture stream for every round: the allocator reuses a block only on the
    # stream that allocated it, so a new stream per round would allocate (and cache) the step anew
    assert cuda.streams_made == 2


@pytest.mark.parametrize("refused", [None, RuntimeError("operation not permitted when stream is capturing")])
def test_a_capture_keeps_the_allocators_cache_and_pauses_the_garbage_collector(monkeypatch, refused):
    """A runtime captures a graph every round: `torch.cuda.graph`'s `empty_cache` before each capture would
    hand the cached blocks back to the driver and make the next round allocate through cudaMalloc again. A
    collection during a capture could free a CUDA object, a call CUDA refuses there. Both hold whether the
    capture succeeds or fails, and the collector is on again after."""
    import gc

    from pipeline.runtime import device_loop

    cuda = FakeCuda(monkeypatch, refused)
    loop = device_loop.DeviceLoop(torch.device("cuda"), graphs=True)
    rnd = device_loop.DenoiseRound(torch.zeros(1), [0], torch.zeros(1, 4), {}, None)
    ran: list[str] = []
    assert gc.isenabled()
    for _ in range(3):
        loop.run(rnd, cuda.step(ran))
    assert ("empty_cache",) not in cuda.calls and ("capture_begin", loop.pool) in cuda.calls
    assert dict(zip(ran, cuda.collecting, strict=True)) == {"side": True, "capture": False, **(
        {"default": True} if refused else {})}  # fmt: skip
    assert gc.isenabled()


@pytest.mark.parametrize(
    "error", [RuntimeError, torch.AcceleratorError]
)  # torch 2.8+ raises CUDA's as the latter
def test_a_failed_capture_runs_the_step_eagerly_and_leaves_graphs_off(monkeypatch, caplog, error):
    """`graph_safe` predicts; CUDA decides. A capture CUDA refuses ran nothing on the device: the loop puts
    back the stream and ends the allocator's recording into the graph's pool (torch before 2.12 leaves it
    recording when `capture_end` raises, and every later `empty_cache` fails), runs that step eagerly on the
    default stream, and every later one, and says why once, naming the refused call. Before, every round
    captured again and failed the requests in flight each time."""
    from pipeline.runtime import device_loop

    cuda = FakeCuda(monkeypatch, error("CUDA driver error: operation not permitted when stream is capturing"))
    loop = device_loop.DeviceLoop(torch.device("cuda"), graphs=True)
    rnd = device_loop.DenoiseRound(torch.zeros(1), [0], torch.zeros(1, 4), {}, None)
    ran: list[str] = []
    with caplog.at_level("WARNING", logger=device_loop.__name__):
        for _ in range(4):
            loop.run(rnd, cuda.step(ran))
    # the warm-up, the step refused in the capture, that step again eagerly, two more eagerly
    assert ran == ["side", "capture", "default", "default", "default"]
    assert cuda.calls == [("capture_begin", (0, 1)), ("set_stream", "default"), ("end_allocate", 0, (0, 1))]
    assert not loop.graphs and loop.captures == 0 and rnd.graph is None
    assert (
        loop.capture_error
        == f"{error.__name__}: CUDA driver error: operation not permitted when stream is capturing"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"dgpipe: CUDA graph capture failed ({loop.capture_error}); denoise steps run eagerly from now on "
        "(slower): report the GPU, torch and Triton versions"
    ]


def test_out_of_memory_in_a_capture_is_the_steps_failure_and_graphs_stay_on(monkeypatch):
    """Running out of memory while capturing says nothing about graphs: the state is put back, the error is
    raised for the server to answer (503, retry), and the next round captures again."""
    from pipeline.runtime import device_loop

    cuda = FakeCuda(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    loop = device_loop.DeviceLoop(torch.device("cuda"), graphs=True)
    rnd = device_loop.DenoiseRound(torch.zeros(1), [0], torch.zeros(1, 4), {}, None)
    ran: list[str] = []
    loop.run(rnd, cuda.step(ran))
    with pytest.raises(torch.OutOfMemoryError):  # itself, not capture_end's error: the server's 503
        loop.run(rnd, cuda.step(ran))
    assert loop.graphs and loop.capture_error is None and cuda.current is cuda.default
    assert ran == ["side", "capture", "capture"]  # tried once more after emptying the cache, in vain


@pytest.mark.parametrize(
    ("refused", "invalidates"),
    [
        (torch.OutOfMemoryError("CUDA out of memory"), False),
        (torch.OutOfMemoryError("CUDA out of memory"), True),  # capture_end raises over it
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    ],
    ids=["oom", "oom-under-capture-end", "cublas-alloc"],
)
def test_a_capture_out_of_memory_is_tried_once_more_after_emptying_the_cache(
    monkeypatch, refused, invalidates
):
    """While a stream captures, the allocator frees no cached block to grow the graphs' pool, and captures
    keep the cache: a capture that ran out of memory (torch's error, or a library's allocation failure,
    raised itself or under `capture_end`'s) ends its recording into the pool, empties the cache and
    captures again, and the round replays that graph."""
    from pipeline.runtime import device_loop

    cuda = FakeCuda(monkeypatch, refused, refusals=1, invalidates=invalidates)
    loop = device_loop.DeviceLoop(torch.device("cuda"), graphs=True)
    rnd = device_loop.DenoiseRound(torch.zeros(1), [0], torch.zeros(1, 4), {}, None)
    ran: list[str] = []
    for _ in range(3):
        loop.run(rnd, cuda.step(ran))
    assert ran == ["side", "capture", "capture"] and loop.captures == 1 and rnd.graph is not None
    assert cuda.calls == [("capture_begin", (0, 1)), ("set_stream", "default"), ("end_allocate", 0, (0, 1)),
                          ("empty_cache",), ("capture_begin", (0, 1))]  # fmt: skip
    assert loop.graphs and loop.capture_error is None and cuda.current is cuda.default


def test_after_running_out_of_memory_the_runtime_admits_fewer_rows_then_grows_back_below_the_failed_size(
    monkeypatch,
):
    """Out of memory at 4 rows: 2 admitted from then on, one more with every canvas that finishes, not 4
    again until `CEILING_RECOVERY_S` passed without another failure (memory can run out for a reason the
    batch size is not), a row for each period passed, idle ones too; the tokens are those of a run that never
    failed."""
    from pipeline.runtime import scheduler

    clock = [1000.0]
    monkeypatch.setattr(scheduler, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model = build_tiny(torch.float64)
    _, plain = generate(model, requests(FIXED), max_batch=4, sync_every=4)
    rt = BlockDiffusionRuntime(model, max_batch=4, max_len=128, sync_every=4)
    rt.after_out_of_memory(4)
    assert (rt.rows_allowed, rt.rows_ceiling) == (2, 3)
    seen: list[int] = []
    step = rt.step

    def counted() -> None:
        step()
        seen.append(sum(r is not None for r in rt.results))

    rt.step = counted
    same_results(plain, rt.generate(requests(FIXED)))
    assert max(seen) == 3 and seen[0] == 2 and rt.rows_allowed == 3
    rt.after_out_of_memory(3)
    assert (rt.rows_allowed, rt.rows_ceiling) == (1, 2)
    rt.after_out_of_memory(1)
    assert (rt.rows_allowed, rt.rows_ceiling) == (1, 1)  # one row always runs
    clock[0] += scheduler.CEILING_RECOVERY_S - 1  # not yet a period
    same_results(plain, rt.generate(requests(FIXED)))
    assert rt.rows_ceiling == 1 and max(seen) == 3
    clock[0] += 2 * scheduler.CEILING_RECOVERY_S  # two periods since the failure without another, idle
    seen.clear()
    same_results(plain, rt.generate(requests(FIXED)))
    assert seen[0] == 1 and max(seen) == 3 and rt.rows_ceiling == 3  # raised by the first finish
    clock[0] += 10 * scheduler.CEILING_RECOVERY_S
    same_results(plain, rt.generate(requests(FIXED)))
    assert rt.rows_ceiling == 4  # max_batch again, and no more
