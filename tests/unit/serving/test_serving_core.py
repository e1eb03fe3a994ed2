"""The serving core in plain Python, without Triton: error kinds on the wire, stop words, deadlines,
response shaping, and a core that answers through a recording channel (shutdown, admission)."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from pipeline.serving import schema
from pipeline.serving.core import responses
from pipeline.serving.core.deadlines import overdue
from pipeline.serving.core.metrics import Metrics
from pipeline.serving.core.responses import Failure, Outputs
from pipeline.serving.core.service import ServingCore
from pipeline.serving.core.shutdown import SHUTTING_DOWN
from pipeline.serving.error_kinds import ErrorKind, from_wire


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        (ErrorKind.INVALID_REQUEST, 400, None),
        (ErrorKind.TIMEOUT, 504, "timeout"),
        (ErrorKind.UNAVAILABLE, 503, "service_unavailable"),
        (ErrorKind.INTERNAL, 500, "internal_error"),
    ],
)
def test_an_error_kind_survives_the_wire_and_names_its_status(kind, status, code):
    wire = kind.on_wire("input 'seed' is bad")
    assert from_wire(wire) == (kind, "input 'seed' is bad")
    assert from_wire("HTTP 400: " + wire) == (
        kind,
        "HTTP 400: input 'seed' is bad",
    )  # after a transport's prefix
    assert (kind.status, kind.code) == (status, code)
    assert ErrorKind.from_status(status) is kind and ErrorKind.from_code(code, 400) is kind


def test_an_untagged_error_is_read_by_nothing_but_its_default():
    assert from_wire(f"{schema.DRAINING} (past its deadline)") == (
        ErrorKind.INVALID_REQUEST,
        f"{schema.DRAINING} (past its deadline)",
    )
    assert from_wire("[bogus] x", ErrorKind.INTERNAL) == (ErrorKind.INTERNAL, "[bogus] x")


def test_a_deadline_counts_from_the_batch_slot_only():
    assert not overdue(0.0, 1.0, 1e9)  # queued: never overdue
    assert not overdue(10.0, 1.0, 10.9) and overdue(10.0, 1.0, 11.1)


def test_final_response_carries_token_counts_only_when_asked():
    assert responses.final("t", "stop", [2]).values == {
        "text_output": ["t"],
        "finish_reason": ["stop"],
        "denoise_steps": [2],
    }
    full = responses.final(
        "t", "length", [2, 3], input_tokens=5, output_tokens=7, logprobs=[], cached_tokens=4
    )
    assert full.final and set(full.values) == set(schema.OUTPUT)
    for name, values in full.values.items():  # every value fits the schema's output dtype
        schema.output_array(name, values)
    assert responses.draft("x", 4) == Outputs({"text_output": ["x"], "denoise_steps": [4]}, final=False)


# ---- a core answering through a recording channel ----------------------------------------------------
class Recorder:
    """Metrics that remember their last value and observations."""

    def __init__(self) -> None:
        self.value, self.observed = 0.0, []

    def increment(self, n: float) -> None:
        self.value += n

    def set(self, v: float) -> None:
        self.value = v

    def observe(self, v: float) -> None:
        self.observed.append(v)


class RecordingFactory:
    def counter(self, name, description):
        return Recorder()

    gauge = counter

    def histogram(self, name, description, buckets):
        return Recorder()


class Channel:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, reply) -> None:
        self.sent.append(reply)

    def is_cancelled(self) -> bool:
        return False


class Session:
    max_new_tokens = None  # the checkpoint sets no default max_tokens
    tokenizer = None

    def sampler(self, **knobs):
        return knobs

    def encode_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def default_template(self, prompt: str) -> None:
        return None

    def decode(self, tokens: list[int]) -> str:
        return "".join(map(chr, tokens))

    def decode_prompt(self, tokens: list[int]) -> str:
        return self.decode(tokens)


class Runtime:
    canvas_length = 8
    max_len = 50 + 64 + 2 * 8  # context_length of the longest prompt and max_tokens core() admits

    def __init__(self) -> None:
        self.waiting, self.dropped, self.cancelled = [], 0, []

    def validate(self, req) -> None:
        pass

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)

    def drop_all(self) -> None:
        self.dropped += 1


def core() -> ServingCore:
    limits = schema.ServerLimits(max_tokens=64, max_steps=8, max_prompt=50, max_request_seconds=30.0)
    return ServingCore(Session(), Runtime(), limits, Metrics(RecordingFactory()))


def inputs(prompt: str, **values) -> dict:
    arrays = {"text_input": schema.input_array("text_input", prompt)}
    return arrays | {n: schema.input_array(n, v) for n, v in values.items()}


def test_stop_answers_every_queued_and_in_flight_request_and_refuses_new_ones():
    c = core()
    queued, running, ping, late = Channel(), Channel(), Channel(), Channel()
    c.accept(inputs("ab").get, {}, queued)
    c.accept(inputs("cd").get, {}, running)
    c.accept(inputs("").get, {schema.HEALTH_PARAMETER: True}, ping)
    job, _ = c.inbox.queue.pop()
    c.jobs[job.request_id] = job  # in the batch
    assert c.stop() == 2
    c.accept(inputs("ef").get, {}, late)
    shutting_down = Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN)
    assert queued.sent == running.sent == ping.sent == late.sent == [shutting_down]
    assert c.runtime.dropped == 1 and c.inbox.empty() and not c.jobs
    assert (c.metrics.active.value, c.metrics.queued.value) == (0, 0)


def test_stop_leaves_the_runtime_to_a_pass_still_running_past_the_join():
    """A pass can outlast shutdown's wait for the loop (a first CUDA-graph capture, a compile): its requests
    are answered, but the runtime is not dropped under it from another thread."""
    import threading

    from pipeline.serving.core.shutdown import shut_down

    c = core()
    running, passing = Channel(), threading.Event()
    c.accept(inputs("ab").get, {}, running)
    job, _ = c.inbox.queue.pop()
    c.jobs[job.request_id] = job
    c.worker = threading.Thread(target=passing.wait, daemon=True)
    c.worker.start()
    assert shut_down(c, join_s=0.01) == 1
    assert running.sent == [Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN)] and c.runtime.dropped == 0
    passing.set()
    c.worker.join()


def test_a_request_runs_from_intake_to_its_final_answer_with_stop_words_and_counts():
    c = core()
    channel = Channel()
    c.accept(inputs("hi", stream=True, stop_words=["!"], return_num_output_tokens=True).get, {}, channel)
    job, req = c.inbox.get_nowait()
    c.jobs[job.request_id] = job
    req.on_canvas(req, [ord(x) for x in "ab"])
    req.on_canvas(req, [ord(x) for x in "c!d"])
    req.on_finish(types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[3, 2]))
    assert c.runtime.cancelled == [job.request_id]  # the stop word ended it
    assert channel.sent == [  # each piece with the tokens so far, as the request asked for counts
        Outputs({"text_output": ["ab"], "num_output_tokens": [2]}, final=False),
        Outputs({"text_output": ["c"], "num_output_tokens": [3]}, final=False),
        # streamed: the text went out already; the count is the returned text's ("abc"), not the canvas's
        Outputs(
            {
                "text_output": [""],
                "finish_reason": ["stop"],
                "num_output_tokens": [3],
                "denoise_steps": [3, 2],
            },
            final=True,
        ),
    ]
    assert c.metrics.requests.value == 1 and c.metrics.canvases.value == 2 and c.metrics.tokens.value == 5
    assert c.metrics.steps_per_canvas.observed == [3, 2] and not c.jobs


def test_a_bad_request_is_answered_with_its_kind_and_never_queued():
    c = core()
    channel = Channel()
    c.accept(inputs("x" * 51).get, {}, channel)
    assert channel.sent == [
        Failure(ErrorKind.INVALID_REQUEST, "prompt has 51 tokens, over this server's limit of 50")
    ]
    assert c.inbox.empty() and c.metrics.rejected.value == 1


def test_a_bug_in_intake_is_a_server_error_not_the_requests(monkeypatch):
    """A request's own problem (a DgpipeError, or a ValueError from a value it sent) is an invalid request;
    an exception of any other type is the server's failure: answered as internal (a 500), not as a 400
    blaming the request, and the core keeps taking requests."""
    c = core()
    channel = Channel()
    monkeypatch.setattr(c.session, "encode_prompt", lambda p: (_ for _ in ()).throw(TypeError("bad call")))
    c.accept(inputs("hi").get, {}, channel)
    (failure,) = channel.sent
    assert failure.kind is ErrorKind.INTERNAL and "TypeError: bad call" in failure.message
    monkeypatch.setattr(c.session, "encode_prompt", lambda p: (_ for _ in ()).throw(ValueError("bad value")))
    c.accept(inputs("hi").get, {}, channel)
    assert channel.sent[1] == Failure(ErrorKind.INVALID_REQUEST, "bad value")
    # an input nested past its parser's recursion limit is the request's too
    monkeypatch.setattr(
        c.session, "encode_prompt", lambda p: (_ for _ in ()).throw(RecursionError("too deep"))
    )
    c.accept(inputs("hi").get, {}, channel)
    assert channel.sent[2].kind is ErrorKind.INVALID_REQUEST and "nests deeper" in channel.sent[2].message
    monkeypatch.undo()
    c.accept(inputs("hi").get, {}, channel)
    assert len(channel.sent) == 3 and not c.inbox.empty()


def test_a_failed_pass_fails_the_requests_in_flight_as_internal():
    c = core()
    channel = Channel()
    c.accept(inputs("hi").get, {}, channel)
    job, _ = c.inbox.get_nowait()
    c.jobs[job.request_id] = job
    c.fail_all(responses.internal_failure("during generation", RuntimeError("boom")))
    assert channel.sent == [
        Failure(ErrorKind.INTERNAL, "internal error during generation: RuntimeError: boom")
    ]
    assert c.runtime.dropped == 1 and not c.jobs


def test_a_drain_that_timed_out_ends_every_request_in_flight_as_unavailable(tmp_path):
    from pipeline.serving.core.drain import ABORT, DrainSignal
    from pipeline.serving.core.engine_loop import DRAIN_EXPIRED, EngineLoop

    c = core()
    c.drain = DrainSignal(str(tmp_path / "draining"))
    channel = Channel()
    c.accept(inputs("hi").get, {}, channel)
    job, _ = c.inbox.get_nowait()
    c.jobs[job.request_id] = job
    loop = EngineLoop(c)
    (tmp_path / "draining").touch()  # draining: the request in flight goes on
    loop.cancel_abandoned(time.perf_counter())
    assert c.jobs and not channel.sent
    (tmp_path / "draining").write_bytes(ABORT)
    loop.cancel_abandoned(time.perf_counter() + 1)
    assert channel.sent == [Failure(ErrorKind.UNAVAILABLE, DRAIN_EXPIRED)] and not c.jobs


def test_internal_failures_are_counted_for_the_alert_and_other_failures_are_not():
    """Triton counts a decoupled model's error responses as successes, so the request-failure alert reads
    dgpipe_requests_failed_total: internal errors only (a bad request, a deadline, a drain are not failures)."""
    c = core()
    channels = [Channel() for _ in range(3)]
    for ch in channels:
        c.accept(inputs("hi").get, {}, ch)
    jobs = [c.inbox.get_nowait()[0] for _ in channels]
    for job in jobs:
        c.jobs[job.request_id] = job
    c.fail(jobs[0], Failure(ErrorKind.TIMEOUT, "ran past its deadline"))
    c.fail_requests([jobs[1].request_id], Failure(ErrorKind.INVALID_REQUEST, "guide"))
    assert c.metrics.failed.value == 0
    c.fail_requests(
        [jobs[1].request_id, jobs[2].request_id], responses.internal_failure("in a pass", KeyError(1))
    )
    assert c.metrics.failed.value == 1  # jobs[1] was already answered
    c.accept(inputs("hi").get, {}, Channel())
    c.accept(inputs("hi").get, {}, Channel())
    for job in (c.inbox.get_nowait()[0], c.inbox.get_nowait()[0]):
        c.jobs[job.request_id] = job
    c.fail_all(responses.internal_failure("in the runtime loop", RuntimeError("boom")))
    assert c.metrics.failed.value == 3


class TinySession(Session):
    """The test session over the tiny model's vocabulary (prompts of three tokens, short canvases)."""

    def sampler(self, **knobs):
        from pipeline.model.config import SamplerConfig

        return SamplerConfig(max_denoising_steps=3, confidence_threshold=0.0)

    def encode_prompt(self, prompt: str) -> list[int]:
        return [2, 5, 6]

    def decode(self, tokens: list[int]) -> str:
        return "x" * len(tokens)


