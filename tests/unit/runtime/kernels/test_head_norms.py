"""dgpipe's attention head-norms kernel (`pipeline.runtime.kernels.chains.head_norms`: q's norm and RoPE, or
k's and v's norms and k's RoPE, in one launch) in Triton's interpreter, with round-to-nearest-even casts
(tests/_utils/interpreter_casts.py): against torch's form (torch's fused RMSNorm, `network.apply_rope`), its
probe, a model's logits with it installed, and compiled for Hopper, B200, Ada and RTX Blackwell without a
GPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.network import RMSNorm, apply_rope
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime.probe.common import same_bits, same_layer_end, spread
from pipeline.runtime.probe.norms import same_rotation
from tests._utils.embedded_passes import denoise_and_prefill, embedded_bf16
from tests._utils.interpreter_casts import interpreted, rne_casts  # noqa: F401  (fixture)
from tests._utils.probes import each_wrong_form_fails
from tests._utils.triton_compile import compiled_for_gpus, separate_roundings_missing, spills

CPU = torch.device("cpu")


def heads(b: int, length: int, h: int, d: int, dtype: torch.dtype, seed: int):
    """(x, v, x's norm, v's norm, cos, sin): x and v [b, length, h, d] over seven decades with a zero row and
    one with infinity and NaN, random norm weights in [0, 2), angles of positions up to 2^17."""
    g = torch.Generator().manual_seed(seed)
    x, v = (spread(2 * b * length * h, d, g) / 64).to(dtype).view(2, b, length, h, d).unbind()
    x[0, 0, 0], v[-1, -1, -1, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
    norm, v_norm = RMSNorm(d, 1e-6).to(dtype), RMSNorm(d, 1e-6, with_scale=False)
    norm.weight.data = (torch.rand(d, generator=g) * 2).to(dtype)
    angles = torch.randint(0, 2**17, (b, length, 1), generator=g).float() * torch.logspace(0, -4, d // 2)
    emb = torch.cat([angles, angles], dim=-1)
    return x, v, norm, v_norm, emb.cos().to(dtype), emb.sin().to(dtype)


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize(("h", "d"), [(16, 256), (8, 256), (2, 512), (3, 24), (5, 2)])
def test_head_norms_are_torchs_but_for_their_norms_sums(rne_casts, dtype, h, d):  # noqa: F811
    """The 26B's q heads (16 of 256), sliding K/V (8 of 256) and global K/V (2 of 512), the embedded model's
    24 and the narrowest: within `probe.same_rotation` of torch's form (v within `same_layer_end`), and bit
    for bit but for under 0.1% of the values (the norms' sums of squares in another order)."""
    x, v, norm, v_norm, cos, sin = heads(2, 9, h, d, dtype, seed=d + h)
    assert kernels.chains.head_norms_serves(x, norm, cos, sin, v, v_norm)
    got, got_v, no_q = kernels.chains.head_norms(x, norm, cos, sin, v, v_norm)
    normed = norm(x)
    want, want_v = apply_rope(normed, cos, sin), v_norm(v)
    assert no_q is None
    assert same_rotation(got, want, normed, cos, sin)
    one = torch.ones(1, dtype=dtype)
    assert same_layer_end(got_v, want_v, torch.zeros_like(v), one)
    for a, b in ((got, want), (got_v, want_v)):
        assert float(((a != b) & ~b.isnan()).float().mean()) < 1e-3
    q, none, no_q = kernels.chains.head_norms(x, norm, cos, sin)  # q: no v
    assert none is None is no_q and same_bits(q, got)


@interpreted
@pytest.mark.parametrize(("h", "kv", "d"), [(16, 8, 256), (16, 2, 512), (3, 1, 24)])
def test_head_norms_read_q_k_and_v_in_place_from_one_merged_projection(rne_casts, h, kv, d):  # noqa: F811
    """q's, k's and v's heads as columns of one q|k|v GEMM's output (tokens h + 2 * kv heads apart): the
    kernel reads them in place and writes what it writes from contiguous copies, bit for bit, in launches of
    their own (q; k and v) and in one launch for the three, q with its own weight; a layout whose heads are
    not contiguous keeps the torch form."""
    x, _, norm, v_norm, cos, sin = heads(2, 5, h + 2 * kv, d, torch.bfloat16, seed=h)
    proj = x.reshape(2, 5, -1)  # [B, L, (h + 2 kv) * d]: q | k | v
    q, k, v = (c.view(2, 5, -1, d) for c in proj.split([h * d, kv * d, kv * d], dim=-1))
    assert not q.is_contiguous() and all(kernels.chains.token_rows(t) for t in (q, k, v))
    assert kernels.chains.head_norms_serves(q, norm, cos, sin) and kernels.chains.head_norms_serves(
        k, norm, cos, sin, v, v_norm
    )
    q_norm = _flipped(norm)
    got_q, none, _ = kernels.chains.head_norms(q, q_norm, cos, sin)
    got_k, got_v, _ = kernels.chains.head_norms(k, norm, cos, sin, v, v_norm)
    want_q = kernels.chains.head_norms(q.contiguous(), q_norm, cos, sin)[0]
    want_k, want_v, _ = kernels.chains.head_norms(k.contiguous(), norm, cos, sin, v.contiguous(), v_norm)
    assert none is None and all(t.is_contiguous() for t in (got_q, got_k, got_v))
    for a, b in ((got_q, want_q), (got_k, want_k), (got_v, want_v)):
        assert same_bits(a, b)
    together = kernels.chains.head_norms(k, norm, cos, sin, v, v_norm, q, q_norm)
    assert all(same_bits(a, b) for a, b in zip(together, (want_k, want_v, want_q), strict=True))
    # q written head-major, [B, H, L, D] contiguous (what packed attention reads), the same values
    head_major = kernels.chains.head_norms(k, norm, cos, sin, v, v_norm, q, q_norm, q_head_major=True)
    assert head_major[2].shape == (2, h, 5, d) and head_major[2].is_contiguous()
    assert same_bits(head_major[2].transpose(1, 2), want_q)
    assert all(same_bits(a, b) for a, b in zip(head_major[:2], (want_k, want_v), strict=True))
    # k and v written into a cache's room: its buffers' rows 1-2, tokens 3-7 of 12, nothing else touched
    cache = torch.full((2, 3, kv, 12, d), 5.0, dtype=torch.bfloat16)  # K|V, slots, heads, length, dim
    room = cache[0, 1:, :, 3:8], cache[1, 1:, :, 3:8]
    assert kernels.chains.head_outputs_serve(room, k, v)
    roomed = kernels.chains.head_norms(k, norm, cos, sin, v, v_norm, q, q_norm, out=room)
    assert roomed[0] is room[0] and roomed[1] is room[1] and same_bits(roomed[2], want_q)
    assert same_bits(room[0], want_k.transpose(1, 2)) and same_bits(room[1], want_v.transpose(1, 2))
    cache[:, 1:, :, 3:8] = 5.0
    assert bool((cache == 5.0).all())
    assert not same_bits(want_q, kernels.chains.head_norms(q, norm, cos, sin)[0])  # the weights differ
    transposed = proj[..., : h * d].view(2, 5, d, h).transpose(2, 3)  # a head's values h apart
    assert not kernels.chains.token_rows(transposed)
    assert not kernels.chains.head_norms_serves(transposed, norm, cos, sin)


def test_other_heads_keep_the_torch_form(monkeypatch):
    x, v, norm, v_norm, cos, sin = heads(1, 4, 2, 64, torch.bfloat16, seed=0)
    serves = kernels.chains.head_norms_serves
    assert serves(x, norm, cos, sin, v, v_norm)
    assert not serves(x.float(), norm.float(), cos.float(), sin.float())  # fp32: no rope kernel either
    assert not serves(x, norm.float(), cos, sin)  # a weight of another dtype
    assert not serves(x, v_norm, cos, sin)  # an unscaled norm for q or k
    assert not serves(x, norm, cos, sin, v, norm)  # a scaled norm for v
    assert not serves(x, norm, cos, sin, v[:, :, :1].contiguous(), v_norm)  # v of another shape
    assert not serves(x, norm, cos, sin, v)  # v without its norm
    # the kernel reads sin at cos's offsets and the weight at each column's: other layouts keep torch's form
    assert not serves(x, norm, cos, torch.cat([cos, sin], -1)[..., 64:])  # sin a view of a wider table
    assert not serves(x, norm, cos, sin[:, :1])  # one token's sin, broadcast
    assert not serves(x, norm, cos, sin.float())
    strided = RMSNorm(64, 1e-6).bfloat16()
    strided.weight.data = torch.ones(128, dtype=torch.bfloat16)[::2]
    assert not serves(x, strided, cos, sin)
    kernel = kernels.chains.head_norms
    monkeypatch.setattr(kernels.chains, "head_norms", lambda *a: pytest.fail("the kernel ran"))
    q_only = kernels.chains.head_norms_or_torch(x, norm, cos, sin, q=x, q_norm=norm)  # no v: the torch form
    assert q_only[1] is None and torch.equal(q_only[0], q_only[2])
    y, w = x.float(), v.float()
    got = kernels.chains.head_norms_or_torch(y, norm.float(), cos.float(), sin.float(), w, v_norm)
    same = lambda a, b: torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)
    assert same(got[0], apply_rope(norm.float()(y), cos.float(), sin.float())) and same(got[1], v_norm(w))
    with pytest.raises(ValueError, match="pass v too"):  # q's programs follow v's in the grid
        kernel(x, norm, cos, sin, q=x, q_norm=norm)
    fp32 = kernels.chains.head_norms_or_torch(
        y, norm.float(), cos.float(), sin.float(), w, v_norm, y, norm.float()
    )
    head_major = kernels.chains.head_norms_or_torch(
        y, norm.float(), cos.float(), sin.float(), w, v_norm, y, norm.float(), q_head_major=True
    )  # the torch form's q as [B, H, L, D]
    assert head_major[2].shape == (1, 2, 4, 64) and same(head_major[2].transpose(1, 2), fp32[2])
    room = torch.zeros(2, 1, 2, 4, 64)  # fp32 K/V: the torch form, copied into the room
    assert not kernels.chains.head_outputs_serve(tuple(room[:, :, :, :, :2]), y, w)  # another shape
    with torch.no_grad():  # as the runtime runs it (the norms' weights are parameters)
        roomed = kernels.chains.head_norms_or_torch(
            y, norm.float(), cos.float(), sin.float(), w, v_norm, out=(room[0], room[1])
        )
    assert roomed[0].data_ptr() == room[0].data_ptr() and same(room[0], fp32[0].transpose(1, 2))
    assert same(room[1], fp32[1].transpose(1, 2))
    with pytest.raises(ValueError, match="pass v too"):
        kernel(x, norm, cos, sin, out=(x.transpose(1, 2), x.transpose(1, 2)))


