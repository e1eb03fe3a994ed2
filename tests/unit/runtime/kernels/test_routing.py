"""dgpipe's routing kernels (`pipeline.runtime.kernels.routing`) in Triton's interpreter: the router's top-k
against its torch form (`network.route_scores`) within fp32 rounding, with the lower expert first among
equal probabilities; the experts' order against torch's stable sort (`scaled_layout.expert_order`) bit for
bit; their load-time probes; a model's logits with both installed; and both compiled for Hopper, B200, Ada
and RTX Blackwell without a GPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.network import route_scores
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime.probe.routing import same_order, same_top_k, separated_scores
from tests._utils.embedded_passes import denoise_and_prefill, embedded_bf16
from tests._utils.interpreter_casts import interpreted, interpreted_exp, rne_casts  # noqa: F401  (fixtures)
from tests._utils.triton_compile import compiled_for_gpus, spills

CPU = torch.device("cpu")


def scales(experts: int, seed: int = 0) -> torch.Tensor:
    return (torch.rand(experts, generator=torch.Generator().manual_seed(seed)) + 0.5).to(torch.bfloat16)


@interpreted
@pytest.mark.parametrize(
    ("dtype", "tokens", "experts", "k"),
    [
        (torch.bfloat16, 37, 128, 8),  # the 26B's routing, tokens that do not fill the last program
        (torch.float32, 19, 128, 8),
        (torch.float16, 5, 100, 8),  # no power of two
        (torch.bfloat16, 3, 4, 2),  # the embedded model's
        (torch.float32, 2, 1, 1),
        (torch.float32, 5, 1024, 32),  # the widest routing it takes: two tokens a program
    ],
)
def test_the_top_k_is_torchs_within_fp32_rounding(interpreted_exp, dtype, tokens, experts, k):  # noqa: F811
    """Scores no rounding can reorder (`probe.separated_scores`): the same experts in the same places and
    each weight within a few fp32 roundings (`probe.same_top_k`)."""
    g = torch.Generator().manual_seed(experts)
    scores, scale = separated_scores(tokens, experts, g).to(dtype), scales(experts)
    assert kernels.routing.top_k_serves(scores, k, scale)
    got = kernels.routing.top_k(scores, k, scale)
    want = route_scores(scores, k, scale)[1:]
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int64
    assert same_top_k(got, want)


@interpreted
@pytest.mark.parametrize("experts", [128, 100])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_with_a_nan_or_infinite_score_still_gets_k_distinct_experts_below_e(
    interpreted_exp,  # noqa: F811
    experts,
    bad,
):
    """One bad score makes every probability of its row NaN, as torch's softmax does; the kernel's choice
    ranks NaN first (as `torch.topk` does), so that row still routes to K distinct experts that exist (the
    expert order and the combine index by them), its weights NaN as torch's are; the other rows are
    untouched."""
    g = torch.Generator().manual_seed(experts)
    scores, scale = separated_scores(6, experts, g), scales(experts)
    scores[2, 17] = bad
    weights, index = kernels.routing.top_k(scores, 8, scale)
    want_w, want_i = route_scores(scores, 8, scale)[1:]
    assert index[2].tolist() == list(range(8)) and weights[2].isnan().all() and want_w[2].isnan().all()
    others = [0, 1, 3, 4, 5]
    assert same_top_k((weights[others], index[others]), (want_w[others], want_i[others]))


@interpreted
def test_random_bf16_scores_choose_torchs_experts_with_ties_to_the_lower_one(interpreted_exp):  # noqa: F811
    """bf16 scores of the 26B's width tie often: 11 of these 37 tokens have two equal probabilities among
    their top 8, and 2 a tie at the 8th place. The kernel orders the k by probability, the lower expert first
    among equal ones (a stable descending sort), so at the k-th place it keeps the lower expert, as torch's
    CUDA top-k does (its selection takes the lower index there; within the k, torch's CPU and CUDA sorts order
    ties their own way). Each expert gets torch's weight within a few fp32 roundings."""
    g = torch.Generator().manual_seed(5)
    scores, scale = torch.randn(37, 128, generator=g).to(torch.bfloat16), scales(128)
    (gw, gi), (ww, wi) = kernels.routing.top_k(scores, 8, scale), route_scores(scores, 8, scale)[1:]
    probs = torch.softmax(scores.float(), dim=-1)
    assert torch.equal(gi, probs.sort(dim=-1, descending=True, stable=True).indices[:, :8])
    kth, next_ = probs.sort(dim=-1, descending=True).values[:, 7:9].unbind(1)
    inside = [len(set(scores[t, gi[t]].tolist())) < 8 for t in range(37)]
    assert sum(inside) == 11 and int((kth == next_).sum()) == 2
    for t in (kth != next_).nonzero().flatten().tolist():  # the same experts, each with its weight
        mine, theirs = dict(zip(gi[t].tolist(), gw[t].tolist())), dict(zip(wi[t].tolist(), ww[t].tolist()))
        assert mine.keys() == theirs.keys()
        assert all(abs(mine[e] - theirs[e]) <= 2.0**-18 * abs(theirs[e]) for e in mine)

    equal = torch.zeros(2, 16, dtype=torch.bfloat16)
    equal[0, [3, 9, 12]] = 1.0  # three equal leaders, two places: the two lower experts
    weights, index = kernels.routing.top_k(equal, 2, torch.ones(16, dtype=torch.bfloat16))
    assert index.tolist() == [[3, 9], [0, 1]] and torch.equal(weights, torch.full((2, 2), 0.5))


