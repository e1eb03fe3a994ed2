"""The Triton model (model_repo) run without tritonserver: a stand-in for `triton_python_backend_utils`
(tensors, requests, response senders, errors, metrics), a session stand-in recording what the model asks
of it, and input arrays typed as the request schema says."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import weakref
from typing import Any

import numpy as np

from pipeline.resources import TRITON_MODEL_SOURCE
from pipeline.serving import schema

PROMPT = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"  # README's


class FakeTensor:
    def __init__(self, name: str, arr: np.ndarray) -> None:
        self.name, self.arr = name, arr

    def as_numpy(self) -> np.ndarray:
        return self.arr


class FakeRequest:
    def __init__(self, inputs: dict[str, np.ndarray], parameters: dict | None = None) -> None:
        self.inputs, self.params, self.sender = inputs, parameters or {}, FakeSender()

    def parameters(self) -> str:
        return json.dumps(self.params)

    def get_response_sender(self):
        return self.sender


class FakeSender:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, response, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


class FakeResponse:
    def __init__(self, output_tensors=None, error=None) -> None:
        self.output_tensors, self.error = output_tensors, error


class FakeError:
    INVALID_ARG, UNAVAILABLE = 3, 4

    def __init__(self, message: str, code: int | None = None) -> None:
        self.message, self.code = message, code


class FakeCounter:
    """Any pb_utils metric: what was set last, and what was observed. Like Triton's, it fails once its
    MetricFamily is gone (the model must keep its families)."""

    def __init__(self, family=None, **kwargs) -> None:
        self.value, self.observed, self.buckets = 0.0, [], kwargs.get("buckets")
        self.family = (lambda: True) if family is None else weakref.ref(family)

    def alive(self) -> None:
        assert self.family() is not None, "the metric's MetricFamily has been deleted"

    def increment(self, n: float) -> None:
        self.alive()
        self.value += n

    def set(self, v: float) -> None:
        self.alive()
        self.value = v

    def observe(self, v: float) -> None:
        self.alive()
        self.observed.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind = name, kind

    def Metric(self, labels: dict, **kwargs) -> FakeCounter:  # pb_utils' spelling
        assert (self.kind == self.HISTOGRAM) == ("buckets" in kwargs), self.name  # histograms need buckets
        return FakeCounter(self, **kwargs)


def _pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.get_input_tensor_by_name = lambda req, name: (
        FakeTensor(name, req.inputs[name]) if name in req.inputs else None
    )
    pb.Tensor = FakeTensor
    pb.InferenceResponse = FakeResponse
    pb.TritonError = FakeError
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.MetricFamily = FakeMetricFamily
    return pb


class FakeSession:
    """What `_parse` asks of the session, recording the sampler knobs it is handed. `max_new_tokens`: the
    checkpoint's generation default for max_tokens (None: it sets none)."""

    def __init__(self, max_new_tokens: int | None = None, tool_call_format: str | None = None) -> None:
        self.knobs: dict[str, Any] = {}
        self.max_new_tokens = max_new_tokens
        self.tool_call_format = tool_call_format  # the chat template's (None: it declares none)
        self.tools: list | None = None  # the tools the last encode_messages rendered

    def sampler(self, **knobs):
        self.knobs = knobs
        from pipeline.model.config import SamplerConfig

        return SamplerConfig(**knobs)  # the real config: every knob the schema hands over must be a field

    def encode_prompt(self, prompt: str) -> list[int]:
        return [ord(c) for c in prompt]

    def build_template(self, template: str) -> str:
        return f"template:{template}"

    def default_template(self, prompt: str) -> str:
        return "default"

    def compile_guide(self, kind: str, guide: str) -> tuple[str, str]:
        return kind, guide  # the real compiler: tests/unit/sampler/test_constraints.py

    def encode_messages(self, messages, tools=None) -> list[int]:
        self.tools = tools
        return self.encode_prompt(self.render(messages))

    @staticmethod
    def render(messages) -> str:
        """A stand-in chat template: each turn as <role>content, then the assistant's turn opened."""
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def decode(self, tokens: list[int]) -> str:
        return "".join(map(chr, tokens))

    def decode_prompt(self, prompt_ids: list[int]) -> str:
        return self.decode(prompt_ids)


def triton_model(monkeypatch):
    """The Triton model as tritonserver loads it, its serving core set up without a checkpoint: limits 512
    tokens, 64 steps per canvas, 100 prompt tokens, 60 s per request; 32-token canvases and the context
    the runtime gets for those limits (as core/loading.py sizes it)."""
    from pipeline.serving.core.metrics import Metrics
    from pipeline.serving.core.service import ServingCore

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    spec = importlib.util.spec_from_file_location("dgpipe_triton_model", TRITON_MODEL_SOURCE)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    m = mod.TritonPythonModel()
    limits = schema.ServerLimits(max_tokens=512, max_steps=64, max_prompt=100, max_request_seconds=60.0)
    from pipeline.limits import context_length

    canvas = 32
    runtime = types.SimpleNamespace(
        validate=lambda req: None,
        waiting=(),
        canvas_length=canvas,
        max_len=context_length(limits.max_prompt, limits.max_tokens, canvas),
    )
    from pipeline.serving.core.guides import Guides

    session, metrics = FakeSession(), Metrics(mod.TritonMetrics())
    # the stand-in session has no tokenizer for a compile child: its guides compile in this process
    m.core = ServingCore(
        session, runtime, limits, metrics, guides=Guides(session, limits, metrics, in_child=False)
    )
    return m


def arr(name: str, *values) -> np.ndarray:
    """Input NAME as Triton hands it to the model: VALUES in the schema's datatype."""
    spec = schema.INPUT[name]
    if spec.datatype == "BYTES":
        return np.array([v if isinstance(v, bytes) else v.encode() for v in values], dtype=np.object_)
    with np.errstate(over="ignore"):  # 1e39 as FP32 is inf, as Triton hands it over
        return np.array(values, dtype=spec.numpy_dtype)