@interpreted
def test_the_head_norms_probe_passes_the_kernel_and_fails_wrong_ones(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_head_norms(CPU)
    kernel = kernels.chains.head_norms
    wrong = {
        "not rotated": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: kernel(
            x, n, torch.ones_like(c), torch.zeros_like(s), v, vn, q, qn, **hm),
        "weights reversed": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: kernel(x, _flipped(n), c, s, v, vn, q, qn, **hm),
        "v not normed": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: (kernel(x, n, c, s)[0], v, None),
        "v scaled": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: (kernel(x, n, c, s)[0], kernel(v, n, c, s)[0], None),
        "tokens read as contiguous": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: kernel(
            _as_contiguous(x), n, c, s, None if v is None else _as_contiguous(v), vn, q, qn, **hm),
        "q with k's weight in one launch": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: kernel(
            x, n, c, s, v, vn, q, None if q is None else n, **hm),
        "q not rotated in one launch": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: (
            *kernel(x, n, c, s, v, vn)[:2], None if q is None else apply_rope(qn(q), torch.ones_like(c), torch.zeros_like(s))),
        "q token-major where asked head-major": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, **hm: kernel(
            x, n, c, s, v, vn, q, qn),
        "q head-major as a transposed view": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, q_head_major=False, **o: (
            lambda out: (*out[:2], out[2].transpose(1, 2) if q_head_major else out[2]))(kernel(x, n, c, s, v, vn, q, qn, **o)),
        "k and v beside the room": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, out=None, **hm: kernel(
            x, n, c, s, v, vn, q, qn, **hm),
        "k and v a token off in the room": lambda x, n, c, s, v=None, vn=None, q=None, qn=None, out=None, **hm: kernel(
            x, n, c, s, v, vn, q, qn, out=None if out is None else tuple(
                t.as_strided(t.shape, t.stride(), t.storage_offset() + t.stride(2)) for t in out), **hm),
    }  # fmt: skip
    check = lambda: probing.check_triton_head_norms(CPU)
    each_wrong_form_fails(monkeypatch, kernels.chains, "head_norms", wrong, check, "head norms .*differ")


def _as_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x's storage from x's first value read as a contiguous tensor of x's shape: what a kernel that ignored
    the tokens' stride would read."""
    return x.as_strided(x.shape, torch.empty(x.shape, device="meta").stride())


def _flipped(norm: RMSNorm) -> RMSNorm:
    out = RMSNorm(norm.weight.shape[0], norm.eps).to(norm.weight.device, norm.weight.dtype)
    out.weight.data = norm.weight.data.flip(0)
    return out


@interpreted
@pytest.mark.parametrize("merged", [False, True])
def test_a_model_with_the_head_norms_kernel_keeps_its_logits(rne_casts, merged):  # noqa: F811
    """The embedded model in bf16 with every layer's head norms on the kernel (as `gpu_load.fuse_network`
    installs it), `merged`: q, k and v one GEMM whose columns the kernel reads in place (as
    `gpu_load.finish_on_device` merges them where the kernel is probed): it ran for q, k and v in one launch
    in every layer, prefill and denoise (k and v alone for the last layer's prefill K/V), and the logits and the K/V a cache keeps stay within 1e-2 relative L2
    of torch's (measured: 1.2e-3 and 0, merged or not; a normed value one rounding away, carried through the
    layers; a merged GEMM may sum in another order on another machine)."""
    from pipeline.runtime import gpu_load, shared_input

    model = embedded_bf16()
    run = denoise_and_prefill(model)
    want = run()
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            kernels.chains,
            "head_norms",
            lambda *a, k=kernels.chains.head_norms: (
                calls.append((len(a) > 6 and a[6] is not None, a[0].is_contiguous())) or k(*a)
            ),
        )
        if merged:
            qkv = sum(2 if layer.self_attn.v_proj is not None else 1 for layer in model.layers)
            gate_up = len(model.layers) + 1  # the dense MLPs' and the self-conditioning's
            assert shared_input.share_inputs(model, merge_qkv=True)[1] == qkv + gate_up
        gpu_load.fuse_network(model, probing.Probe("sm90", {probing.HEAD_NORMS: None}), None)
        got = run()
    assert all(layer.self_attn.head_norms_kernel for layer in model.layers)
    layers = len(model.layers)  # q, k and v in each layer of the denoise pass and of the prefill, whose
    qkv_calls = [contiguous for with_q, contiguous in calls if with_q]
    kv_calls = [contiguous for with_q, contiguous in calls if not with_q]
    assert len(qkv_calls) == 2 * layers - 1 and len(kv_calls) == 1  # last layer's prefill wants no q
    # merged: every q, k and v read in place from the GEMM's output, but the last layer's prefill K/V
    # (`Attention.project_kv`: k's and v's own linears, on views of the merged weights)
    assert qkv_calls.count(False) == merged * len(qkv_calls) and kv_calls == [True]
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
    kv_rel = max(rel(a, b) for kv, kv_want in zip(got[1], want[1], strict=True) for a, b in zip(kv, kv_want))
    assert rel(got[0], want[0]) < 1e-2 and kv_rel < 1e-2


