"""dgpipe's one-pass activation quantization kernels (`pipeline.runtime.kernels.quant`) in Triton's interpreter,
code for code against torch's forms (with round-to-nearest-even casts: tests/_utils/interpreter_casts.py), and
compiled for Hopper, B200, Ada and RTX Blackwell without a GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import nvfp4_fake_quant
from pipeline.runtime import probe as probing
from pipeline.runtime.kernels import quant as tq
from pipeline.runtime.kernels.jit import quant as jit_quant
from pipeline.runtime.probe.common import fp8_codes_equal
from pipeline.runtime.probe.quant import QUANT_PROBE_VALUES, nvfp4_probe_rows
from pipeline.runtime.tensor_cores import _rowwise_dynamic, in_one_pass, quantize_rows
from tests._utils.interpreter_casts import interpreted, rne_casts, uninitialised_bytes_are_0xab  # noqa: F401  (fixture)
from tests._utils.triton_compile import compiled_for_gpus, converts_to_e4m3_once, spills

pytestmark = interpreted
CPU = torch.device("cpu")


def activations(dtype: torch.dtype, k: int = 256, seed: int = 0) -> torch.Tensor:
    """Rows over twelve decades, with an all-zero block, a block too small for a scale, NaN, infinities,
    and the probe's rows (every E2M1 decision point and its neighbours)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(37, k, generator=g) * torch.logspace(-6, 6, 37)[:, None]
    x[0, :16], x[4, :32] = 0.0, 1e-30
    x[1, 3], x[2, 5], x[3, 17] = float("nan"), float("inf"), -float("inf")
    x = torch.cat([x[:, :176], nvfp4_probe_rows(CPU).float()]) if k == 176 else x
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.5, 3.7e-3, 8.0 / 448])
def test_fp8_codes_are_torchs(rne_casts, dtype, scale):  # noqa: F811
    """Normal, subnormal, tie, saturating and non-finite values (the probe's) and random ones over 32 binades."""
    v = torch.tensor(QUANT_PROBE_VALUES)
    g = torch.Generator().manual_seed(1)
    x = torch.cat(
        [v, -v, (torch.randn(64, 512, generator=g) * torch.logspace(-16, 16, 512, base=2.0)).flatten()]
    )
    x, s = x.to(dtype), torch.tensor(scale)
    assert fp8_codes_equal(tq.fp8(x, s), sl.fp8_quantize(x, s))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("global_scale", [0.01, 0.5, 0.0, 1e-20, 3.0])
def test_nvfp4_codes_and_scales_are_torchs(rne_casts, dtype, global_scale):  # noqa: F811
    x, gs = activations(dtype), torch.tensor(global_scale)
    (packed, scales), (want_packed, want_scales) = tq.nvfp4(x, gs), sl.nvfp4_quantize(x, gs)
    assert torch.equal(packed, want_packed)
    assert fp8_codes_equal(scales, want_scales)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("global_scale", [0.01, 0.5, 0.0, 3.0])
@pytest.mark.parametrize("k", [176, 256, 704])  # 11, 16 and 44 blocks: rows not a power of two of blocks
def test_nvfp4_rounded_rows_as_fp8_are_torchs(rne_casts, dtype, global_scale, k):  # noqa: F811
    x, gs = activations(dtype, k), torch.tensor(global_scale)
    (q, scales), (want_q, want_scales) = tq.nvfp4_fp8_rows(x, gs), _rowwise_dynamic(nvfp4_fake_quant(x, gs))
    assert fp8_codes_equal(q, want_q)
    assert torch.equal(scales, want_scales)