def tiny_core(max_batch: int) -> ServingCore:
    """A core over a real runtime on the tiny model."""
    from pipeline.runtime.scheduler import BlockDiffusionRuntime
    from tests._utils.tiny import build_tiny

    limits = schema.ServerLimits(max_tokens=64, max_steps=8, max_prompt=50, max_request_seconds=30.0)
    runtime = BlockDiffusionRuntime(build_tiny(), max_batch=max_batch, max_len=128)
    return ServingCore(TinySession(), runtime, limits, Metrics(RecordingFactory()))


def test_out_of_memory_fails_the_batch_as_unavailable_and_the_queue_is_served(monkeypatch):
    """A step that runs out of GPU memory: the requests in its batch are answered 503 (retry) with what to
    change if it recurs; the requests still waiting for a slot stay queued and are served. Before, every
    request the runtime held, queued ones too, failed as a 500 with the allocator's text."""
    import torch

    c = tiny_core(max_batch=2)
    channels = [Channel() for _ in range(4)]
    for channel in channels:
        c.accept(inputs("hi", max_tokens=16).get, {}, channel)
    real, failures = c.runtime.backend.denoise_step, iter([True])

    def once(*args, **kwargs):
        if next(failures, False):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(c.runtime.backend, "denoise_step", once)
    c.loop.turn()
    batch, queued = channels[:2], channels[2:]
    for channel in batch:
        ((failure,),) = [channel.sent]
        assert failure.kind == ErrorKind.UNAVAILABLE and failure.message.startswith(
            "the GPU ran out of memory at a batch of 2 requests: retry (the server now admits 1 at a time"
        )
    assert all(not channel.sent for channel in queued) and len(c.jobs) == 2
    assert c.metrics.out_of_memory.value == 1 and c.metrics.rows_allowed.value == 1
    c.loop.turn()  # the queued two: one row at a time now, a size that has not failed
    assert sum(r is not None for r in c.runtime.results) == 1
    while c.jobs:
        c.loop.turn()
    for channel in queued:
        assert not any(isinstance(r, Failure) for r in channel.sent) and channel.sent[-1].final


