"""Scaled-GEMM operand layouts, on the CPU: each converter against torch's own test helpers (the vendor's
reference for the cuBLAS scale layout and the fp4 packing) and against dgpipe's dequantized reference."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.model import scaled_layout as sl
from pipeline.model.fake_quant import fp8_fake_quant, nvfp4_fake_quant
from pipeline.model.modelopt import unpack_e2m1

GEN = torch.Generator().manual_seed(0)


def _torch_test_helpers() -> types.SimpleNamespace:
    """torch's own layout helpers (torch/testing/_internal/common_quantized.py), read from the installed
    torch without importing its test framework (which needs test-only packages)."""
    src = Path(torch.__file__).parent / "testing/_internal/common_quantized.py"
    want = {
        "ceil_div",
        "to_blocked",
        "from_blocked",
        "pack_uint4",
        "down_size",
        "_n_ones",
        "_floatx_unpacked_to_f32",
    }
    tree = ast.parse(src.read_text())
    body = [
        n
        for n in tree.body  # the wanted functions and the module's constants, in file order
        if (isinstance(n, ast.FunctionDef) and n.name in want) or isinstance(n, ast.Assign)
    ]
    ns: dict = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(src), "exec"), ns)
    assert want <= set(ns)
    return types.SimpleNamespace(**{k: ns[k] for k in want})


tq = _torch_test_helpers()


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def test_to_blocked_matches_torch_and_cublas_formula():
    for rows, cols in ((128, 4), (130, 7), (300, 12), (5, 1)):
        s = torch.randint(0, 255, (rows, cols), generator=GEN, dtype=torch.uint8)
        flat = sl.to_blocked(s)
        assert torch.equal(flat, tq.to_blocked(s))
        assert torch.equal(sl.from_blocked(flat, rows, cols), s)
    s = torch.randint(1, 255, (130, 6), generator=GEN, dtype=torch.uint8).float()
    # torch's loop implementation of the cuBLAS offset formula (block size 16 -> 16 * cols values of K)
    assert torch.equal(tq.from_blocked(torch.empty(130, 6 * 16), sl.to_blocked(s), 16), s)


def test_stacked_weight_scales_are_each_matrixs_blocked_layout():
    """Experts' stacked block scales swizzled in one go: each matrix's `to_blocked` (torch's), padding included."""
    for experts, rows, cols in ((1, 5, 1), (3, 130, 7), (4, 256, 176), (2, 704, 88)):
        s = torch.randint(0, 256, (experts, rows, cols), generator=GEN, dtype=torch.uint8)
        assert torch.equal(sl.nvfp4_weight_blocked(s), torch.stack([tq.to_blocked(m) for m in s]))
    assert torch.equal(sl.nvfp4_weight_blocked(s[0]), tq.to_blocked(s[0]))


def test_grouped_blocked_scales_are_per_group_blocks_back_to_back():
    offs = torch.tensor([3, 3, 140, 141, 400], dtype=torch.int32)  # an empty group, a 1-row group
    s = torch.randint(1, 255, (400, 8), generator=GEN, dtype=torch.uint8)
    got = sl.to_blocked_grouped(s, offs)
    assert got.shape == (sl.blocked_rows_bound(400, 5), 8)
    start, parts = 0, []
    for end in offs.tolist():
        if end > start:  # as torch's grouped tests build them: one to_blocked per non-empty group
            parts.append(tq.to_blocked(s[start:end]))
        start = end
    want = torch.cat(parts)
    assert torch.equal(got.reshape(-1)[: want.numel()], want)
    assert not got.reshape(-1)[want.numel() :].any()


def test_nvfp4_activation_quantizer_is_the_fake_quant():
    x = _randn(6, 64) * 3
    x[0, :16] = 0  # an all-zero block
    gs = x.abs().amax() / (6 * 448)
    packed, bs = sl.nvfp4_quantize(x, gs)
    deq = unpack_e2m1(packed) * (bs.float() * gs).repeat_interleave(16, -1)  # the emulation's order
    assert torch.equal(deq, nvfp4_fake_quant(x, gs))


def test_fp4_packing_is_torch_float4_e2m1fn_x2():
    codes = torch.randint(0, 16, (4, 32), generator=GEN, dtype=torch.uint8)
    packed = sl.pack_e2m1(codes)
    assert sl.as_fp4x2(packed).dtype == torch.float4_e2m1fn_x2
    # torch's test unpacking (low nibble = even element) and E2M1 decoding vs ModelOpt's reader
    via_torch = tq._floatx_unpacked_to_f32(codes, 2, 1)
    assert torch.equal(unpack_e2m1(packed), via_torch)
    assert torch.equal(tq.pack_uint4(codes), packed)


def test_fp8_operands_dequantize_to_the_fake_quant_and_rowwise_requant_bound():
    x, scale = _randn(5, 32) * 4, torch.tensor(0.02)
    assert torch.equal(sl.fp8_quantize(x, scale).float() * scale, fp8_fake_quant(x, scale))
    w = _randn(3, 16, 32)
    q, s = sl.fp8_rowwise_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 16)
    err = (q.float() * s[..., None] - w).abs() / w.abs().amax(-1, keepdim=True)
    assert float(err.max()) <= 2**-4  # e4m3 keeps 3 mantissa bits; row amax maps to 448
    assert torch.equal(
        sl.fp8_expert_row_scales(torch.tensor([1.0, 2.0]), 3), torch.tensor([[1.0] * 3, [2.0] * 3])
    )
    # each expert's scale stored as a 1-element tensor (shape [1], not 0-dim): stacked [E, 1], the same
    assert torch.equal(
        sl.fp8_expert_row_scales(torch.tensor([[1.0], [2.0]]), 3), torch.tensor([[1.0] * 3, [2.0] * 3])
    )


