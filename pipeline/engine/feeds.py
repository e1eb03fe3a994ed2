"""Engine inputs from the runtime's tensors, and the runtime's results from engine outputs.

Kept apart from `trt_backend` (which only binds and executes) so the exact feeds TensorRT receives can be
run through onnxruntime on the same exported graph on a CPU machine (tests/unit/engine/test_engine.py): the names,
dtypes, mask widths, dummy sampler rows of causal passes and the full-width zero self-conditioning embedding of a
canvas's first step are all checked against the PyTorch runtime without TensorRT.
"""

from __future__ import annotations

import torch

from pipeline.model.config import TextConfig
from pipeline.onnx.contract import MODE_CAUSAL, MODE_DENOISE
from pipeline.runtime.backends import KV, Masks, SamplerInputs

MODES = {"causal": MODE_CAUSAL, "denoise": MODE_DENOISE}


def denoise_sc(
    sc_soft: torch.Tensor | None, b: int, q: int, hidden: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Self-conditioning input `sc_embed`, always [B, L, hidden]: zeros (= no self-conditioning, exactly)
    when no row has a previous step, so the denoise shapes, and a captured CUDA graph, stay the same for a
    whole canvas."""
    if sc_soft is None:
        return torch.zeros(b, q, hidden, dtype=dtype, device=device)
    return sc_soft.to(device=device, dtype=dtype)


def engine_feeds(
    kind: str,
    cfg: TextConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    masks: Masks,
    past: KV | None,
    sc: torch.Tensor,
    sampler: SamplerInputs | None,
    mode: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Every graph input (pipeline/onnx/contract.py) for one pass, on `device` (`mode` may be given as a pinned
    host tensor: TensorRT reads shape-tensor inputs from host memory). The K/V are the cache's row views as
    they lie (strided where the rows are shorter than the buffers): whoever binds them makes the one copy
    TensorRT needs, into a contiguous tensor for an eager run or into a captured graph's static input."""
    b, q = tokens.shape
    long = {"dtype": torch.int64, "device": device}
    f32 = {"dtype": torch.float32, "device": device}
    feeds: dict[str, torch.Tensor] = {
        "mode": mode if mode is not None else torch.tensor([MODES[kind]], dtype=torch.int64),
        "tokens": tokens.to(**long),
        "positions": positions.to(**long),
        "sc_embed": sc,
    }
    past_len: dict[str, int] = {}
    for i, layer_kind in enumerate(cfg.layer_types):  # type: ignore[union-attr]
        shape = cfg.layer_shape(i)
        for j, kv in enumerate(("key", "value")):
            if past is None:  # fresh prefill: no cached keys
                t = torch.zeros(b, shape.num_kv_heads, 0, shape.head_dim, dtype=dtype, device=device)
            else:
                t = past[i][j].to(device=device, dtype=dtype)
            feeds[f"past.{i}.{kv}"] = t
        past_len[layer_kind] = feeds[f"past.{i}.key"].shape[2]
    for layer_kind, name in (
        ("full_attention", "attention_mask.full"),
        ("sliding_attention", "attention_mask.sliding"),
    ):
        mask = masks.get(layer_kind)
        keys = past_len.get(layer_kind, 0) + q
        # attention_masks returns None when every key is visible; the graph always takes a mask
        feeds[name] = (
            torch.ones(b, 1, q, keys, dtype=torch.bool, device=device) if mask is None else mask.to(device)
        )
    if sampler is None:  # causal pass: the head runs on one position; harmless sampler rows, outputs ignored
        zeros = torch.zeros(b, **long)
        free = torch.full((b, q), -1, **long)
        feeds |= {
            "temperature": torch.ones(b, **f32),
            "bound": torch.ones(b, **f32),
            "seed": zeros,
            "request": zeros,
            "canvas": zeros,
            "step": zeros,
            "template": free,
            "prev_argmax": free,
            "stable_count": zeros,
            "stability_threshold": torch.ones(b, **long),
            "confidence_threshold": torch.zeros(b, **f32),
        }
    else:
        s, k = sampler, sampler.keys
        feeds |= {
            "temperature": s.temperature.to(**f32),
            "bound": s.bound.to(**f32),
            "seed": k.seed.to(**long),
            "request": k.request.to(**long),
            "canvas": k.canvas.to(**long),
            "step": k.step.to(**long),
            "template": s.template.to(**long) if s.template is not None else torch.full((b, q), -1, **long),
            "prev_argmax": s.prev_argmax.to(**long),
            "stable_count": s.stable_count.to(**long),
            "stability_threshold": s.stability_threshold.to(**long),
            "confidence_threshold": s.confidence_threshold.to(**f32),
        }
    return feeds