def test_other_scores_keep_the_torch_form(monkeypatch):
    scores, scale = torch.randn(3, 16), scales(16)
    assert not kernels.routing.top_k_serves(scores.t(), 2, scales(3))  # not contiguous
    assert not kernels.routing.top_k_serves(scores[None], 2, scale)  # not [tokens, experts]
    assert not kernels.routing.top_k_serves(scores, 17, scale)  # more choices than experts
    assert not kernels.routing.top_k_serves(scores.double(), 2, scale)
    assert not kernels.routing.top_k_serves(torch.randn(2, 2048), 8, scales(2048))  # wider than a program
    monkeypatch.setattr(kernels.routing, "top_k", lambda *a: pytest.fail("the kernel ran"))
    got = kernels.routing.top_k_or_torch(scores.double(), 2, scale)
    want = route_scores(scores.double(), 2, scale)[1:]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@interpreted
@pytest.mark.parametrize(
    ("tokens", "k", "experts"),
    [
        (300, 8, 128),  # 2,400 slots: two steps of the rank sweep
        (700, 8, 128),  # 5,600: two of the count sweep, three of the rank sweep
        (1, 8, 128),  # most experts chosen by none
        (9, 2, 4),
        (5, 1, 1),
        (0, 8, 16),  # no tokens: every offset 0
    ],
)
def test_the_expert_order_is_torchs_stable_sort_bit_for_bit(tokens, k, experts):
    index = torch.randint(0, experts, (tokens, k), generator=torch.Generator().manual_seed(tokens))
    assert kernels.routing.expert_order_serves(index, experts)
    got, want = kernels.routing.expert_order(index, experts), sl.expert_order(index, experts)
    assert [t.dtype for t in got] == [torch.int64, torch.int64, torch.int32, torch.int64]
    assert same_order(got, want)  # the order's inverse included, which the kernel writes too


def test_other_routings_keep_torchs_sort(monkeypatch):
    index = torch.randint(0, 8, (6, 2))
    assert not kernels.routing.expert_order_serves(index.int(), 8)
    assert not kernels.routing.expert_order_serves(index.t(), 8)  # not contiguous
    assert not kernels.routing.expert_order_serves(index.reshape(-1), 8)
    assert not kernels.routing.expert_order_serves(
        torch.zeros(kernels.routing.ORDER_MAX_SLOTS + 1, 1).long(), 8
    )
    monkeypatch.setattr(kernels.routing, "expert_order", lambda *a: pytest.fail("the kernel ran"))
    got = kernels.routing.expert_order_or_torch(index.int(), 8)
    assert got.rows is None and same_order(got, sl.expert_order(index.int(), 8))


@interpreted
def test_the_routing_probes_pass_the_kernels_and_fail_wrong_ones(interpreted_exp, monkeypatch):  # noqa: F811
    probing.check_triton_top_k(CPU)
    probing.check_triton_expert_order(CPU)
    top_k, order = kernels.routing.top_k, kernels.routing.expert_order
    wrong = {
        "top_k": lambda s, k, scale: top_k(s, k, torch.ones_like(scale)),  # the experts' scales left out
        "expert_order": lambda i, e: order(i, e)._replace(offs=order(i, e).offs.roll(1)),
        "rows": lambda i, e: order(i, e)._replace(rows=order(i, e).rows.roll(1)),  # the inverse
    }
    checks = (
        ("top_k", "top-k differs"),
        ("expert_order", "expert order differs"),
        ("rows", "expert order differs"),
    )
    for name, message in checks:
        with monkeypatch.context() as mp:
            mp.setattr(kernels.routing, "expert_order" if name == "rows" else name, wrong[name])
            with pytest.raises(DgpipeError, match=message):
                probing.NETWORK_CHECKS["expert_order" if name == "rows" else name](CPU)
    with monkeypatch.context() as mp:  # the renormalisation left out: the probabilities themselves
        mp.setattr(kernels.routing, "top_k", lambda s, k, scale: (
            (lambda w, i: (w * route_scores(s, k, scale)[0].gather(1, i).sum(1, keepdim=True), i))(*top_k(s, k, scale))
        ))  # fmt: skip
        with pytest.raises(DgpipeError, match="top-k differs"):
            probing.check_triton_top_k(CPU)


