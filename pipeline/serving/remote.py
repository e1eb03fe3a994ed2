"""Generation answered by a server: the same inputs and settings as in-process batch generation
(pipeline/runtime/batch.py), sent to Triton over HTTP or gRPC, or to the OpenAI-compatible frontend.

Nothing here prints: streamed pieces and drafts go to the caller's callbacks, each answer comes back as
data with the figures `dgpipe generate --json` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipeline.endpoints import MODEL_NAME
from pipeline.errors import DgpipeError
from pipeline.runtime.batch import Callbacks, GenerateInput, GenerateSettings


@dataclass
class RemoteOutput:
    """One input's answer from the server."""

    text: str
    finish_reason: str | None
    steps_per_canvas: list[int]
    prompt_tokens: int | None
    cached_tokens: int | None  # of the prompt's, those the server's prefix cache held
    output_tokens: int | None
    total_s: float
    url: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "steps_per_canvas": self.steps_per_canvas,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "total_s": round(self.total_s, 4),
            "url": self.url,
        }


def request_options(settings: GenerateSettings) -> dict[str, Any]:
    """The per-request inputs the settings map to; a server-side-only setting is refused by name."""
    overrides = settings.sampler
    if overrides.get("stability_threshold") is not None:
        raise DgpipeError("--stability-threshold is a server-side setting; it cannot be sent per request")
    options = {k: v for k, v in overrides.items() if k != "stability_threshold"}
    options.update(
        infill_template=settings.infill,
        stream_drafts=settings.drafts or None,
        exclude_input_in_output=True,
        return_num_input_tokens=True,
        return_num_output_tokens=True,
    )
    if settings.guide is not None:
        options.update(guided_decoding_guide_type=settings.guide[0], guided_decoding_guide=settings.guide[1])
    return options


def generate_remote(
    url: str,
    item: GenerateInput,
    settings: GenerateSettings,
    api_key: str | None = None,
    callbacks: Callbacks | None = None,
    model: str = MODEL_NAME,
) -> RemoteOutput:
    """One input answered by the model named `model` of the server at `url`; streamed (pieces and drafts
    to `callbacks`) when the settings ask for it."""
    from pipeline.serving.client import generate

    cb = callbacks or Callbacks()
    options = request_options(settings)
    start = time.perf_counter()
    gen = generate(
        url,
        item.prompt if item.messages is None else None,
        max_tokens=settings.max_tokens,
        stream=settings.stream or settings.drafts,
        seed=settings.seed,
        messages=item.messages,
        model=model,
        api_key=api_key,
        on_draft=cb.on_draft,
        **options,
    )
    try:
        while True:
            piece = next(gen)
            if cb.on_piece is not None:
                cb.on_piece(piece)
    except StopIteration as stop:
        reply = stop.value
    if cb.on_done is not None:
        cb.on_done()
    return RemoteOutput(
        text=reply.text,
        finish_reason=reply.finish_reason,
        steps_per_canvas=reply.denoise_steps,
        prompt_tokens=reply.num_input_tokens,
        cached_tokens=reply.num_cached_tokens,
        output_tokens=reply.num_output_tokens,
        total_s=time.perf_counter() - start,
        url=url,
    )
