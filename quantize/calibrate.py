"""Calibration data and the calibration forward loop, run on the transformers model ModelOpt quantizes.

The loop is the serving path, not one clean causal pass: prefill the prompt (causal, writes the KV cache),
then denoise a uniform-noise canvas for a fixed number of steps at the scheduled temperatures with the
EB-sampler keep/re-noise rule and self-conditioning fed back, then commit the argmax canvas (causal pass
over the block). So the activation ranges ModelOpt records cover noisy early canvases, confident late ones,
the self-conditioning input and both attention modes. Steps are fixed (no adaptive stop) so every
temperature of the schedule is seen.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pipeline.errors import InputError
from pipeline.runtime.prompt_format import EncodedPrompt


def jsonl_prompts(path: Path, n: int, encode: Callable[[str], list[int]]) -> list[EncodedPrompt]:
    """`{"text": ...}` per line; the first n non-empty texts, encoded with the checkpoint's prompt format."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(
            f"--calib-data {path}: cannot be read ({e})", 'pass a JSONL file of {"text": ...}'
        ) from e
    out: list[EncodedPrompt] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(
                f"--calib-data {path}: line {i} is not a JSON object with a 'text' field",
                'expected {"text": "..."}',
            ) from e
        if not isinstance(text, str) or not text:
            raise InputError(f"--calib-data {path}: line {i}: 'text' must be a non-empty string")
        out.append(EncodedPrompt(encode(text)))
        if len(out) == n:
            break
    if not out:
        raise InputError(f"--calib-data {path}: no calibration texts found")
    return out


def _batches(prompts: list[EncodedPrompt], batch: int) -> Iterator[list[EncodedPrompt]]:
    """Equal-length prompts share a batch (no padding masks needed)."""
    by_len: dict[int, list[EncodedPrompt]] = {}
    for p in prompts:
        by_len.setdefault(len(p.ids), []).append(p)
    for group in by_len.values():
        for lo in range(0, len(group), batch):
            yield group[lo : lo + batch]


def eb_keep(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """EB-sampler rule (docs/model.md, "Sampler"): keep the lowest-entropy positions while the accepted entropy minus
    the largest accepted one stays within the bound; the lowest is always kept."""
    order = torch.argsort(entropy, dim=-1)
    h = torch.gather(entropy, -1, order)
    ok = (torch.cumsum(h, -1) - h) <= bound
    keep = torch.zeros_like(ok)
    return keep.scatter(-1, order, ok)


@torch.no_grad()
def denoise_block(
    model,
    prompts: list[EncodedPrompt],
    steps: int,
    t_min: float,
    t_max: float,
    entropy_bound: float,
    generator: torch.Generator,
    on_pass: Callable[[int], None] | None = None,
) -> None:
    """Prefill, `steps` denoise passes, commit: one canvas of the serving path for a batch of prompts.
    `on_pass(1)` after each of its `steps + 2` model passes (a watched build's progress)."""
    tick = on_pass or (lambda k: None)
    vocab = model.config.text_config.vocab_size
    length = model.config.canvas_length
    ids = torch.tensor([p.ids for p in prompts])
    b = ids.shape[0]
    pkv = model.model.encoder(input_ids=ids).past_key_values
    tick(1)
    pinned = torch.full((b, length), -1, dtype=torch.long)
    for i, p in enumerate(prompts):
        if p.template is not None:
            t = torch.tensor(p.template[:length])
            pinned[i, : len(t)] = t
    is_pinned = pinned >= 0

    def noise() -> torch.Tensor:
        return torch.where(is_pinned, pinned, torch.randint(0, vocab, (b, length), generator=generator))

    canvas, sc = noise(), None
    z = None
    for s in range(steps):
        temp = t_min + (t_max - t_min) * (steps - s) / steps
        logits = model(decoder_input_ids=canvas, self_conditioning_logits=sc, past_key_values=pkv).logits
        z = logits.float() / temp
        probs = torch.softmax(z, -1)
        cand = torch.multinomial(probs.view(-1, vocab), 1, generator=generator).view(b, length)
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        canvas = torch.where(eb_keep(entropy, entropy_bound), cand, noise())
        canvas = torch.where(is_pinned, pinned, canvas)
        sc = z.to(model.dtype)
        tick(1)
    block = torch.where(is_pinned, pinned, z.argmax(-1))
    model.model.encoder(input_ids=block, past_key_values=pkv)  # commit: causal pass over the block
    tick(1)


def make_forward_loop(
    prompts: list[EncodedPrompt],
    steps: int = 8,
    t_min: float = 0.4,
    t_max: float = 0.8,
    entropy_bound: float = 0.1,
    batch: int = 16,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    on_loop: Callable[[int], Callable[[int], None]] | None = None,
) -> Callable:
    """The `forward_loop(model)` ModelOpt calls (more than once for AWQ: statistics, then the search).
    `progress(k)` counts prompts. `on_loop(total)`, at the start of each call, returns the callback that
    counts that call's `total` model passes (prefill, each denoise pass, commit), a watched build's progress."""

    def loop(model) -> None:
        gen = torch.Generator().manual_seed(seed)  # same canvases on every call
        on_pass = None
        if on_loop is not None:
            on_pass = on_loop(sum(steps + 2 for _ in _batches(prompts, batch)))
        for chunk in _batches(prompts, batch):
            denoise_block(model, chunk, steps, t_min, t_max, entropy_bound, gen, on_pass)
            if progress is not None:
                progress(len(chunk))

    return loop
