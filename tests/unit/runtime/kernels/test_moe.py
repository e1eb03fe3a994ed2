"""The Triton FP8 MoE GEMM (`pipeline.runtime.kernels.moe`) in Triton's interpreter on the CPU: against the
float product of its FP8 operands, inside `ScaledExperts` against the fake-quantized expert loop, and under
torch.compile as one opaque op (on a GPU, compiled by Triton: tests/gpu/test_tensor_cores_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import InputQuantizer
from pipeline.model.modelopt import _quantized_experts_forward
from pipeline.runtime import probe as probing
from pipeline.runtime import tensor_cores as tc
from pipeline.runtime.dispatch import EVERY_PASS, TRITON_MAX_ROWS_PER_EXPERT
from pipeline.runtime.kernels import moe as tf
from pipeline.runtime.kernels import quant as tq
from pipeline.runtime.probe.gemm import float_experts
from tests._utils.compile import compiled_whole, graph_targets
from tests._utils.interpreter_casts import interpreted
from tests._utils.quantized import grouped_scaled_mm_on_cpu, packed_linear
from tests._utils.triton_compile import compiled_for_gpus

CPU = torch.device("cpu")
# one unit in the last place, relative: the interpreter truncates its bf16 casts, GPUs round
BF16_ULP, FP16_ULP = 2**-7, 2**-10


pytestmark = interpreted


def _fp8(*shape, gen):
    return (torch.randn(*shape, generator=gen) * 8).to(torch.float8_e4m3fn)


def _reference(a, a_scale, rows, w, w_scale, offs) -> torch.Tensor:
    """The float product, expert by expert: slot i = a[rows[i]] @ w[e].T * a_scale[rows[i]] * w_scale[e]."""
    rows = torch.arange(a.shape[0]) if rows is None else rows
    out, start = torch.empty(rows.shape[0], w.shape[1]), 0
    for e, end in enumerate(offs.tolist()):
        r = rows[start:end]
        out[start:end] = (a[r].float() @ w[e].float().t()) * a_scale[r, None] * w_scale[e][None]
        start = end
    return out


@pytest.mark.parametrize(("tokens", "top_k"), [(37, 2), (300, 2), (700, 4)])  # 12, 100, 467 rows per expert
def test_the_kernel_is_the_float_product_of_its_fp8_operands(tokens, top_k):
    """Uneven experts and an empty one, K and N not multiples of the tiles, every M tile size; the token
    rows gathered in the kernel or given in slot order, per-row or one broadcast activation scale."""
    gen = torch.Generator().manual_seed(tokens)
    e, n, k = 6, 96, 160
    w, w_scale = _fp8(e, n, k, gen=gen), torch.rand(e, n, generator=gen) + 0.5
    a, a_scale = _fp8(tokens, k, gen=gen), torch.rand(tokens, generator=gen) + 0.5
    index = torch.randint(0, e - 1, (tokens, top_k), generator=gen)  # the last expert gets no slot
    _, token_of, offs, _ = sl.expert_order(index, e)
    for args in ((a, a_scale, token_of), (a[token_of], a_scale[token_of], None),
                 (a[token_of], torch.tensor(0.7).expand(token_of.shape[0]), None)):  # fmt: skip
        got = tf.moe_gemm(*args, w, w_scale, offs)
        want = _reference(*args, w, w_scale, offs)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert bool(((got.float() - want).abs() <= want.abs() * BF16_ULP + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "top_k"), [(37, 2), (700, 4)])  # 12 and 467 rows per expert
def test_the_kernel_is_the_float_product_of_its_float_operands(tokens, top_k, dtype):
    """bf16 operands without scales (float experts on Ada and RTX Blackwell), or fp16 ones (a model loaded
    in fp16, on every GPU), the result in their dtype: uneven experts and an empty one, K and N not multiples
    of the tiles, rows gathered in the kernel or in slot order; mixing the forms' arguments is refused."""
    gen = torch.Generator().manual_seed(tokens)
    e, n, k = 6, 96, 160
    w, a = torch.randn(e, n, k, generator=gen).to(dtype), torch.randn(tokens, k, generator=gen).to(dtype)
    index = torch.randint(0, e - 1, (tokens, top_k), generator=gen)
    _, token_of, offs, _ = sl.expert_order(index, e)
    ones = lambda m: torch.ones(m)
    ulp = BF16_ULP if dtype == torch.bfloat16 else FP16_ULP
    for args in ((a, token_of), (a[token_of], None)):
        got = tf.moe_gemm(args[0], None, args[1], w, None, offs)
        rows = args[0].shape[0]
        want = _reference(args[0], ones(rows), args[1], w, torch.ones(e, n), offs)
        assert got.dtype == dtype and got.shape == want.shape
        assert bool(((got.float() - want).abs() <= want.abs() * ulp + 1e-4).all())
    with pytest.raises(ValueError, match="FP8 operands take both scales"):
        tf.moe_gemm(a, ones(tokens), token_of, w, None, offs)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="float operands are bf16 or fp16, both one dtype"):
        tf.moe_gemm(a, None, token_of, w.to(other), None, offs)


