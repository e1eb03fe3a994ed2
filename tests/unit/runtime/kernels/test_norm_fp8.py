"""dgpipe's norm-to-FP8 and norm-to-NVFP4 kernels (`pipeline.runtime.kernels.chains.norm_fp8`, `norm_nvfp4`: a
layer's input norm written as its quantized q|k|v operand in one pass) in Triton's interpreter, with
round-to-nearest-even casts (tests/_utils/interpreter_casts.py): against torch's fused RMSNorm then the
quantization, their probes, and compiled for Hopper, B200, Ada and RTX Blackwell without a GPU; and
`SharedInput` taking the un-normed rows."""

from __future__ import annotations

import pytest
import torch

from pipeline.model import scaled_layout as sl
from pipeline.model.network import RMSNorm
from pipeline.runtime import kernels
from pipeline.runtime import probe as probing
from pipeline.runtime import shared_input as si
from pipeline.runtime import tensor_cores as tc
from pipeline.runtime.probe.common import same_layer_end, spread
from pipeline.runtime.probe.norms import same_fp8_of_norm
from tests._utils.interpreter_casts import interpreted, rne_casts  # noqa: F401  (fixture)
from tests._utils.probes import each_wrong_form_fails
from tests._utils.quantized import packed_linear
from tests._utils.triton_compile import (
    compiled_for_gpus,
    converts_to_e4m3_once,
    separate_roundings_missing,
    spills,
)

CPU = torch.device("cpu")


def rows_and_norm(n: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, RMSNorm]:
    """Rows [n, d] over seven decades with a zero row and one with infinity and NaN, and a norm with random
    weights in [0, 2)."""
    g = torch.Generator().manual_seed(seed)
    x = (spread(n, d, g) / 64).to(dtype)
    x[0], x[1, :2] = 0.0, torch.tensor([float("inf"), float("nan")])
    norm = RMSNorm(d, 1e-6).to(dtype)
    norm.weight.data = (torch.rand(d, generator=g) * 2).to(dtype)
    return x, norm


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize("d", [2816, 100])
def test_the_norm_to_fp8_is_torchs_but_for_its_norms_sums(rne_casts, dtype, d):  # noqa: F811
    """The 26B's width and one that is no power of two: within one E4M3 step of torch's codes
    (`probe.same_fp8_of_norm`), and the same codes but for under 0.1% of them."""
    x, norm = rows_and_norm(9, d, dtype, seed=d)
    scale = torch.tensor(0.004)  # rows past 448 * 0.004 saturate
    assert kernels.chains.norm_fp8_serves(x, norm, scale)
    got, want = kernels.chains.norm_fp8(x, norm, scale), sl.fp8_quantize(norm(x), scale)
    assert got.dtype == torch.float8_e4m3fn and same_fp8_of_norm(got, want)
    g, w = got.float(), want.float()
    assert float(((g != w) & ~w.isnan()).float().mean()) < 1e-3
    assert (w.abs() == 448).any() and (w == 0).any()  # saturated and zero codes both checked


def test_other_rows_keep_the_torch_form(monkeypatch):
    x, norm = rows_and_norm(4, 64, torch.bfloat16, seed=0)
    scale = torch.tensor(0.01)
    assert not kernels.chains.norm_fp8_serves(x.float(), norm.float(), scale)
    assert not kernels.chains.norm_fp8_serves(x[:, :32], norm, scale)  # not contiguous, another width
    assert not kernels.chains.norm_fp8_serves(x, norm, scale.bfloat16())
    assert not kernels.chains.norm_fp8_serves(x, RMSNorm(64, 1e-6, with_scale=False), scale)
    strided = RMSNorm(64, 1e-6).bfloat16()  # the kernel reads the weight at each column's offset
    strided.weight.data = torch.stack([norm.weight.data] * 2, 1)[:, 0]
    assert not kernels.chains.norm_fp8_serves(x, strided, scale)
    monkeypatch.setattr(kernels.chains, "norm_fp8", lambda *a: pytest.fail("the kernel ran"))
    got = kernels.chains.norm_fp8_or_torch(x.float(), norm.float(), scale)
    assert torch.equal(
        got.view(torch.uint8), sl.fp8_quantize(norm.float()(x.float()), scale).view(torch.uint8)
    )