def test_the_rows_gauge_says_max_batch_before_the_first_step():
    """A fresh server admits max_batch rows, and dgpipe_batch_rows_allowed says so before any request (it
    read 0 until the first step, which an alert on fewer rows than max_batch would take for a failure)."""
    assert tiny_core(max_batch=2).metrics.rows_allowed.value == 2


def test_out_of_memory_lets_go_of_the_dropped_round_before_the_cache_is_emptied(monkeypatch):
    """After a step runs out of GPU memory the allocator's cache is emptied for the next one, and what the
    failed step held must be unreferenced by then: the traceback's frames keep their functions, and the
    denoise step's closure held the dropped round (its slots, masks and the K/V copy of a batch whose rows
    are no range). Before, the round lived until the failure's handling returned."""
    import gc
    import weakref

    import torch

    from pipeline.runtime import device_errors

    c = tiny_core(max_batch=2)
    for _ in range(2):
        c.accept(inputs("hi", max_tokens=16).get, {}, Channel())
    rounds: list[weakref.ref] = []
    prepare = c.runtime._prepare_round

    def prepared(slots):
        rounds.append(weakref.ref(rnd := prepare(slots)))
        return rnd

    def out_of_memory(*args, **kwargs):  # as on a GPU (the runtime itself runs on the CPU)
        monkeypatch.setattr(c.runtime, "device", torch.device("cuda"))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(c.runtime, "_prepare_round", prepared)
    monkeypatch.setattr(c.runtime.backend, "denoise_step", out_of_memory)
    monkeypatch.setattr(device_errors, "unusable", lambda device: None)
    alive_when_emptied: list[bool] = []
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: alive_when_emptied.append(rounds[-1]() is not None)
    )
    gc.disable()  # only references count: a collection in between would hide one
    try:
        c.loop.turn()
    finally:
        gc.enable()
    assert len(rounds) == 1 and c.runtime._round is None
    assert alive_when_emptied == [False]


