"""Parity with the transformers DiffusionGemma implementation (the model oracle), on tiny random configs.

(a) prefill, denoise (with and without self-conditioning) and commit logits within ||d||/||ref|| < 1e-4;
(b) with the same draws (see tests/hf_reference.py for how they are shared), a full multi-canvas
    generation gives identical tokens and identical per-canvas step counts to transformers' `generate`.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers",
    reason="the parity oracle is transformers' DiffusionGemma (pip install transformers>=5.23)",
)

from pipeline.model.checkpoint import load_model
from pipeline.model.config import SamplerConfig
from pipeline.model.network import canvas_positions
from pipeline.runtime.kv_cache import KVCache, attention_masks
from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
from tests._utils.hf_reference import count_passes, make_hf_checkpoint, shared_draws

CONFIGS = {
    # sliding window (8) far shorter than the context; one global layer; top-2 of 4 experts
    "window<context": {},
    # several global layers, wider global heads, top-1 of 8 experts, more KV heads
    "multi-global": {
        "num_hidden_layers": 5,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
            "full_attention",
        ],
        "num_experts": 8,
        "top_k_experts": 1,
        "num_key_value_heads": 4,
        "global_head_dim": 64,
        "num_global_key_value_heads": 2,
        "sliding_window": 12,
    },
    # the 26B's 5:1 pattern at depth 12 (globals 5 and 11), top-3 of 6 experts
    "5:1 pattern": {"num_hidden_layers": 12, "num_experts": 6, "top_k_experts": 3, "sliding_window": 20},
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoints(request, tmp_path_factory):
    """Per config: a checkpoint with plain logits (pass parity) and one with sharp logits (generation,
    where low temperatures must reach confident canvases for the adaptive stop)."""
    cfg = CONFIGS[request.param]
    plain = make_hf_checkpoint(tmp_path_factory.mktemp("hf"), **cfg)
    sharp = make_hf_checkpoint(tmp_path_factory.mktemp("hf_sharp"), embed_scale=25.0, **cfg)
    return plain, sharp


def reference(path, dtype):
    from transformers import DiffusionGemmaForBlockDiffusion

    # eager experts: transformers' grouped_mm has no float64 kernel
    return DiffusionGemmaForBlockDiffusion.from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    ).eval()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.float64, 1e-9)], ids=["fp32", "fp64"])
def test_pass_logits_match(checkpoints, dtype, tol):
    """Prefill, denoise (first step and self-conditioned) and commit, each against transformers: within
    fp32 tolerance in fp32, and equal to rounding in fp64 (which shows the fp32 gap is only rounding)."""
    from transformers.cache_utils import DynamicCache

    ref, (model, _) = reference(checkpoints[0], dtype), load_model(checkpoints[0], dtype=dtype)
    cfg = model.cfg
    if dtype == torch.float32:  # fp32 rounding compounds with depth: 1e-4 per 6 layers
        tol *= max(1.0, cfg.num_hidden_layers / 6)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (1, 29), generator=g)
    canvas = torch.randint(0, cfg.vocab_size, (1, 16), generator=g)
    block = torch.randint(3, cfg.vocab_size, (1, 16), generator=g)
    sc_logits = (3 * torch.randn(1, 16, cfg.vocab_size, generator=g)).to(dtype)

    hf_cache = DynamicCache(config=ref.config.get_text_config())
    kv = KVCache(cfg, 1, 128, dtype)  # ring buffer of window-1 slots: wraps during the test
    slot = torch.tensor([0])

    def causal(tokens):
        pos = canvas_positions(kv.lengths[slot], tokens.shape[1])
        valid = torch.ones_like(pos, dtype=torch.bool)
        past, meta = kv.read(slot)
        h, new = model.encode(tokens, pos, attention_masks(pos, valid, meta, True, kv.window), past)
        kv.write(slot, new, pos, valid)
        return model.logits(h)

    def denoise(sc_probs):
        pos = canvas_positions(kv.lengths[slot], 16)
        past, meta = kv.read(slot)
        masks = attention_masks(pos, torch.ones_like(pos, dtype=torch.bool), meta, False, kv.window)
        return model.denoise(canvas, sc_probs, pos, masks, past)

    # transformers' encoder output is normed hidden states; the LM head + softcap are the same as decoding
    with torch.no_grad():
        ours = causal(prompt)
        theirs = _softcapped(
            ref, ref.model.encoder(input_ids=prompt, past_key_values=hf_cache).last_hidden_state
        )
        assert rel(ours, theirs) < tol, "prefill"

        ours = denoise(None)
        theirs = ref(decoder_input_ids=canvas, past_key_values=hf_cache).logits
        assert rel(ours, theirs) < tol, "denoise, first step"

        ours = denoise(torch.softmax(sc_logits, -1, dtype=torch.float32))
        theirs = ref(
            decoder_input_ids=canvas, past_key_values=hf_cache, self_conditioning_logits=sc_logits
        ).logits
        assert rel(ours, theirs) < tol, "denoise, self-conditioned"

        ours = causal(block)
        theirs = _softcapped(
            ref, ref.model.encoder(input_ids=block, past_key_values=hf_cache).last_hidden_state
        )
        assert rel(ours, theirs) < tol, "commit"

        ours = denoise(None)  # the cache after commit (ring buffer wrapped) must still agree
        theirs = ref(decoder_input_ids=canvas, past_key_values=hf_cache).logits
        assert rel(ours, theirs) < tol, "denoise after commit"


def _softcapped(ref, hidden: torch.Tensor) -> torch.Tensor:
    z = ref.lm_head(hidden).float()
    cap = ref.config.text_config.final_logit_softcapping
    return torch.tanh(z / cap) * cap


@pytest.mark.parametrize(
    "settings",
    [
        # fixed steps: a confidence threshold no canvas reaches
        {"max_denoising_steps": 6, "entropy_bound": 0.5, "confidence_threshold": 1e-30},
        # adaptive stop: the cooling schedule makes canvases confident after a varying number of steps
        {
            "max_denoising_steps": 12,
            "entropy_bound": 1.0,
            "t_min": 0.2,
            "t_max": 1.0,
            "stability_threshold": 0,
            "confidence_threshold": 1.0,
        },
    ],
)
def test_generate_matches_reference(checkpoints, settings):
    """A batch of prompts of different lengths through dgpipe equals transformers run per prompt.

    float64 on both sides: token identity must not hinge on fp32 rounding at the entropy bound's edge
    (batching changes BLAS blocking, and 1e-7 noise can flip which position is the last one kept)."""
    path = checkpoints[1]
    ref = reference(path, torch.float64)
    model, _ = load_model(path, dtype=torch.float64)
    cfg = model.cfg
    sampler = SamplerConfig(**settings)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 23, 11)]
    eos = [1, 7]
    cfg.eos_token_id = eos  # both sides stop on the same end tokens
    seed, max_tokens = 1234, 64

    runtime = BlockDiffusionRuntime(model, max_batch=3, max_len=256)
    ours = runtime.generate(
        [
            Request(prompt_ids=p, max_tokens=max_tokens, sampler=sampler, seed=seed, request_id=i)
            for i, p in enumerate(prompts)
        ]
    )
    canvases = 0
    for i, prompt in enumerate(prompts):
        per_canvas, hooks = count_passes(ref)
        with shared_draws(seed, i), torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                pad_token_id=0,
                **sampler.transformers_kwargs(),
            )
        for h in hooks:
            h.remove()
        new = out.sequences[0, len(prompt) :].tolist()
        cut = next((j for j, t in enumerate(new) if t in eos), None)
        expected = new if cut is None else new[: cut + 1]
        assert ours[i].tokens == expected, f"prompt {i}"
        assert ours[i].steps_per_canvas == per_canvas, f"prompt {i} steps"
        canvases += len(per_canvas)
    assert canvases > len(prompts), "the test must cover multi-canvas generation"
    if settings["confidence_threshold"] > 1e-3:
        steps = [s for r in ours for s in r.steps_per_canvas]
        assert min(steps) < sampler.max_denoising_steps, "adaptive stop never triggered"