@pytest.mark.parametrize("scaled", [True, False])
def test_rows_written_in_slot_order_are_the_gathered_rows_bit_for_bit(scaled):
    """`out_rows=order` writes each sorted slot's row where the expert order's inverse gather would put it:
    the same bf16 values, no gather, at every M tile."""
    gen = torch.Generator().manual_seed(3)
    e, n, k, tokens, top_k = 6, 96, 160, 300, 2
    index = torch.randint(0, e - 1, (tokens, top_k), generator=gen)
    routing = sl.expert_order(index, e)
    order, token_of, offs = routing.order, routing.token_of, routing.offs
    a = _fp8(tokens, k, gen=gen) if scaled else torch.randn(tokens, k, generator=gen).bfloat16()
    w = _fp8(e, n, k, gen=gen) if scaled else torch.randn(e, n, k, generator=gen).bfloat16()
    scales = (
        (torch.rand(tokens, generator=gen) + 0.5, torch.rand(e, n, generator=gen) + 0.5)
        if scaled
        else (None, None)
    )
    for block_m in tf.BLOCK_MS:
        sorted_rows = tf.moe_gemm(a, scales[0], token_of, w, scales[1], offs, block_m)
        in_slot_order = tf.moe_gemm(a, scales[0], token_of, w, scales[1], offs, block_m, out_rows=order)
        assert torch.equal(in_slot_order, sorted_rows.index_select(0, sl.slot_rows(routing)))


def test_tiles_and_which_passes_take_the_kernel():
    assert tf.serves(2048, 128) and tf.serves(64 * 128, 128) and not tf.serves(64 * 128 + 1, 128)
    assert not tf.serves(4096 * 8, 128)  # 16 canvases: 256 rows per expert stay on torch's grouped GEMM
    assert tf.serves(4096 * 8, 128, EVERY_PASS) and tf.serves(10**9, 128, EVERY_PASS)  # sm89, sm120
    assert not tf.serves(1, 128, 0.0)  # Triton off
    assert [tf.default_tile(s, 128).block_m for s in (512, 2048, 8192, 32768)] == [16, 32, 64, 64]
    assert tuple(sorted({tf.default_tile(s, 128).block_m for s in range(1, 40000, 97)})) == tf.BLOCK_MS
    assert [t.block_m for t in tf.probe_tiles(CPU, 1)] == list(tf.BLOCK_MS)  # no table off CUDA


def test_it_says_where_it_cannot_run(monkeypatch):
    assert tf.unavailable(CPU) is None  # interpreted
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA" in tf.unavailable(CPU)