def test_a_cache_release_that_fails_after_out_of_memory_leaves_the_batch_answered(monkeypatch):
    """On CUDA the failed step's cached memory is released after its requests are answered, and whatever that
    release raises (an allocator left recording by a failed capture: `captures_underway.empty()`) neither
    leaves the batch unanswered nor stops the runtime loop."""
    import torch

    from pipeline.runtime import device_errors

    c = tiny_core(max_batch=1)
    channels = [Channel() for _ in range(2)]
    for channel in channels:
        c.accept(inputs("hi", max_tokens=16).get, {}, channel)

    def out_of_memory(*args, **kwargs):  # the failed step as on a GPU (the runtime itself runs on the CPU)
        monkeypatch.setattr(c.runtime, "device", torch.device("cuda"))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def assert_failed(*args, **kwargs):
        raise RuntimeError("captures_underway.empty() INTERNAL ASSERT FAILED")

    real = c.runtime.backend.denoise_step
    monkeypatch.setattr(c.runtime.backend, "denoise_step", out_of_memory)
    monkeypatch.setattr(device_errors, "unusable", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", assert_failed)
    c.loop.turn()
    assert channels[0].sent[-1].kind == ErrorKind.UNAVAILABLE and not channels[1].sent
    monkeypatch.setattr(c.runtime, "device", torch.device("cpu"))
    monkeypatch.setattr(c.runtime.backend, "denoise_step", real)
    while c.jobs:
        c.loop.turn()
    assert channels[1].sent[-1].final and not any(isinstance(r, Failure) for r in channels[1].sent)


def test_a_gpu_left_unusable_fails_everything_and_fails_health(monkeypatch):
    """A sticky CUDA error (an illegal memory access): every later CUDA call fails, so the core fails every
    request, queued ones too, and from then on refuses requests and health pings as unavailable, so the
    watchdog or the kubelet restarts the server. Before, pings answered "alive" while every request failed."""
    import torch

    from pipeline.runtime import device_errors

    c = tiny_core(max_batch=1)
    channels = [Channel() for _ in range(2)]
    for channel in channels:
        c.accept(inputs("hi", max_tokens=16).get, {}, channel)
    lost = "AcceleratorError: CUDA error: an illegal memory access was encountered"

    def illegal_access(*args, **kwargs):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(c.runtime.backend, "denoise_step", illegal_access)
    monkeypatch.setattr(device_errors, "unusable", lambda device: lost)  # a synchronize would fail too
    c.loop.turn()
    broken = Failure(ErrorKind.UNAVAILABLE, f"the GPU can run no more work in this process ({lost}): "
                     "restart the server")  # fmt: skip
    assert [channel.sent for channel in channels] == [[broken], [broken]] and not c.jobs
    ping, late = Channel(), Channel()
    c.accept(inputs("").get, {schema.HEALTH_PARAMETER: True}, ping)
    c.accept(inputs("hi").get, {}, late)
    assert ping.sent == late.sent == [broken]


def test_clients_are_asked_whether_they_went_away_at_most_every_poll_interval():
    """In Triton's Python backend `is_cancelled` is a round trip to the server per request: asked at every
    step for every request held, queued ones too, it would keep the GPU waiting. The clients are asked once
    per `CANCEL_POLL_S`; deadlines, a local check, are kept every step."""
    from pipeline.serving.core.engine_loop import CANCEL_POLL_S

    c = core()
    asked: list[int] = []

    class Asked(Channel):
        def is_cancelled(self) -> bool:
            asked.append(1)
            return False

    for _ in range(3):
        c.accept(inputs("hi").get, {}, Asked())
        job, _ = c.inbox.get_nowait()
        c.jobs[job.request_id] = job
    for i in range(10):  # ten steps within one interval
        c.loop.cancel_abandoned(100.0 + i * CANCEL_POLL_S / 20)
    assert len(asked) == 3
    c.loop.cancel_abandoned(100.0 + CANCEL_POLL_S * 1.01)
    assert len(asked) == 6
    late = next(iter(c.jobs.values()))
    late.timeout_s, late.result = 1.0, types.SimpleNamespace(admitted=99.0)
    c.loop.cancel_abandoned(100.0 + CANCEL_POLL_S * 1.5)  # between polls: the deadline is still checked
    assert len(asked) == 6 and c.runtime.cancelled == [late.request_id] and late.expired


def test_input_arrays_reach_the_core_as_the_transport_hands_them():
    """The getter is the only view the core has of a request: a plain function of the input name."""
    c = core()
    channel = Channel()
    arrays = inputs("hi", max_tokens=4)
    c.accept(lambda name: arrays.get(name), {}, channel)
    _, req = c.inbox.get_nowait()
    assert req.max_tokens == 4 and req.prompt_ids == [104, 105]
    assert isinstance(arrays["max_tokens"], np.ndarray)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_word_straddling_two_canvases_is_never_sent(stream):
    """A stop word begun at one canvas's end and finished by the next: no part of it reaches the client,
    streamed or not, and the finish reason is `stop`."""
    c, channel = core(), Channel()
    c.accept(inputs("hi", stop_words=["END"], exclude_input_in_output=True, stream=stream).get, {}, channel)
    job, req = c.inbox.get_nowait()
    c.jobs[job.request_id] = job
    req.on_canvas(req, [ord(x) for x in "abcE"])  # the stop word's first letter ends the first canvas
    req.on_canvas(req, [ord(x) for x in "NDxyz"])
    req.on_finish(types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[3, 2]))
    texts = [r.values["text_output"][0] for r in channel.sent if r is not None]
    assert "".join(texts) == "abc" and channel.sent[-1].values["finish_reason"] == ["stop"]
    if stream:  # "abc" as soon as its canvas came, the held "E" never
        assert texts[0] == "abc"