def test_leading_dims_strided_rows_and_empty_inputs(rne_casts):  # noqa: F811
    x = activations(torch.bfloat16).reshape(37, 4, 64)
    (packed, scales), want = tq.nvfp4(x, torch.tensor(0.02)), sl.nvfp4_quantize(x, torch.tensor(0.02))
    assert packed.shape == (37, 4, 32) and scales.shape == (37, 4, 4)
    assert torch.equal(packed, want[0]) and fp8_codes_equal(scales, want[1])
    wide = activations(torch.bfloat16, 704)
    rows = wide[:, 64:240]  # 176 columns at a stride of 704
    got, want = (
        tq.nvfp4_fp8_rows(rows, torch.tensor(0.01)),
        _rowwise_dynamic(nvfp4_fake_quant(rows, torch.tensor(0.01))),
    )
    assert fp8_codes_equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = torch.empty(0, 64, dtype=torch.bfloat16)
    assert tq.nvfp4(empty, torch.tensor(1.0))[0].shape == (0, 32)
    assert tq.nvfp4_fp8_rows(empty, torch.tensor(1.0))[1].shape == (0,)


@pytest.mark.parametrize("k", [176, 256, 704])  # 11, 16 and 44 scale columns: padded to 12, 16 and 44
@pytest.mark.parametrize("rows", [37, 130, 1])  # one, two and one row tile, each padded to 128 rows
def test_nvfp4_with_swizzled_scales_is_nvfp4_then_the_swizzle(rne_casts, k, rows):  # noqa: F811
    """A linear's operand in one launch: `nvfp4`'s codes, and its scales in `to_blocked`'s layout with the
    padded rows and columns zero, byte for byte, where the memory it is handed holds other bytes."""
    x, gs = activations(torch.bfloat16, k, seed=rows).repeat(4, 1)[:rows], torch.tensor(0.01)
    want_packed, want_scales = sl.nvfp4_quantize(x, gs)
    with uninitialised_bytes_are_0xab():
        packed, scales = tq.nvfp4_blocked(x, gs)
    assert torch.equal(packed, want_packed)
    assert fp8_codes_equal(scales, sl.to_blocked(want_scales.view(torch.uint8)))
    assert tq.nvfp4_blocked(torch.empty(0, k, dtype=torch.bfloat16), gs)[1].numel() == 0


@pytest.mark.parametrize(("m", "c"), [(37, 11), (300, 44), (128, 176), (1, 3), (0, 44)])
def test_grouped_scale_swizzle_is_torchs(m, c, monkeypatch):
    """The block scales' 128x4-tile layout for rows grouped by expert (uneven, empty and leading empty
    groups, rows not a multiple of 128, columns not of 4, no rows at all): byte for byte, where the memory
    the kernel is handed holds other bytes (it writes the padding's zeros itself). Each output row is
    computed on its own, so programs of 128 rows compute what the GPU's of `BLOCKED_ROWS` do, in a 32nd
    of the interpreter's time (the probe runs the GPU's)."""
    monkeypatch.setattr(tq, "BLOCKED_ROWS", 128)
    g = torch.Generator().manual_seed(m)
    s = torch.randint(0, 256, (m, c), dtype=torch.uint8, generator=g)
    for groups in (1, 4, 7, 128):
        cuts = torch.sort(torch.randint(0, m + 1, (groups - 1,), generator=g)).values
        offs = torch.cat([cuts, torch.tensor([m])]).to(torch.int32)
        with uninitialised_bytes_are_0xab():
            got = tq.blocked_scales(s, offs)
        assert torch.equal(got, sl.to_blocked_grouped(s, offs)), offs.tolist()
        rows = torch.randint(0, max(m, 1), (m,), generator=g)  # gathered to expert order first
        assert torch.equal(tq.blocked_scales(s, offs, rows), sl.to_blocked_grouped(s[rows], offs)), (
            offs.tolist()
        )