def _experts(
    mode: str, gen, e: int = 8, d: int = 128, inner: int = 64, rows: float = TRITON_MAX_ROWS_PER_EXPERT
):
    fmt = "fp8" if mode == "fp8" else "nvfp4"
    gate, up, down = (
        [packed_linear(fmt, n, k, gen) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    return tc.ScaledExperts(gate, up, down, mode, CPU, triton_rows=rows), gate, up, down


@pytest.mark.parametrize("mode", ["fp8", "fp8_rowwise"])
def test_experts_on_the_triton_gemm_route_like_torchs_path(monkeypatch, mode):
    """`ScaledExperts` with Hopper's Triton threshold at few rows per expert: the right rows through the right experts with
    the right scales (a routing or scale error is O(1)), against the fake-quantized expert loop (FP8) and
    torch's path (grouped GEMM stand-in, bf16 out). The interpreter truncates its bf16 casts where a GPU
    rounds to nearest, and the down projection re-quantizes those bf16 intermediates to FP8, so a biased
    rounding flips FP8 codes: over 12 seeds 0.022 median / 0.036 max from the fake-quant loop (torch's
    path: 0.015 / 0.018; tests/gpu holds both GPU paths to 2e-2) and up to 0.06 from torch's path for
    the NVFP4 re-quantization. Torch's grouped GEMM is not called."""
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    gen = torch.Generator().manual_seed(5)
    m, gate, up, down = _experts(mode, gen)
    x = torch.randn(50, 128, generator=gen)
    index = torch.randint(0, 7, (50, 2), generator=gen)  # the last expert gets no token
    weights = torch.rand(50, 2, generator=gen)
    got = m(x, index, weights)
    rel = lambda a, b: float((a - b).norm() / b.norm())
    if mode == "fp8":
        ref = torch.nn.Module()
        ref.num_experts = 8
        ref.gate_up_proj = torch.stack(
            [torch.cat([g.dequantized(), u.dequantized()]) for g, u in zip(gate, up)]
        )
        ref.down_proj = torch.stack([p.dequantized() for p in down])
        quants = {
            "gate_up": InputQuantizer("fp8", m.in_scale),
            "down": InputQuantizer("fp8", m.down_in_scale),
        }
        assert rel(got, _quantized_experts_forward(quants)(ref, x, index, weights)) < 0.08
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    assert rel(got, tc.ScaledExperts(gate, up, down, mode, CPU)(x, index, weights)) < 0.12


def test_many_rows_per_expert_stay_on_torchs_grouped_gemm(monkeypatch):
    calls = []
    stand_in = grouped_scaled_mm_on_cpu(torch.bfloat16)
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: calls.append(1) or stand_in(*a, **k))
    m, *_ = _experts("fp8", torch.Generator().manual_seed(6), e=2)
    x, index = torch.randn(80, 128), torch.randint(0, 2, (80, 2))  # 80 rows per expert
    m(x, index, torch.rand(80, 2))
    assert len(calls) == 2


def test_the_triton_gemm_compiles_as_one_opaque_op():
    m, *_ = _experts("fp8", torch.Generator().manual_seed(7))
    x, index, weights = torch.randn(20, 128), torch.randint(0, 8, (20, 2)), torch.rand(20, 2)
    compiled, graphs = compiled_whole(m)
    torch.testing.assert_close(compiled(x, index, weights), m(x, index, weights), rtol=0, atol=0)
    assert graph_targets(graphs[0]).count("dgpipe.moe_gemm.default") == 2


COMPILE_FOR_GPUS = """
import json, re, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime import kernels

def signature(operand, scale):
    return {"a_ptr": operand, "a_scale_ptr": scale, "rows_ptr": "*i64", "w_ptr": operand, "w_scale_ptr": scale,
            "offs_ptr": "*i32", "out_ptr": "*bf16" if operand != "*fp16" else "*fp16", "out_rows_ptr": "*i64", "N": "i32", "K": "i32", "num_experts": "i32", "stride_am": "i32",
            "stride_as": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_om": "i32"}
kernel_fn, out = kernels.moe._kernel(), []
# FP8 on Hopper (few rows per expert), FP8 and bf16 on Ada and RTX Blackwell (every pass), FP8 on B200 (every
# pass), fp16 everywhere (a model loaded in fp16; Hopper here); bf16 and fp16 take no scales (the offsets stand
# in for their pointers, unread)
for cc, operand in ((90, "fp8"), (89, "fp8"), (120, "fp8"), (89, "bf16"), (120, "bf16"), (100, "fp8"), (90, "fp16")):
  args = signature("*fp8e4nv", "*fp32") if operand == "fp8" else signature(f"*{operand}", "*i32")
  # what Triton's launcher specializes on the 26B's shapes: 16-byte aligned tensors, 16-divisible sizes and strides
  aligned = [*[a for a in args if a.endswith("_ptr")], "N", "K", "stride_am", "stride_we", "stride_wn", "stride_om"]
  for slots, gather in ((512, True), (2048, True), (8192, False)):
    cfg = kernels.moe.default_tile(slots, 128, 1 if operand == "fp8" else 2)
    # gate|up gathers its token rows; down (slot order in) writes its rows back in token-major slot order
    consts = {"GATHER": gather, "SCATTER": not gather, "SCALED": operand == "fp8", "DOT_F32": False, "E_POW2": 128, "N_FASTEST": cfg.n_fastest, "BLOCK_M": cfg.block_m,
              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    attrs = {(kernel_fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=kernel_fn, signature={**args, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx, cubin = kernel.asm["ptx"], Path(sys.argv[1]) / f"moe_sm{cc}_{operand}_{cfg.block_m}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    mma = {"fp8": r"mma\\.sync\\.aligned\\.m16n8k32\\.row\\.col\\.f32\\.e4m3\\.e4m3",
           "bf16": r"mma\\.sync\\.aligned\\.m16n8k16\\.row\\.col\\.f32\\.bf16\\.bf16",
           "fp16": r"(wgmma\\.mma_async\\S*\\.f32\\.f16\\.f16|mma\\.sync\\.aligned\\.m16n8k16\\.row\\.col\\.f32\\.f16\\.f16)"}[operand]
    out.append({"cc": cc, "operand": operand, "block_m": cfg.block_m, "cubin": str(cubin), "cp_async": "cp.async" in ptx,
                "wgmma_e4m3": "wgmma.mma_async" in ptx and "e4m3" in ptx, "shared": kernel.metadata.shared,
                "tcgen05_f8": "tcgen05.mma" in ptx and "kind::f8f6f4" in ptx,
                "mma": bool(re.search(mma, ptx))})
json.dump(out, sys.stdout)
"""


def test_the_kernel_compiles_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton (the installed version) lowers the GEMM to sm_90a, sm_100a, sm_89 and sm_120 cubins, given
    what its launcher specializes at run time on the 26B's shapes (aligned tensors, 16-divisible sizes): no
    GPU needed. The MoE GEMM at each M tile it picks keeps its loads software-pipelined through shared memory
    (cp.async) and fits the GPU's shared memory per block (H200, B200: 227 KB; Ada and RTX Blackwell: 99 KB);
    the 64-row tile runs Hopper's FP8 warpgroup MMA (wgmma e4m3) and B200's fifth-generation tensor-core MMA
    (tcgen05 kind::f8f6f4: the 16 canvases' 256 rows per expert), every tile on Ada and RTX Blackwell their
    FP8 `mma.sync` (e4m3), and with fp16 operands (a model loaded in fp16) Hopper's fp16 MMAs. No tile spills a register to the stack (ptxas's resource usage, read by
    cuobjdump); without the specializations the GEMM compiled to 255 registers and ~1.5 KB of stack per
    thread. (The activations' quantization kernels: tests/unit/runtime/kernels/test_quant.py.)"""
    import re
    import subprocess

    from pipeline.sampler.kernels.build import find_cuobjdump

    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    hopper = [k for k in compiled if k["cc"] == 90 and k["operand"] == "fp8"]
    assert [k["block_m"] for k in hopper] == list(tf.BLOCK_MS)
    assert all(k["cp_async"] and 0 < k["shared"] <= 227 * 1024 for k in hopper), hopper
    assert hopper[2]["wgmma_e4m3"], hopper
    # fp16 operands (a model loaded in fp16) on fp16 tensor-core MMAs, written as fp16
    fp16 = [k for k in compiled if k["operand"] == "fp16"]
    assert [k["block_m"] for k in fp16] == list(tf.BLOCK_MS)
    assert all(k["cp_async"] and k["mma"] and 0 < k["shared"] <= 227 * 1024 for k in fp16), fp16
    # Ada and RTX Blackwell: FP8 (e4m3) and bf16 tensor-core MMAs, and every M tile within the 99 KB of
    # shared memory a block may use there (72 KB at the 64-row tile, measured), or the launch fails
    b200 = [k for k in compiled if k["cc"] == 100]
    assert [k["block_m"] for k in b200] == list(tf.BLOCK_MS) and b200[2]["tcgen05_f8"], b200
    assert all(k["cp_async"] and 0 < k["shared"] <= 227 * 1024 for k in b200), b200
    others = [k for k in compiled if k["cc"] not in (90, 100)]  # fp16 is compiled for Hopper alone
    assert [(k["operand"], k["cc"], k["block_m"]) for k in others] == [
        (op, cc, m) for op in ("fp8", "bf16") for cc in (89, 120) for m in tf.BLOCK_MS
    ]
    assert all(k["cp_async"] and k["mma"] and 0 < k["shared"] <= 99 * 1024 for k in others), others
    tool = find_cuobjdump()
    assert tool, "cuobjdump: the nvidia-cuda-cuobjdump wheel is a test dependency"
    for k in compiled:
        usage = subprocess.run(
            [tool, "--dump-resource-usage", k["cubin"]], capture_output=True, text=True
        ).stdout
        regs, stack = (int(re.search(rf"{f}:(\d+)", usage).group(1)) for f in ("REG", "STACK"))
        assert regs <= 255 and stack == 0, (k, usage)


def test_the_probes_float_reference_is_the_fake_quantized_expert_loop():
    """`float_experts`, the reference the probe holds the Triton experts to, computes in fp32 what the CPU
    path's fake-quantized expert loop computes (same quantized operands, same products, other summation
    order), with uneven and empty experts."""
    gen = torch.Generator().manual_seed(9)
    m, gate, up, down = _experts("fp8", gen)
    x, index, weights = (
        torch.randn(60, 128, generator=gen),
        torch.randint(0, 7, (60, 2), generator=gen),
        torch.rand(60, 2),
    )
    ref = torch.nn.Module()
    ref.num_experts = 8
    ref.gate_up_proj = torch.stack([torch.cat([g.dequantized(), u.dequantized()]) for g, u in zip(gate, up)])
    ref.down_proj = torch.stack([p.dequantized() for p in down])
    quants = {"gate_up": InputQuantizer("fp8", m.in_scale), "down": InputQuantizer("fp8", m.down_in_scale)}
    want = _quantized_experts_forward(quants)(ref, x, index, weights)
    torch.testing.assert_close(float_experts(m, x, index, weights), want, rtol=1e-5, atol=1e-5)


def test_every_pass_rows_keep_many_rows_per_expert_on_the_triton_gemm(monkeypatch):
    """Ada and RTX Blackwell: 80 rows per expert (Hopper would hand them to torch) run on the Triton GEMM,
    never on torch's grouped GEMM, within the bound of the few-rows test from the float reference."""
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    gen = torch.Generator().manual_seed(6)
    m, *_ = _experts("fp8", gen, e=2, rows=EVERY_PASS)
    x, index, weights = (
        torch.randn(80, 128, generator=gen),
        torch.randint(0, 2, (80, 2), generator=gen),
        torch.rand(80, 2),
    )
    got, want = m(x, index, weights), float_experts(m, x, index, weights)
    assert float((got - want).norm() / want.norm()) < 0.08


def test_the_probe_uses_the_triton_kernels_only_where_they_agree_with_the_float_reference(monkeypatch):
    """The load-time probe's agreement check, run here with the interpreted GEMM (the interpreter cannot
    convert to E4M3, so the quantization under test is torch's own or a broken one). It needs no grouped
    GEMM kernel of torch's (Ada and RTX Blackwell have none): agreeing kernels pass; a GEMM wrong at one M
    tile, experts wrong only on the tile the module picks, or a quantization one code off fail with an
    error naming the kernel."""
    from pipeline.errors import DgpipeError

    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    monkeypatch.setattr(tq, "fp8", sl.fp8_quantize)
    for mode, fmt in (("fp8", "fp8"), ("fp8_rowwise", "nvfp4")):
        probing.check_triton_fp8(mode, fmt, CPU)
    one_off = lambda v, s: (sl.fp8_quantize(v, s).view(torch.uint8) ^ (torch.arange(v.numel()) == 3)).view(
        torch.float8_e4m3fn
    )
    probing.check_triton_quant("fp8", CPU)  # the one-pass quantization: a probe of its own
    monkeypatch.setattr(tq, "fp8", one_off)
    with pytest.raises(DgpipeError, match="Triton fp8 activation quantization differs"):
        probing.check_triton_quant("fp8", CPU)
    monkeypatch.setattr(tq, "fp8", sl.fp8_quantize)
    real_launch, real_gemm = tf.launch, tf.moe_gemm

    def wrong_at(tile):  # the GEMM with its rows reversed at one tile
        def launch(t, a, a_scale, rows, w, w_scale, offs, out_rows=None):
            rows = rows.flip(0) if t == tile and rows is not None else rows
            return real_launch(t, a, a_scale, rows, w, w_scale, offs, out_rows)

        return launch

    for tile in tf.probe_tiles(CPU, 1):  # a tile the probe's own pass would not pick is still checked
        monkeypatch.setattr(tf, "launch", wrong_at(tile))
        with pytest.raises(DgpipeError, match=rf"Triton MoE GEMM \({tile.short()} tiles\) differs"):
            probing.check_triton_fp8("fp8", "fp8", CPU)
    monkeypatch.setattr(tf, "launch", real_launch)

    def wrong_in_the_pass(a, a_scale, rows, w, w_scale, offs, block_m=None, out_rows=None):
        return real_gemm(
            a, a_scale, rows.flip(0) if rows is not None else rows, w, w_scale, offs, block_m, out_rows
        )

    monkeypatch.setattr(tf, "moe_gemm", wrong_in_the_pass)
    with pytest.raises(DgpipeError, match="experts on the Triton MoE GEMM differ from their float reference"):
        probing.check_triton_fp8("fp8", "fp8", CPU)
