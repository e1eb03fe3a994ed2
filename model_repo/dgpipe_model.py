"""Triton Python-backend model (decoupled) that serves DiffusionGemma with dgpipe's runtime.

`dgpipe package` copies this file to <repo>/<model>/1/model.py. Requests are validated in `execute` against
pipeline/serving/schema.py and the repository's caps (a bad one is answered with an INVALID_ARG error and
never reaches the batch), then handed to a worker thread that owns the BlockDiffusionRuntime: requests in flight share denoise passes and join at canvas
boundaries; cancellation is checked between steps. Responses stream per committed canvas (and per
denoise step with `stream_drafts`). A failure that belongs to one request (its submission, its callbacks)
is answered to that request alone; only a failed shared pass fails the requests in flight.

Lifecycle (pipeline/serving/lifecycle.py is the other side): every request has a deadline (the repository's
`max_request_seconds`, or less with its `timeout_s` input), counted from when it gets a batch slot, after
which it ends with an error and frees the slot, so work a client abandoned is bounded even where Triton
does not pass the disconnect on (HTTP). A request with the `health_check` parameter is a ping answered by the worker thread between steps: it
proves the stub, its intake and its runtime loop are alive (Triton's own readiness stays 200 when the stub
is gone). Once the drain file (env DGPIPE_DRAIN_FILE) is touched after this model loaded, new requests and
pings are refused as UNAVAILABLE while those in flight finish.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving import schema
from pipeline.serving.schema import BadRequest  # answered with INVALID_ARG; never reaches the batch

# Histogram buckets (upper bounds; Prometheus adds +Inf): seconds for latencies, steps for steps per canvas.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)


@dataclass
class Job:
    sender: Any
    request_id: int
    prompt_ids: list[int]
    flags: dict[str, bool]
    stop_words: list[str]
    text: str = ""
    tokens: int = 0
    canvases: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_canvas: float | None = None
    last_canvas: float | None = None  # when the previous canvas was committed (None: none yet)
    failed: bool = False  # answered with an error: nothing more is sent
    timeout_s: float = float("inf")  # its deadline, from when it got a batch slot
    expired: bool = False  # cancelled by its deadline: answered with an error, not a result
    result: Any = None  # the runtime's Result once submitted (its `admitted` time: when it got a slot)

    def overdue(self, now: float) -> bool:
        """Running longer than its deadline. Time queued does not count: the queue moves because every
        running request is bounded, and a full batch must not expire the requests waiting behind it."""
        admitted = self.result.admitted if self.result is not None else 0.0
        return admitted > 0 and now - admitted > self.timeout_s


def _input(request, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


class TritonPythonModel:
    drain_file: str | None = None  # set by initialize from DGPIPE_DRAIN_FILE
    loaded_at = 0.0  # time.time() at load: an older drain file is a previous server's

    def initialize(self, args: dict[str, str]) -> None:
        from pipeline.builddir import MODEL_CHECKPOINT
        from pipeline.limits import Limits, context_length
        from pipeline.runtime.scheduler import BlockDiffusionRuntime
        from pipeline.runtime.session import load_session
        from pipeline.threads import apply_thread_policy

        config = json.loads(args["model_config"])
        # each instance is its own stub process: the thread budget is split among them (README: Threads)
        groups = config.get("instance_group", [])
        instances = sum(int(g.get("count", 1)) * max(1, len(g.get("gpus", []))) for g in groups) or 1
        threads = apply_thread_policy(instances)
        pb_utils.Logger.log_info(f"dgpipe: {threads} compute threads per instance ({instances} instances)")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        limits = Limits()  # what `dgpipe package` writes when a parameter is missing
        ckpt = Path(params.get("checkpoint", MODEL_CHECKPOINT))
        if not ckpt.is_absolute():
            ckpt = Path(args["model_repository"]) / args["model_version"] / ckpt
        version_dir = Path(args["model_repository"]) / args["model_version"]
        dtype, device = params.get("dtype", "auto"), params.get("device", "auto")
        choice = self._choose(version_dir)
        # with a TensorRT plan the weights live in the engine: the session then holds config + tokenizer only
        # compile: the PyTorch passes through torch.compile; the warm-up request compiles them during load
        compile = params.get("compile", "false") == "true"
        self.session = load_session(ckpt, dtype, device, weights=choice.kind != "tensorrt", compile=compile)
        length = self.session.model.config.canvas_length
        positions = self.session.model.config.text_config.max_position_embeddings
        self.limits = schema.ServerLimits(
            max_tokens=int(params.get("max_tokens", limits.max_tokens)),
            max_steps=int(params.get("max_steps", limits.max_steps)),
            max_prompt=schema.prompt_limit(
                int(params.get("max_prompt", limits.max_prompt)), positions, length
            ),
            max_request_seconds=float(params.get("max_request_seconds", limits.max_request_seconds)),
        )
        self.drain_file = os.environ.get(schema.DRAIN_FILE_ENV)
        self.loaded_at = time.time()  # a drain file older than this is a previous container's: ignored
        backend = self._backend(choice)
        if backend is None:  # the plan failed to load: fall back to the PyTorch weights
            self.session = load_session(ckpt, dtype, device, compile=compile)
            backend = self.session.model
        self.runtime = BlockDiffusionRuntime(
            backend,
            max_batch=int(params.get("max_batch", limits.max_batch)),
            # never past the model's positions: generation ends ("length") when the next canvas would not fit
            max_len=min(context_length(self.limits.max_prompt, self.limits.max_tokens, length), positions),
        )
        self.ids = itertools.count(1)
        self.inbox: queue.Queue = queue.Queue()
        # health pings' response senders: answered by the worker thread, so a wedged runtime loop fails
        # them (apart from the inbox, so they never show in the load gauges)
        self.pings: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}
        self._metrics()
        self.running = True
        self.worker = threading.Thread(target=self._loop, name="dgpipe-runtime", daemon=True)
        self.worker.start()

    def _choose(self, version_dir: Path):
        """The TensorRT plan for this GPU when the repository holds a matching one, else the PyTorch model.
        A plan that is present but unusable (other TensorRT, other GPU) is logged as an error, not hidden."""
        from pipeline.engine.probe import gpu, tensorrt_version
        from pipeline.engine.select import choose_backend

        g = gpu()
        choice = choose_backend(version_dir, g[0] if g else None, tensorrt_version())
        if choice.kind != "tensorrt":
            log = pb_utils.Logger.log_error if choice.loud else pb_utils.Logger.log_info
            log(f"dgpipe: PyTorch runtime ({choice.reason})")
        return choice

    def _backend(self, choice):
        """The runtime's backend for the choice; None when a chosen plan fails to load (the log says why)."""
        self.runtime_kind = "pytorch"
        if choice.kind != "tensorrt":
            return self.session.model
        try:
            from pipeline.engine.trt_backend import TensorRTBackend

            backend = TensorRTBackend(choice.engine_dir, self.session.model.config)
        except Exception as e:  # the server must come up
            pb_utils.Logger.log_error(
                f"dgpipe: TensorRT engine failed to load ({e}); using the PyTorch runtime"
            )
            return None
        pb_utils.Logger.log_info(f"dgpipe: TensorRT runtime, {choice.reason}")
        self.runtime_kind = "tensorrt"
        return backend

    def _metrics(self) -> None:
        """Counters, load gauges (set on every change: 0 when idle) and Prometheus histograms (Triton's
        Python backend has MetricFamily.HISTOGRAM since 24.08; the bundled tritonserver 2.51 is 24.10)."""
        self.families = []  # a MetricFamily must outlive its metrics, so the model keeps them

        def metric(name: str, description: str, kind, **kwargs):
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self.families[-1].Metric(labels={}, **kwargs)

        def counter(name: str, description: str):
            return metric(name, description, pb_utils.MetricFamily.COUNTER)

        def gauge(name: str, description: str):
            return metric(name, description, pb_utils.MetricFamily.GAUGE)

        def histogram(name: str, description: str, buckets: tuple[float, ...]):
            return metric(
                name, description, pb_utils.MetricFamily.HISTOGRAM, buckets=[float(b) for b in buckets]
            )

        self.m_requests = counter("dgpipe_requests_total", "Generate requests accepted")
        self.m_rejected = counter("dgpipe_requests_rejected_total", "Requests refused as invalid")
        self.m_cancelled = counter("dgpipe_requests_cancelled_total", "Requests the client cancelled")
        self.m_expired = counter(
            "dgpipe_requests_expired_total",
            "Requests ended by their deadline (max_request_seconds/timeout_s)",
        )
        self.m_draining = gauge("dgpipe_draining", "1 once the server drains: new requests are refused")
        self.m_canvases = counter("dgpipe_canvases_total", "Canvases committed")
        self.m_steps = counter("dgpipe_denoise_steps_total", "Denoise steps over all canvases")
        self.m_tokens = counter("dgpipe_generated_tokens_total", "Tokens generated")
        self.m_active = gauge(
            "dgpipe_active_requests", "Requests accepted and not yet answered (in the batch or queued)"
        )
        self.m_queued = gauge("dgpipe_queued_requests", "Accepted requests waiting for a batch slot")
        self.m_ttfc = histogram(
            "dgpipe_time_to_first_canvas_seconds",
            "From acceptance to a request's first committed canvas",
            LATENCY_BUCKETS,
        )
        self.m_canvas_latency = histogram(
            "dgpipe_canvas_latency_seconds",
            "Time per committed canvas (the first one from acceptance, the others from the previous canvas)",
            LATENCY_BUCKETS,
        )
        self.m_steps_per_canvas = histogram(
            "dgpipe_steps_per_canvas", "Denoise steps per committed canvas", STEP_BUCKETS
        )
        self.m_request_latency = histogram(
            "dgpipe_request_latency_seconds",
            "From acceptance to the final response of a request answered with a result",
            REQUEST_BUCKETS,
        )
        self.load_lock = threading.Lock()
        self.load = (0, 0)
        self.m_active.set(0)
        self.m_queued.set(0)

    def _update_load(self) -> None:
        """Set the load gauges from the current state; called on every change of it (by either thread)."""
        with self.load_lock:
            inbox = self.inbox.qsize()
            load = (inbox + len(self.jobs), inbox + len(self.runtime.waiting))
            if load != self.load:
                self.load = load
                self.m_active.set(load[0])
                self.m_queued.set(load[1])

    # ---- request intake (Triton's thread) -------------------------------------------------------
    def draining(self) -> bool:
        """Whether `dgpipe serve` or the pod's preStop hook asked this server to drain (a stat per call)."""
        if not self.drain_file:
            return False
        try:
            # file times come from the kernel's coarse clock, which can trail time.time() by a few ms: a
            # file touched right after load must not read as older (a previous container's is seconds older)
            return os.stat(self.drain_file).st_mtime >= self.loaded_at - 1.0
        except OSError:
            return False

    def execute(self, requests):
        draining = self.draining()
        if draining:
            self.m_draining.set(1)
        for request in requests:
            sender = request.get_response_sender()
            try:
                if draining:
                    error = pb_utils.TritonError(
                        schema.DRAINING,
                        pb_utils.TritonError.UNAVAILABLE,
                    )
                    sender.send(
                        pb_utils.InferenceResponse(error=error),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                    )
                    continue
                if schema.HEALTH_PARAMETER in json.loads(request.parameters() or "{}"):
                    self.pings.put(sender)
                    continue
                self.inbox.put(self._parse(request, sender))
                self.m_requests.increment(1)
                self._update_load()
            except Exception as e:  # a bad request is answered alone; the batch keeps going
                self.m_rejected.increment(1)
                error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG)
                sender.send(
                    pb_utils.InferenceResponse(error=error),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        return None

    def _parse(self, request, sender):
        from pipeline.errors import DgpipeError
        from pipeline.runtime.scheduler import Request

        parsed = schema.parse_request(
            lambda name: _input(request, name),
            json.loads(request.parameters() or "{}"),
            self.limits,
        )
        try:
            sampler = self.session.sampler(**parsed.sampler)
            prompt_ids = (
                self.session.encode_prompt(parsed.prompt)
                if parsed.messages is None
                else self.session.encode_messages(parsed.messages)  # through the checkpoint's chat template
            )
            if len(prompt_ids) > self.limits.max_prompt:
                raise BadRequest(
                    f"prompt has {len(prompt_ids)} tokens, over this server's limit of {self.limits.max_prompt}"
                )
            template = (
                self.session.build_template(parsed.infill_template)
                if parsed.infill_template is not None
                else self.session.default_template(parsed.prompt)
            )
            guide = None if parsed.guide is None else self.session.compile_guide(*parsed.guide)
            job = Job(
                sender,
                next(self.ids),
                prompt_ids,
                parsed.flags,
                parsed.stop_words,
                timeout_s=parsed.timeout_s,
            )
            req = Request(
                prompt_ids=prompt_ids,
                max_tokens=parsed.max_tokens,
                sampler=sampler,
                seed=parsed.seed,
                request_id=job.request_id,
                draw_id=0,  # the seed alone decides the draws: same seed, same answer, whatever the id
                template=template,
                guide=guide,
                on_canvas=lambda r, toks, j=job: self._guarded(j, self._on_canvas, toks),
                on_draft=(lambda r, toks, step, j=job: self._guarded(j, self._on_draft, toks, step))
                if parsed.flags["stream_drafts"]
                else None,
                on_finish=lambda res, j=job: self._guarded(j, self._on_finish, res),
            )
            self.runtime.validate(req)
        except DgpipeError as e:
            raise BadRequest(str(e)) from e
        return job, req

    # ---- the runtime loop (worker thread) --------------------------------------------------------
    def _loop(self) -> None:
        import torch

        while self.running:
            try:
                block = not self.runtime.busy()
                while True:
                    job, req = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
                    block = False
                    try:
                        job.result = self.runtime.submit(req)
                    except Exception as e:  # this request alone is refused; the batch never saw it
                        self._fail(job, str(e), pb_utils.TritonError.INVALID_ARG)
                        continue
                    self.jobs[job.request_id] = job
            except queue.Empty:
                pass
            while not self.pings.empty():  # alive: this loop runs and reaches its queues
                self.pings.get_nowait().send(
                    pb_utils.InferenceResponse(output_tensors=[]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
            self._update_load()
            now = time.perf_counter()
            for job in list(self.jobs.values()):
                if job.sender.is_cancelled():
                    self.runtime.cancel(job.request_id)
                elif not job.expired and job.overdue(now):
                    job.expired = True  # answered with an error when the runtime lets it go (_on_finish)
                    self.runtime.cancel(job.request_id)
            if self.runtime.busy():
                try:
                    with torch.inference_mode():
                        self.runtime.step()
                except Exception as e:  # fail the requests in flight, keep the server serving
                    self._fail_all(f"internal error during generation: {type(e).__name__}: {e}")
                self._update_load()  # requests admitted to batch slots leave the queue

    def _guarded(self, job: Job, callback, *args) -> None:
        """A request's callback; if it fails, that request is answered with the error and cancelled, and
        the pass goes on for the others."""
        if job.failed:
            return
        try:
            callback(job, *args)
        except Exception as e:
            self.runtime.cancel(job.request_id)
            self._fail(job, f"internal error in this request: {type(e).__name__}: {e}")

    def _fail(self, job: Job, message: str, code=None) -> None:
        pb_utils.Logger.log_error(f"dgpipe: request {job.request_id}: {message}")
        job.failed = True
        self.jobs.pop(job.request_id, None)
        self._update_load()
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        job.sender.send(
            pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    def _fail_all(self, message: str) -> None:
        pb_utils.Logger.log_error(message)
        error = pb_utils.TritonError(message)
        for job in list(self.jobs.values()):
            job.sender.send(
                pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            )
        self.jobs.clear()
        self.runtime.drop_all()
        self._update_load()

    def _respond(
        self, job: Job, text: str, final: bool, reason: str = "", steps: list[int] | None = None
    ) -> None:
        outs: list = []

        def out(name: str, values: list) -> None:
            outs.append(pb_utils.Tensor(name, schema.output_array(name, values)))

        out("text_output", [text])
        if final:
            out("finish_reason", [reason])
            if job.flags["return_num_input_tokens"]:
                out("num_input_tokens", [len(job.prompt_ids)])
            if job.flags["return_num_output_tokens"]:
                out("num_output_tokens", [job.tokens])
        if steps is not None:
            out("denoise_steps", steps)
        job.sender.send(
            pb_utils.InferenceResponse(output_tensors=outs),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0,
        )

    def _on_draft(self, job: Job, tokens: list[int], step: int) -> None:
        self._respond(job, self.session.decode(tokens), final=False, steps=[step])

    def _on_canvas(self, job: Job, tokens: list[int]) -> None:
        piece = self.session.decode(tokens)
        job.tokens += len(tokens)
        job.canvases += 1
        self.m_canvases.increment(1)
        self.m_tokens.increment(len(tokens))
        now = time.perf_counter()
        self.m_canvas_latency.observe(now - (job.started if job.last_canvas is None else job.last_canvas))
        job.last_canvas = now
        if job.first_canvas is None:
            job.first_canvas = now - job.started
            self.m_ttfc.observe(job.first_canvas)
        hit = min((i for w in job.stop_words if (i := (job.text + piece).find(w)) >= 0), default=-1)
        if hit >= 0:
            piece = (job.text + piece)[:hit][len(job.text) :]
            self.runtime.cancel(job.request_id)
            job.flags["stopped_by_word"] = True
        job.text += piece
        if job.flags["stream"] and piece:
            self._respond(job, piece, final=False)

    def _on_finish(self, job: Job, res) -> None:
        # metrics first: a client that reads them after its final response sees its request counted
        self.jobs.pop(job.request_id, None)
        self._update_load()
        reason = "stop" if job.flags.get("stopped_by_word") else res.finish_reason
        if reason == "cancelled" and job.sender.is_cancelled():
            self.m_cancelled.increment(1)
            # the client went away: no response, but the final flag still releases the request in Triton
            # (python_backend's rule for cancelled requests; without it the model can never unload)
            job.sender.send(None, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if reason == "cancelled" and job.expired:
            self.m_expired.increment(1)
            self._fail(
                job,
                f"{schema.PAST_DEADLINE} of {job.timeout_s:g} s and was stopped after "
                f"{job.canvases} canvas(es); ask for fewer max_tokens or max_denoising_steps, or a longer "
                f"timeout_s (this server allows up to {self.limits.max_request_seconds:g} s)",
                pb_utils.TritonError.UNAVAILABLE,
            )
            return
        for steps in res.steps_per_canvas:
            self.m_steps.increment(steps)
            self.m_steps_per_canvas.observe(steps)
        self.m_request_latency.observe(time.perf_counter() - job.started)
        if job.flags["stream"]:
            text = ""
        elif job.flags["exclude_input_in_output"]:
            text = job.text
        else:  # the prompt as the model read it (a chat: its rendered template), for text and messages alike
            text = self.session.decode_prompt(job.prompt_ids) + job.text
        self._respond(job, text, final=True, reason=reason, steps=res.steps_per_canvas)

    def finalize(self) -> None:
        self.running = False
        self.worker.join(timeout=5)
