"""Autoregressive decoding with the same weights: the encoder mode is a causal LM.

Greedy, batched, with the same pre-allocated KV cache as diffusion. Used as the baseline that diffusion
is compared against (speed in `dgpipe bench local`, accuracy in `dgpipe eval sudoku --decode ar`).
"""

from __future__ import annotations

import torch

from pipeline.model.network import DiffusionGemma, canvas_positions
from pipeline.runtime.kv_cache import KVCache, attention_masks


@torch.no_grad()
def ar_generate(
    model: DiffusionGemma,
    prompts: list[list[int]],
    max_tokens: int,
    templates: list[list[int]] | None = None,
    max_len: int | None = None,
) -> tuple[list[list[int]], int]:
    """Greedy decode; returns tokens per prompt (through the first end token) and the number of passes.

    A template pins token i of the continuation (-1 = free), mirroring diffusion infilling.
    """
    cfg = model.cfg
    p = next(model.parameters())
    b = len(prompts)
    longest = max(len(x) for x in prompts)
    cache = KVCache(cfg, b, max_len or longest + max_tokens + 1, p.dtype, p.device)
    slots = torch.arange(b, device=p.device)
    tokens = torch.full((b, longest), cfg.pad_token_id, dtype=torch.long, device=p.device)
    for i, x in enumerate(prompts):
        tokens[i, : len(x)] = torch.tensor(x)
    lens = torch.tensor([len(x) for x in prompts], device=p.device)
    valid = torch.arange(longest, device=p.device)[None, :] < lens[:, None]
    positions = canvas_positions(cache.lengths, longest)
    h, kv = model.encode(tokens, positions, attention_masks(positions, valid, None, True, cache.window))
    cache.write(slots, kv, positions, valid)
    last = h[torch.arange(b), lens - 1]
    end_ids = torch.tensor(cfg.end_token_ids, device=p.device)
    pinned = torch.full((b, max_tokens), -1, dtype=torch.long, device=p.device)
    for i, t in enumerate(templates or []):
        pinned[i, : min(len(t), max_tokens)] = torch.tensor(t[:max_tokens])
    out = torch.full((b, max_tokens), cfg.pad_token_id, dtype=torch.long, device=p.device)
    done = torch.zeros(b, dtype=torch.bool, device=p.device)
    passes = 1
    for i in range(max_tokens):
        nxt = torch.argmax(model.logits(last), dim=-1)
        nxt = torch.where(pinned[:, i] >= 0, pinned[:, i], nxt)
        out[:, i] = torch.where(done, cfg.pad_token_id, nxt)
        done |= torch.isin(nxt, end_ids)
        if bool(done.all()) or i == max_tokens - 1:
            break
        positions = cache.lengths[:, None].clone()
        past, meta = cache.read(slots)
        one = torch.ones_like(positions, dtype=torch.bool)
        h, kv = model.encode(
            nxt[:, None], positions, attention_masks(positions, one, meta, True, cache.window), past
        )
        cache.write(slots, kv, positions, one)
        last = h[:, 0]
        passes += 1
    results = []
    for row in out.tolist():
        cut = next((j for j, t in enumerate(row) if t in cfg.end_token_ids), None)
        results.append(row if cut is None else row[: cut + 1])
    return results, passes
