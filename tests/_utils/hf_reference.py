"""The transformers DiffusionGemma implementation as an oracle: tiny random checkpoints and shared draws.

How draws are shared with transformers' `generate` (which calls `torch.randint` for the initial canvas
and for re-noising, and `torch.multinomial` to sample the denoiser distribution):
  * the generation module's `torch` is swapped for a proxy whose `randint` / `multinomial` return
    dgpipe's counter-based draws for the same (seed, request, canvas, step) coordinates;
  * the proxy infers those coordinates from the call sequence transformers makes for one sequence:
    randint(init), then per step multinomial + randint(renoise); a randint right after a multinomial
    is a re-noise, any other randint starts the next canvas;
  * multinomial(p) becomes Gumbel-max argmax(log p + g) with dgpipe's Gumbel noise g: an exact sample of
    the same categorical distribution, and the same token dgpipe's argmax(z + g) picks, since
    log softmax(z) = z - logsumexp(z).
Everything else (temperatures, entropy-bound acceptance, self-conditioning, adaptive stop, commit,
end-token handling) runs as transformers wrote it.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path

import torch

from pipeline.sampler import rng
from pipeline.sampler.reference import CounterDraws, RowKeys

TINY_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def make_hf_checkpoint(
    out: Path, canvas_length: int = 16, seed: int = 0, embed_scale: float = 1.0, **text
) -> Path:
    """Random DiffusionGemmaForBlockDiffusion saved with save_pretrained; norms, scales and layer scalars
    are randomised too, so a runtime that ignores one of them fails parity."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    tc = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "sliding_window": 8,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
        "max_position_embeddings": 1024,
        **text,
    }
    torch.manual_seed(seed)
    cfg = DiffusionGemmaConfig(text_config=tc, vision_config=TINY_VISION, canvas_length=canvas_length)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "vision" not in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        # embed_scale 25 gives O(1) logits (std-0.02 embeddings give ~0.1), so that low temperatures
        # reach confident canvases and the adaptive stop triggers
        model.model.decoder.embed_tokens.weight.mul_(embed_scale)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.5 + float(torch.rand(1, generator=gen)))
    model.save_pretrained(out)
    return out


class _SharedDrawTorch(types.ModuleType):
    """Stand-in for `torch` inside transformers' generation module (see module docstring)."""

    def __init__(self, seed: int, request: int) -> None:
        super().__init__("torch")
        self.draws = CounterDraws()
        self.seed, self.request = seed, request
        self.canvas, self.step = -1, 0
        self.after_sample = False

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def _keys(self) -> RowKeys:
        t = lambda v: torch.tensor([v])
        return RowKeys(t(self.seed), t(self.request), t(self.canvas), t(self.step))

    def randint(self, low, high, size, device=None, **kw):
        assert low == 0 and size[0] == 1, "the shared-draw proxy handles one sequence at a time"
        if self.after_sample:  # re-noise of the step just sampled
            out = self.draws.renoise(self._keys(), size[1], high)
            self.after_sample = False
            self.step += 1
            return out
        self.canvas, self.step = self.canvas + 1, 0
        return self.draws.initial_canvas(self._keys(), size[1], high)

    def multinomial(self, probs, num_samples=1, **kw):
        key = rng.key_hash(*self._keys().__dict__.values(), rng.STREAM_SAMPLE)
        g = rng.gumbel(key, probs.shape[0], probs.shape[1])[0]
        self.after_sample = True
        return torch.argmax(torch.log(probs) + g, dim=-1, keepdim=True)


@contextlib.contextmanager
def shared_draws(seed: int, request: int):
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen_mod

    proxy = _SharedDrawTorch(seed, request)
    saved = gen_mod.torch
    gen_mod.torch = proxy
    try:
        yield proxy
    finally:
        gen_mod.torch = saved


def count_passes(model):
    """Per-canvas decoder pass counts of a transformers generate call, from forward hooks."""
    per_canvas: list[int] = []

    def on_encoder(*_):
        per_canvas.append(0)

    def on_decoder(*_):
        per_canvas[-1] += 1

    hooks = [
        model.model.encoder.register_forward_hook(on_encoder),
        model.model.decoder.register_forward_hook(on_decoder),
    ]
    return per_canvas, hooks
