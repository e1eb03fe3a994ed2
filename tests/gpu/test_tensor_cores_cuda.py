"""Tensor-core linears and experts on a GPU against the dequantized, fake-quantized float reference, and the
quantized runtime under CUDA graphs equal to eager (run by `dgpipe bench gpu`; skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import InputQuantizer, fp8_fake_quant, nvfp4_fake_quant
from pipeline.model.modelopt import _quantized_experts_forward
from pipeline.model.network import RMSNorm
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime import tensor_cores as tc
from pipeline.runtime.dispatch import ARCHS, EVERY_PASS, TRITON_MAX_ROWS_PER_EXPERT, arch_of, dispatch
from pipeline.runtime.probe.common import fp8_codes_equal, same_bits, same_layer_end
from pipeline.runtime.probe.norms import (
    ffn_probe_layer,
    same_ffn_inputs,
    same_fp8_of_norm,
    same_layer_end_of,
    same_operands,
    same_rotation,
)
from pipeline.runtime.probe.quant import QUANT_PROBE_VALUES
from pipeline.runtime.probe.routing import same_order, same_top_k
from tests._utils.quantized import build_quantized_checkpoint, packed_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]
CUDA = torch.device("cuda")
FEW = TRITON_MAX_ROWS_PER_EXPERT  # Hopper's threshold


@pytest.fixture(scope="module")
def probed() -> probing.Probe:
    return probing.probe(CUDA)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_probe_serves_what_the_dispatch_table_promises(probed):
    """Every vendor kernel the table names for this GPU runs, or, for experts whose row names a second
    quantized path (sm100's NVFP4: Thor, a torch without its grouped FP4 kernels), that path does (a failure
    here means the row is wrong)."""
    if probed.arch is None:
        pytest.skip("no dispatch row for this GPU")
    for fmt in ("fp8", "nvfp4"):
        r = dispatch(fmt, probed.arch)
        experts = "experts" if r.torch_experts else "triton"  # Ada, RTX Blackwell: the Triton GEMM only
        for kind, kernel, mode in (
            ("linear", r.linears, r.linear_mode),
            (experts, r.experts, r.experts_mode),
        ):
            second = r.experts_fallback_mode if kind == experts else None
            if mode:
                ok = probed.ok(f"{kind}:{mode}") or (second is not None and probed.ok(f"triton:{second}"))
                assert ok, (fmt, kernel, probed.results)


@pytest.mark.parametrize("mode", ["fp8", "nvfp4", "fp8_rowwise"])
def test_scaled_linear_equals_reference(probed, mode):
    if not probed.ok(f"linear:{mode}"):
        pytest.skip(f"{mode} linear not served here: {probed.results.get(f'linear:{mode}')}")
    gen = torch.Generator().manual_seed(0)
    q = packed_linear("fp8" if mode == "fp8" else "nvfp4", 256, 512, gen)
    x = torch.randn(37, 512, generator=gen)
    got = tc.ScaledLinear(q, mode, CUDA, torch.float32)(x.to(CUDA)).cpu()
    if mode == "fp8":
        want = F.linear(fp8_fake_quant(x, q.input_scale), q.dequantized())
    elif mode == "nvfp4":
        want = F.linear(nvfp4_fake_quant(x, q.input_scale), q.dequantized())
    else:
        a = nvfp4_fake_quant(x, q.input_scale)
        wq, ws = tc.sl.fp8_rowwise_weight(q.dequantized())
        want = F.linear(fp8_fake_quant(a, a.abs().amax(-1, keepdim=True) / 448), wq.float() * ws[:, None])
    # FP8 accumulates with the tensor cores' fast accumulation (~14 bits of the running sum on Hopper):
    # 4e-4 to 8e-4 at K = 512 in the model of tests/_utils/accumulation.py (14 / 13 bits); a layout error
    # is O(1)
    assert _rel(got, want) < (5e-3 if mode != "nvfp4" else 1e-3)


@pytest.mark.parametrize("mode", ["fp8", "nvfp4", "fp8_rowwise"])
def test_sibling_linears_on_one_quantization_and_one_gemm_equal_the_linears_alone(probed, mode):
    """q/k/v-style siblings (a weight scale each) share one quantization: each output bit for bit the
    linear's own; FP8 ones are also one RowWise GEMM where it passed its probe (the column scales carry the
    per-tensor ones: within the GEMMs' summation orders). Gate/up-style siblings with one weight scale also run as one GEMM, split into views: the
    same operands, so within the GEMM's summation order (the 26B's 2,112 rows: NVFP4 scales swizzled anew)."""
    from pipeline.runtime import shared_input as si

    if not probed.ok(f"linear:{mode}"):
        pytest.skip(f"{mode} linear not served here: {probed.results.get(f'linear:{mode}')}")
    gen = torch.Generator().manual_seed(3)
    fmt = "fp8" if mode == "fp8" else "nvfp4"
    x = torch.randn(2, 256, 2816, generator=gen).to(CUDA, torch.bfloat16)
    build = lambda n: tc.ScaledLinear(packed_linear(fmt, n, 2816, gen), mode, CUDA, torch.bfloat16, True)
    qkv = [build(4096), build(2048), build(2048)]
    alone = [p(x) for p in qkv]
    for a, b in zip(alone, si.SharedInput(qkv, None)(x), strict=True):
        assert torch.equal(a, b)
    if mode == "fp8" and probed.ok(probing.FP8_COLUMNS):  # a weight scale each: one RowWise GEMM
        assert si.concatenates(qkv, fp8_columns=True) and not si.concatenates(qkv)
        for a, b, p in zip(alone, si.SharedInput(qkv, si.concatenate(qkv))(x), qkv, strict=True):
            assert _rel(b, a) < 5e-3 and torch.equal(p(x), a)  # bf16 outputs; each part alone, on its view
    gate, up = build(2112), build(2112)
    if mode == "fp8":  # one weight scale, as ModelOpt gives gate and up
        up.weight_scale, up.static_scales = gate.weight_scale.clone(), gate.static_scales
    elif mode == "nvfp4":  # one global scale, likewise
        up.weight_scale_2, up.static_scales = gate.weight_scale_2.clone(), gate.static_scales
    alone = [gate(x), up(x)]
    assert si.concatenates([gate, up])
    together = si.SharedInput([gate, up], si.concatenate([gate, up]))(x)
    for a, b, p in zip(alone, together, (gate, up), strict=True):
        assert _rel(b, a) < 5e-3 and torch.equal(p(x), a)  # bf16 outputs; each part alone, on its view


def test_fast_accumulation_costs_less_than_the_fp8_rounding_at_the_26b_depth(probed):
    """The FP8 linear's fast accumulation and promoted fp32 accumulation against an fp32 product of the same
    operands at the 26B's K (2,816): the error fast accumulation adds stays an order of magnitude under the
    FP8 activations' own rounding (~3%)."""
    if not probed.ok("linear:fp8"):
        pytest.skip(f"fp8 linear not served here: {probed.results.get('linear:fp8')}")
    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(256, 2816, generator=gen) * 16).to(torch.float8_e4m3fn).to(CUDA)
    w = (torch.randn(1024, 2816, generator=gen) * 16).to(torch.float8_e4m3fn).to(CUDA)
    one = torch.tensor(1.0, device=CUDA)
    tensorwise = F.ScalingType.TensorWise
    out = {
        fast: F.scaled_mm(a, w.t(), one, tensorwise, one, tensorwise, output_dtype=torch.float32, use_fast_accum=fast)
        for fast in (True, False)
    }  # fmt: skip
    exact = a.float() @ w.float().t()
    # tests/_utils/accumulation.py's model (14 / 13 bits): 1e-4 to 2e-4 promoting every 128 values, 2.2e-3
    # to 4.4e-3 without
    assert _rel(out[False], exact) < 1e-3
    assert _rel(out[True], exact) < 1e-2