def test_a_tail_held_for_a_stop_word_that_never_comes_is_sent_at_the_end():
    c, channel = core(), Channel()
    c.accept(inputs("hi", stop_words=["END"], exclude_input_in_output=True, stream=True).get, {}, channel)
    job, req = c.inbox.get_nowait()
    c.jobs[job.request_id] = job
    req.on_canvas(req, [ord(x) for x in "abcEN"])
    req.on_finish(types.SimpleNamespace(finish_reason="length", steps_per_canvas=[3]))
    texts = [r.values["text_output"][0] for r in channel.sent if r is not None]
    assert texts[:2] == ["abc", "EN"] and channel.sent[-1].values["finish_reason"] == ["length"]


def test_a_sudoku_canvas_cut_short_is_not_padded_so_text_and_count_agree():
    from pipeline.demo import tokenizer as stok
    from pipeline.demo.prompt_format import SudokuFormat

    ids = stok.sudoku_target_ids("5" * 81)[:5]
    assert SudokuFormat().decode(ids) == "55555"  # 5 tokens, 5 cells: no '.' padding a stop word could match
    assert len(SudokuFormat().decode(stok.sudoku_target_ids("5" * 81))) == 81


def test_logprobs_travel_with_the_tokens_returned_cut_at_a_stop_word():
    """Each response carries the entries of its own tokens (the runtime's records, in OpenAI's shape); a stop
    word drops the entries of the tokens it drops; the final response carries what is left unsent."""
    import json
    import math

    c = core()
    channel = Channel()
    get = inputs("hi", stream=True, stop_words=["!"], return_log_probs=True, top_logprobs=1).get
    c.accept(get, {}, channel)
    job, req = c.inbox.get_nowait()
    assert req.logprobs == 1
    c.jobs[job.request_id] = job
    job.result = types.SimpleNamespace(logprobs=[])

    def canvas(text: str, lps: list[float]) -> None:
        job.result.logprobs += [(lp, [(ord("z"), -0.1)]) for lp in lps]
        req.on_canvas(req, [ord(x) for x in text])

    canvas("ab", [-0.5, -1.0])
    canvas("c!d", [-0.25, -2.0, -math.inf])
    req.on_finish(types.SimpleNamespace(finish_reason="cancelled", steps_per_canvas=[3, 2]))
    sent = [json.loads(r.values["logprobs"][0]) for r in channel.sent]
    alt = [{"token": "z", "logprob": -0.1, "bytes": [122]}]
    assert sent == [
        [
            {"token": t, "logprob": v, "bytes": [ord(t)], "top_logprobs": alt}
            for t, v in (("a", -0.5), ("b", -1.0))
        ],
        [{"token": "c", "logprob": -0.25, "bytes": [99], "top_logprobs": alt}],
        [],  # "!" and "d" were cut: their entries with them
    ]