@interpreted
def test_the_norm_fp8_probe_passes_the_kernel_and_fails_wrong_ones(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_norm_fp8(CPU)
    kernel = kernels.chains.norm_fp8
    wrong = {
        "scale doubled": lambda x, n, s: kernel(x, n, s * 2),
        "not normed": lambda x, n, s: sl.fp8_quantize(x, s),
        "weights reversed": lambda x, n, s: kernel(x, _flipped(n), s),
    }
    check = lambda: probing.check_triton_norm_fp8(CPU)
    each_wrong_form_fails(monkeypatch, kernels.chains, "norm_fp8", wrong, check, "norm to FP8 differs")


@interpreted
@pytest.mark.parametrize("dtype", kernels.chains.DTYPES)
@pytest.mark.parametrize(("m", "d"), [(37, 2816), (130, 96), (2, 16)])
def test_the_norm_to_nvfp4_is_torchs_but_for_its_norms_sums(rne_casts, dtype, m, d):  # noqa: F811
    """The 26B's width, a narrow one over two 128-row tiles, two rows of one block: the codes and swizzled block scales
    (padding's zeros included) are bit for bit what `kernels.quant.nvfp4_blocked` makes of the rows the kernel
    normed, those within a norm's rounding of torch's (`probe.same_layer_end`), and the quantization of
    torch's norm differs in under 0.5% of the codes and 1% of the scales (a normed value one rounding
    away can move its block's maximum)."""
    x, norm = rows_and_norm(m, d, dtype, seed=d + m)
    gs = torch.tensor(0.003)
    assert kernels.chains.norm_nvfp4_serves(x, norm, gs)
    normed = torch.empty_like(x)
    q, s = kernels.chains.norm_nvfp4(x, norm, gs, normed)
    assert same_layer_end(normed, norm(x), torch.zeros_like(x), torch.ones(1, dtype=dtype))
    want_q, want_s = kernels.quant.nvfp4_blocked(normed, gs)
    assert torch.equal(q, want_q) and torch.equal(s, want_s)
    assert [
        torch.equal(a, b) for a, b in zip(kernels.chains.norm_nvfp4(x, norm, gs), (q, s), strict=True)
    ] == [True] * 2
    torch_q, torch_s = kernels.quant.nvfp4_blocked(norm(x), gs)
    assert float((q != torch_q).float().mean()) < 5e-3 and float((s != torch_s).float().mean()) < 1e-2


def test_other_rows_keep_the_torch_form_of_the_nvfp4_operand(monkeypatch):
    x, norm = rows_and_norm(4, 64, torch.bfloat16, seed=1)
    gs = torch.tensor(0.01)
    assert not kernels.chains.norm_nvfp4_serves(
        x[:, :40].contiguous(), RMSNorm(40, 1e-6).bfloat16(), gs
    )  # 40: no whole blocks
    assert not kernels.chains.norm_nvfp4_serves(x.float(), norm.float(), gs)
    monkeypatch.setattr(kernels.chains, "norm_nvfp4", lambda *a: pytest.fail("the kernel ran"))
    monkeypatch.setattr(kernels.quant, "nvfp4_blocked", lambda rows, g: ("quantized", rows))
    got = kernels.chains.norm_nvfp4_or_torch(x.float(), norm.float(), gs)
    same = torch.allclose(got[1], norm(x.float()), rtol=0, atol=0, equal_nan=True)  # (a NaN row)
    assert got[0] == "quantized" and same


@interpreted
def test_the_norm_nvfp4_probe_passes_the_kernel_and_fails_wrong_ones(rne_casts, monkeypatch):  # noqa: F811
    probing.check_triton_norm_nvfp4(CPU)
    kernel = kernels.chains.norm_nvfp4

    def not_normed(x, n, gs, normed=None):
        if normed is not None:
            normed.copy_(x)
        return kernels.quant.nvfp4_blocked(x, gs)

    def scales_a_tile_off(x, n, gs, normed=None):
        q, s = kernel(x, n, gs, normed)
        return q, s.roll(512)

    wrong = {
        "global scale doubled": lambda x, n, gs, normed=None: kernel(x, n, gs * 2, normed),
        "not normed": not_normed,
        "weights reversed": lambda x, n, gs, normed=None: kernel(x, _flipped(n), gs, normed),
        "scales a tile off": scales_a_tile_off,
        "normed rows not written": lambda x, n, gs, normed=None: kernel(x, n, gs),
    }
    check = lambda: probing.check_triton_norm_nvfp4(CPU)
    each_wrong_form_fails(monkeypatch, kernels.chains, "norm_nvfp4", wrong, check, "norm to NVFP4 differs")


def _flipped(norm: RMSNorm) -> RMSNorm:
    out = RMSNorm(norm.weight.shape[0], norm.eps).to(norm.weight.dtype)
    out.weight.data = norm.weight.data.flip(0)
    return out


def test_shared_fp8_projections_take_their_operand_from_the_un_normed_rows(monkeypatch):
    """q, k and v with one FP8 input scale (CPU `F.scaled_mm`): given the layer's un-normed rows and its input
    norm, each output is the linear's own of the normed rows bit for bit, with the operand from `norm_quant`
    (here its torch form) where set and the parts quantize in one pass, from the norm then `quantize` where
    not."""
    gen = torch.Generator().manual_seed(4)
    parts = [tc.ScaledLinear(packed_linear("fp8", n, 64, gen), "fp8", CPU, torch.float32, triton=True)
             for n in (48, 32, 32)]  # fmt: skip
    shared = si.SharedInput(parts, None)
    x = torch.randn(2, 5, 64, generator=gen)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64, generator=gen) * 2
    want = [p(norm(x)) for p in parts]
    for a, b in zip(shared(x, norm), want, strict=True):
        assert torch.equal(a, b)  # no fused form installed: the norm, then the shared quantization
    monkeypatch.setattr(tc, "in_one_pass", lambda triton, t: triton)  # as on CUDA
    monkeypatch.setattr(si, "in_one_pass", lambda triton, t: triton)
    calls = []
    fp8_of_norm = lambda rows, n, s: calls.append(rows.shape) or sl.fp8_quantize(n(rows), s)
    shared.norm_quant = si.norm_operand("fp8", fp8_of_norm, None)
    quantize_rows = tc.quantize_rows
    monkeypatch.setattr(tc, "quantize_rows", lambda *a: pytest.fail("quantized again") or quantize_rows(*a))
    for a, b in zip(shared(x, norm), want, strict=True):
        assert torch.equal(a, b)
    assert calls == [(10, 64)]