@pytest.mark.parametrize(
    ("mode", "rows"),
    [("fp8", 0), ("nvfp4", 0), ("fp8_rowwise", 0), ("fp8", FEW), ("fp8_rowwise", FEW), ("fp8", EVERY_PASS), ("fp8_rowwise", EVERY_PASS)],
)  # fmt: skip
def test_scaled_experts_equal_fake_quant_experts(probed, mode, rows):
    """Routed tokens (uneven, some experts empty) through the grouped GEMM (torch's; at few rows per expert
    the Triton one, Hopper's threshold; or the Triton one at 100 rows per expert, as Ada and RTX Blackwell
    run every pass) vs the fake-quant expert loop on the dequantized weights (fp8_rowwise: vs the NVFP4
    reference, within the re-quantization's error)."""
    if not rows and not probed.ok(f"experts:{mode}"):
        pytest.skip(f"{mode} experts not served here: {probed.results.get(f'experts:{mode}')}")
    if rows and not probed.ok(f"triton:{mode}"):
        pytest.skip(f"the Triton GEMM is not served here: {probed.results.get(f'triton:{mode}')}")
    gen = torch.Generator().manual_seed(1)
    fmt = "fp8" if mode == "fp8" else "nvfp4"
    e, d, inner, t = 8, 256, 128, 100 if rows == FEW else 300  # 33 or 100 rows per expert
    gate, up, down = (
        [packed_linear(fmt, n, k, gen) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    m = tc.ScaledExperts(gate, up, down, mode, CUDA, triton_rows=rows)
    assert tc.kernels.moe.serves(2 * t, e, rows) == (rows > 0)
    x = torch.randn(t, d, generator=gen)
    index = torch.randint(0, e - 2, (t, 2), generator=gen)  # the last two experts get no token
    weights = torch.rand(t, 2, generator=gen)
    got = m(x.to(CUDA), index.to(CUDA), weights.to(CUDA)).cpu()
    ref = torch.nn.Module()
    ref.num_experts = e
    ref.gate_up_proj = torch.stack([torch.cat([g.dequantized(), u.dequantized()]) for g, u in zip(gate, up)])
    ref.down_proj = torch.stack([p.dequantized() for p in down])
    quants = {
        "gate_up": InputQuantizer(fmt, m.in_scale.cpu()),
        "down": InputQuantizer(fmt, m.down_in_scale.cpu()),
    }
    want = _quantized_experts_forward(quants)(ref, x, index, weights)
    if mode == "fp8_rowwise":
        # the fallback's arithmetic: weights re-quantized to E4M3 per row, inputs NVFP4-rounded then E4M3 per row
        exact = want
        requant = lambda w: (lambda q, s: q.float() * s[..., None])(*tc.sl.fp8_rowwise_weight(w))
        ref.gate_up_proj, ref.down_proj = requant(ref.gate_up_proj), requant(ref.down_proj)
        rows = lambda s: (
            lambda a: (lambda b: fp8_fake_quant(b, b.abs().amax(-1, keepdim=True) / 448))(
                nvfp4_fake_quant(a, s)
            )
        )
        want = _quantized_experts_forward(
            {"gate_up": rows(m.in_scale.cpu()), "down": rows(m.down_in_scale.cpu())}
        )(ref, x, index, weights)
        # what re-quantizing costs against the NVFP4 experts: 0.118 on an H200 and in a CPU run of this module
        # (grouped GEMM as per-expert F.scaled_mm, bf16 out)
        assert _rel(got, exact) < 0.15
    # the grouped kernels write bf16 (gate/up before the down projection's re-quantization, and the outputs):
    # bf16 rounding, and the FP8/NVFP4 rounding it flips, against an fp32 reference. fp8_rowwise rounds the
    # down input to NVFP4's 4 bits first, where a flip moves a value by up to a third: 0.029 in that CPU run
    assert _rel(got, want) < (2e-2 if mode != "fp8_rowwise" else 5e-2)


def test_triton_moe_gemm_is_the_float_product_of_its_operands(probed):
    """The Triton FP8 MoE GEMM compiled for this GPU: uneven experts, an empty one, rows gathered in the
    kernel; within one bf16 unit of the float product at a small K (its fast accumulation adds ~1e-4
    there: tests/_utils/accumulation.py), and within 1e-2 relative L2 at the 26B's K (2e-3 to 4e-3)."""
    from pipeline.runtime import kernels

    if not probed.ok("triton:fp8"):
        pytest.skip(f"the Triton GEMM is not served here: {probed.results.get('triton:fp8')}")
    gen = torch.Generator().manual_seed(3)
    for k, e, n, t in ((160, 6, 96, 37), (2816, 16, 1408, 256)):
        w = (torch.randn(e, n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
        a = (torch.randn(t, k, generator=gen) * 8).to(torch.float8_e4m3fn)
        w_scale, a_scale = torch.rand(e, n, generator=gen) + 0.5, torch.rand(t, generator=gen) + 0.5
        index = torch.randint(0, e - 1, (t, 2), generator=gen)
        _, rows, offs, _ = sl.expert_order(index, e)
        got = kernels.moe.moe_gemm(*(v.to(CUDA) for v in (a, a_scale, rows, w, w_scale, offs))).float().cpu()
        want, start = torch.empty_like(got), 0
        for i, end in enumerate(offs.tolist()):
            r = rows[start:end]
            want[start:end] = (a[r].float() @ w[i].float().t()) * a_scale[r, None] * w_scale[i][None]
            start = end
        if k == 160:
            assert bool(((got - want).abs() <= want.abs() * 2**-8 + want.abs().max() * 1e-4).all())
        else:
            assert _rel(got, want) < 1e-2


def test_the_tuners_tiles_compute_the_float_product_too(probed):
    """Tiles `dgpipe bench moe-tiles` tries beyond the defaults (wider N, deeper K, 8 warps, other stages, N
    blocks launched first), compiled for this GPU at the 26B's expert shapes: the float product of their
    operands, token rows gathered in (gate|up) and rows written back in slot order (down)."""
    from pipeline.bench.gpu import tiles
    from pipeline.runtime.kernels.moe_tiles import Tile

    if not probed.ok("triton:fp8"):
        pytest.skip(f"the Triton GEMM is not served here: {probed.results.get('triton:fp8')}")
    props = torch.cuda.get_device_properties(CUDA)
    shared = getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)
    candidates = [
        Tile(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, n_fastest=True),
        Tile(block_m=32, block_n=64, block_k=256, num_warps=4, num_stages=5),
        Tile(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=2),
        Tile(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, n_fastest=True),
    ]
    problems = tiles.problems(tiles.gemm_shapes(2816, 704), (1,), canvas=128, experts=16, top_k=8, operand="fp8",
                              dev=CUDA)  # fmt: skip
    for p in problems:
        want = tiles.reference(p)
        for tile in (t for t in candidates if t.shared_bytes(1) <= shared):
            assert _rel(kernels.moe.launch(tile, *p.args), want) < tiles.SAME_OUTPUT, (p.shape, tile.short())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_quantization_is_torchs_bit_for_bit(probed, dtype):
    """The one-pass FP8 quantization against torch's three passes: every code equal (NaN's sign aside) on
    random activations over 16 binades and the probe's edge values; and a linear using it computes
    exactly what the torch-quantized one does."""

    if not probed.ok("triton:fp8"):
        pytest.skip(f"dgpipe's Triton kernels are not served here: {probed.results.get('triton:fp8')}")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, 512, generator=gen) * torch.logspace(-8, 8, 512, base=2.0)
    x = torch.cat([x.flatten(), torch.tensor(QUANT_PROBE_VALUES)]).to(CUDA, dtype)
    for scale in (torch.tensor(0.5), torch.tensor(3.7e-3), torch.tensor(8.0 / 448)):
        s = scale.to(CUDA)
        assert fp8_codes_equal(kernels.quant.fp8(x, s), sl.fp8_quantize(x, s)), float(scale)
    q, xs = packed_linear("fp8", 256, 512, gen), torch.randn(37, 512, generator=gen).to(CUDA, torch.bfloat16)
    plain, one_pass = (tc.ScaledLinear(q, "fp8", CUDA, torch.bfloat16, triton=t)(xs) for t in (False, True))
    assert torch.equal(plain, one_pass)


@pytest.mark.parametrize("mode", ["nvfp4", "fp8_rowwise"])
def test_triton_nvfp4_quantization_is_torchs_bit_for_bit(mode, probed):
    """The one-pass NVFP4 kernels against torch's forms on this GPU: the probe's rows, then random rows over
    sixteen decades at the 26B's input widths, and a linear using them computes what the torch-quantized one
    does. Run whatever the dispatch row of this GPU is: the kernels need no FP4 tensor cores."""
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_quant(mode, CUDA)
    gen = torch.Generator().manual_seed(6)
    for k in (704, 2112, 2816, 8192):
        x = (torch.randn(64, k, generator=gen) * torch.logspace(-8, 8, 64)[:, None]).to(CUDA, torch.bfloat16)
        gs = torch.tensor(0.003, device=CUDA)
        (q, s), (want_q, want_s) = (tc.quantize_rows(x, gs, mode, triton=t) for t in (True, False))
        if mode == "nvfp4":
            assert torch.equal(q, want_q) and fp8_codes_equal(s, want_s), k
            q, s = kernels.quant.nvfp4_blocked(x, gs)  # a linear's operand: its scales swizzled
            assert torch.equal(q, want_q) and fp8_codes_equal(s, sl.to_blocked(want_s.view(torch.uint8)))
        else:
            assert fp8_codes_equal(q, want_q) and torch.equal(s, want_s), k
    q, xs = (
        packed_linear("nvfp4", 256, 512, gen),
        torch.randn(37, 512, generator=gen).to(CUDA, torch.bfloat16),
    )
    linear_modes = ["fp8_rowwise"] + (["nvfp4"] if mode == "nvfp4" and probed.ok("linear:nvfp4") else [])
    for linear_mode in linear_modes:  # the NVFP4 linear itself where this GPU serves it (B200, RTX Blackwell)
        plain, one_pass = (
            tc.ScaledLinear(q, linear_mode, CUDA, torch.bfloat16, triton=t)(xs) for t in (False, True)
        )
        assert torch.equal(plain, one_pass), linear_mode


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_checkpoint_on_tensor_cores_graph_equals_eager(tmp_path, fmt):
    """The embedded model quantized to `fmt`, loaded on CUDA: every layer's experts on tensor cores as the
    table says, or all of them routed in float on the device where the load's probe failed that kernel (the
    load reports why); graph-safe, and CUDA-graph tokens identical to eager."""
    from pipeline.runtime.backends import TorchBackend
    from pipeline.runtime.session import load_session
    from pipeline.sampler.kernels.build import load_torch_extension, missing_build_tools
    from tests._utils.generation import FIXED, generate, requests

    missing = missing_build_tools()
    if missing is not None:
        pytest.skip(str(missing))
    arch = arch_of(*torch.cuda.get_device_capability())
    if arch is None:
        pytest.skip(f"{torch.cuda.get_device_name()} has no dispatch row (dgpipe's: {', '.join(ARCHS)})")
    load_torch_extension()
    path = build_quantized_checkpoint(tmp_path / fmt, fmt)
    session = load_session(path, dtype="bfloat16", device="cuda")
    model, report = session.model, session.tensor_cores
    on_tensor_cores = [isinstance(layer.experts, tc.ScaledExperts) for layer in model.layers]
    assert dispatch(fmt, arch).experts_mode  # every quantized row names a kernel
    assert all(on_tensor_cores) or (not any(on_tensor_cores) and report.fallbacks), report.summary()
    backend = TorchBackend(model)
    if not backend.graph_safe:  # only a failed probe leaves experts that read the routing on the host
        assert report.fallbacks, report.summary()
        pytest.skip(f"{fmt} experts read the routing on the host here: {report.summary()}")
    _, eager = generate(backend, requests(FIXED), graphs=False, sync_every=4)
    _, graphed = generate(backend, requests(FIXED), graphs=True, sync_every=4)
    for a, b in zip(eager, graphed, strict=True):
        assert (a.tokens, a.steps_per_canvas) == (b.tokens, b.steps_per_canvas)


def test_the_loads_warm_up_passes_run_on_an_fp8_checkpoint_and_change_no_token(tmp_path):
    """`BlockDiffusionRuntime.warm_kernels` on the embedded model's FP8 checkpoint: one K/V pass per GEMM path
    of its experts (`warm.warm_token_counts`), after which it generates the tokens of a runtime not warmed."""
    from pipeline.runtime.scheduler import BlockDiffusionRuntime
    from pipeline.runtime.session import load_session
    from pipeline.runtime.warm import warm_token_counts
    from pipeline.sampler.kernels.build import load_torch_extension, missing_build_tools
    from tests._utils.generation import FIXED, requests

    missing = missing_build_tools()
    if missing is not None:
        pytest.skip(str(missing))
    load_torch_extension()
    session = load_session(
        build_quantized_checkpoint(tmp_path / "fp8", "fp8"), dtype="bfloat16", device="cuda"
    )
    cold, warm = (BlockDiffusionRuntime(session.model, max_batch=3, max_len=128) for _ in range(2))
    before = cold.generate(requests(FIXED))  # the model's first passes: before any warm-up
    tokens = warm.warm_kernels()
    assert tokens == warm_token_counts(session.model, 3 * max(warm.canvas_length, warm.prefill_chunk))
    assert tokens or session.tensor_cores.fallbacks, session.tensor_cores.summary()
    for a, b in zip(before, warm.generate(requests(FIXED)), strict=True):
        assert (a.tokens, a.steps_per_canvas) == (b.tokens, b.steps_per_canvas)


@pytest.mark.parametrize("triton", [False, True])
def test_routed_float_experts_equal_the_fp32_experts_and_replay_in_a_cuda_graph(triton):
    """`pipeline.runtime.routed` on this GPU (the bf16 Triton GEMM runs on any GPU with Triton, though only
    Ada and RTX Blackwell load it): one layer of the embedded model's experts against the same experts in
    fp32, and a CUDA-graph replay equal to the eager call (the routing never leaves the device)."""
    from pipeline.model.checkpoint import load_model
    from pipeline.model.network import grouped_mm_reads_host
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import kernels, routed

    if triton and kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    if not triton and grouped_mm_reads_host(CUDA, torch.bfloat16):
        pytest.skip("torch's grouped GEMM has no kernel on this GPU")
    exact = load_model(EMBEDDED_MODEL)[0].layers[0].experts.to(CUDA)  # fp32 on CUDA: the dense form
    experts = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].layers[0].experts.to(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    x = torch.randn(512, experts.gate_up_proj.shape[-1], device=CUDA, generator=gen)
    index = torch.randint(0, experts.num_experts, (512, 2), device=CUDA, generator=gen)
    weights = torch.rand(512, 2, device=CUDA, generator=gen)
    m = routed.RoutedExperts(experts, triton)
    with torch.inference_mode():
        eager = m(x.bfloat16(), index, weights)
        assert _rel(eager, exact(x, index, weights)) < 1e-2  # bf16 operands and outputs
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m(x.bfloat16(), index, weights)  # warm-up (Triton compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out = m(x.bfloat16(), index, weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_triton_float_probe_passes_on_this_gpu(dtype):
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_float(CUDA, dtype)


def test_the_chain_kernels_are_torchs_forms_and_a_model_keeps_its_logits():
    """RoPE, the logit softcap, the MoE combine, the gated GeLU, the residual sum, the K/V concatenation and
    the router's input on this GPU: the probe's checks, RoPE and the K/V concatenation bit for bit at the
    26B's shapes at 16 canvases, and a bf16 model loaded as the runtime loads it
    (`gpu_load.finish_on_device` installs every network kernel) against the torch forms' logits: within bf16
    rounding with every kernel but the router's top-k (the combine's fp32 sums in another order than cuBLAS's
    batched product, the head norms', FFN inputs' and layer end's sums of squares in another order), bit for
    bit with those off (RoPE, the K/V concatenation, the residual sums, the router inputs and the experts'
    order), within the softcap's fp32 rounding with it too; a CUDA graph replays the eager pass of every
    kernel exactly; and that pass is within bf16 rounding too. The top-k is last: its weights are a few fp32
    roundings off, and where it took another expert at a tie than torch's top-k (which takes the lower
    index on CUDA, as the kernel does: the routing test; not on the CPU, where this check, run under
    Triton's interpreter, gives 2.2e-2) a token's output changes outright."""
    from pipeline.bench.model import _graphed
    from pipeline.model.checkpoint import load_model
    from pipeline.model.network import apply_rope
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime import gpu_load, kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_rope(CUDA)
    probing.check_triton_softcap(CUDA)
    probing.check_triton_combine(CUDA)
    probing.check_triton_geglu(CUDA)
    probing.check_triton_residual(CUDA)
    probing.check_triton_kv_cat(CUDA)
    probing.check_triton_router(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(7)
    for heads, d in ((8, 256), (2, 512)):  # the cache's first 256 tokens of 16 rows, the canvas's 256
        cache = torch.randn(2, 16, heads, 600, d, device=CUDA, generator=gen).bfloat16()
        new = torch.randn(2, 16, 256, heads, d, device=CUDA, generator=gen).bfloat16().transpose(2, 3)
        pk, pv = cache[0, :, :, :256], cache[1, :, :, :256]
        got = kernels.chains.kv_cat(pk, pv, new[0], new[1])
        assert torch.equal(got[0], torch.cat([pk, new[0]], 2)) and torch.equal(
            got[1], torch.cat([pv, new[1]], 2)
        )
    for heads, d in ((16, 256), (8, 256), (16, 512), (2, 512)):
        x = torch.randn(16, 256, heads, d, device=CUDA, generator=gen).to(torch.bfloat16)
        angles = torch.rand(16, 256, d // 2, device=CUDA, generator=gen) * 1e4
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
        assert torch.equal(kernels.chains.rope(x, cos, sin), apply_rope(x, cos, sin)), (heads, d)
    model = load_model(EMBEDDED_MODEL, torch.bfloat16, CUDA)[0].eval()
    length = model.config.canvas_length
    canvas = torch.randint(0, model.cfg.vocab_size, (2, length), device=CUDA, generator=gen)
    positions = torch.arange(length, device=CUDA).expand(2, length) + 5
    masks = dict.fromkeys(set(model.layer_types))
    step = lambda: model.denoise(canvas, None, positions, masks, None)

    def kernel_slots() -> tuple[list, list]:
        """Where the installed kernels that compute torch's form within a rounding sit, and the router's
        top-k (after the load: it puts the experts on the device in modules of their own)."""
        rounding = [(model, "softcap_kernel"), (model.self_conditioning, "geglu_kernel")]
        for layer in model.layers:
            rounding += [(layer.experts, "combine_kernel"), (layer.experts, "geglu_kernel"), (layer.mlp, "geglu_kernel"),
                         (layer.self_attn, "head_norms_kernel"), (layer, "end_kernel"), (layer, "ffn_inputs_kernel")]  # fmt: skip
        return rounding, [(layer.router, "top_k_kernel") for layer in model.layers]

    def exact_slots() -> list:
        """Where the installed kernels that compute torch's form bit for bit sit."""
        return [slot for layer in model.layers for slot in ((layer.self_attn, "rope_kernel"), (layer.self_attn, "kv_cat_kernel"), (layer, "residual_kernel"), (layer.router, "scale_kernel"), (layer.experts, "order_kernel"))]  # fmt: skip

    def without(slots: list) -> None:
        for owner, name in slots:
            setattr(owner, name, None)

    with torch.inference_mode():
        want = step()
        gpu_load.finish_on_device(model, CUDA, None, None)
        assert all(layer.self_attn.rope_kernel is kernels.chains.rope_or_torch for layer in model.layers)
        assert model.softcap_kernel is kernels.chains.softcap
        assert all(layer.experts.combine_kernel is kernels.chains.combine for layer in model.layers)
        assert all(layer.mlp.geglu_kernel is kernels.chains.geglu_or_torch for layer in model.layers)
        assert all(layer.residual_kernel is kernels.chains.add_scaled_or_torch for layer in model.layers)
        assert all(layer.self_attn.kv_cat_kernel is kernels.chains.kv_cat_or_torch for layer in model.layers)
        assert all(
            layer.router.scale_kernel is kernels.chains.scale_columns_or_torch for layer in model.layers
        )
        assert all(
            layer.self_attn.head_norms_kernel is kernels.chains.head_norms_or_torch for layer in model.layers
        )
        assert all(layer.end_kernel is kernels.chains.layer_end_or_torch for layer in model.layers)
        assert all(layer.ffn_inputs_kernel is kernels.chains.ffn_inputs_or_torch for layer in model.layers)
        assert all(layer.router.top_k_kernel is kernels.routing.top_k_or_torch for layer in model.layers)
        rounding, routing = kernel_slots()
        exact = exact_slots()
        installed = {slot: getattr(*slot) for slot in rounding + routing + exact}
        got = step()
        without(routing)
        assert float((step() - want).norm() / want.norm()) < 1e-2
        without(rounding)
        exact_only = step()
        without(exact)
        # every kernel's torch form, on the GEMMs the load merged (q|k|v, gate|up): the oracle for the exact
        # kernels, as cuBLAS promises no equal bits between a merged GEMM and its parts (`want`)
        torch_forms = step()
        assert torch.equal(exact_only, torch_forms)  # RoPE, K/V, residual sums, router inputs, expert order
        for owner, name in exact:
            setattr(owner, name, installed[owner, name])
        model.softcap_kernel = kernels.chains.softcap
        torch.testing.assert_close(step(), torch_forms, rtol=1e-6, atol=0.0)
        for (owner, name), kernel in installed.items():
            setattr(owner, name, kernel)
        outs = []  # the warm-up's and then the captured pass's logits (the graph's own output buffer)
        replay = _graphed(lambda: outs.append(step()), CUDA)
        replay()
        assert torch.equal(outs[-1], got)
        assert float((got - want).norm() / want.norm()) < 1e-2


def test_the_gated_gelu_kernel_is_torchs_cuda_gelu_bit_for_bit():
    """The gated GeLU at the 26B's shapes at 16 canvases (the experts' 32,768 slots, 704 wide, as the gate|up
    halves of one GEMM output; the dense MLP's 4,096 tokens, 2,112 wide): bit for bit torch's `F.gelu` then
    the product, since its tanh is libdevice's, the one torch's CUDA kernel calls; its FP8 codes those of
    that product. (The probe allows another tanh's rounding; this holds the kernel to the claim.)"""
    from pipeline.model.network import gelu_tanh
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    gen = torch.Generator(device=CUDA).manual_seed(8)
    scale = torch.tensor(0.02, device=CUDA)
    for rows, cols in ((32768, 704), (4096, 2112)):
        gu = (torch.randn(rows, 2 * cols, device=CUDA, generator=gen) * 3).bfloat16()
        gate, up = gu.chunk(2, dim=-1)
        want = gelu_tanh(gate) * up
        got = kernels.chains.geglu(gate, up)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), int((got != want).sum())
        codes = kernels.chains.geglu(gate, up, scale)
        assert fp8_codes_equal(codes, sl.fp8_quantize(want, scale))


def test_the_layer_end_kernel_is_torchs_but_for_its_norms_sums():
    """A decoder layer's end at the 26B's width and 16 canvases (4,096 rows of 2,816): within
    `probe.same_layer_end_of` torch's form on torch's fused CUDA RMSNorm, and bit for bit but for under 1% of
    the values (the sums of squares are added in another order)."""
    from pipeline.model.network import RMSNorm, layer_end
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    gen = torch.Generator(device=CUDA).manual_seed(9)
    residual, dense, moe = (torch.randn(3, 4096, 2816, device=CUDA, generator=gen) * 2).bfloat16().unbind()
    norms = tuple(RMSNorm(2816, 1e-6).to(CUDA, torch.bfloat16) for _ in range(3))
    for n in norms:
        n.weight.data = (torch.rand(2816, device=CUDA, generator=gen) * 2).bfloat16()
    scale = torch.tensor([0.7], device=CUDA, dtype=torch.bfloat16)
    got = kernels.chains.layer_end(residual, dense, moe, norms, scale)
    want = layer_end(residual, dense, moe, norms, scale)
    assert same_layer_end_of(got, residual, dense, moe, norms, scale)
    assert float((got != want).float().mean()) < 0.01


def test_the_ffn_inputs_kernel_is_torchs_but_for_its_norms_sums():
    """A decoder layer's FFN inputs at the 26B's width and 16 canvases: the residual and the three norms'
    outputs within `probe.same_ffn_inputs` of torch's form on torch's fused CUDA RMSNorm, bit for bit but for
    under 1% of the values; the MLP's and experts' inputs as FP8, NVFP4 and per-row FP8 operands bit for bit
    what the quantizations make of the rows."""
    from pipeline.model.network import ffn_inputs
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    layer = ffn_probe_layer(2816, CUDA, torch.bfloat16, torch.Generator().manual_seed(10))
    gen = torch.Generator(device=CUDA).manual_seed(10)
    h, attn = (torch.randn(2, 16, 256, 2816, device=CUDA, generator=gen) * 2).bfloat16().unbind()
    got, want = kernels.chains.ffn_inputs(layer, h, attn), ffn_inputs(layer, h, attn)
    assert same_ffn_inputs(got, layer, h, attn)
    for a, b in zip(got, want, strict=True):
        assert float((a != b).float().mean()) < 0.01
    # the MLP's and the experts' inputs as FP8, NVFP4 and per-row FP8 operands: what the torch forms of the
    # one-pass quantizations make of the rows (4,096 rows: the MLP's NVFP4 scales swizzled)
    for kind in ("fp8", "nvfp4", "fp8_rowwise"):
        assert same_operands(layer, h, attn, got, kind), kind
    fp8 = kernels.chains.ffn_inputs(layer, h, attn, ("fp8", torch.tensor(0.01, device=CUDA)), None)
    assert fp8_codes_equal(fp8[1].operand, kernels.quant.fp8(got[1], fp8[1].scales[0]))


def test_the_routing_kernels_choose_torchs_experts_and_order_them_as_its_sort():
    """The 26B's routing at 16 canvases (4,096 tokens, top 8 of 128 experts, bf16 scores): the top-k kernel
    picks the experts torch's CUDA top-k picks, ties at the k-th place included (both take the lower expert),
    with each weight within a few fp32 roundings (`probe.same_top_k` once both are put in expert order: the
    order of tied experts within the k is torch's sort's own); the expert order is torch's stable sort bit for
    bit (32,768 slots: torch's radix sort)."""
    from pipeline.model.network import route_scores
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_top_k(CUDA)
    probing.check_triton_expert_order(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(11)
    scores = torch.randn(4096, 128, device=CUDA, generator=gen).bfloat16()
    scale = (torch.rand(128, device=CUDA, generator=gen) + 0.5).bfloat16()
    got, want = kernels.routing.top_k(scores, 8, scale), route_scores(scores, 8, scale)[1:]
    by_expert = lambda w, i: (w.gather(1, i.argsort(1)), i.sort(1).values)
    assert same_top_k(by_expert(*got), by_expert(*want))
    index = got[1]
    order = kernels.routing.expert_order(index, 128)
    assert same_order(order, sl.expert_order(index, 128))


@pytest.mark.parametrize(
    ("kv_heads", "head_dim", "masked"), [(2, 512, False), (2, 512, True), (8, 256, True)]
)
def test_packed_queries_take_the_memory_efficient_kernel_and_compute_the_expanded_attention(
    kv_heads, head_dim, masked
):
    """The 26B's global attention (16 query heads on 2 K/V heads of 512), and its sliding attention (on 8 K/V
    heads of 256) where rows of different lengths give it a mask, at 16 canvases over 256 cached tokens: the
    network's packed form runs on torch's memory-efficient kernel (forced: no math fallback) and equals the
    same kernel on K/V expanded to every query head, within bf16 rounding of O(1) outputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pipeline.model.network import attend, packs_queries

    groups = 16 // kv_heads
    gen = torch.Generator(device=CUDA).manual_seed(11)
    q = torch.randn(16, 256, 16, head_dim, device=CUDA, generator=gen).bfloat16().transpose(1, 2)
    k, v = (torch.randn(16, kv_heads, 512, head_dim, device=CUDA, generator=gen).bfloat16() for _ in range(2))
    mask = None
    if masked:  # rows of different cached lengths, as a mixed batch has them
        lengths = torch.arange(16, device=CUDA) * 16
        keys = torch.arange(512, device=CUDA)
        mask = ((keys[None] < lengths[:, None]) | (keys[None] >= 256))[:, None, None, :].expand(
            16, 1, 256, 512
        )
    assert packs_queries(CUDA, head_dim, groups, masked)
    with torch.inference_mode(), sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = attend(q, k, v, mask)
        want = F.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=1.0
        )
    assert got.shape == want.shape and got.transpose(1, 2).is_contiguous()
    assert float((got.float() - want.float()).abs().max()) <= 2**-6


@pytest.mark.parametrize("masked", [False, True])
def test_the_sliding_attention_of_a_pass_runs_flash_or_the_memory_efficient_kernel_never_cudnns(masked):
    """The 26B's sliding attention (16 query heads on 8 K/V heads of 256) at 16 canvases over 256 cached
    tokens, as a pass runs it (`network.attention_kernels`): rows of one length on flash's grouped kernel,
    rows of several lengths (a mask) packed onto the memory-efficient kernel; no cuDNN attention, whose
    host plan per new shape a server would pay (torch prefers it on sm90 and sm100)."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline.model.network import attend, attention_kernels

    gen = torch.Generator(device=CUDA).manual_seed(13)
    # q and k at 256^-1/4 of unit size: scores of unit size (scale 1), so bf16 stays near the fp32 reference
    q = (torch.randn(16, 256, 16, 256, device=CUDA, generator=gen) / 4).bfloat16().transpose(1, 2)
    k = (torch.randn(16, 8, 512, 256, device=CUDA, generator=gen) / 4).bfloat16()
    v = torch.randn(16, 8, 512, 256, device=CUDA, generator=gen).bfloat16()
    mask = None
    if masked:
        keys = torch.arange(512, device=CUDA)
        visible = keys[None] < 512 - torch.arange(16, device=CUDA)[:, None]
        mask = visible[:, None, None, :].expand(16, 1, 256, 512)
    with torch.inference_mode(), attention_kernels(CUDA), profile(activities=[ProfilerActivity.CPU]) as prof:
        got = attend(q, k, v, mask)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_cudnn_attention" not in ops, ops
    want = "efficient" if masked else "flash"
    assert f"aten::_scaled_dot_product_{want}_attention" in ops, ops
    assert torch.backends.cuda.cudnn_sdp_enabled()  # on again after the pass
    ref = F.scaled_dot_product_attention(
        q.float(),
        k.float().repeat_interleave(2, 1),
        v.float().repeat_interleave(2, 1),
        attn_mask=mask,
        scale=1.0,
    )
    assert float((got.float() - ref).abs().max()) <= 2**-6


def test_the_head_norms_kernel_is_torchs_but_for_its_norms_sums():
    """Attention's head norms at the 26B's shapes and 16 canvases (q: 16 heads of 256; a global layer's k and
    v: 2 heads of 512): within `probe.same_rotation` of torch's fused CUDA norm and RoPE (v within
    `same_layer_end`), and bit for bit but for under 1% of the values; heads read in place from a merged
    q|k|v projection's columns bit for bit as from a contiguous tensor; q, k and v in one launch bit for bit
    as in their own, k and v also written into a cache's room and q head-major."""
    from pipeline.model.network import RMSNorm, apply_rope
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_head_norms(CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(12)
    for h, d, with_v in ((16, 256, False), (2, 512, True)):
        x, v = (torch.randn(2, 16, 256, h, d, device=CUDA, generator=gen) * 2).bfloat16().unbind()
        norm, v_norm = RMSNorm(d, 1e-6).to(CUDA, torch.bfloat16), RMSNorm(d, 1e-6, with_scale=False)
        norm.weight.data = (torch.rand(d, device=CUDA, generator=gen) * 2).bfloat16()
        angles = torch.rand(16, 256, d // 2, device=CUDA, generator=gen) * 1e4
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
        got, got_v, _ = kernels.chains.head_norms(
            x, norm, cos, sin, v if with_v else None, v_norm if with_v else None
        )
        normed = norm(x)
        want = apply_rope(normed, cos, sin)
        assert same_rotation(got, want, normed, cos, sin)
        assert float((got != want).float().mean()) < 0.01
        if with_v:
            one = torch.ones(1, device=CUDA, dtype=torch.bfloat16)
            assert same_layer_end(got_v, v_norm(v), torch.zeros_like(v), one)
            assert float((got_v != v_norm(v)).float().mean()) < 0.01
        # the same heads as columns of one merged q|k|v output (tokens h + 2 heads apart), read in place
        merged = torch.cat([x, x[:, :, :1], v[:, :, :1]], dim=2).view(16, 256, -1)
        q = merged[..., : h * d].view(16, 256, h, d)
        got_strided = kernels.chains.head_norms(q, norm, cos, sin)[0]
        assert not q.is_contiguous() and same_bits(
            got_strided, kernels.chains.head_norms(x, norm, cos, sin)[0]
        )
    # a layer's q (16 heads of 256) beside its k and v (8 each) in one launch: each its own launch's values
    x, k, v = (torch.randn(16, 256, n, 256, device=CUDA, generator=gen).bfloat16() for n in (16, 8, 8))
    norms = [RMSNorm(256, 1e-6).to(CUDA, torch.bfloat16) for _ in range(2)]
    for n in norms:
        n.weight.data = (torch.rand(256, device=CUDA, generator=gen) * 2).bfloat16()
    v_norm = RMSNorm(256, 1e-6, with_scale=False)
    angles = torch.rand(16, 256, 128, device=CUDA, generator=gen) * 1e4
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    assert kernels.chains.head_norms_serves(k, norms[1], cos, sin, v, v_norm)
    together = kernels.chains.head_norms(k, norms[1], cos, sin, v, v_norm, x, norms[0])
    apart = (*kernels.chains.head_norms(k, norms[1], cos, sin, v, v_norm)[:2],
             kernels.chains.head_norms(x, norms[0], cos, sin)[0])  # fmt: skip
    assert all(same_bits(a, b) for a, b in zip(together, apart, strict=True))
    # k and v into a cache's room (rows 16-31 of 48, after 1,023 cached tokens of a ring with room for
    # 256), q head-major: each the values of its own launch, the rest of the buffers untouched
    cache = torch.full((2, 48, 8, 1023 + 256, 256), 3.0, device=CUDA, dtype=torch.bfloat16)
    room = cache[0, 16:32, :, 1023:], cache[1, 16:32, :, 1023:]
    roomed = kernels.chains.head_norms(
        k, norms[1], cos, sin, v, v_norm, x, norms[0], q_head_major=True, out=room
    )
    assert roomed[0] is room[0] and roomed[1] is room[1]
    assert same_bits(room[0], apart[0].transpose(1, 2)) and same_bits(room[1], apart[1].transpose(1, 2))
    assert roomed[2].is_contiguous() and same_bits(roomed[2].transpose(1, 2), apart[2])
    cache[:, 16:32, :, 1023:] = 3.0
    assert bool((cache == 3.0).all())


def _rows_and_norm(seed: int) -> tuple[torch.Tensor, RMSNorm]:
    """A layer's input at 16 canvases (4,096 rows of 2,816, bf16) and an input norm with random weights."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = (torch.randn(4096, 2816, device=CUDA, generator=gen) * 2).bfloat16()
    norm = RMSNorm(2816, 1e-6).to(CUDA, torch.bfloat16)
    norm.weight.data = (torch.rand(2816, device=CUDA, generator=gen) * 2).bfloat16()
    return x, norm


def test_the_norm_to_fp8_kernel_is_torchs_but_for_its_norms_sums():
    """A layer's input norm written as its FP8 q|k|v operand at the 26B's width and 16 canvases: within one
    E4M3 step of torch's fused CUDA RMSNorm then the FP8 quantization (`probe.same_fp8_of_norm`), the same
    codes but for under 1% of them."""
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_norm_fp8(CUDA)
    x, norm = _rows_and_norm(seed=13)
    scale = torch.tensor(0.01, device=CUDA)
    got, want = kernels.chains.norm_fp8(x, norm, scale), sl.fp8_quantize(norm(x), scale)
    assert same_fp8_of_norm(got, want)
    assert float((got.float() != want.float()).float().mean()) < 0.01


def test_the_norm_to_nvfp4_kernel_quantizes_what_it_normed_as_torch_would():
    """A layer's input norm written as its NVFP4 q|k|v operand at the 26B's width and 16 canvases: the rows it
    normed within a norm's rounding of torch's fused CUDA RMSNorm, its codes and swizzled block scales bit
    for bit what `kernels.quant.nvfp4_blocked` makes of them, and the same codes as the norm then that
    quantization but for under 1% of them."""
    from pipeline.runtime import kernels

    if kernels.moe.unavailable(CUDA):
        pytest.skip(kernels.moe.unavailable(CUDA))
    probing.check_triton_norm_nvfp4(CUDA)
    x, norm = _rows_and_norm(seed=14)
    gs, normed = torch.tensor(0.003, device=CUDA), torch.empty_like(x)
    q, s = kernels.chains.norm_nvfp4(x, norm, gs, normed)
    one = torch.ones(1, device=CUDA, dtype=torch.bfloat16)
    assert same_layer_end(normed, norm(x), torch.zeros_like(x), one)
    want_q, want_s = kernels.quant.nvfp4_blocked(normed, gs)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    torch_q = kernels.quant.nvfp4_blocked(norm(x), gs)[0]
    assert float((q != torch_q).float().mean()) < 0.01