def test_top_logprobs_needs_return_log_probs():
    c = core()
    channel = Channel()
    c.accept(inputs("hi", top_logprobs=2).get, {}, channel)
    assert channel.sent == [
        Failure(ErrorKind.INVALID_REQUEST, "input 'top_logprobs' needs 'return_log_probs': true")
    ]
    c.accept(inputs("hi", return_log_probs=True, top_logprobs=21).get, {}, channel)
    assert channel.sent[-1] == Failure(
        ErrorKind.INVALID_REQUEST, "input 'top_logprobs' must be in [0, 20] (got 21)"
    )


def test_a_request_waiting_on_its_guide_at_shutdown_is_answered_not_left_hanging():
    """The guide compiles on an intake thread; the model stops meanwhile: that request is answered as the
    queued ones are (shutting down), and so is one still waiting for an intake thread."""
    import threading

    from pipeline.serving.core.guides import Guides

    release, compiling = threading.Event(), threading.Event()

    class GuidedSession(Session):
        tokenizer = None

        def compile_guide(self, kind: str, guide: str):
            compiling.set()
            release.wait(10)
            return types.SimpleNamespace(kind=kind, guide=guide)

    limits = schema.ServerLimits(max_tokens=64, max_steps=8, max_prompt=50, max_request_seconds=30.0)
    metrics = Metrics(RecordingFactory())
    session = GuidedSession()
    c = ServingCore(
        session, Runtime(), limits, metrics, guides=Guides(session, limits, metrics, in_child=False)
    )
    guide = {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9]+"}
    channels = [Channel() for _ in range(3)]  # 2 intake threads: the third waits for one
    for ch in channels:
        c.accept(inputs("ab", **guide).get, {}, ch)
    assert compiling.wait(5)
    c.stop()
    release.set()
    c.guided_intake.shutdown(wait=True)
    assert all(ch.sent == [Failure(ErrorKind.UNAVAILABLE, SHUTTING_DOWN)] for ch in channels), channels