def test_fp8_quantize_divides_in_fp32_for_every_input_dtype_and_scale_shape():
    """The operand is e4m3(clamp(float(x) / scale)) bit for bit, whatever x's dtype and whether the scale is
    0-dim (static per tensor), one per row, or float64: dividing a bf16 tensor by a 0-dim fp32 scale would
    round the quotient to bf16 first (0-dim tensors do not take part in type promotion) and flip roundings."""
    x = _randn(64, 96) * torch.logspace(-4, 4, 96)  # magnitudes past E4M3's 448 after scaling: the clamp
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dtype)
        for scale in (
            torch.tensor(0.0123),
            torch.tensor(3.7, dtype=torch.float64),
            _randn(64, 1).abs() + 1e-3,
        ):
            want = (xd.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            got = sl.fp8_quantize(xd, scale)
            assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    bf, s = torch.tensor([1.9453125, 3.15625, -4.25], dtype=torch.bfloat16), torch.tensor(0.37)
    assert sl.fp8_quantize(bf, s).float().tolist() == [5.5, 9.0, -11.0]  # 5.2576, 8.5304, -11.4865 in fp32
    assert (bf / s).to(torch.float8_e4m3fn).float().tolist() == [5.0, 8.0, -12.0]  # quotients rounded to bf16


def test_scaled_grouped_gemm_from_layouts_equals_dequantized_reference():
    """Emulate what scaled_grouped_mm computes from the converted operands (codes x unswizzled block
    scales x global scales, per group) and compare with the dequantized weights times the fake-quantized
    activations: the converters lose nothing."""
    e, n, k, m = 3, 16, 64, 40
    w_codes = torch.randint(0, 16, (e, n, k), generator=GEN, dtype=torch.uint8)
    w_packed = sl.pack_e2m1(w_codes)
    w_bs = (torch.rand(e, n, k // 16, generator=GEN) * 2 + 0.1).to(torch.float8_e4m3fn)
    w_gs = torch.rand(e, generator=GEN) + 0.5
    w_ref = unpack_e2m1(w_packed) * w_bs.float().repeat_interleave(16, -1) * w_gs[:, None, None]
    x = _randn(m, k)
    x_gs = x.abs().amax() / (6 * 448)
    offs = torch.tensor([10, 10, 40], dtype=torch.int32)
    xq, x_bs = sl.nvfp4_quantize(x, x_gs)
    x_blocked = sl.to_blocked_grouped(x_bs.view(torch.uint8), offs).view(torch.float8_e4m3fn)
    w_blocked = sl.nvfp4_weight_blocked(w_bs.view(torch.uint8)).view(torch.float8_e4m3fn)
    got, start, pstart = torch.zeros(m, n), 0, 0
    for g, end in enumerate(offs.tolist()):
        rows = end - start
        if rows:
            xs = x_blocked.reshape(-1)[pstart * 4 :].view(torch.uint8)
            a_bs = sl.from_blocked(xs[: sl.ceil_div(rows, 128) * 128 * 4], rows, k // 16)
            b_bs = sl.from_blocked(w_blocked[g].view(torch.uint8), n, k // 16)
            a = unpack_e2m1(xq[start:end]) * a_bs.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
            b = unpack_e2m1(w_packed[g]) * b_bs.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
            got[start:end] = (a @ b.T) * x_gs * w_gs[g]
            pstart += sl.ceil_div(rows, 128) * 128
        start = end
    want = torch.cat(
        [
            nvfp4_fake_quant(x[s:t], x_gs) @ w_ref[g].T
            for g, (s, t) in enumerate(zip([0, 10, 10], [10, 10, 40]))
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "k", "experts"), [(7, 2, 5), (256, 8, 128), (3, 2, 9), (0, 2, 4), (64, 1, 1)]
)
def test_expert_order_matches_grouped_experts(tokens, k, experts):
    """Sorted slots, their tokens and every expert's end offset, empty experts (first, last, in between) and an
    empty routing included."""
    g = torch.Generator().manual_seed(tokens)
    index = torch.randint(0, experts, (tokens, k), generator=g)
    if experts > 4:
        index[index < 2] = 3  # experts 0 and 1 empty
    order, token, offs, rows = sl.expert_order(index, experts)
    assert rows is None  # torch's form leaves the inverse to `slot_rows`, which the combine calls
    assert torch.equal(order, torch.argsort(index.reshape(-1), stable=True))
    assert torch.equal(token, order // k)
    assert (
        offs.dtype == torch.int32
        and offs.tolist() == torch.bincount(index.reshape(-1), minlength=experts).cumsum(0).tolist()
    )
    assert F.grouped_mm is not None  # the bf16 path the fallback rows name