COMPILE_FOR_GPUS = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime.kernels import chains as tn
from pipeline.runtime.kernels.jit import chains as k

out = []
for cc in (90, 100, 89, 120):
    for d in (256, 512):
        for dt in ("bf16", "fp16"):
            sig = {**{p: f"*{dt}" for p in ("x_ptr", "w_ptr", "cos_ptr", "sin_ptr", "out_ptr", "v_ptr", "v_out_ptr")},
                   "rows": "i32", "heads": "i32", "x_stride": "i32", "v_stride": "i32", "eps": "fp32",
                   "seq": "i32", "out_sb": "i32", "out_sl": "i32", "out_sh": "i32",
                   **{p: f"*{dt}" for p in ("q_ptr", "q_w_ptr", "q_out_ptr")}, "q_rows": "i32", "q_heads": "i32",
                   "q_stride": "i32", "q_out_sb": "i32", "q_out_sl": "i32", "q_out_sh": "i32"}
            consts = {"HALF": d // 2, "HALF_P2": d // 2, "BLOCK_R": tn.HEAD_NORMS_VALUES // d}
            src = ASTSource(fn=k.head_norms, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                            attrs={(k.head_norms.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr")})
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=tn.OPTIONS)
            cubin = Path(sys.argv[1]) / f"head_norms_{d}_{dt}_sm{cc}.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            out.append({"cc": cc, "d": d, "dtype": dt, "cubin": str(cubin), "ptx": kernel.asm["ptx"]})
json.dump(out, sys.stdout)
"""


def test_the_kernel_compiles_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton lowers the head-norms kernel for both head dims and dtypes to sm_90a, sm_100a, sm_89 and sm_120
    cubins, no GPU needed: every product and sum rounded on its own (no fused multiply-add, which would round
    once where torch rounds twice) and no register spills (no STL/LDL in the SASS)."""
    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    assert len(compiled) == 16
    for k in compiled:
        assert not separate_roundings_missing(k["ptx"]), (k["cc"], k["d"], k["dtype"])
        assert not spills(k["cubin"]), (k["cc"], k["d"], k["dtype"])


@pytest.mark.parametrize(("dtype", "probed", "merged"), [
    (torch.bfloat16, True, True), (torch.bfloat16, False, False), (torch.float32, True, False),
])  # fmt: skip
def test_a_gpu_load_merges_q_k_and_v_only_where_the_head_norms_kernel_reads_them(dtype, probed, merged):
    """`gpu_load.finish_on_device` makes q, k and v one GEMM where the head-norms kernel passed its probe and
    takes the model's dtype (bf16, fp16); elsewhere torch's norms would copy the merged output's columns."""
    from pipeline.model.checkpoint import load_model
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import gpu_load

    model = load_model(EMBEDDED_MODEL, dtype)[0].eval()
    results = {**dict.fromkeys(gpu_load.TORCH_FORMS), probing.HEAD_NORMS: None if probed else "failed"}
    gpu_load.finish_on_device(model, torch.device("cuda"), probing.Probe("sm90", results), None)
    attn = model.layers[0].self_attn
    assert (attn.qkv_kernel is not None and attn.qkv_kernel.merged is not None) == merged
