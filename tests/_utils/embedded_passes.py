"""The embedded model in bf16 and a fixed pair of its passes: what the kernel tests run with a kernel
installed and without, to hold the model's logits and the K/V a cache keeps to their torch forms."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.model.checkpoint import load_model
from pipeline.model.network import DiffusionGemma
from pipeline.resources import EMBEDDED_MODEL

Passes = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]


def embedded_bf16() -> DiffusionGemma:
    return load_model(EMBEDDED_MODEL, torch.bfloat16)[0].eval()


def denoise_and_prefill(model: DiffusionGemma, seed: int = 0) -> Callable[[], Passes]:
    """A function running one denoise pass (its logits) and one prefill (`encode_kv`: the K/V) of two random
    canvases at positions 7 onward, without a cache or masks."""
    cfg, length = model.cfg, model.config.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))
    positions = torch.arange(length).expand(2, length) + 7
    masks = dict.fromkeys(set(model.layer_types))

    def run() -> Passes:
        with torch.inference_mode():
            logits = model.denoise(canvas, None, positions, masks, None)
            return logits, model.encode_kv(canvas, positions, masks)

    return run
