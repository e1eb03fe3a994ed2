"""dgpipe's kernels for the network's element-wise chains (`pipeline.runtime.kernels.chains`) in Triton's
interpreter: RoPE against the torch form (`network.apply_rope`) bit for bit (with round-to-nearest-even casts:
tests/_utils/interpreter_casts.py) and a model's logits unchanged with it installed, the logit softcap against
torch's form within fp32 rounding; the load-time probe; and both compiled for Hopper, B200, Ada and RTX
Blackwell without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import DgpipeError
from pipeline.model import network
from pipeline.model import scaled_layout as sl
from pipeline.model.network import apply_rope
from pipeline.model.scaled_layout import expert_order, slot_rows
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime.probe.chains import same_geglu
from pipeline.runtime.probe.common import fp8_codes_equal, same_bits, same_layer_end, spread
from pipeline.runtime.probe.norms import ffn_probe_layer, same_ffn_inputs, same_layer_end_of, same_operands
from tests._utils.embedded_passes import denoise_and_prefill, embedded_bf16
from tests._utils.interpreter_casts import (  # noqa: F401  (fixtures)
    interpreted,
    interpreted_tanh,
    rne_casts,
    uninitialised_bytes_are_0xab,
)
from tests._utils.probes import each_wrong_form_fails
from tests._utils.triton_compile import (
    compiled_for_gpus,
    converts_to_e4m3_once,
    separate_roundings_missing,
    spills,
)


def tables(b: int, length: int, d: int, dtype: torch.dtype, seed: int = 0, partial: int | None = None):
    """cos/sin [b, length, d] of positions up to 2^17; `partial`: only the first `partial` frequencies rotate
    (the "proportional" RoPE of the global layers: the rest have cos 1, sin 0)."""
    g = torch.Generator().manual_seed(seed)
    inv = torch.logspace(0, -4, d // 2)
    if partial is not None:
        inv[partial:] = 0.0
    angles = torch.randint(0, 2**17, (b, length, 1), generator=g).float() * inv
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize(
    ("heads", "d", "partial"), [(3, 64, None), (16, 256, None), (2, 512, 64), (5, 2, None), (4, 24, None)]
)
def test_rope_is_the_torch_form_bit_for_bit(rne_casts, dtype, heads, d, partial):  # noqa: F811
    """Rows that do not fill the last program, values over eight decades with zeros, infinities and NaN,
    head dims from 2 to the 26B's 512 (its global layers rotate 64 of 256 frequencies; the embedded model's
    24 is no power of two)."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(2, 9, heads, d, generator=g) * torch.logspace(-4, 4, d)
    x[0, 0, 0, :2], x[1, 2, 0, 0], x[1, 3, -1, -1] = 0.0, float("inf"), float("nan")
    x = x.to(dtype)
    cos, sin = tables(2, 9, d, dtype, partial=partial)
    assert kernels.chains.rope_serves(x, cos, sin)
    got, want = kernels.chains.rope(x, cos, sin), apply_rope(x, cos, sin)
    assert same_bits(got, want)  # bit patterns: NaN and -0.0 too


def test_other_inputs_keep_the_torch_form(monkeypatch):
    x, (cos, sin) = torch.randn(1, 4, 2, 64, dtype=torch.bfloat16), tables(1, 4, 64, torch.bfloat16)
    serves = kernels.chains.rope_serves
    assert serves(x, cos, sin)
    assert not serves(
        x.float(), cos.float(), sin.float()
    )  # fp32: the compiler may fuse a product into the sum
    assert not serves(x.transpose(1, 2), cos, sin)  # [B, H, L, D]: not the layout it reads
    assert not serves(
        x[..., :48], cos[..., :48].contiguous(), sin[..., :48].contiguous()
    )  # rows not contiguous
    assert not serves(x, cos.half(), sin)
    # sin is read at cos's offsets: a sin torch's form would broadcast or promote keeps that form
    assert not serves(x, cos, torch.cat([cos, sin], -1)[..., 64:])  # a view of a wider table
    assert not serves(x, cos, sin[:, :1])  # one token's, broadcast
    assert not serves(x, cos, sin.half())
    assert not serves(x[..., :0], cos[..., :0], sin[..., :0])  # no head dim
    monkeypatch.setattr(kernels.chains, "rope", lambda *a: pytest.fail("the kernel ran"))
    y = x.float()
    assert torch.equal(
        kernels.chains.rope_or_torch(y, cos.float(), sin.float()), apply_rope(y, cos.float(), sin.float())
    )