def test_a_token_of_no_mass_or_of_nan_is_reported_at_the_floor():
    """JSON has no infinity and no NaN: a log-probability of -inf (no mass) or NaN (a broken checkpoint's
    logits) is the floor, in the entry and in its alternatives; a finite one is itself."""
    import json

    from pipeline.serving.core.logprobs import LOGPROB_FLOOR, token_entries

    texts = lambda t: (chr(t), [t])
    nan, inf = float("nan"), float("inf")
    entries = token_entries(texts, [97, 98], [(-0.5, [(97, -0.5), (99, -inf)]), (nan, [(98, nan)])])
    assert [e["logprob"] for e in entries] == [-0.5, LOGPROB_FLOOR]
    assert [[a["logprob"] for a in e["top_logprobs"]] for e in entries] == [
        [-0.5, LOGPROB_FLOOR],
        [LOGPROB_FLOOR],
    ]
    json.dumps(entries, allow_nan=False)


def test_a_request_past_a_full_queue_is_refused_unavailable_at_once_and_one_fits_again_once_it_moves():
    """max_queue bounds the requests waiting for a batch slot: one more is answered 503 (retry) before any
    work instead of waiting behind the backlog; the batch itself is not counted."""
    import dataclasses

    c = core()
    c.limits = dataclasses.replace(c.limits, max_queue=2)
    first, second, third = Channel(), Channel(), Channel()
    c.accept(inputs("ab").get, {}, first)
    c.accept(inputs("cd").get, {}, second)
    c.accept(inputs("ef").get, {}, third)
    assert first.sent == second.sent == [] and c.inbox.qsize() == 2
    assert [type(r) for r in third.sent] == [Failure] and third.sent[0].kind is ErrorKind.UNAVAILABLE
    assert "queue is full (2 requests" in third.sent[0].message
    job, _ = c.inbox.get_nowait()  # the runtime loop takes one into the batch
    c.jobs[job.request_id] = job
    fourth = Channel()
    c.accept(inputs("gh").get, {}, fourth)
    assert fourth.sent == [] and c.inbox.qsize() == 2


def test_guided_requests_being_taken_in_count_toward_the_queue():
    """A guided request waits for an intake thread (its guide compiles) before it reaches the inbox: it
    counts as waiting from when it is accepted, so a flood of guided requests is shed at once too."""
    import dataclasses
    import threading

    c = core()
    c.limits = dataclasses.replace(c.limits, max_queue=2)
    held = threading.Event()
    taken: list[bool] = []
    c._take = lambda get, params, channel: (held.wait(10), taken.append(True))  # an intake thread, busy
    channels = [Channel() for _ in range(3)]
    for ch in channels:
        c.accept(inputs("ab", guided_decoding_guide_type="regex", guided_decoding_guide="[0-9]+").get, {}, ch)
    assert c.waiting() == 2 and channels[0].sent == channels[1].sent == []
    assert [type(r) for r in channels[2].sent] == [Failure] and "queue is full (2 requests" in channels[
        2
    ].sent[0].message
    held.set()
    c.guided_intake.shutdown(wait=True)
    assert taken == [True, True] and c.waiting() == 0