@triton.jit
def _to_e4m3(x_ptr, grid_ptr, codes_ptr, raw_ptr, n, BLOCK: tl.constexpr):
    """Each value on E4M3's grid (fp32), its code through `e4m3`, and its code by a bare conversion."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    v = tl.load(x_ptr + i, mask=inside, other=0.0)
    tl.store(grid_ptr + i, jit_quant.e4m3_grid(v), mask=inside)
    tl.store(codes_ptr + i, jit_quant.e4m3(v), mask=inside)
    tl.store(raw_ptr + i, v.to(tl.float8e4nv), mask=inside)


def e4m3_boundaries() -> torch.Tensor:
    """Every E4M3 value up to 448 and every midpoint between neighbours, with the fp32 values either side
    of each midpoint one fp32 step away and 2^-12 and 2^-11 of it away (where rounding first to fp16, to
    nearest or toward zero, lands on the midpoint), random values over 21 binades, +-0, fp32 subnormals and
    NaN; both signs."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    mid = (grid[:-1] + grid[1:]) / 2
    near = [torch.nextafter(mid, torch.zeros(())), torch.nextafter(mid, torch.full((), 448.0))]
    near += [mid * (1 + f) for f in (2.0**-12, -(2.0**-12), 2.0**-11, -(2.0**-11))]
    g = torch.Generator().manual_seed(5)
    rand = (torch.randn(4096, generator=g) * torch.logspace(-12, 9, 4096, base=2.0)).clamp(-448, 448)
    special = torch.tensor([0.0, 1e-45, 1e-40, 448.0, float("nan")])
    x = torch.cat([grid, mid, *near, rand, special])
    return torch.cat([x, -x])


def test_e4m3_rounds_once_to_torchs_codes_whatever_conversion_follows():
    """`e4m3_grid` is torch's rounding to E4M3 in fp32, bit for bit (sign of zero and NaN too), and its values
    are fp16 values, so a conversion through fp16 (Triton before 3.9 on sm_89) is exact on them. No
    round-to-nearest-even casts installed: the interpreter's own conversion rounds otherwise (its bare
    conversion misses torch's codes here), yet `e4m3` gives torch's codes, as under any lowering."""
    x = e4m3_boundaries()
    grid, codes, raw = torch.empty_like(x), *(torch.empty_like(x, dtype=torch.float8_e4m3fn) for _ in "cr")
    _to_e4m3[(triton.cdiv(x.numel(), 1024),)](x, grid, codes, raw, x.numel(), BLOCK=1024)
    want, nan = x.to(torch.float8_e4m3fn), x.isnan()
    assert (
        torch.equal(grid[~nan].view(torch.int32), want[~nan].float().view(torch.int32))
        and grid[nan].isnan().all()
    )
    assert torch.equal(grid[~nan].half().float(), grid[~nan])  # exact in fp16: any rounding mode keeps it
    # NaN aside: the interpreter's own conversion makes it a finite code (a GPU's keeps it NaN)
    assert fp8_codes_equal(codes[~nan], want[~nan])
    assert not fp8_codes_equal(raw[~nan], want[~nan])  # the interpreter's conversion alone misses
    # and the conversion Triton before 3.9 emits on sm_89 (toward zero to fp16, then to nearest) on the raw
    # values misses torch's codes on this set too: what the grid is for
    toward_zero = (x.view(torch.int32) & ~0x1FFF).view(torch.float32)  # fp16's 10 mantissa bits, truncated
    assert not fp8_codes_equal(toward_zero.to(torch.float8_e4m3fn), want)


def test_the_probe_holds_each_kernel_to_torchs_form(rne_casts, monkeypatch):  # noqa: F811
    for mode in ("nvfp4", "fp8_rowwise"):
        probing.check_triton_quant(mode, CPU)
    real = tq.nvfp4

    def one_code_off(x, gs):
        packed, scales = real(x, gs)
        return packed ^ (torch.arange(packed.numel()).reshape(packed.shape) == 5).to(torch.uint8), scales

    monkeypatch.setattr(tq, "nvfp4", one_code_off)
    with pytest.raises(DgpipeError, match="Triton nvfp4 activation quantization differs"):
        probing.check_triton_quant("nvfp4", CPU)
    monkeypatch.setattr(tq, "nvfp4", real)
    swizzle = tq.blocked_scales
    monkeypatch.setattr(tq, "blocked_scales", lambda s, offs, rows=None: swizzle(s.flip(0), offs, rows))
    with pytest.raises(DgpipeError, match="Triton swizzle of grouped NVFP4 scales differs"):
        probing.check_triton_quant("nvfp4", CPU)
    monkeypatch.setattr(tq, "blocked_scales", swizzle)
    linear = tq.nvfp4_blocked
    monkeypatch.setattr(tq, "nvfp4_blocked", lambda x, gs: (linear(x, gs)[0], linear(x.flip(0), gs)[1]))
    with pytest.raises(DgpipeError, match="Triton nvfp4 activation quantization differs"):
        probing.check_triton_quant("nvfp4", CPU)
    monkeypatch.setattr(tq, "nvfp4_fp8_rows", lambda x, gs: _rowwise_dynamic(x))  # no NVFP4 rounding
    with pytest.raises(DgpipeError, match="Triton fp8_rowwise activation quantization differs"):
        probing.check_triton_quant("fp8_rowwise", CPU)


