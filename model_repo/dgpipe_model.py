"""Triton Python-backend model (decoupled) that serves DiffusionGemma with dgpipe's runtime.

`dgpipe package` copies this file to <repo>/<model>/1/model.py. It is a thin adapter over the serving core
(pipeline/serving/core: intake, the runtime loop, deadlines, stop words, metrics, response shaping, drain
and shutdown): it reads Triton's requests into input getters, parameters and a reply channel, sends the
core's replies back through the response senders as tensors or errors (the error's kind tagged in its
message, pipeline/serving/error_kinds.py), records metrics as Triton metric families, and wires Triton's
initialize / execute / finalize to the core's load / accept / stop.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.serving import schema
from pipeline.serving.core.drain import DrainSignal
from pipeline.serving.core.loading import Log, load_model
from pipeline.serving.core.metrics import Metrics
from pipeline.serving.core.responses import Failure, Reply
from pipeline.serving.core.service import ServingCore
from pipeline.serving.error_kinds import ErrorKind


def _input(request: Any, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def _error(failure: Failure) -> Any:
    """The Triton error for a failure: its kind tagged in the message (the clients read it back) and as
    the nearest Triton code (INTERNAL is TritonError's default)."""
    codes = {
        ErrorKind.INVALID_REQUEST: pb_utils.TritonError.INVALID_ARG,
        ErrorKind.TIMEOUT: pb_utils.TritonError.UNAVAILABLE,
        ErrorKind.UNAVAILABLE: pb_utils.TritonError.UNAVAILABLE,
    }
    message = failure.kind.on_wire(failure.message)
    code = codes.get(failure.kind)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonChannel:
    """A request's response sender as the core's reply channel."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def send(self, reply: Reply | None) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if reply is None:  # the final flag alone releases the request in Triton (python_backend's rule)
            self.sender.send(None, flags=final)
        elif isinstance(reply, Failure):
            self.sender.send(pb_utils.InferenceResponse(error=_error(reply)), flags=final)
        else:
            tensors = [pb_utils.Tensor(n, schema.output_array(n, v)) for n, v in reply.values.items()]
            response = pb_utils.InferenceResponse(output_tensors=tensors)
            self.sender.send(response, flags=final if reply.final else 0)


# Every call on a Triton metric holds this lock. A Python-backend metric call is a message over the stub's
# shared-memory channel to tritonserver, and calls from several threads at once (the runtime loop, Triton's
# request thread, the guide compilers) crashed tritonserver under concurrent guided requests (SIGABRT from a
# boost::interprocess::lock_exception, or SIGSEGV, in libtriton_python.so) and took every request in flight
# down with it; serialized, the same load ran clean.
_METRICS_LOCK = threading.Lock()


class _SerializedMetric:
    """A Triton metric whose calls are made one at a time, process-wide (`_METRICS_LOCK`)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric

    def increment(self, value: float) -> None:
        with _METRICS_LOCK:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with _METRICS_LOCK:
            self._metric.set(value)

    def observe(self, value: float) -> None:
        with _METRICS_LOCK:
            self._metric.observe(value)

    def __getattr__(self, name: str) -> Any:  # anything else (reading a value) on the metric itself
        return getattr(self._metric, name)


class TritonMetrics:
    """The core's metric factory over Triton's metric families (MetricFamily.HISTOGRAM since 24.08; the
    bundled tritonserver 2.51 is 24.10). A family must outlive its metrics, so this keeps them.

    Triton registers a family by name and hands every instance that asks for the same labels the same
    series (core src/metric_family.cc), so each instance labels its own (model, version, model_instance): with
    two instances on a GPU, unlabelled gauges would hold whichever instance wrote last. Readers sum the
    series (lifecycle.active_requests, the HPA's adapter rule)."""

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.families: list = []
        self.labels = labels or {}

    def _metric(self, name: str, description: str, kind: Any, **kwargs: Any) -> _SerializedMetric:
        with _METRICS_LOCK:
            self.families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return _SerializedMetric(self.families[-1].Metric(labels=self.labels, **kwargs))

    def counter(self, name: str, description: str) -> Any:
        return self._metric(name, description, pb_utils.MetricFamily.COUNTER)

    def gauge(self, name: str, description: str) -> Any:
        return self._metric(name, description, pb_utils.MetricFamily.GAUGE)

    def histogram(self, name: str, description: str, buckets: tuple[float, ...]) -> Any:
        kind = pb_utils.MetricFamily.HISTOGRAM
        return self._metric(name, description, kind, buckets=[float(b) for b in buckets])


class TritonPythonModel:
    core: ServingCore

    def initialize(self, args: dict[str, str]) -> None:
        log = Log(pb_utils.Logger.log_info, pb_utils.Logger.log_error)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        # an instance Triton placed on a GPU (KIND_GPU) serves on that GPU
        placed = args.get("model_instance_kind"), args.get("model_instance_device_id")
        loaded = load_model(json.loads(args["model_config"]), version_dir, log, *placed)
        instance = {"model": args["model_name"], "version": args["model_version"]}
        # not `instance`: Prometheus gives that label to the scrape target (and renames a scraped one)
        instance["model_instance"] = args.get("model_instance_name", args["model_name"])
        metrics = Metrics(TritonMetrics(instance))
        # the drain file touched after this load drains the server (an older file is a previous server's)
        drain = DrainSignal.from_env()
        self.core = ServingCore(loaded.session, loaded.runtime, loaded.limits, metrics, drain, log.error)
        self.core.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            parameters = json.loads(request.parameters() or "{}")
            getter = lambda name, request=request: _input(request, name)
            self.core.accept(getter, parameters, TritonChannel(request.get_response_sender()))
        return None

    def finalize(self) -> None:
        """Stop the runtime loop. Triton calls this only once every request had its final response (each
        response factory holds the model), so nothing is left to answer here; a drain that timed out had the
        runtime loop answer what was left (core.drain)."""
        self.core.stop()