@interpreted
def test_a_model_with_the_kernels_installed_gives_the_same_logits(rne_casts):  # noqa: F811
    """The embedded model in bf16 with every layer's RoPE, residual sum and router input on the kernels (as
    `gpu_load.fuse_network` installs them): the same logits bit for bit, prefill and denoise; all three kernels
    ran. (The softcap kernel's tanh is numpy's in the interpreter, not torch's: it stays off here; the next
    test covers it.)"""
    from pipeline.runtime import gpu_load

    model = embedded_bf16()
    run = denoise_and_prefill(model)
    want = run()
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("rope", "add_scaled", "scale_columns"):
            kernel = getattr(kernels.chains, name)
            mp.setattr(kernels.chains, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
        probed = probing.Probe("sm90", {probing.ROPE: None, probing.RESIDUAL: None, probing.ROUTER: None})
        report = gpu_load.fuse_network(model, probed, None)
        got = run()
    assert set(calls) == {"rope", "add_scaled", "scale_columns"} and model.softcap_kernel is None
    assert all(layer.self_attn.rope_kernel and layer.residual_kernel for layer in model.layers)
    assert report.fallbacks == [
        f"{gpu_load.TORCH_FORMS[form]} (the Triton kernel failed its probe: not run)"
        for form in (
            probing.SOFTCAP,
            probing.COMBINE,
            probing.GEGLU,
            probing.KV_CAT,
            probing.LAYER_END,
            probing.FFN_INPUTS,
            probing.TOP_K,
            probing.EXPERT_ORDER,
            probing.HEAD_NORMS,
            probing.NORM_FP8,
            probing.NORM_NVFP4,
        )
    ]
    assert torch.equal(got[0], want[0])
    assert all(
        torch.equal(a, b) for kv, kv_want in zip(got[1], want[1], strict=True) for a, b in zip(kv, kv_want)
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_softcap_is_torchs_cuda_form_within_fp32_rounding(interpreted_tanh, dtype):  # noqa: F811
    """Logits from 0 to 1e4 with infinities and NaN, a count that does not fill the last program: torch's
    CUDA form (a product with the cap's fp32 reciprocal, tanh, a product) within 2 ulp, the gap being numpy's
    tanh against torch's; the model's LM head takes the kernel where it is installed."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5001, generator=g) * torch.logspace(-3, 4, 5001)
    x[0, :4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
    x = x.to(dtype)
    inv = torch.tensor(1.0) / torch.tensor(30.0)
    cuda_form = torch.tanh(x.float() * inv) * 30.0
    got = kernels.chains.softcap(x, 30.0)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, cuda_form, rtol=2.4e-7, atol=0.0, equal_nan=True)
    assert got[0, 1] == 30.0 and got[0, 2] == -30.0 and got[0, 3].isnan()
    torch.testing.assert_close(
        got, x.float().div_(30.0).tanh_().mul_(30.0), rtol=4.8e-7, atol=0.0, equal_nan=True
    )
    probing.check_triton_softcap(torch.device("cpu"))


@interpreted
@pytest.mark.parametrize(("tokens", "k", "d"), [(37, 8, 2816 + 8), (5, 2, 24), (64, 1, 1024)])
def test_combine_is_its_torch_form_bit_for_bit_and_the_batched_product_within_rounding(
    rne_casts,  # noqa: F811
    tokens,
    k,
    d,
):
    """Rows read through the expert order's inverse or already in slot order, a row width that is no block
    multiple: `sequential_combine` bit for bit; the batched product it replaces within a bf16 unit."""
    g = torch.Generator().manual_seed(tokens)
    index, weights = torch.randint(0, 16, (tokens, k), generator=g), torch.rand(tokens, k, generator=g)
    routing = expert_order(index, 16)
    y = (torch.randn(tokens * k, d, generator=g) * 4).bfloat16()
    rows = slot_rows(routing)
    got = kernels.chains.combine(y, rows, weights)
    assert torch.equal(got, kernels.chains.sequential_combine(y, rows, weights))
    assert torch.equal(
        kernels.chains.combine(y, None, weights), kernels.chains.sequential_combine(y, None, weights)
    )
    strided = torch.stack([rows, rows], 1)[:, 0]  # the same rows, every other value of a buffer
    assert torch.equal(kernels.chains.combine(y, strided, weights), got)
    want = network.combine_top_k(y, routing, weights)
    assert bool(((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-6).all())
    assert torch.equal(network.combine_top_k(y, routing, weights, kernels.chains.combine), got)  # the hook


@interpreted
def test_the_combine_probe_passes_the_kernel_and_fails_a_wrong_one(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_combine(torch.device("cpu"))
    kernel = kernels.chains.combine
    monkeypatch.setattr(kernels.chains, "combine", lambda y, rows, w: kernel(y, rows, w.flip(1)))
    with pytest.raises(DgpipeError, match="MoE combine differs"):
        probing.check_triton_combine(torch.device("cpu"))


def test_the_reciprocal_is_torchs_fp32_division():
    for cap in (30.0, 7.0, 0.3, 1e-3, 3.0e38, 1.1754944e-38):
        want = float(torch.tensor(1.0) / torch.tensor(cap, dtype=torch.float32))
        assert kernels.chains.fp32_reciprocal(cap) == want, cap


def test_the_lm_head_takes_the_softcap_kernel_where_installed(monkeypatch):
    from pipeline.model.config import ModelConfig
    from pipeline.model.network import DiffusionGemma

    model = DiffusionGemma(ModelConfig.from_yaml("sudoku-tiny")).bfloat16()
    hidden = torch.randn(2, 3, model.cfg.hidden_size, dtype=torch.bfloat16)
    seen = []
    model.softcap_kernel = lambda logits, cap: seen.append((logits.dtype, cap)) or logits.float()
    with torch.inference_mode():
        out = model.logits(hidden)
    assert seen == [(torch.bfloat16, model.cfg.final_logit_softcapping)] and out.dtype == torch.float32


def test_a_failed_probe_keeps_the_torch_form_and_says_why():
    from pipeline.model.config import ModelConfig
    from pipeline.model.network import DiffusionGemma
    from pipeline.runtime import gpu_load

    with torch.device("meta"):
        model = DiffusionGemma(ModelConfig.from_yaml("sudoku-tiny"))
    for layer in model.layers:
        layer.self_attn.rope_kernel = kernels.chains.rope_or_torch
    probed = probing.Probe(
        "sm90",
        {
            probing.ROPE: "out of resources",
            probing.SOFTCAP: None,
            probing.COMBINE: None,
            probing.GEGLU: None,
            probing.RESIDUAL: None,
            probing.KV_CAT: None,
            probing.ROUTER: None,
            probing.LAYER_END: None,
            probing.FFN_INPUTS: None,
            probing.TOP_K: None,
            probing.EXPERT_ORDER: None,
            probing.HEAD_NORMS: None,
            probing.NORM_FP8: None,
            probing.NORM_NVFP4: None,
        },
    )
    report = gpu_load.fuse_network(model, probed, None)
    assert all(layer.self_attn.rope_kernel is None for layer in model.layers)
    assert all(
        layer.self_attn.head_norms_kernel is kernels.chains.head_norms_or_torch for layer in model.layers
    )
    gated = [model.self_conditioning, *(m for layer in model.layers for m in (layer.mlp, layer.experts))]
    assert all(m.geglu_kernel is kernels.chains.geglu_or_torch for m in gated)
    assert all(layer.residual_kernel is kernels.chains.add_scaled_or_torch for layer in model.layers)
    assert all(layer.end_kernel is kernels.chains.layer_end_or_torch for layer in model.layers)
    assert all(layer.ffn_inputs_kernel is kernels.chains.ffn_inputs_or_torch for layer in model.layers)
    assert all(layer.self_attn.kv_cat_kernel is kernels.chains.kv_cat_or_torch for layer in model.layers)
    assert all(layer.router.scale_kernel is kernels.chains.scale_columns_or_torch for layer in model.layers)
    assert model.softcap_kernel is kernels.chains.softcap
    assert all(layer.experts.combine_kernel is kernels.chains.combine for layer in model.layers)
    assert all(layer.router.top_k_kernel is kernels.routing.top_k_or_torch for layer in model.layers)
    assert all(layer.experts.order_kernel is kernels.routing.expert_order_or_torch for layer in model.layers)
    assert report.fallbacks == [
        "RoPE: torch's five element-wise kernels per tensor (the Triton kernel failed its probe: out of resources)"
    ]


@interpreted
def test_the_probe_check_passes_the_kernel_and_fails_a_wrong_one(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_rope(torch.device("cpu"))
    kernel = kernels.chains.rope
    monkeypatch.setattr(kernels.chains, "rope", lambda x, c, s: kernel(x, s, c))  # cos and sin swapped
    with pytest.raises(DgpipeError, match="RoPE kernel differs"):
        probing.check_triton_rope(torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("n", [1, 4099, 2 * 4096])
def test_the_residual_sum_is_torchs_bit_for_bit(rne_casts, dtype, n):  # noqa: F811
    """Sums that round, overflow and cancel, infinities and NaN, counts that do and do not fill the last
    program: torch's `(a + b) * scale` bit for bit; other inputs keep the torch form."""
    g = torch.Generator().manual_seed(n)
    a, b = spread(2, n, g).unbind()
    edges = torch.tensor([[6e4, 1.0, float("inf"), float("nan"), 3.0], [6e4, -1.0, 1.0, 1.0, -3.0]])[:, :n]
    a[: edges.shape[1]], b[: edges.shape[1]] = edges
    a, b, scale = a.to(dtype).view(1, -1), b.to(dtype).view(1, -1), torch.tensor([0.7], dtype=dtype)
    assert kernels.chains.add_scaled_serves(a, b, scale)
    got = kernels.chains.add_scaled(a, b, scale)
    assert same_bits(got, (a + b) * scale)
    assert not kernels.chains.add_scaled_serves(a, b, scale.float())  # torch would promote to fp32
    assert not kernels.chains.add_scaled_serves(a.float(), b.float(), scale.float())
    assert not kernels.chains.add_scaled_serves(a, b, torch.ones(2, dtype=dtype))
    assert not kernels.chains.add_scaled_serves(a, b, scale.view(1, 1, 1))  # torch would broadcast the sum up
    wide = torch.randn(3, 8, dtype=dtype)
    assert not kernels.chains.add_scaled_serves(wide.t(), wide.t(), scale)  # not contiguous
    y = kernels.chains.add_scaled_or_torch(a.float(), b.float(), scale.float())
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, (a.float() + b.float()) * scale.float(), rtol=0, atol=0, equal_nan=True)


@interpreted
def test_the_residual_probe_passes_the_kernel_and_fails_a_wrong_one(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_residual(torch.device("cpu"))
    kernel = kernels.chains.add_scaled
    monkeypatch.setattr(
        kernels.chains, "add_scaled", lambda a, b, s: kernel(a, b, s.float().bfloat16() + 0.01)
    )
    with pytest.raises(DgpipeError, match="residual sum differs"):
        probing.check_triton_residual(torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.KV_DTYPES)
@pytest.mark.parametrize(
    ("heads", "d", "past", "new"),
    [(8, 256, 37, 19), (2, 512, 0, 5), (3, 24, 5, 1), (1, 2, 3, 0), (2, 512, 9, 5)],
)
def test_the_kv_concatenation_is_torch_cat(dtype, heads, d, past, new):
    """The cached K/V as the cache hands them out (the first tokens of some rows of its buffers: views) and the
    new K/V as attention makes them (transposed from [B, Q, H, D]); head dims 2 to 512 (24 no power of two),
    an empty cache, no new tokens, token counts that do not fill the last program: torch.cat bit for bit."""
    g = torch.Generator().manual_seed(d + past)
    cache = (torch.randn(2, 3, heads, 64, d, generator=g) * 1e3).to(dtype)  # K|V, slots, heads, length, dim
    cache[0, 1, 0, 0, :2] = torch.tensor([float("nan"), -0.0])
    pk, pv = cache[0, 1:, :, :past], cache[1, 1:, :, :past]
    fresh = torch.randn(2, 2, new, heads, d, generator=g).to(dtype).transpose(2, 3)  # K|V, B, H, Q, D
    assert kernels.chains.kv_cat_serves(pk, pv, fresh[0], fresh[1])
    got = kernels.chains.kv_cat(pk, pv, fresh[0], fresh[1])
    want = network.cat_kv(pk, pv, fresh[0], fresh[1])
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a.view(bits), b.view(bits))


def test_other_kv_layouts_keep_torch_cat(monkeypatch):
    k = torch.randn(2, 4, 6, 8, dtype=torch.bfloat16)
    assert kernels.chains.kv_cat_serves(k, k, k, k)
    assert not kernels.chains.kv_cat_serves(k, k, k.float(), k.float())  # torch.cat would promote
    strided = torch.randn(2, 4, 8, 6, dtype=torch.bfloat16).transpose(2, 3)  # each row of D strided
    assert not kernels.chains.kv_cat_serves(strided, strided, k, k)
    other = k.transpose(0, 1).contiguous().transpose(0, 1)  # V laid out unlike K
    assert not kernels.chains.kv_cat_serves(k, other, k, k)
    assert not kernels.chains.kv_cat_serves(k[:1], k[:1], k, k)  # another batch
    monkeypatch.setattr(kernels.chains, "kv_cat", lambda *a: pytest.fail("the kernel ran"))
    got = kernels.chains.kv_cat_or_torch(strided, strided, k, k)
    assert torch.equal(got[0], torch.cat([strided, k], dim=2)) and torch.equal(got[1], got[0])


def _layer_end_inputs(dtype: torch.dtype, d: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    residual, dense, moe = (spread(3 * rows, d, g) / 64).to(dtype).chunk(3)
    norms = tuple(network.RMSNorm(d, 1e-6).to(dtype) for _ in range(3))
    for n in norms:
        n.weight.data = (torch.rand(d, generator=g) * 2).to(dtype)
    return residual, dense, moe, norms, torch.tensor([0.7], dtype=dtype)


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("d", [2816, 100])
def test_the_layer_end_is_torchs_but_for_its_norms_sums(rne_casts, dtype, d):  # noqa: F811
    """Three RMSNorms, two sums and the scale in one kernel against torch's form (`network.layer_end`), rows
    over seven decades: within `probe.same_layer_end_of` torch's form, and bit for bit but where a sum of
    squares added in another order moved a rounding (under 1% of the values); other inputs keep the torch
    form."""
    residual, dense, moe, norms, scale = _layer_end_inputs(dtype, d, 24, d)
    assert kernels.chains.layer_end_serves(residual, dense, moe, norms, scale)
    got = kernels.chains.layer_end(residual, dense, moe, norms, scale)
    want = network.layer_end(residual, dense, moe, norms, scale)
    assert same_layer_end_of(got, residual, dense, moe, norms, scale)
    assert (got != want).float().mean() < 0.01
    wrong = network.layer_end(residual, dense, moe, (norms[1], norms[0], norms[2]), scale)
    assert not same_layer_end_of(wrong, residual, dense, moe, norms, scale)
    assert not kernels.chains.layer_end_serves(
        residual.float(), dense.float(), moe.float(), norms, scale.float()
    )
    assert not kernels.chains.layer_end_serves(residual, dense.t(), moe, norms, scale)  # not contiguous
    unscaled = (*norms[:2], network.RMSNorm(d, 1e-6, with_scale=False))
    assert not kernels.chains.layer_end_serves(residual, dense, moe, unscaled, scale)
    strided = network.RMSNorm(d, 1e-6).to(dtype)  # the kernel reads a weight at each column's offset
    strided.weight.data = torch.stack([norms[2].weight.data] * 2, 1)[:, 0]
    assert not kernels.chains.layer_end_serves(residual, dense, moe, (*norms[:2], strided), scale)
    y = kernels.chains.layer_end_or_torch(residual, dense, moe, unscaled, scale)
    assert torch.equal(y, network.layer_end(residual, dense, moe, unscaled, scale))


@interpreted
def test_the_layer_end_probe_passes_the_kernel_and_fails_a_wrong_one(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_layer_end(torch.device("cpu"))
    kernel = kernels.chains.layer_end
    swapped = lambda r, d, m, norms, s: kernel(r, d, m, (norms[1], norms[0], norms[2]), s)
    monkeypatch.setattr(kernels.chains, "layer_end", swapped)
    with pytest.raises(DgpipeError, match="layer end differs"):
        probing.check_triton_layer_end(torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("d", [2816, 100])
def test_the_ffn_inputs_are_torchs_but_for_their_norms_sums(rne_casts, dtype, d):  # noqa: F811
    """The residual sum after attention and the three FFN inputs (dense MLP, experts, router) in one kernel
    against torch's form (`network.ffn_inputs`): within `probe.same_ffn_inputs` and bit for bit but where a
    sum of squares added in another order moved a rounding (under 1% of the values); other inputs keep the
    torch form."""
    g = torch.Generator().manual_seed(d)
    layer = ffn_probe_layer(d, torch.device("cpu"), dtype, g)
    h, attn = (spread(48, d, g) / 64).to(dtype).view(2, 4, 6, d).unbind()
    assert kernels.chains.ffn_inputs_serves(layer, h, attn)
    got, want = kernels.chains.ffn_inputs(layer, h, attn), network.ffn_inputs(layer, h, attn)
    assert [t.shape for t in got] == [t.shape for t in want] == [h.shape, h.shape, (24, d), (24, d)]
    assert same_ffn_inputs(got, layer, h, attn)
    assert all((a != b).float().mean() < 0.01 for a, b in zip(got, want, strict=True))
    layer.pre_feedforward_layernorm, layer.pre_feedforward_layernorm_2 = (
        layer.pre_feedforward_layernorm_2,
        layer.pre_feedforward_layernorm,
    )
    assert not same_ffn_inputs(got, layer, h, attn)  # the norms' weights swapped
    layer.pre_feedforward_layernorm, layer.pre_feedforward_layernorm_2 = (
        layer.pre_feedforward_layernorm_2,
        layer.pre_feedforward_layernorm,
    )
    assert not kernels.chains.ffn_inputs_serves(layer, h.float(), attn.float())
    assert not kernels.chains.ffn_inputs_serves(layer, h, attn.transpose(0, 1))  # not contiguous
    router_scale = layer.router.scale.data
    layer.router.scale.data = torch.stack([router_scale] * 2, 1)[:, 0]  # its values, every other of a buffer
    assert not kernels.chains.ffn_inputs_serves(layer, h, attn)
    layer.router.scale.data = router_scale
    layer.router.norm = network.RMSNorm(d, 1e-6).to(dtype)  # a scaled router norm: not the kernel's form
    assert not kernels.chains.ffn_inputs_serves(layer, h, attn)
    fallback = kernels.chains.ffn_inputs_or_torch(layer, h, attn)
    assert all(torch.equal(a, b) for a, b in zip(fallback, network.ffn_inputs(layer, h, attn), strict=True))


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("kind", ["fp8", "nvfp4", "fp8_rowwise"])
def test_the_ffn_inputs_write_the_mlps_and_experts_operands_bit_for_bit(rne_casts, dtype, kind):  # noqa: F811
    """Given their GEMMs' forms, the dense MLP's and the experts' inputs come as the operands those GEMMs'
    own one-pass quantizations make of the rows the kernel writes without them, bit for bit (FP8: some codes
    saturated; NVFP4: the linear's block scales swizzled over 128 rows, the experts' as they are; the NVFP4 fallback's per-row FP8 of the NVFP4-rounded rows, a scale a row), the
    residual and the router's input unchanged (`probe.same_operands`); fewer rows than a tile give the
    linear its rows; and one of them alone."""
    d = 2816
    g = torch.Generator().manual_seed(5)
    layer = ffn_probe_layer(d, torch.device("cpu"), dtype, g)
    h, attn = (spread(256, d, g) / 64).to(dtype).view(2, 2, 64, d).unbind()
    plain = kernels.chains.ffn_inputs(layer, h, attn)  # (the launch `same_operands` makes without rows)
    assert same_operands(layer, h, attn, plain, kind)
    assert same_operands(layer, h[:, :3], attn[:, :3], None, kind)  # 6 rows
    scale = torch.tensor(0.003)
    mlp_only = kernels.chains.ffn_inputs(layer, h, attn, (kind, scale), None)
    assert same_bits(mlp_only[2], plain[2]) and isinstance(mlp_only[1], sl.QuantizedRows)
    # 32 wide (two NVFP4 blocks, fewer than a swizzled tile's four scale columns), and 40 (no whole blocks)
    for width in (32, 40):
        layer = ffn_probe_layer(width, torch.device("cpu"), dtype, g)
        h, attn = (spread(256, width, g) / 64).to(dtype).view(2, 128, width).unbind()
        rows = kernels.chains.ffn_inputs(layer, h, attn)
        if kind == "fp8" or width % 16 == 0:  # (NVFP4 and its per-row FP8 fallback: whole 16-value blocks)
            assert same_operands(layer, h, attn, rows, kind)
        else:  # the rows, which their GEMMs quantize themselves
            got = kernels.chains.ffn_inputs(layer, h, attn, (kind, scale), (kind, scale))
            assert same_bits(got[1], rows[1]) and same_bits(got[2], rows[2])


def test_the_ffn_inputs_torch_form_gives_the_rows_to_quantize(monkeypatch):
    """Where the kernel does not serve, the GEMMs get the rows and quantize them themselves."""
    d = 64
    layer = ffn_probe_layer(d, torch.device("cpu"), torch.bfloat16, torch.Generator().manual_seed(1))
    h, attn = torch.randn(2, 3, d).bfloat16().unbind()
    layer.router.norm = network.RMSNorm(d, 1e-6).bfloat16()  # a scaled router norm: not the kernel's form
    assert not kernels.chains.ffn_inputs_serves(layer, h, attn)
    forms = ("fp8", torch.tensor(0.1)), ("nvfp4", torch.tensor(0.1))
    got, want = kernels.chains.ffn_inputs_or_torch(layer, h, attn, *forms), network.ffn_inputs(layer, h, attn)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_layer_end_may_carry_a_rounding_of_its_inner_norms_through_the_outer_one():
    """Where norm_1(dense) and norm_2(moe) cancel, their sum one rounding off (a norm's sum of squares in
    another order flipped a rounding of norm_1's) is far off relatively, and the outer norm keeps it: such a
    layer end misses `same_layer_end` of torch's form and is within `probe.same_layer_end_of` it; another
    outer weight, or an inner value off by more than a rounding, is not."""
    d, dtype = 64, torch.bfloat16
    g = torch.Generator().manual_seed(6)
    dense = torch.randn(2, 3, d, generator=g).to(dtype)
    norms = [network.RMSNorm(d, 1e-6).to(dtype) for _ in range(3)]
    for n in norms:
        n.weight.data = (torch.rand(d, generator=g) + 0.5).to(dtype)
    norms[1].weight.data = norms[0].weight.data.clone()
    # moe = dense: norm_2(moe) = norm_1(dense) but at column 7, where they cancel
    norms[1].weight.data[7] *= -1
    residual, scale = torch.zeros_like(dense), torch.tensor([0.7], dtype=dtype)
    want = network.layer_end(residual, dense, dense, tuple(norms), scale)
    n1, n2 = norms[0](dense), norms[1](dense)
    assert bool(((n1 + n2)[..., 7] == 0).all()) and bool((want[..., 7] == 0).all())

    def end_with_inner(n1_at_7: torch.Tensor, outer: network.RMSNorm = norms[2]) -> torch.Tensor:
        inner = n1.clone()
        inner[..., 7] = n1_at_7
        return (residual + outer(inner + n2)) * scale

    rounding_off = end_with_inner((n1[..., 7].view(torch.int16) + 1).view(dtype))  # one bf16 unit out
    assert not same_layer_end(rounding_off, want, residual, scale)
    assert same_layer_end_of(rounding_off, residual, dense, dense, tuple(norms), scale)
    assert not same_layer_end_of(
        end_with_inner(n1[..., 7] * 1.25), residual, dense, dense, tuple(norms), scale
    )
    other = network.RMSNorm(d, 1e-6).to(dtype)
    other.weight.data = norms[2].weight.data.flip(0)
    assert not same_layer_end_of(
        end_with_inner(n1[..., 7], other), residual, dense, dense, tuple(norms), scale
    )


def test_ffn_inputs_are_held_to_torchs_norms_of_their_own_residual():
    """Where h and the normed attention output cancel, a residual value one rounding off (the post-attention
    norm's sum of squares in another order flipped that value's rounding) is far off relatively, and the
    three norms of the residual keep it: against torch's norms of torch's residual they miss
    `same_layer_end`, against torch's norms of the kernel's own residual (`probe.same_ffn_inputs`) they
    pass; a norm with another's weights, or a residual off by more than that rounding, still fails."""
    d, dtype = 64, torch.bfloat16
    layer = ffn_probe_layer(d, torch.device("cpu"), dtype, torch.Generator().manual_seed(3))
    attn = torch.randn(2, 5, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    normed = layer.post_attention_layernorm(attn)
    h = (torch.randn(2, 5, d, generator=torch.Generator().manual_seed(5)) - normed.float()).to(dtype)
    h[0, 0, 7] = -normed[0, 0, 7]  # the residual cancels there: 0
    want = network.ffn_inputs(layer, h, attn)
    assert float(want[0][0, 0, 7]) == 0.0
    residual = want[0].clone()
    residual[0, 0, 7] = normed[0, 0, 7].float() * 2**-8  # what a flipped rounding of the norm leaves
    got = network.ffn_norms(layer, residual)
    zero, one = torch.zeros_like(want[1]), torch.ones(1, dtype=dtype)
    assert not same_layer_end(got[1], want[1], zero, one)  # the norms of torch's residual: far off
    assert same_ffn_inputs(got, layer, h, attn)
    swapped = (
        got[0],
        got[1],
        got[1].reshape(-1, d),
        got[3],
    )  # the experts' input normed with the MLP's weights
    assert not same_ffn_inputs(swapped, layer, h, attn)
    residual[0, 0, 7] = normed[0, 0, 7] * 0.1  # off by a tenth of the normed value, not a rounding
    assert not same_ffn_inputs(network.ffn_norms(layer, residual), layer, h, attn)


@interpreted
def test_the_ffn_inputs_probe_passes_the_kernel_and_fails_wrong_ones(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_ffn_inputs(torch.device("cpu"))
    kernel = kernels.chains.ffn_inputs
    wrong = {
        "inputs swapped": lambda layer, h, a, *forms: kernel(layer, a, h, *forms),
        "experts at the MLP's scale": lambda layer, h, a, mf=None, ef=None: kernel(
            layer, h, a, mf, None if ef is None else (ef[0], mf[1].clone())),
        "rows not quantized": lambda layer, h, a, mf=None, ef=None: kernel(layer, h, a),
        "NVFP4 experts as FP8": lambda layer, h, a, mf=None, ef=None: kernel(
            layer, h, a, mf, ef if ef is None or ef[0] == "fp8" else ("fp8", ef[1])),
    }  # fmt: skip
    check = lambda: probing.check_triton_ffn_inputs(torch.device("cpu"))
    each_wrong_form_fails(monkeypatch, kernels.chains, "ffn_inputs", wrong, check, "FFN inputs differ")


@interpreted
def test_a_model_with_the_layer_end_and_ffn_inputs_kernels_keeps_its_logits(rne_casts):  # noqa: F811
    """The embedded model in bf16 with every layer's FFN inputs and end on their kernels (as
    `gpu_load.fuse_network` installs them): both ran in every layer, and the logits are as close to the fp32
    model's as torch's bf16 form is (bf16 activations through every layer drift ~5% relative L2 from fp32
    either way; the kernels' norms sum in another order, so the two bf16 forms differ by 0.7-2.1%, by seed
    and machine: a bound between them would test which way each rounding fell)."""
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import gpu_load

    model = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].eval()
    cfg, length = model.cfg, model.config.canvas_length
    canvas = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length).expand(2, length)
    masks = dict.fromkeys(set(model.layer_types))
    step = lambda: model.denoise(canvas, None, positions, masks, None).float()
    with torch.inference_mode():
        exact = (
            load_model(EMBEDDED_MODEL, torch.float32)[0].eval().denoise(canvas, None, positions, masks, None)
        )
        want = step()
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            for name in ("layer_end", "ffn_inputs"):
                kernel = getattr(kernels.chains, name)
                mp.setattr(kernels.chains, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
            probed = probing.Probe("sm90", {probing.LAYER_END: None, probing.FFN_INPUTS: None})
            gpu_load.fuse_network(model, probed, None)
            got = step()
    assert calls.count("layer_end") == calls.count("ffn_inputs") == cfg.num_hidden_layers
    off = lambda x: float((x - exact).norm() / exact.norm())
    assert off(got) <= 1.2 * off(want) and off(want) < 0.1, (off(got), off(want))


@interpreted
def test_a_denoise_pass_over_a_cache_keeps_its_logits_with_the_kv_kernel():
    """The embedded model in bf16 denoising over its cached prompt K/V with every layer's concatenation on
    the kernel (as `gpu_load.fuse_network` installs it): the same logits bit for bit; the kernel ran in every
    layer."""
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import gpu_load

    model = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].eval()
    cfg, length = model.cfg, model.config.canvas_length
    g = torch.Generator().manual_seed(3)
    prompt, canvas = (torch.randint(0, cfg.vocab_size, (2, n), generator=g) for n in (11, length))
    masks = dict.fromkeys(set(model.layer_types))
    positions = torch.arange(11 + length).expand(2, -1)
    with torch.inference_mode():
        past = model.encode_kv(prompt, positions[:, :11], masks)
        step = lambda: model.denoise(canvas, None, positions[:, 11:], masks, past)
        want = step()
        calls = []
        kernel = kernels.chains.kv_cat
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernels.chains, "kv_cat", lambda *a: calls.append(a[0].shape) or kernel(*a))
            gpu_load.fuse_network(model, probing.Probe("sm90", {probing.KV_CAT: None}), None)
            got = step()
    assert len(calls) == cfg.num_hidden_layers and all(shape[2] == 11 for shape in calls)
    assert torch.equal(got, want)


@interpreted
def test_the_kv_probe_passes_the_kernel_and_fails_a_wrong_one(monkeypatch):
    probing.check_triton_kv_cat(torch.device("cpu"))
    kernel = kernels.chains.kv_cat
    monkeypatch.setattr(
        kernels.chains, "kv_cat", lambda pk, pv, k, v: kernel(pv, pk, k, v)
    )  # K and V swapped
    with pytest.raises(DgpipeError, match="K/V concatenation differs"):
        probing.check_triton_kv_cat(torch.device("cpu"))
    monkeypatch.setattr(  # the new tokens first
        kernels.chains,
        "kv_cat",
        lambda pk, pv, k, v: tuple(t.roll(-k.shape[2], 2) for t in kernel(pk, pv, k, v)),
    )
    with pytest.raises(DgpipeError, match="K/V concatenation differs"):
        probing.check_triton_kv_cat(torch.device("cpu"))


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("d", [2816, 100])
def test_the_router_input_is_torchs_bit_for_bit(rne_casts, dtype, d):  # noqa: F811
    """norm(x) * scale * d^-0.5 as the router computes it, over seven decades with zeros, infinities and NaN, a
    width that is no block multiple: torch's two products bit for bit; other inputs keep the torch form."""
    g = torch.Generator().manual_seed(d)
    x = spread(5, d, g)
    x[0, :3] = torch.tensor([float("inf"), float("nan"), 0.0])
    x, w = x.to(dtype), (torch.rand(d, generator=g) * 4).to(dtype)
    assert kernels.chains.scale_columns_serves(x, w)
    got = kernels.chains.scale_columns(x, w, d**-0.5)
    assert same_bits(got, x * w * d**-0.5)
    assert not kernels.chains.scale_columns_serves(x, w.float())  # torch would promote
    assert not kernels.chains.scale_columns_serves(x.t(), w)
    assert not kernels.chains.scale_columns_serves(x, torch.stack([w, w], 1)[:, 0])  # w's values, strided
    assert not kernels.chains.scale_columns_serves(x[0, 0], w[0])  # one value: no columns


def test_the_router_takes_its_input_kernel_where_installed():
    from pipeline.model.config import ModelConfig
    from pipeline.model.network import DiffusionGemma

    model = DiffusionGemma(ModelConfig.from_yaml("sudoku-tiny")).bfloat16()
    router, seen = model.layers[0].router, []
    x = torch.randn(6, model.cfg.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = router(x)
        router.scale_kernel = lambda h, w, c: seen.append(c) or h * w * c
        got = router(x)
    assert seen == [router.root] and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@interpreted
def test_the_router_probe_passes_the_kernel_and_fails_a_wrong_one(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_router(torch.device("cpu"))
    kernel = kernels.chains.scale_columns
    monkeypatch.setattr(kernels.chains, "scale_columns", lambda x, w, c: kernel(x, w, c * 1.01))
    with pytest.raises(DgpipeError, match="router input differs"):
        probing.check_triton_router(torch.device("cpu"))


def cuda_geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up as torch's CUDA kernels compute it (`GeluCUDAKernelImpl`, then the product), in
    numpy with numpy's fp32 tanh: (x * x) * x, the one fma nvcc contracts `x + kKappa * x_cube` into (exact
    in float64, then rounded), the GeLU rounded to gate's dtype, the product rounded."""
    import numpy as np

    x = gate.float().numpy()
    kappa, beta = np.float32(kernels.chains.GELU_KAPPA), np.float32(kernels.chains.GELU_BETA)
    fma = (np.float64(kappa) * ((x * x) * x).astype(np.float64) + x.astype(np.float64)).astype(np.float32)
    gelu = (np.float32(0.5) * x) * (np.float32(1.0) + np.tanh(beta * fma))
    return (torch.from_numpy(gelu).to(gate.dtype).float() * up.float()).to(gate.dtype)


def geglu_inputs(
    rows: int, cols: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate|up halves of one GEMM output: values over seven decades, zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(seed)
    gu = spread(rows, 2 * cols, g)
    gu[0, :4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
    gu[-1, -3:] = torch.tensor([1e-39, -2.0, 3.0])  # a subnormal gate and up
    return gu.to(dtype).chunk(2, dim=-1)


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize(("rows", "cols"), [(33, 704), (5, 2112), (3, 24), (1, 1500)])
def test_geglu_is_torchs_cuda_arithmetic_bit_for_bit(rne_casts, interpreted_tanh, dtype, rows, cols):  # noqa: F811
    """Rows read through the gate|up halves' stride, widths from 24 to the 26B's 2,112 (none a block multiple
    but 704's power-of-two program): torch's CUDA arithmetic bit for bit (with numpy's tanh in both), torch's
    CPU form within one unit in the last place, and the FP8 codes of that product."""
    gate, up = geglu_inputs(rows, cols, dtype, seed=cols)
    assert kernels.chains.geglu_serves(gate, up) and gate.stride(0) == 2 * cols
    got = kernels.chains.geglu(gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    assert same_bits(got, cuda_geglu(gate, up))
    assert same_geglu(got, network.gelu_tanh(gate) * up, gate, up)  # another tanh
    scale = torch.tensor(0.05)
    codes = kernels.chains.geglu(gate, up, scale)
    assert codes.dtype == torch.float8_e4m3fn and fp8_codes_equal(codes, sl.fp8_quantize(got, scale))


@interpreted
@pytest.mark.parametrize(("rows", "cols"), [(33, 704), (130, 2112), (3, 32), (1, 1488)])
def test_geglu_writes_the_nvfp4_codes_of_its_product(rne_casts, interpreted_tanh, rows, cols):  # noqa: F811
    """The down projections' NVFP4 operand from the gated GeLU kernel: the codes and block scales
    `nvfp4_quantize` makes of its product, byte for byte, the scales as they are (the experts') or in a
    linear's 128x4-tile layout with its padded rows and columns zero (the dense MLP's: 2 and 93 scale
    columns padded to 4 and 96, one and two row tiles), where the memory it is handed holds other bytes."""
    gate, up = geglu_inputs(rows, cols, torch.bfloat16, seed=cols)
    gs = torch.tensor(0.02)
    want_packed, want_scales = sl.nvfp4_quantize(kernels.chains.geglu(gate, up), gs)
    packed, scales = kernels.chains.geglu_nvfp4(gate, up, gs)
    assert torch.equal(packed, want_packed) and fp8_codes_equal(scales, want_scales)
    with uninitialised_bytes_are_0xab():
        packed, scales = kernels.chains.geglu_nvfp4(gate, up, gs, blocked=True)
    assert torch.equal(packed, want_packed)
    assert fp8_codes_equal(scales, sl.to_blocked(want_scales.view(torch.uint8)))


@interpreted
def test_a_model_with_the_geglu_kernel_keeps_its_logits(rne_casts, interpreted_tanh):  # noqa: F811
    """The embedded model in bf16 with its dense MLPs, experts and self-conditioning on the gated-GeLU kernel
    (as `gpu_load.fuse_network` installs it), a denoise step with the self-conditioning signal: the kernel
    ran in all three, and the logits stay within bf16 rounding of torch's form (numpy's tanh here against
    torch's CPU one; on a GPU both are libdevice's)."""
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import gpu_load

    model = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].eval()
    cfg, length = model.cfg, model.config.canvas_length
    g = torch.Generator().manual_seed(1)
    canvas = torch.randint(0, cfg.vocab_size, (2, length), generator=g)
    probs = torch.softmax(torch.randn(2, length, cfg.vocab_size, generator=g) * 3, -1)
    positions = torch.arange(length).expand(2, length) + 7
    masks = dict.fromkeys(set(model.layer_types))
    step = lambda: model.denoise(canvas, probs, positions, masks, None)
    with torch.inference_mode():
        want = step()
        shapes = []
        kernel = kernels.chains.geglu
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(
                kernels.chains,
                "geglu",
                lambda gt, up, s=None: shapes.append(gt.shape[-1]) or kernel(gt, up, s),
            )
            gpu_load.fuse_network(model, probing.Probe("sm90", {probing.GEGLU: None}), None)
            got = step()
    assert set(shapes) == {cfg.intermediate_size, cfg.moe_intermediate_size}
    assert len(shapes) == 2 * cfg.num_hidden_layers + 1  # each layer's MLP and experts, the self-conditioning
    assert float((got - want).norm() / want.norm()) < 1e-2


@interpreted
def test_the_geglu_probe_passes_the_kernel_and_fails_a_wrong_one(rne_casts, interpreted_tanh, monkeypatch):  # noqa: F811
    probing.check_triton_geglu(torch.device("cpu"))
    kernel = kernels.chains.geglu
    monkeypatch.setattr(kernels.chains, "geglu", lambda g, u, s=None: kernel(u, g, s))  # gate and up swapped
    with pytest.raises(DgpipeError, match="gated GeLU differs"):
        probing.check_triton_geglu(torch.device("cpu"))
    monkeypatch.setattr(kernels.chains, "geglu", kernel)
    nvfp4 = kernels.chains.geglu_nvfp4
    for wrong in (
        lambda g, u, gs, blocked=False: nvfp4(g, u, gs * 2, blocked),  # another global scale
        lambda g, u, gs, blocked=False: (
            nvfp4(g, u, gs, blocked)[0],
            nvfp4(g.flip(0), u.flip(0), gs, blocked)[1],
        ),
    ):
        monkeypatch.setattr(kernels.chains, "geglu_nvfp4", wrong)
        with pytest.raises(DgpipeError, match="gated GeLU's NVFP4 codes differ"):
            probing.check_triton_geglu(torch.device("cpu"))


def test_gated_gelus_agree_as_far_as_a_tanh_can_make_them_differ():
    """torch's CPU form against the CUDA arithmetic (numpy's tanh): apart in the negative tail, where 1 + tanh
    cancels, by far more than bf16 rounding, yet within `same_geglu`; a wrong form is not."""
    gate, up = geglu_inputs(33, 704, torch.bfloat16, seed=1)
    cuda, cpu = cuda_geglu(gate, up), network.gelu_tanh(gate) * up
    tail = (gate.float() < -4) & (cuda != cpu) & (cpu != 0) & cuda.isfinite() & cpu.isfinite()
    assert tail.any() and float(((cuda - cpu).float().abs() / cpu.float().abs())[tail].max()) > 0.5
    assert same_geglu(cuda, cpu, gate, up)
    assert not same_geglu(cuda_geglu(up, gate), cpu, gate, up)
    assert not same_geglu(cuda.nan_to_num(), cpu, gate, up)  # NaN in other places
    swapped = cpu.clone()
    swapped[0, 1] = -swapped[0, 1]  # -inf for inf
    assert not same_geglu(swapped, cpu, gate, up)


def test_the_gated_gelus_take_the_kernel_where_installed(monkeypatch):
    """The dense MLP, the self-conditioning MLP, both experts forms and the FP8 experts' down operand call an
    installed kernel in place of torch's form; the FP8 operand quantized by it in the same call."""
    from pipeline.model.config import ModelConfig
    from pipeline.model.network import DiffusionGemma
    from pipeline.runtime import tensor_cores
    from pipeline.runtime.routed import RoutedExperts

    model = DiffusionGemma(ModelConfig.from_yaml("sudoku-tiny")).bfloat16()
    seen = []
    kernel = lambda g, u, s=None: seen.append((tuple(g.shape), s)) or network.gelu_tanh(g) * u
    layer, d = model.layers[0], model.cfg.hidden_size
    x = torch.randn(6, d, dtype=torch.bfloat16)
    index, weights = torch.randint(0, model.cfg.num_experts, (6, 2)), torch.rand(6, 2)
    with torch.inference_mode():
        layer.mlp.geglu_kernel = kernel
        layer.mlp(x)
        model.self_conditioning.geglu_kernel = kernel
        model.self_conditioning(x[None], x[None])
        layer.experts.geglu_kernel = kernel
        layer.experts(x, index, weights)
        routed = RoutedExperts(layer.experts, triton=False)
        routed.geglu_kernel = kernel
        routed(x, index, weights)
    inner, moe = model.cfg.intermediate_size, model.cfg.moe_intermediate_size
    assert seen == [((6, inner), None), ((1, 6, inner), None), ((12, moe), None), ((12, moe), None)]
    seen.clear()
    gate, up = torch.randn(2, 12, 32, dtype=torch.bfloat16).unbind()
    scale = torch.tensor(0.1)
    monkeypatch.setattr(tensor_cores, "in_one_pass", lambda one_pass, t: one_pass)
    q, qs = tensor_cores.down_operand(
        gate, up, scale, "fp8", True, lambda g, u, s=None: sl.fp8_quantize(kernel(g, u, s), s)
    )
    assert seen == [((12, 32), scale)] and torch.equal(qs, scale.expand(12))
    assert torch.equal(
        q.view(torch.uint8), sl.fp8_quantize(network.gelu_tanh(gate) * up, scale).view(torch.uint8)
    )
    seen.clear()
    tensor_cores.down_operand(gate, up, scale, "nvfp4", True, kernel)  # another format: the product only
    assert seen == [((12, 32), None)]


COMPILE_FOR_GPUS = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime.kernels import chains as tn
from pipeline.runtime.kernels.jit import chains as k

out = []

def build(fn, sig, consts, cc, name, label, d=0, options=tn.OPTIONS):
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr")})
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    cubin = Path(sys.argv[1]) / f"{name}_sm{cc}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out.append({"cc": cc, "d": d, "dtype": label, "cubin": str(cubin), "ptx": kernel.asm["ptx"]})

ptrs = lambda dt, *names: {p: f"*{dt}" for p in names}
ints = lambda *names: dict.fromkeys(names, "i32")
for cc in (90, 100, 89, 120):
    for d in (256, 512):
        for dt in ("bf16", "fp16"):
            build(k.rope, {**ptrs(dt, "x_ptr", "cos_ptr", "sin_ptr", "out_ptr"), **ints("rows", "heads")},
                  {"HALF": d // 2, "HALF_P2": d // 2, "BLOCK_R": tn.ROW_VALUES // d}, cc, f"rope_{d}_{dt}", dt, d)
    build(k.softcap, {"x_ptr": "*bf16", "out_ptr": "*fp32", "n": "i32", "inv_cap": "fp32", "cap": "fp32"},
          {"BLOCK": tn.SOFTCAP_BLOCK}, cc, "softcap", "softcap")
    for gather in (True, False):
        build(k.combine, {**ptrs("bf16", "y_ptr", "out_ptr"), "rows_ptr": "*i64", "w_ptr": "*fp32", **ints("D", "stride_y")},
              {"K": 8, "GATHER": gather, "BLOCK_D": tn.COMBINE_BLOCK}, cc, f"combine_{gather}", "combine")
    for quant in (False, True):
        build(k.geglu, {**ptrs("bf16", "gate_ptr", "up_ptr"), "scale_ptr": "*fp32", "out_ptr": "*fp8e4nv" if quant else "*bf16",
                        **ints("cols", "stride_gate", "stride_up")},
              {"BETA": tn.GELU_BETA, "KAPPA": tn.GELU_KAPPA, "E4M3_MAX": 448.0, "QUANT": quant, "BLOCK": tn.GEGLU_BLOCK},
              cc, f"geglu_{quant}", "geglu")
    for blocked in (False, True):  # the experts' down operand, the dense MLP's
        build(k.geglu_nvfp4, {**ptrs("bf16", "gate_ptr", "up_ptr"), "gs_ptr": "*fp32", "packed_ptr": "*u8",
                              "scales_ptr": "*u8" if blocked else "*fp8e4nv", **ints("rows", "cols", "stride_gate", "stride_up", "CP")},
              {"BETA": tn.GELU_BETA, "KAPPA": tn.GELU_KAPPA, "E2M1_MAX": 6.0, "E4M3_MAX": 448.0, "BLOCKED": blocked,
               "BLOCK": tn.GEGLU_BLOCK}, cc, f"geglu_nvfp4_{blocked}", "geglu")
    for d in (256, 512):
        build(k.kv_cat, {**ptrs("bf16", "pk_ptr", "pv_ptr", "k_ptr", "v_ptr", "ok_ptr", "ov_ptr"),
                         **ints("heads", "past", "total", "p_sb", "p_sh", "p_st", "n_sb", "n_sh", "n_st")},
              {"D": d, "D_P2": d, "BLOCK_T": tn.KV_CAT_VALUES // d}, cc, f"kv_cat_{d}", "kv_cat", d)
    for dt in ("bf16", "fp16"):
        build(k.scale_columns, {**ptrs(dt, "x_ptr", "w_ptr", "out_ptr"), **ints("n", "cols"), "c": "fp32"},
              {"BLOCK": tn.SCALE_COLUMNS_BLOCK}, cc, f"router_{dt}", f"router {dt}")
        build(k.add_scaled, {**ptrs(dt, "a_ptr", "b_ptr", "s_ptr", "out_ptr"), "n": "i32"},
              {"BLOCK": tn.ADD_SCALED_BLOCK}, cc, f"residual_{dt}", f"residual {dt}")
        build(k.layer_end, {**ptrs(dt, "dense_ptr", "moe_ptr", "res_ptr", "w1_ptr", "w2_ptr", "w_ptr", "s_ptr", "out_ptr"),
                            "cols": "i32", "eps": "fp32"},
              {"BLOCK": 4096}, cc, f"layer_end_{dt}", f"layer_end {dt}", options=tn.ROW_OPTIONS)
        # the MLP's and experts' inputs as rows, as FP8, as NVFP4 (swizzled for the MLP's linear), as per-row FP8
        for mlp, experts, codes, bs in ((0, 0, dt, dt), (1, 1, "fp8e4nv", dt), (3, 2, "u8", "u8"), (4, 4, "fp8e4nv", "fp32")):
            build(k.ffn_inputs, {**ptrs(dt, "h_ptr", "a_ptr", "wa_ptr", "w1_ptr", "w2_ptr", "ws_ptr", "res_ptr", "router_ptr"),
                                 **ptrs(codes, "mlp_ptr", "exp_ptr"), **ptrs("fp32", "mlp_scale_ptr", "exp_scale_ptr"),
                                 "mlp_bs_ptr": f"*{bs}", "exp_bs_ptr": "*fp8e4nv" if experts == 2 else f"*{bs}",
                                 **ints("rows", "cols", "CP"), "eps": "fp32", "root": "fp32"},
                  {"E2M1_MAX": 6.0, "E4M3_MAX": 448.0, "MLP_FORM": mlp, "EXP_FORM": experts, "BLOCK": 4096}, cc,
                  f"ffn_inputs_{dt}_{mlp}", f"ffn_inputs {dt}", options=tn.ROW_OPTIONS)
json.dump(out, sys.stdout)
"""


def test_the_kernels_compile_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton lowers the RoPE kernel for both head dims and dtypes, the softcap kernel (libdevice's tanh
    linked in, no `tanh.approx`), the gated GeLU (the same tanh, and the one FMA torch's CUDA GeLU has), the
    residual sum, the router's input, the FFN inputs (as rows, and as FP8, NVFP4 and per-row FP8 operands) and the layer end, the K/V concatenation and the MoE combine (each product and sum rounded on its own, as its
    torch form computes them), to sm_90a, sm_100a, sm_89 and sm_120 cubins, no GPU needed. RoPE: every product is rounded to the input's dtype before the sum (`mul.rn`, `add.rn`; a fused
    multiply-add would round once where torch rounds twice, and Triton's default contraction made one), and no
    register spills (no STL/LDL in the SASS)."""
    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    assert len(compiled) == 108 and sum(k["dtype"] == "softcap" for k in compiled) == 4
    # the E4M3 writers (the gated GeLU's FP8 and NVFP4 outputs, the FFN inputs' operands): one rounding each
    fp8 = [k for k in compiled if "e4m3" in k["ptx"]]
    assert len(fp8) == 4 * (3 + 2 * 3), [(k["cc"], k["dtype"]) for k in fp8]
    assert all(converts_to_e4m3_once(k["ptx"], k["cc"]) for k in fp8), [k["cc"] for k in fp8]
    for k in compiled:
        if k["dtype"] == "softcap":  # its tanh is libdevice's own code (its FMAs are the function's)
            assert "mul.rn.f32" in k["ptx"] and "tanh.approx" not in k["ptx"], k["cc"]
        elif k["dtype"] == "geglu":  # libdevice's tanh (flush-to-zero FMAs) and one FMA of its own per value
            fused = k["ptx"].count("fma.rn.f32") + k["ptx"].count(
                "fma.rn.f32x2"
            )  # sm_100a: two values a pair
            assert fused and fused == k["ptx"].count("ex2.approx") and "tanh.approx" not in k["ptx"], k["cc"]
            assert not [f for f in separate_roundings_missing(k["ptx"]) if not f.startswith("fma.rn")], k[
                "cc"
            ]
        else:
            assert not separate_roundings_missing(k["ptx"]), (
                k["cc"],
                k["dtype"],
                separate_roundings_missing(k["ptx"]),
            )
        assert not spills(k["cubin"]), (k["cc"], k["d"], k["dtype"])