def test_the_probe_plan_checks_the_one_pass_kernels_where_a_row_quantizes_activations():
    quant = lambda arch: [m for k, m, _ in probing.probe_plan(arch) if k == "quant"]
    # B200: FP8 linears and experts, NVFP4 ones; the NVFP4 experts' second path re-quantizes to FP8
    assert quant("sm100") == ["fp8", "nvfp4", "fp8_rowwise"]
    assert quant("sm120") == ["fp8", "nvfp4", "fp8_rowwise"]  # its NVFP4 experts re-quantized to FP8
    assert quant("sm90") == quant("sm89") == ["fp8", "fp8_rowwise"]
    assert not [k for k, *_ in probing.probe_plan("sm90", ("bf16",)) if k == "quant"]


def test_quantize_rows_takes_the_kernels_on_cuda_only(monkeypatch):
    """Each mode's one-pass kernel where asked for on a CUDA tensor (a fake one here: the kernels are
    recorded, not run); torch's form on the CPU or where not asked for."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    monkeypatch.setattr(tq, "nvfp4", lambda x, gs: calls.append("nvfp4"))
    monkeypatch.setattr(tq, "fp8", lambda x, s: calls.append("fp8"))
    monkeypatch.setattr(tq, "nvfp4_fp8_rows", lambda x, gs: calls.append("fp8_rowwise"))
    modes = ("nvfp4", "fp8", "fp8_rowwise")
    x = activations(torch.bfloat16)
    for mode in modes:
        quantize_rows(x, torch.tensor(0.01), mode, triton=True)  # a CPU tensor: torch's form
    assert calls == []
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(4, 64, dtype=torch.bfloat16, device="cuda")
        for mode in modes:
            quantize_rows(x, torch.tensor(0.01, device="cuda"), mode, triton=True)
        assert not in_one_pass(False, x)  # not asked for: torch's form on CUDA too
    assert calls == list(modes)


COMPILE_FOR_GPUS = """
import json, re, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline.runtime import kernels
from pipeline.runtime.kernels.jit import quant as k