@interpreted
def test_nvfp4_projections_take_their_operand_from_the_un_normed_rows(rne_casts, monkeypatch):  # noqa: F811
    """`norm_operand` gives an NVFP4 linear the operand and scales its own one-pass `quantize` gives the normed
    rows (here from the norm-to-NVFP4 kernel's torch form), in the order its GEMM takes them; FP8 takes the
    FP8 kernel's codes at the input scale; the per-row FP8 fallback, or a kernel not probed, takes none."""
    gen = torch.Generator().manual_seed(6)
    linear = tc.ScaledLinear(packed_linear("nvfp4", 48, 64, gen), "nvfp4", CPU, torch.float32, triton=True)
    x, norm = rows_and_norm(5, 64, torch.bfloat16, seed=7)
    monkeypatch.setattr(tc, "in_one_pass", lambda triton, t: triton)  # as on CUDA
    operand = si.norm_operand("nvfp4", None, lambda rows, n, gs: kernels.quant.nvfp4_blocked(n(rows), gs))
    (a, (scales, gs)), (want_a, (want_scales, want_gs)) = operand(x, norm, linear), linear.quantize(norm(x))
    assert torch.equal(a, want_a) and gs is want_gs is linear.input_scale
    assert scales.dtype == want_scales.dtype == torch.float8_e4m3fn
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    fp8 = si.norm_operand("fp8", lambda rows, n, s: ("codes", s), None)
    assert fp8(x, norm, linear) == (("codes", linear.input_scale), [linear.input_scale])
    assert (
        si.norm_operand("fp8_rowwise", fp8, operand) is None and si.norm_operand("nvfp4", fp8, None) is None
    )


COMPILE_FOR_GPUS = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime.kernels import chains as tn
from pipeline.runtime.kernels.jit import chains as k

out = []

def build(fn, sig, consts, cc, dt, kernel):
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts,
                    attrs={(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr")})
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=tn.ROW_OPTIONS)
    cubin = Path(sys.argv[1]) / f"norm_{kernel}_{dt}_sm{cc}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    out.append({"cc": cc, "dtype": dt, "kernel": kernel, "cubin": str(cubin), "ptx": compiled.asm["ptx"]})

for cc in (90, 100, 89, 120):
    for dt in ("bf16", "fp16"):
        build(k.norm_fp8, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "scale_ptr": "*fp32", "out_ptr": "*fp8e4nv",
                           "cols": "i32", "eps": "fp32"}, {"E4M3_MAX": 448.0, "BLOCK": 4096}, cc, dt, "fp8")
        build(k.norm_nvfp4, {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "gs_ptr": "*fp32", "packed_ptr": "*u8",
                             "scales_ptr": "*u8", "normed_ptr": f"*{dt}", "rows": "i32", "cols": "i32", "CP": "i32",
                             "eps": "fp32"},
              {"E2M1_MAX": 6.0, "E4M3_MAX": 448.0, "WRITE_NORMED": False, "BLOCK": 4096}, cc, dt, "nvfp4")
json.dump(out, sys.stdout)
"""


def test_the_kernel_compiles_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton lowers the norm-to-FP8 and norm-to-NVFP4 kernels for bf16 and fp16 rows to sm_90a, sm_100a,
    sm_89 and sm_120 cubins, no GPU needed: IEEE divisions (`div.rn.f32`), the saturating round-to-nearest
    E4M3 conversion (of the codes, or of the block scales), no fused multiply-add, and no register spills (no
    STL/LDL in the SASS)."""
    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    assert len(compiled) == 16
    for k in compiled:
        where = (k["cc"], k["dtype"], k["kernel"])
        assert "div.rn.f32" in k["ptx"] and converts_to_e4m3_once(k["ptx"], k["cc"]), where
        assert not separate_roundings_missing(k["ptx"]), where
        assert not spills(k["cubin"]), where