def cuda_tie_top_k(scores: torch.Tensor, k: int, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`network.route_scores`' weights and experts with ties taken as torch's CUDA top-k takes them at the
    k-th place, the lower expert (torch's CPU top-k takes another: the embedded model's router ties there)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, index = probs.sort(dim=-1, descending=True, stable=True)
    weights, index = weights[:, :k], index[:, :k]
    return weights / weights.sum(dim=-1, keepdim=True) * scale[index], index


@interpreted
def test_a_model_with_the_routing_kernels_keeps_its_logits(interpreted_exp, monkeypatch):  # noqa: F811
    """The embedded model in bf16 with every layer's top-k and expert order on the kernels (as
    `gpu_load.fuse_network` installs them): both ran in every layer, and the logits stay within 1e-4
    relative L2 of the torch forms' with CUDA's choice among tied experts (`cuda_tie_top_k`; a weight an
    fp32 rounding off, rounded to bf16 in the combine). Tied experts are common here: bf16 scores of 4
    experts."""
    from pipeline.runtime import gpu_load

    model = embedded_bf16()
    passes = denoise_and_prefill(model)
    run = lambda: passes()[0].float()
    torch_choice = run()
    for layer in model.layers:
        layer.router.top_k_kernel = cuda_tie_top_k
    want = run()
    assert ((want - torch_choice).norm() / want.norm()).item() > 1e-2  # ties decided: another expert
    calls = []
    for name in ("top_k", "expert_order"):
        kernel = getattr(kernels.routing, name)
        monkeypatch.setattr(kernels.routing, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    probed = probing.Probe("sm90", {probing.TOP_K: None, probing.EXPERT_ORDER: None})
    gpu_load.fuse_network(model, probed, None)
    assert all(layer.router.top_k_kernel and layer.experts.order_kernel for layer in model.layers)
    got = run()
    assert (
        calls.count("top_k") == calls.count("expert_order") == 2 * len(model.layers) - 1
    )  # prefill: no last FFN
    assert ((got - want).norm() / want.norm()).item() < 1e-4


COMPILE_FOR_GPUS = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime.kernels import routing as tr
from pipeline.runtime.kernels.jit import routing as k

out = []

def build(fn, sig, consts, cc, name, options=tr.OPTIONS):
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr")})
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    cubin = Path(sys.argv[1]) / f"{name}_sm{cc}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    out.append({"cc": cc, "name": name, "cubin": str(cubin), "ptx": kernel.asm["ptx"]})

for cc in (90, 100, 89, 120):
    for dt in ("bf16", "fp32"):
        for e, top in ((128, 8), (tr.TOP_K_MAX_EXPERTS, tr.TOP_K_MAX_K))[: 2 if cc == 90 else 1]:
            build(k.top_k, {"scores_ptr": f"*{dt}", "scale_ptr": "*bf16", "w_ptr": "*fp32", "i_ptr": "*i64", "tokens": "i32"},
                  {"E": e, "K": top, "E_P2": e, "K_P2": top, "BLOCK_T": tr.TOP_K_VALUES // e}, cc, f"top_k_{dt}_{e}")
    build(k.expert_order, {"index_ptr": "*i64", "order_ptr": "*i64", "token_ptr": "*i64", "offs_ptr": "*i32", "rows_ptr": "*i64",
                              "tokens": "i32"},
          {"K": 8, "COUNT": tr.ORDER_COUNT, "CHUNK": tr.ORDER_CHUNK}, cc, "expert_order", tr.ORDER_OPTIONS)
json.dump(out, sys.stdout)
"""


def test_the_kernels_compile_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton lowers the top-k kernel (bf16 and fp32 scores, the 26B's routing, and on sm_90a the widest it takes; libdevice's expf linked in, not `ex2.approx`
    alone; IEEE divisions, `div.rn.f32`) and the expert-order kernel to sm_90a, sm_100a, sm_89 and sm_120
    cubins, no GPU needed, with no register spills (no STL/LDL in the SASS)."""
    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    assert len(compiled) == 14
    for k in compiled:
        if k["name"].startswith("top_k"):
            assert "div.rn.f32" in k["ptx"] and "div.full.f32" not in k["ptx"], k["cc"]
            assert "__nv_expf" not in k["ptx"]  # linked and inlined, not left a call
            # libdevice's expf: its range reduction (an fma rounding down, then a saturating cvt) before ex2;
            # `tl.exp` would be `ex2.approx` alone
            assert "fma.rm.ftz.f32" in k["ptx"] and "cvt.ftz.sat.f32.f32" in k["ptx"], k["cc"]
        assert not spills(k["cubin"]), (k["cc"], k["name"])