consts = {"E2M1_MAX": 6.0, "E4M3_MAX": 448.0}
forms = {
    "fp8": (k.fp8_static_quant, {"x_ptr": "*bf16", "scale_ptr": "*fp32", "out_ptr": "*fp8e4nv", "n": "i32"},
            {"E4M3_MAX": 448.0, "BLOCK": kernels.quant.FP8_BLOCK}, 4),
    "nvfp4": (k.nvfp4_quant, {"x_ptr": "*bf16", "gs_ptr": "*fp32", "packed_ptr": "*u8", "scales_ptr": "*fp8e4nv",
              "blocks": "i32"}, {**consts, "BLOCKS": kernels.quant.NVFP4_BLOCKS}, 4),
    "nvfp4_blocked": (k.nvfp4_quant_blocked, {"x_ptr": "*bf16", "gs_ptr": "*fp32", "packed_ptr": "*u8",
                      "out_ptr": "*u8", "rows": "i32", "C": "i32", "CP": "i32", "padded": "i32"},
                      {**consts, "BLOCKS": kernels.quant.NVFP4_BLOCKS}, 4),
    # the 26B's widest input (the global layers' o_proj: 16 heads x 512): 512 blocks a row
    "nvfp4_fp8_rows": (k.nvfp4_fp8_rows, {"x_ptr": "*bf16", "gs_ptr": "*fp32", "out_ptr": "*fp8e4nv",
                       "scales_ptr": "*fp32", "K": "i32", "stride_x": "i32"}, {**consts, "NB": 512}, 8),
}
# 128 experts' grouped rows of 176 scale columns (the 26B's hidden size / 16), gathered to expert order or not
for gather in (True, False):
    forms[f"blocked_scales{'_gather' if gather else ''}"] = (k.blocked_scales, {"scales_ptr": "*u8", "offs_ptr": "*i32",
        "rows_ptr": "*i64", "out_ptr": "*u8", "R": "i32", "C": "i32", "CP": "i32", "num_groups": "i32"},
        {"GATHER": gather, "G_POW2": 128, "BLOCK_R": kernels.quant.BLOCKED_ROWS, "BLOCK_C": 256}, 4)
out = []
for cc in (90, 100, 89, 120):
    for name, (fn, sig, constexprs, warps) in forms.items():
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a.endswith("_ptr")}
        src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(constexprs, "constexpr")}, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": warps})
        ptx, cubin = kernel.asm["ptx"], Path(sys.argv[1]) / f"{name}_sm{cc}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out.append({"name": name, "cc": cc, "cubin": str(cubin),
                    "ptx": sorted(set(re.findall(r"(div\\.\\S+|cvt\\.r[nz]\\.\\S*|min\\.\\S+)", ptx)))})
json.dump(out, sys.stdout)
"""


def test_the_kernels_compile_for_hopper_b200_ada_and_rtx_blackwell_without_spills(tmp_path):
    """Triton (the installed version) lowers the kernels to sm_90a, sm_100a, sm_89 and sm_120 cubins, no
    GPU needed. Each quantizing kernel divides with IEEE rounding (div.rn), converts to E4M3 with round-to-nearest saturation
    (cvt.rn.satfinite), and keeps NaN through its clamps (min.NaN): torch's arithmetic, which the tests above
    and the load-time probe hold them to bit for bit. None spills a register to local memory (no STL/LDL
    in the SASS; the NVFP4 kernel's 8-byte stack frame is a local array Triton declares and never uses)."""
    compiled = compiled_for_gpus(COMPILE_FOR_GPUS, tmp_path)
    names = ("fp8", "nvfp4", "nvfp4_blocked", "nvfp4_fp8_rows", "blocked_scales_gather", "blocked_scales")
    assert [(k["name"], k["cc"]) for k in compiled] == [(n, cc) for cc in (90, 100, 89, 120) for n in names]
    for k in (k for k in compiled if not k["name"].startswith("blocked")):  # the swizzle only moves bytes
        assert "div.rn.f32" in k["ptx"] and converts_to_e4m3_once(" ".join(k["ptx"]), k["cc"]), k
        assert any(p.startswith("min.NaN") for p in k["ptx"]), k
    for k in compiled:
        assert not spills(k["cubin"]), k["name"]


def test_which_loads_quantize_activations_in_one_pass():
    from pipeline.runtime import gpu_load
    from pipeline.runtime.probe import Probe

    pr = Probe("sm120", {"quant:nvfp4": None, "quant:fp8_rowwise": "a compile error", "triton:fp8": None})
    assert gpu_load.one_pass("nvfp4", pr)  # its own probe passed; no Triton GEMM needed
    assert not gpu_load.one_pass("fp8_rowwise", pr)  # its probe failed: torch's form
    assert not gpu_load.one_pass("fp8", pr)  # not probed: the Triton GEMM's probe does not stand for it
    pr.results["quant:fp8"] = None
    assert gpu_load.one_pass("fp8", pr) and not gpu_load.one_pass(None, pr)
