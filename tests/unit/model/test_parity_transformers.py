"""Parity with the transformers DiffusionGemma implementation (the model oracle), on tiny random configs.

(a) prefill, denoise (with and without self-conditioning) and commit logits: equal to float64 rounding in
    float64, and in fp32 within 4x transformers' own fp32 error against that float64 oracle (see
    tests/_utils/numerics.py: no bound tuned to one CPU);
(b) with the same draws (see tests/_utils/hf_reference.py for how they are shared), a full multi-canvas
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
from tests._utils.numerics import assert_within_reference_noise, error

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


PASSES = ("prefill", "denoise, first step", "denoise, self-conditioned", "commit", "denoise after commit")
# Float64 on both sides. Both implementations round to fp32 at the same places (inside RMSNorm, softmax,
# RoPE angles, the logits), identically on identical inputs: measured bit-equal hidden states and logits
# on every config here, at 1 and 2 threads. A real bug shows at >= 1e-3.
FP64_TOL = 1e-12


def _inputs(vocab: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, 29), generator=g)
    canvas = torch.randint(0, vocab, (1, 16), generator=g)
    block = torch.randint(3, vocab, (1, 16), generator=g)
    sc_logits = (3 * torch.randn(1, 16, vocab, generator=g)).to(dtype)  # fp32 values, exact in float64
    return prompt, canvas, block, sc_logits


@torch.no_grad()
def _our_passes(model, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prefill, denoise (first step, self-conditioned), commit, denoise again through dgpipe: the logits
    and the final hidden states that enter the LM head, per pass."""
    cfg = model.cfg
    prompt, canvas, block, sc_logits = _inputs(cfg.vocab_size, dtype)
    kv = KVCache(cfg, 1, 128, dtype)  # ring buffer of window-1 slots: wraps during the test
    slot = torch.tensor([0])
    hidden: list[torch.Tensor] = []
    head = model.logits

    def recording_head(h):
        hidden.append(h)
        return head(h)

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

    sc_probs = torch.softmax(sc_logits, -1, dtype=torch.float32)  # as transformers does, in any dtype
    model.logits = recording_head
    try:
        logits = [causal(prompt), denoise(None), denoise(sc_probs), causal(block), denoise(None)]
    finally:
        del model.logits
    return logits, hidden


@torch.no_grad()
def _their_passes(ref, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The same passes through transformers (its encoder returns normed hidden states; the LM head and
    softcap are the decoder's), with the LM head's inputs recorded."""
    from transformers.cache_utils import DynamicCache

    prompt, canvas, block, sc_logits = _inputs(ref.config.get_text_config().vocab_size, dtype)
    cache = DynamicCache(config=ref.config.get_text_config())
    hidden: list[torch.Tensor] = []

    def encode(tokens):
        return _softcapped(ref, ref.model.encoder(input_ids=tokens, past_key_values=cache).last_hidden_state)

    def decode(sc=None):
        return ref(decoder_input_ids=canvas, past_key_values=cache, self_conditioning_logits=sc).logits

    hook = ref.lm_head.register_forward_pre_hook(lambda _, args: hidden.append(args[0]))
    try:
        logits = [encode(prompt), decode(), decode(sc_logits), encode(block), decode()]
    finally:
        hook.remove()
    return logits, hidden


def test_pass_logits_match_in_float64(checkpoints):
    """The math: in float64, dgpipe's final hidden states and logits equal transformers' to rounding on
    every pass (a wrong norm, scale, mask, rotary angle or cache slot shows up at 1e-3 or more)."""
    ours, ours_h = _our_passes(load_model(checkpoints[0], dtype=torch.float64)[0], torch.float64)
    theirs, theirs_h = _their_passes(reference(checkpoints[0], torch.float64), torch.float64)
    assert all(h.dtype == torch.float64 for h in (*ours_h, *theirs_h))
    for what, a, b, ha, hb in zip(PASSES, ours, theirs, ours_h, theirs_h, strict=True):
        for kind, x, y in (("hidden", ha, hb), ("logits", a, b)):
            err = error(x, y)
            assert err <= FP64_TOL, f"{what}: {kind} rel error {err:.3e} vs transformers > {FP64_TOL:.0e}"


def test_pass_logits_fp32_within_transformers_fp32_noise(checkpoints):
    """fp32: dgpipe's error against the float64 oracle is at most 4x transformers' own fp32 error (the
    bound follows this CPU's and this thread count's rounding instead of being tuned to one machine)."""
    oracle, _ = _their_passes(reference(checkpoints[0], torch.float64), torch.float64)
    theirs, _ = _their_passes(reference(checkpoints[0], torch.float32), torch.float32)
    ours, _ = _our_passes(load_model(checkpoints[0], dtype=torch.float32)[0], torch.float32)
    for what, a, o, r in zip(PASSES, ours, oracle, theirs, strict=True):
        assert_within_reference_noise(what, a, o, r)


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


@torch.no_grad()
def test_bf16_self_conditioning_input_is_transformers(checkpoints):
    """bf16: the self-conditioning input of a canvas's second step is transformers', bit for bit. transformers
    keeps the scaled logits in the embedding dtype between steps (`processed_logits.to(embeddings_dtype)`)
    and softmaxes those; at logits of tens bf16 moves each by up to 1/8, so the softmax of the fp32 logits
    would differ by percents. Both sides see the same first-step logits (transformers' LM head answers
    fixed values; dgpipe's pass returns them through transformers' own softcap)."""
    path = checkpoints[0]
    ref = reference(path, torch.bfloat16)
    model, _ = load_model(path, dtype=torch.bfloat16)
    length, vocab = model.config.canvas_length, model.cfg.vocab_size
    head = (
        torch.randn(1, length, vocab, generator=torch.Generator().manual_seed(3)).mul(20).to(torch.bfloat16)
    )
    cap = ref.final_logit_softcapping
    logits = torch.tanh(head.to(torch.float32) / cap) * cap  # transformers' forward on its LM head's output
    sampler = SamplerConfig(max_denoising_steps=2, confidence_threshold=1e-30)
    prompt = [5, 9, 14]

    ours: list[torch.Tensor | None] = []

    def denoise_soft(canvas, soft, positions, masks, past):
        ours.append(None if soft is None else soft.clone())
        return logits.expand(canvas.shape[0], -1, -1).clone()

    model.denoise_soft = denoise_soft
    BlockDiffusionRuntime(model, max_batch=1, max_len=64).generate(
        [Request(prompt_ids=prompt, max_tokens=length, sampler=sampler, seed=1)]
    )

    theirs: list[torch.Tensor] = []
    hooks = [
        ref.lm_head.register_forward_hook(lambda *_: head),
        ref.model.decoder.self_conditioning.register_forward_pre_hook(
            lambda _, a: theirs.append(a[1].clone())
        ),
    ]
    try:
        ref.generate(
            torch.tensor([prompt]), max_new_tokens=length, pad_token_id=0, **sampler.transformers_kwargs()
        )
    finally:
        for h in hooks:
            h.remove()
    assert len(ours) == len(theirs) == 2, (len(ours), len(theirs))
    assert ours[1].dtype == theirs[1].dtype == torch.bfloat16
    assert torch.equal(ours[1], theirs[1])
