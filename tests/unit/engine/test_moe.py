"""The routed-experts plugin without a GPU: the PyTorch reference (the kernel's oracle) against the model's
own MoE in float64, the plugin contract and geometry, and TensorRT's registration code on plugin.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.engine import moe_spec
from pipeline.engine.kernels.moe_reference import moe_experts_reference, moe_reference
from pipeline.errors import DgpipeError
from pipeline.model.fake_quant import fp8_fake_quant
from pipeline.sampler.kernels.build import find_nvcc
from tests._utils.tiny import build_tiny


@pytest.fixture(scope="module")
def layer():
    return build_tiny(torch.float64, seed=3).layers[0]


def routed(layer, tokens: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.experts.gate_up_proj.shape[-1], generator=g, dtype=torch.float64)
    with torch.no_grad():
        _, weights, index = layer.router(x)
    return x, index, weights.float()  # the node's expert_weight is fp32


def test_reference_equals_the_model_moe_in_float64(layer):
    x, index, weights = routed(layer)
    assert index.shape == (37, 2) and len(torch.unique(index)) == 4  # every expert used
    want = layer.experts(x, index, weights.double())
    got = moe_reference(x, index, weights, layer.experts.gate_up_proj, layer.experts.down_proj)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    rows = moe_experts_reference(x, index, weights, layer.experts.gate_up_proj, layer.experts.down_proj)
    assert rows.shape == (37, 2, 32) and rows.dtype == torch.float64
    one = layer.experts(x[:1], index[:1, :1], weights[:1, :1].double())  # one (token, choice) row alone
    assert torch.allclose(rows[0, 0], one[0], rtol=0, atol=1e-12)


def test_fp8_weights_are_their_dequantized_values(layer):
    x, index, weights = routed(layer, seed=1)
    gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
    e, two_i, d = gu.shape
    inter = two_i // 2
    gu_scale = torch.stack([gu[:, :inter].abs().amax((1, 2)), gu[:, inter:].abs().amax((1, 2))], 1) / 448
    gu_scale = gu_scale[:, :, None].expand(e, 2, d).float()  # the DequantizeLinear scale [E, 2, d]
    dn_scale = (dn.abs().amax((1, 2)) / 448).float()
    full = torch.cat([gu_scale[:, :1].expand(-1, inter, -1), gu_scale[:, 1:].expand(-1, inter, -1)], 1)
    gu8 = (gu / full).to(torch.float8_e4m3fn)
    dn8 = (dn / dn_scale[:, None, None]).to(torch.float8_e4m3fn)
    got = moe_reference(x, index, weights, gu8, dn8, gate_up_scale=gu_scale, down_scale=dn_scale)
    deq_gu, deq_dn = gu8.double() * full.double(), dn8.double() * dn_scale.double()[:, None, None]
    layer.experts.gate_up_proj.data, saved = deq_gu, gu.data.clone()
    layer.experts.down_proj.data, saved_dn = deq_dn, dn.data.clone()
    try:
        want = layer.experts(x, index, weights.double())
    finally:
        layer.experts.gate_up_proj.data, layer.experts.down_proj.data = saved, saved_dn
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    exact = moe_reference(x, index, weights, gu, dn)
    assert not torch.allclose(got, exact, atol=1e-6)  # E4M3 rounding is visible: the scales were applied


def test_fp8_activation_fake_quant_per_expert(layer):
    x, index, weights = routed(layer, tokens=9, seed=2)
    gu, dn = layer.experts.gate_up_proj, layer.experts.down_proj
    inter = gu.shape[1] // 2
    scales = torch.tensor([[0.01, 0.02, 0.03, 0.04], [0.05, 0.01, 0.02, 0.03], [0.002, 0.003, 0.004, 0.005]])
    got = moe_experts_reference(x, index, weights, gu, dn, input_scale=scales)
    gelu = lambda v: torch.nn.functional.gelu(v, approximate="tanh")
    for t in range(9):  # slot by slot with the model's own fake-quant function
        for j in range(2):
            e = int(index[t, j])
            s = scales[:, e].double()
            g = fp8_fake_quant(x[t], s[0]) @ gu[e, :inter].T
            u = fp8_fake_quant(x[t], s[1]) @ gu[e, inter:].T
            want = fp8_fake_quant(gelu(g) * u, s[2]) @ dn[e].T * weights[t, j].double()
            assert torch.allclose(got[t, j], want, rtol=0, atol=1e-12)


def test_out_of_range_experts_give_zero_rows(layer):
    x, index, weights = routed(layer, tokens=4)
    bad = index.clone()
    bad[1, 0], bad[2, 1] = -1, 4
    rows = moe_experts_reference(x, bad, weights, layer.experts.gate_up_proj, layer.experts.down_proj)
    assert rows[1, 0].abs().max() == 0 and rows[2, 1].abs().max() == 0 and rows[0].abs().max() > 0


# ---- NVFP4 experts ----------------------------------------------------------------------------------------
def nvfp4_experts(layer):
    """The layer's experts as NVFP4 plugin inputs (tests/_utils/nvfp4.py: ModelOpt's quantization, the
    export's stacking)."""
    from tests._utils.nvfp4 import quantize_experts

    return quantize_experts(layer.experts.gate_up_proj, layer.experts.down_proj)


def nvfp4_input_scales(layer) -> torch.Tensor:
    """NVFP4 activation global scales [3, E] as ModelOpt calibrates them (amax / (6 * 448)) from the routed
    expert inputs of a calibration batch; up's amax doubled so a swapped gate / up scale would show."""
    x, index, _ = routed(layer, tokens=64, seed=11)
    gu = layer.experts.gate_up_proj.detach()
    rows = []
    for e in range(gu.shape[0]):
        xe = x[(index == e).any(-1)]
        g, u = torch.nn.functional.linear(xe, gu[e]).chunk(2, dim=-1)
        h = torch.nn.functional.gelu(g, approximate="tanh") * u
        rows.append([float(xe.abs().max()), 2 * float(xe.abs().max()), float(h.abs().max())])
    return torch.tensor(rows).T.contiguous() / (6 * 448)


def test_nvfp4_dequantization_is_modelopts(layer):
    """dequantize_nvfp4 (what the reference and the kernel multiply by) equals ModelOpt's own dequantization of
    each expert's linear, bit for bit: same nibble order, same block-scale x global-scale product."""
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    from pipeline.engine.kernels.moe_reference import dequantize_nvfp4

    def modelopts(codes, bs, gs):  # ModelOpt's NVFP4QTensor over the packed codes, as its export reads them
        q = nvfp4_tensor.NVFP4QTensor(torch.Size((codes.shape[0], codes.shape[1] * 2)), torch.float32, codes)
        return q.dequantize(dtype=torch.float32, scale=bs, double_scale=gs, block_sizes={-1: 16})

    w = nvfp4_experts(layer)
    inter = w["gate_up"].shape[1] // 2
    for e in range(w["gate_up"].shape[0]):
        for half, rows in ((0, slice(0, inter)), (1, slice(inter, 2 * inter))):
            codes, bs = w["gate_up"][e, rows], w["gate_up_block_scale"][e, rows]
            gs = w["gate_up_scale"][e, half, 0]
            assert torch.equal(dequantize_nvfp4(codes, bs, gs), modelopts(codes, bs, gs))
        codes, bs, gs = w["down"][e], w["down_block_scale"][e], w["down_scale"][e]
        assert torch.equal(dequantize_nvfp4(codes, bs, gs), modelopts(codes, bs, gs))
    deq = dequantize_nvfp4(w["down"], w["down_block_scale"], w["down_scale"][:, None, None])
    ref = layer.experts.down_proj.detach().float()
    rel = float((deq - ref).norm() / ref.norm())
    assert 0.01 < rel < 0.2  # a real 4-bit approximation, not garbage and not the float weights


def test_nvfp4_weights_are_their_dequantized_values(layer):
    from pipeline.engine.kernels.moe_reference import dequantize_nvfp4

    x, index, weights = routed(layer, seed=6)
    w = nvfp4_experts(layer)
    inter = w["gate_up"].shape[1] // 2
    s = w["gate_up_scale"]
    deq_gu = dequantize_nvfp4(
        w["gate_up"],
        w["gate_up_block_scale"],
        torch.cat([s[:, :1].expand(-1, inter, -1), s[:, 1:].expand(-1, inter, -1)], 1),
    )
    deq_dn = dequantize_nvfp4(w["down"], w["down_block_scale"], w["down_scale"][:, None, None])
    got = moe_reference(x, index, weights, **w)
    want = moe_reference(x, index, weights, deq_gu, deq_dn)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    exact = moe_reference(x, index, weights, layer.experts.gate_up_proj, layer.experts.down_proj)
    assert not torch.allclose(got, exact, atol=1e-4)  # E2M1 rounding is visible: the codes were used


def test_nvfp4_activation_fake_quant_per_expert(layer):
    """act_quant nvfp4 with NVFP4 weights: every routed copy of x (gate, up) and of the GELU product (down)
    is nvfp4_fake_quant'ed with its expert's global scale, slot by slot."""
    from pipeline.engine.kernels.moe_reference import dequantize_nvfp4
    from pipeline.model.fake_quant import nvfp4_fake_quant

    x, index, weights = routed(layer, tokens=9, seed=7)
    w = nvfp4_experts(layer)
    inter = w["gate_up"].shape[1] // 2
    scales = nvfp4_input_scales(layer)
    got = moe_experts_reference(x, index, weights, input_scale=scales, **w)
    s = w["gate_up_scale"]
    gu = dequantize_nvfp4(
        w["gate_up"],
        w["gate_up_block_scale"],
        torch.cat([s[:, :1].expand(-1, inter, -1), s[:, 1:].expand(-1, inter, -1)], 1),
    ).double()
    dn = dequantize_nvfp4(w["down"], w["down_block_scale"], w["down_scale"][:, None, None]).double()
    gelu = lambda v: torch.nn.functional.gelu(v, approximate="tanh")
    for t in range(9):
        for j in range(2):
            e = int(index[t, j])
            sc = scales[:, e].double()
            g = nvfp4_fake_quant(x[t], sc[0]) @ gu[e, :inter].T
            u = nvfp4_fake_quant(x[t], sc[1]) @ gu[e, inter:].T
            want = nvfp4_fake_quant(gelu(g) * u, sc[2]) @ dn[e].T * weights[t, j].double()
            assert torch.allclose(got[t, j], want, rtol=0, atol=1e-12)
    plain = moe_experts_reference(x, index, weights, **w)
    assert float((got - plain).abs().max()) > 1e-2 * float(plain.abs().max())  # activations really quantized
    with pytest.raises(ValueError, match="both block scales"):
        moe_experts_reference(
            x, index, weights, w["gate_up"], w["down"], gate_up_block_scale=w["gate_up_block_scale"]
        )


# ---- the kernel's NVFP4 helpers, compiled for the host from dg_moe.cu itself -----------------------------
_HOST_PROGRAM = r"""
#define DG_MOE_HELPERS_ONLY
#include "dg_moe.cu"
#include <stdio.h>
static bool get(void* p, size_t size, size_t n) { return fread(p, size, n, stdin) == n; }
int main() {  // three sections on stdin, answers on stdout: the calls the NVFP4 tile makes, in its order
  int n;
  if (!get(&n, 4, 1)) return 1;
  for (int b = 0; b < n; ++b) {  // activation block: gs, 16 floats -> fake_fp4 with the block's scale
    float gs, v[16], q[16];
    if (!get(&gs, 4, 1) || !get(v, 4, 16)) return 1;
    const float s = dg_moe::nvfp4_block_scale(dg_moe::block_amax(v), gs);
    for (int j = 0; j < 16; ++j) q[j] = dg_moe::fake_fp4(v[j], s);
    fwrite(q, 4, 16, stdout);
  }
  if (!get(&n, 4, 1)) return 1;
  for (int i = 0; i < n; ++i) {  // weight word: 8 codes, scale -> dequant8
    uint32_t word;
    float scale, v[8];
    if (!get(&word, 4, 1) || !get(&scale, 4, 1)) return 1;
    dg_moe::dequant8(word, scale, v);
    fwrite(v, 4, 8, stdout);
  }
  if (!get(&n, 4, 1)) return 1;
  for (int i = 0; i < n; ++i) {  // 8 bf16 from (16-byte aligned) shared memory -> load8
    alignas(16) __nv_bfloat16 row[8];
    float v[8];
    if (!get(row, 2, 8)) return 1;
    dg_moe::load8(row, v);
    fwrite(v, 4, 8, stdout);
  }
  return 0;
}
"""


@pytest.mark.slow  # compiles dg_moe.cu's helpers with nvcc
@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (compiles dg_moe.cu's helpers for the host)")
def test_kernel_nvfp4_helpers_match_pipeline_model_bit_for_bit(tmp_path):
    """dg_moe.cu's own NVFP4 code (E2M1 decode, weight dequantization, dynamic block scales, E2M1 rounding
    with its ties, bf16 unpacking), compiled for the host, against nvfp4_fake_quant and ModelOpt's
    unpack_e2m1: bit for bit on random blocks over 12 decades, exact ties, zero / tiny / saturating blocks and
    a zero global scale. (The GPU test checks the whole kernel; this runs wherever nvcc does.)"""
    import subprocess

    import numpy as np

    from pipeline.engine.kernels import CSRC
    from pipeline.model.fake_quant import nvfp4_fake_quant
    from pipeline.model.modelopt import unpack_e2m1

    src = tmp_path / "helpers.cu"
    src.write_text(_HOST_PROGRAM)
    exe = tmp_path / "helpers"
    build = subprocess.run(
        [find_nvcc(), "-O3", "-std=c++17", f"-I{CSRC}", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    g = torch.Generator().manual_seed(0)
    # activation blocks
    blocks = torch.randn(600, 16, generator=g) * torch.logspace(-6, 6, 600)[:, None]
    gs = blocks.abs().amax(1) / (6 * 448) * torch.empty(600).uniform_(0.1, 4, generator=g)  # some saturate
    ties = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, 0.5, -0.0, 6.0, 1.0]
    )
    special = torch.stack([ties * 0.125, ties * 2.0, torch.zeros(16), torch.full((16,), 1e-9), ties * 1e4])
    # amax 6 s0 and gs = s0 / 8: block scale e4m3(8) * gs = s0 exactly, so v / s lands on the ties exactly
    special_gs = torch.tensor([0.125 / 8, 2.0 / 8, 0.01, 0.01, 0.0])
    blocks, gs = torch.cat([blocks, special]), torch.cat([gs, special_gs])
    # weight words: every code in every position, then random words
    codes = torch.arange(16, dtype=torch.int64)
    words = [int(sum(int(c) << (4 * j) for j in range(8))) for c in codes]
    words += [int(w) for w in torch.randint(0, 2**32, (200,), generator=g, dtype=torch.int64)]
    word_scale = torch.rand(len(words), generator=g) * 10
    bf = (torch.randn(64, 8, generator=g) * 100).to(torch.bfloat16)
    stdin = b"".join(
        [
            np.int32(len(blocks)).tobytes(),
            torch.cat([gs[:, None], blocks], 1).float().numpy().tobytes(),
            np.int32(len(words)).tobytes(),
            b"".join(
                np.uint32(w).tobytes() + np.float32(s).tobytes() for w, s in zip(words, word_scale.tolist())
            ),
            np.int32(len(bf)).tobytes(),
            bf.view(torch.int16).numpy().tobytes(),
        ]
    )
    run = subprocess.run([str(exe)], input=stdin, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    out = torch.from_numpy(np.frombuffer(run.stdout, dtype=np.float32).copy())
    n_act, n_w = blocks.numel(), len(words) * 8
    assert out.numel() == n_act + n_w + bf.numel()
    got_act, got_w, got_bf = (
        out[:n_act].view(-1, 16),
        out[n_act : n_act + n_w].view(-1, 8),
        out[n_act + n_w :],
    )
    want_act = torch.stack([nvfp4_fake_quant(b, s) for b, s in zip(blocks, gs)])
    assert torch.equal(got_act, want_act), (got_act - want_act).abs().max()
    ties_to_even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])  # 0.25 0.75 1.25 1.75 2.5 3.5 5 6
    assert torch.equal(got_act[-5, :8], ties_to_even * 0.125) and torch.equal(
        got_act[-4, :8], ties_to_even * 2
    )
    assert torch.equal(
        got_act[-1].abs().max(), torch.tensor(6.0)
    )  # zero global scale: block scale 1, saturated
    assert torch.equal(got_act[-3], torch.zeros(16))  # all-zero block: scale 1, zeros
    packed = torch.tensor(words, dtype=torch.int64).to(torch.uint32).view(torch.uint8).view(-1, 4)
    want_w = unpack_e2m1(packed).float() * word_scale[:, None]
    assert torch.equal(got_w, want_w)
    assert torch.equal(got_w[:16, 0].abs(), torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2) * word_scale[:16])
    assert torch.equal(got_bf, bf.float().flatten())


# ---- contract and geometry ---------------------------------------------------------------------------
def test_kernel_choice_and_tile():
    assert moe_spec.kernel(moe_spec.EXPERTS_OP, "bfloat16") == "dg_trt_moe_bf16"
    assert moe_spec.kernel(moe_spec.W8A8_OP, "bfloat16") == "dg_trt_moe_bf16_w8a8"
    with pytest.raises(DgpipeError, match="export the model in bf16"):
        moe_spec.kernel(moe_spec.W8_OP, "float32")
    assert moe_spec.tile(32, 16, "float32") == 16  # tiny: capped
    assert moe_spec.tile(2816, 704, "bfloat16") == 5  # 26B-A4B: 8448 bytes per token of 48 KiB
    assert moe_spec.shared_bytes(2816, 704, "bfloat16", 5) == 42240 <= moe_spec.SMEM_BUDGET
    # 4 tokens of 12,288 bytes fill 48 KiB exactly, leaving no room for the block's static shared memory
    assert moe_spec.tile(4096, 1024, "bfloat16") == 3
    assert moe_spec.SMEM_BUDGET + moe_spec.STATIC_SHARED == 48 * 1024
    assert moe_spec.kernel(moe_spec.W4_OP, "bfloat16") == "dg_trt_moe_bf16_w4"
    assert moe_spec.kernel(moe_spec.W4A4_OP, "bfloat16") == "dg_trt_moe_bf16_w4a4"
    with pytest.raises(DgpipeError, match="FP8 and NVFP4 expert weights run with bf16 activations"):
        moe_spec.kernel(moe_spec.W4A4_OP, "float32")
    with pytest.raises(DgpipeError, match="more than the kernel's"):
        moe_spec.tile(8192, 8192, "float32")


def test_weight_shapes_are_checked():
    assert moe_spec.check_dims("MoEExperts", 32, 4, (4, 32, 32), (4, 32, 16)) == 16
    with pytest.raises(DgpipeError, match="do not fit"):
        moe_spec.check_dims("MoEExperts", 32, 4, (4, 32, 32), (4, 32, 8))
    with pytest.raises(DgpipeError, match="must share one dtype"):
        moe_spec.check_inputs(
            "MoEExperts", ["bfloat16", "int64", "float32", "float32", "bfloat16"], [2, 2, 2, 3, 3]
        )
    with pytest.raises(DgpipeError, match="'expert_index' must be int64"):
        moe_spec.check_inputs(
            "MoEExperts", ["float32", "int32", "float32", "float32", "float32"], [2, 2, 2, 3, 3]
        )


# ---- plugin.py's MoE plugins through TensorRT's own tensorrt.plugin (tests/_utils/trt_native.py) --------
def test_moe_plugins_pass_tensorrt_registration(real_trtp):
    trt, trtp = real_trtp
    for op, ports in moe_spec.SPECS.items():
        d = trtp._lib.QDP_REGISTRY[f"dgpipe::{op}"]  # parsed and validated by TensorRT's _validate.py
        assert d.input_tensor_names == [p.name for p in ports] and d.num_outputs == 1 and not d.input_attrs
        assert d.aot_impl_func is not None
        assert trt.get_plugin_registry().get_creator(op, "1", "dgpipe") is not None


@pytest.mark.parametrize(
    ("op", "x", "w", "kernel"),
    [
        ("MoEExperts", "bfloat16", "bfloat16", b"dg_trt_moe_bf16"),
        ("MoEExperts", "float32", "float32", b"dg_trt_moe_f32"),
        ("MoEExpertsW8", "bfloat16", "fp8", b"dg_trt_moe_bf16_w8"),
        ("MoEExpertsW8A8", "bfloat16", "fp8", b"dg_trt_moe_bf16_w8a8"),
    ],
)
def test_moe_plugin_at_build_time(real_trtp, op: str, x: str, w: str, kernel: bytes):
    """TensorRT's build-time calls on the wheel's AOT plugin class, 26B-A4B dims (d 2816, E 128, I 704,
    K 8), tokens dynamic: output [T, K, d] fp32, grid (E, splits of T), 5-token tiles in 42 KiB."""
    from tests._utils.trt_native import build_time_call

    trt, _ = real_trtp
    xt, wt, f32, i64 = getattr(trt, x), getattr(trt, w), trt.float32, trt.int64
    ins = [((None, 2816), xt), ((None, 8), i64), ((None, 8), f32), ((128, 1408, 2816), wt)]
    if op == "MoEExperts":
        ins += [((128, 2816, 704), wt)]
    else:
        ins += [((128, 2, 2816), f32), ((128, 2816, 704), wt), ((128,), f32)]
    if op == "MoEExpertsW8A8":
        ins += [((3, 128), f32)]
    r = build_time_call(trt, f"dgpipe::{op}", ins)
    assert r["output_types"] == [f32] and r["output_dims"] == [(None, 8, 2816)]
    tile = 5 if x == "bfloat16" else 3
    assert r["kernel"] == kernel and r["ptx"] == b"// ptx"
    assert r["launch"]["grid_x"] == 128 and r["launch"]["grid_y"] is None  # splits follow T at run time
    assert r["launch"]["block_x"] == 256 and r["launch"]["shared_mem"] == tile * (
        704 * 4 + 2816 * (2 if x == "bfloat16" else 4)
    )
    assert r["extras"] == [None, 8, 2816, 704, 128, tile]
    static = [((600, *d[1:]) if d[0] is None else d, t) for d, t in ins]
    r = build_time_call(trt, f"dgpipe::{op}", static)
    assert r["launch"]["grid_y"] == 3 and r["extras"][0] == 600  # ceil(600 / 256) splits
    big = [((10**5, *d[1:]) if d[0] is None else d, t) for d, t in ins]
    assert build_time_call(trt, f"dgpipe::{op}", big)["launch"]["grid_y"] == moe_spec.MAX_SPLITS


def test_moe_plugin_refuses_mismatched_weights(real_trtp):
    from tests._utils.trt_native import build_time_call

    trt, _ = real_trtp
    bf, i64, f32 = trt.bfloat16, trt.int64, trt.float32
    ok = [((None, 32), bf), ((None, 2), i64), ((None, 2), f32), ((4, 32, 32), bf), ((4, 32, 16), bf)]
    assert build_time_call(trt, "dgpipe::MoEExperts", ok)["extras"][1:] == [2, 32, 16, 4, 16]
    with pytest.raises(DgpipeError, match="do not fit"):
        build_time_call(trt, "dgpipe::MoEExperts", [*ok[:4], ((4, 32, 8), bf)])
    with pytest.raises(DgpipeError, match="must share one dtype"):
        build_time_call(trt, "dgpipe::MoEExperts", [*ok[:3], ((4, 32, 32), f32), ((4, 32, 16), f32)])
    with pytest.raises(DgpipeError, match="build-time constants"):
        build_time_call(trt, "dgpipe::MoEExperts", [((None, None), bf), *ok[1:]])
    fp8 = trt.fp8
    w8 = [*ok[:3], ((4, 32, 32), fp8), ((4, 2, 32), f32), ((4, 32, 16), fp8), ((4,), f32)]
    assert build_time_call(trt, "dgpipe::MoEExpertsW8", w8)["kernel"] == b"dg_trt_moe_bf16_w8"
    with pytest.raises(DgpipeError, match=r"gate_up_scale must be \[4, 2, 32\], got \[4, 2, 1\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW8", [*w8[:4], ((4, 2, 1), f32), *w8[5:]])
    with pytest.raises(DgpipeError, match=r"input_scale must be \[3, 4\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW8A8", [*w8, ((4, 3), f32)])


def _w4_inputs(trt, x, tokens=None, d=2816, inter=704, e=128, k=8, act_quant=False):
    fp4, fp8, f32, i64 = trt.fp4, trt.fp8, trt.float32, trt.int64
    ins = [((tokens, d), x), ((tokens, k), i64), ((tokens, k), f32)]
    ins += [((e, 2 * inter, d), fp4), ((e, 2 * inter, d // 16), fp8), ((e, 2, d // 16), f32)]
    ins += [((e, d, inter), fp4), ((e, d, inter // 16), fp8), ((e,), f32)]
    return [*ins, ((3, e), f32)] if act_quant else ins


@pytest.mark.parametrize(
    ("op", "x", "kernel", "tile", "per_token"),
    [
        ("MoEExpertsW4", "bfloat16", b"dg_trt_moe_bf16_w4", 5, 2816 * 2 + 704 * 4),
        # NVFP4 activations: the rows staged as codes + block scales (1.5 d bytes) in the same region
        ("MoEExpertsW4A4", "bfloat16", b"dg_trt_moe_bf16_w4a4", 5, 2816 * 2 + 704 * 4),
    ],
)
def test_nvfp4_moe_plugin_at_build_time(real_trtp, op: str, x: str, kernel: bytes, tile: int, per_token: int):
    """The NVFP4 plugins through TensorRT's build-time calls at 26B-A4B dims: FP4 weights with dims in
    elements (TensorRT packs two per byte), E4M3 block scales, fp32 global scales; tokens dynamic."""
    from tests._utils.trt_native import build_time_call

    trt, _ = real_trtp
    ins = _w4_inputs(trt, getattr(trt, x), act_quant=op.endswith("A4"))
    r = build_time_call(trt, f"dgpipe::{op}", ins)
    assert r["output_types"] == [trt.float32] and r["output_dims"] == [(None, 8, 2816)]
    assert r["kernel"] == kernel and r["launch"]["grid_x"] == 128 and r["launch"]["block_x"] == 256
    assert r["launch"]["shared_mem"] == tile * per_token <= moe_spec.SMEM_BUDGET
    assert r["extras"] == [None, 8, 2816, 704, 128, tile]
    static = [((600, *d[1:]) if d[0] is None else d, t) for d, t in ins]
    assert build_time_call(trt, f"dgpipe::{op}", static)["launch"]["grid_y"] == 3


def test_nvfp4_moe_plugin_refuses_mismatched_scales(real_trtp):
    from tests._utils.trt_native import build_time_call

    trt, _ = real_trtp
    bf, f32, fp8, fp4 = trt.bfloat16, trt.float32, trt.fp8, trt.fp4
    ok = _w4_inputs(trt, bf, d=32, inter=16, e=4, k=2)
    assert build_time_call(trt, "dgpipe::MoEExpertsW4", ok)["extras"][1:] == [2, 32, 16, 4, 16]
    with pytest.raises(DgpipeError, match=r"gate_up_block_scale must be \[4, 32, 2\], got \[4, 32, 1\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", [*ok[:4], ((4, 32, 1), fp8), *ok[5:]])
    with pytest.raises(DgpipeError, match=r"gate_up_scale must be \[4, 2, 2\], got \[4, 2, 32\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", [*ok[:5], ((4, 2, 32), f32), *ok[6:]])
    with pytest.raises(DgpipeError, match=r"down_scale must be \[4\], got \[1\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", [*ok[:8], ((1,), f32)])
    with pytest.raises(DgpipeError, match="'gate_up' must be float4e2m1, got float8e4m3"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", [*ok[:3], ((4, 32, 32), fp8), *ok[4:]])
    with pytest.raises(DgpipeError, match="'gate_up_block_scale' must be float8e4m3, got float32"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", [*ok[:4], ((4, 32, 2), f32), *ok[5:]])
    odd = _w4_inputs(trt, bf, d=32, inter=8, e=4, k=2)  # I = 8: half a block
    odd[7] = ((4, 32, 1), fp8)
    with pytest.raises(DgpipeError, match="whole blocks of 16, got d=32, I=8"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", odd)
    with pytest.raises(DgpipeError, match=r"input_scale must be \[3, 4\]"):
        build_time_call(trt, "dgpipe::MoEExpertsW4A4", [*ok, ((4, 3), f32)])
    with pytest.raises(DgpipeError, match="run with bf16 activations: export the model in bf16"):
        build_time_call(trt, "dgpipe::MoEExpertsW4", _w4_inputs(trt, f32, d=32, inter=16, e=4, k=2))
    assert fp4 is trt.DataType.FP4


# ---- the engine build's lowering of dgpipe::MoE (pipeline/engine/moe_graph.py) ---------------------------
def _moe_graph(layer, x, index, weights, *, fp8: bool = False, act_quant: bool = False):
    """A graph with one dgpipe::MoE node as the routed exporter writes it (pipeline/onnx/contract.py MOE):
    model-dtype weights, or FP8 initializers behind DequantizeLinear (gate_up blocked per gate/up half)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    gu, dn = layer.experts.gate_up_proj.detach(), layer.experts.down_proj.detach()
    e, two_i, d = gu.shape
    inter = two_i // 2
    nodes, inits = [], []
    if fp8:
        gs = torch.stack([gu[:, :inter].abs().amax((1, 2)), gu[:, inter:].abs().amax((1, 2))], 1) / 448
        gs = gs[:, :, None].expand(e, 2, d).float().contiguous()
        ds = (dn.abs().amax((1, 2)) / 448).float()
        full = torch.cat([gs[:, :1].expand(-1, inter, -1), gs[:, 1:].expand(-1, inter, -1)], 1)
        gu8 = (gu.float() / full).to(torch.float8_e4m3fn)
        dn8 = (dn.float() / ds[:, None, None]).to(torch.float8_e4m3fn)
        for name, t in (("gu8", gu8), ("dn8", dn8)):
            inits.append(
                helper.make_tensor(
                    name,
                    TensorProto.FLOAT8E4M3FN,
                    list(t.shape),
                    t.view(torch.uint8).numpy().tobytes(),
                    raw=True,
                )
            )
        inits += [numpy_helper.from_array(gs.numpy(), "gu_s"), numpy_helper.from_array(ds.numpy(), "dn_s")]
        nodes += [
            helper.make_node("DequantizeLinear", ["gu8", "gu_s"], ["gate_up"], axis=1, block_size=inter),
            helper.make_node("DequantizeLinear", ["dn8", "dn_s"], ["down"], axis=0),
        ]
        weights_ref = {"gate_up": gu8, "down": dn8, "gate_up_scale": gs, "down_scale": ds}
    else:
        inits += [
            numpy_helper.from_array(gu.float().numpy(), "gate_up"),
            numpy_helper.from_array(dn.float().numpy(), "down"),
        ]
        weights_ref = {"gate_up": gu.float(), "down": dn.float()}
    moe_inputs = ["hidden32", "expert_index", "expert_weight", "gate_up", "down"]
    if act_quant:
        scales = torch.tensor([[0.01] * e, [0.02] * e, [0.004] * e])
        inits.append(numpy_helper.from_array(scales.numpy(), "input_scale"))
        moe_inputs.append("input_scale")
        weights_ref["input_scale"] = scales
    nodes.insert(0, helper.make_node("Cast", ["hidden"], ["hidden32"], to=TensorProto.FLOAT))
    nodes.append(
        helper.make_node(
            "MoE", moe_inputs, ["out"], name="layers.0.moe", domain="dgpipe", num_experts=e, top_k=2,
            expert_hidden=inter, activation="gelu_tanh", act_quant="fp8" if act_quant else "none",
            plugin_namespace="dgpipe", plugin_version="1",
        )
    )  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "moe",
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", d]),
            helper.make_tensor_value_info("expert_index", TensorProto.INT64, ["T", 2]),
            helper.make_tensor_value_info("expert_weight", TensorProto.FLOAT, ["T", 2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", d])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("dgpipe", 1)]
    )
    model.ir_version = 10
    feeds = {"hidden": x.float().numpy(), "expert_index": index.numpy(), "expert_weight": weights.numpy()}
    return onnx, model, feeds, weights_ref


def onnx_numpy(t: torch.Tensor, name: str):
    from onnx import numpy_helper

    return numpy_helper.from_array(t.detach().float().numpy(), name)


def _run_lowered(model, feeds):
    """Run the lowered graph with onnx's reference evaluator: the standard ops (DequantizeLinear, ReduceSum,
    CastLike) are onnx's own; the plugin nodes run the PyTorch reference (the GPU kernel's oracle)."""
    import numpy as np
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    def rows(*ins, **scales):
        t = [torch.from_numpy(np.array(a)) for a in ins]
        return (moe_experts_reference(*t[:3], t[3], t[4], dtype=torch.float32, **scales).numpy(),)

    class MoEExperts(OpRun):
        op_domain = "dgpipe"

        def _run(self, hidden, index, weight, gate_up, down, **plugin_attributes):
            return rows(hidden, index, weight, gate_up, down)

    def fp8(a):
        return torch.from_numpy(np.array(a).view(np.uint8)).view(torch.float8_e4m3fn)

    class MoEExpertsW8(OpRun):
        op_domain = "dgpipe"

        def _run(self, hidden, index, weight, gu, gu_s, dn, dn_s, **plugin_attributes):
            t = [torch.from_numpy(np.array(a)) for a in (hidden, index, weight)]
            out = moe_experts_reference(*t, fp8(gu), fp8(dn), gate_up_scale=torch.from_numpy(np.array(gu_s)),
                                        down_scale=torch.from_numpy(np.array(dn_s)), dtype=torch.float32)  # fmt: skip
            return (out.numpy(),)

    class MoEExpertsW8A8(OpRun):
        op_domain = "dgpipe"

        def _run(self, hidden, index, weight, gu, gu_s, dn, dn_s, in_s, **plugin_attributes):
            t = [torch.from_numpy(np.array(a)) for a in (hidden, index, weight)]
            out = moe_experts_reference(*t, fp8(gu), fp8(dn), gate_up_scale=torch.from_numpy(np.array(gu_s)),
                                        down_scale=torch.from_numpy(np.array(dn_s)), input_scale=torch.from_numpy(np.array(in_s)),
                                        dtype=torch.float32)  # fmt: skip
            return (out.numpy(),)

    return ReferenceEvaluator(model, new_ops=[MoEExperts, MoEExpertsW8, MoEExpertsW8A8]).run(None, feeds)[0]


@pytest.mark.parametrize(
    ("fp8", "act_quant", "op"),
    [(False, False, "MoEExperts"), (True, False, "MoEExpertsW8"), (True, True, "MoEExpertsW8A8")],
)
def test_lowering_keeps_the_node_semantics(layer, fp8: bool, act_quant: bool, op: str):
    from pipeline.engine.moe_graph import lower_moe

    x, index, weights = routed(layer, tokens=11, seed=4)
    onnx, model, feeds, w = _moe_graph(layer, x, index, weights, fp8=fp8, act_quant=act_quant)
    assert lower_moe(model) == 1
    onnx.checker.check_model(model)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert ("dgpipe", "MoE") not in ops and ("dgpipe", op) in ops
    assert ops[-2:] == [("", "ReduceSum"), ("", "CastLike")]
    assert ("", "DequantizeLinear") not in ops  # FP8: the plugin reads the packed weights themselves
    plugin = next(n for n in model.graph.node if n.op_type == op)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in plugin.attribute} == {
        "plugin_namespace": b"dgpipe",
        "plugin_version": b"1",
        "aot": 1,
    }
    got = _run_lowered(model, feeds)
    scales = {k: v for k, v in w.items() if k.endswith("scale")}
    want = moe_reference(x.float(), index, weights, w["gate_up"], w["down"], dtype=torch.float64, **scales)
    assert got.shape == (11, 32) and got.dtype.name == "float32"
    assert torch.allclose(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)  # fp32 evaluation of fp64 oracle


def test_lowering_refuses_what_no_kernel_runs(layer):
    from onnx import helper

    from pipeline.engine.moe_graph import lower_moe

    x, index, weights = routed(layer, tokens=3)
    _, model, _, _ = _moe_graph(layer, x, index, weights)
    node = next(n for n in model.graph.node if n.op_type == "MoE")
    node.attribute.append(helper.make_attribute("act_quant", "fp8"))
    del node.attribute[[a.name for a in node.attribute].index("act_quant")]
    with pytest.raises(DgpipeError, match="act_quant=fp8 needs FP8 expert weights"):
        lower_moe(model)
    _, model, _, _ = _moe_graph(layer, x, index, weights)
    node = next(n for n in model.graph.node if n.op_type == "MoE")
    del node.attribute[[a.name for a in node.attribute].index("activation")]
    node.attribute.append(helper.make_attribute("activation", "silu"))
    with pytest.raises(DgpipeError, match="gelu_tanh only"):
        lower_moe(model)
    _, model, _, _ = _moe_graph(layer, x, index, weights, fp8=True)
    next(i for i in model.graph.initializer if i.name == "gu8").data_type = 22  # INT4: no kernel
    with pytest.raises(DgpipeError, match="dequantized from INT4: the MoE plugin has FP8 E4M3, NVFP4 and"):
        lower_moe(model)
    _, model, _, _ = _moe_graph(layer, x, index, weights, fp8=True)
    next(n for n in model.graph.node if n.output[0] == "down").output[0] = "down_dq"
    next(n for n in model.graph.node if n.op_type == "MoE").input[4] = "down_f"
    model.graph.initializer.append(onnx_numpy(layer.experts.down_proj, "down_f"))
    with pytest.raises(DgpipeError, match=r"must share one format .* got fp8 and model dtype"):
        lower_moe(model)


def _nvfp4_moe_graph(layer, act_quant: bool):
    """One dgpipe::MoE node fed as the NVFP4 exporter writes it (pipeline/onnx/quant.py insert_routed_nvfp4:
    FLOAT4E2M1 -> DQ(axis -1, block 16) whose scale is DQ(E4M3 block scales, global; gate_up axis 1 block
    I, down axis 0)), with the node's reference function (opset 23: FLOAT4E2M1), so onnx's reference
    evaluator runs the node as the contract defines it. Returns (model, the weights as the plugin reads them)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pipeline.onnx import contract as onnx_io
    from pipeline.onnx.moe import moe_function

    w = nvfp4_experts(layer)
    e, two_i, half_d = w["gate_up"].shape
    d, inter = 2 * half_d, two_i // 2
    inits, nodes = [], []
    for name, shape, axis in (
        ("gate_up", [e, two_i, d], {"axis": 1, "block_size": inter}),
        ("down", [e, d, inter], {"axis": 0}),
    ):
        raw = w[name].contiguous().numpy().tobytes()
        inits.append(helper.make_tensor(f"{name}.w4", TensorProto.FLOAT4E2M1, shape, raw, raw=True))
        bs = w[f"{name}_block_scale"]
        inits.append(
            helper.make_tensor(
                f"{name}.bs",
                TensorProto.FLOAT8E4M3FN,
                list(bs.shape),
                bs.view(torch.uint8).numpy().tobytes(),
                raw=True,
            )
        )
        inits.append(numpy_helper.from_array(w[f"{name}_scale"].float().numpy(), f"{name}.ws2"))
        nodes += [
            helper.make_node("DequantizeLinear", [f"{name}.bs", f"{name}.ws2"], [f"{name}/w_scale"], **axis),
            helper.make_node(
                "DequantizeLinear", [f"{name}.w4", f"{name}/w_scale"], [name], axis=-1, block_size=16
            ),
        ]
    moe_inputs = ["hidden", "expert_index", "expert_weight", "gate_up", "down"]
    if act_quant:
        w["input_scale"] = nvfp4_input_scales(layer)
        inits.append(numpy_helper.from_array(w["input_scale"].numpy(), "input_scale"))
        moe_inputs.append("input_scale")
    quant = "nvfp4" if act_quant else "none"
    nodes.append(
        helper.make_node(
            "MoE", moe_inputs, ["out"], name="layers.0.moe", domain="dgpipe", num_experts=e, top_k=2,
            expert_hidden=inter, activation="gelu_tanh", act_quant=quant,
            plugin_namespace="dgpipe", plugin_version="1",
        )
    )  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "moe",
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", d]),
            helper.make_tensor_value_info("expert_index", TensorProto.INT64, ["T", 2]),
            helper.make_tensor_value_info("expert_weight", TensorProto.FLOAT, ["T", 2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", d])],
        inits,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", onnx_io.OPSET_NVFP4), helper.make_opsetid("dgpipe", 1)],
        functions=[moe_function(onnx_io.OPSET_NVFP4, quant)],
    )
    model.ir_version = 11
    onnx.checker.check_model(model)
    return model, w


def _run_lowered_nvfp4(model, feeds):
    """The lowered NVFP4 graph in onnx's reference evaluator: the Casts and ReduceSum are onnx's, the plugin
    node runs the PyTorch reference on the initializers as TensorRT hands them to the kernel (FLOAT4E2M1 codes
    repacked two per byte, low nibble first, as ONNX stores them)."""
    import copy

    import numpy as np
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    def packed(a) -> torch.Tensor:
        codes = torch.from_numpy(np.array(a).view(np.uint8).copy())
        return codes[..., 0::2] | (codes[..., 1::2] << 4)

    def fp8(a) -> torch.Tensor:
        return torch.from_numpy(np.array(a).view(np.uint8).copy()).view(torch.float8_e4m3fn)

    def rows(hidden, index, weight, gu, gu_bs, gu_s, dn, dn_bs, dn_s, in_s=None):
        t = [torch.from_numpy(np.array(a)) for a in (hidden, index, weight)]
        out = moe_experts_reference(
            *t, packed(gu), packed(dn), gate_up_block_scale=fp8(gu_bs), gate_up_scale=torch.from_numpy(np.array(gu_s)),
            down_block_scale=fp8(dn_bs), down_scale=torch.from_numpy(np.array(dn_s)),
            input_scale=None if in_s is None else torch.from_numpy(np.array(in_s)), dtype=torch.float32,
        )  # fmt: skip
        return (out.numpy(),)

    class MoEExpertsW4(OpRun):
        op_domain = "dgpipe"

        def _run(self, *ins, **plugin_attributes):
            return rows(*ins)

    class MoEExpertsW4A4(MoEExpertsW4):
        pass

    model = copy.deepcopy(model)
    del model.functions[:]  # the MoE node's reference function: no node calls it any more
    return ReferenceEvaluator(model, new_ops=[MoEExpertsW4, MoEExpertsW4A4]).run(None, feeds)[0]


@pytest.mark.parametrize(("act_quant", "op"), [(False, "MoEExpertsW4"), (True, "MoEExpertsW4A4")])
def test_nvfp4_lowering_keeps_the_node_semantics(layer, act_quant: bool, op: str):
    """An NVFP4 routed node lowers to the W4 plugin reading the packed initializers (no DequantizeLinear
    left), and the plugin's reference equals the ONNX node's own reference function (onnx's evaluator:
    onnxruntime has no FLOAT4E2M1 kernels) to fp32 noise."""
    import copy

    import onnx
    import onnx.inliner
    from onnx.reference import ReferenceEvaluator

    from pipeline.engine.moe_graph import lower_moe

    x, index, weights = routed(layer, tokens=13, seed=8)
    model, w = _nvfp4_moe_graph(layer, act_quant)
    feeds = {"hidden": x.float().numpy(), "expert_index": index.numpy(), "expert_weight": weights.numpy()}
    # the node's function inlined and typed (onnx's evaluator runs Gelu only with its input type known)
    inlined = onnx.shape_inference.infer_shapes(onnx.inliner.inline_local_functions(model))
    want = torch.from_numpy(ReferenceEvaluator(inlined).run(None, feeds)[0])  # the node's reference function
    lowered = copy.deepcopy(model)
    assert lower_moe(lowered, "sm100") == 1
    onnx.checker.check_model(lowered)
    ops = [(n.domain, n.op_type) for n in lowered.graph.node]
    assert ("dgpipe", "MoE") not in ops and ("dgpipe", op) in ops and ("", "DequantizeLinear") not in ops
    plugin = next(n for n in lowered.graph.node if n.op_type == op)
    assert list(plugin.input[3:5]) == ["gate_up.w4", "gate_up.bs"] and list(plugin.input[6:8]) == [
        "down.w4",
        "down.bs",
    ]
    assert len(plugin.input) == (10 if act_quant else 9)
    got = torch.from_numpy(_run_lowered_nvfp4(lowered, feeds))
    assert got.shape == (13, 32) and torch.isfinite(got).all()
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    oracle = moe_reference(x.float(), index, weights, **w)  # float64, and the plugin's reference equals it
    assert float((got.double() - oracle).abs().max()) <= 1e-5 * scale
    if act_quant:
        plain = moe_reference(x.float(), index, weights, **{k: v for k, v in w.items() if k != "input_scale"})
        assert float((plain - oracle).abs().max()) > 1e-2 * scale  # the node's activations are quantized


def test_nvfp4_lowering_refusals(layer):
    from onnx import helper

    from pipeline.engine.moe_graph import lower_moe

    model, _ = _nvfp4_moe_graph(layer, act_quant=True)
    with pytest.raises(DgpipeError, match="does not run natively on sm90") as refused:
        lower_moe(model, "sm90")  # pipeline.targets: NVFP4 is sm100 / sm120 only
    assert "fp8" in str(refused.value.hint)
    assert lower_moe(model, "sm120") == 1
    model, _ = _nvfp4_moe_graph(layer, act_quant=True)
    node = next(n for n in model.graph.node if n.op_type == "MoE")
    del node.attribute[[a.name for a in node.attribute].index("act_quant")]
    node.attribute.append(helper.make_attribute("act_quant", "fp8"))
    with pytest.raises(DgpipeError, match="act_quant=fp8 needs FP8 expert weights"):
        lower_moe(model)
    model, _ = _nvfp4_moe_graph(layer, act_quant=False)
    dq = next(n for n in model.graph.node if n.output[0] == "gate_up/w_scale")
    dq.attribute[[a.name for a in dq.attribute].index("axis")].i = 2  # global scale along d: not the layout
    with pytest.raises(
        DgpipeError, match="gate_up global scale must be applied by DequantizeLinear axis=1, block_size=16"
    ):
        lower_moe(model)
    model, _ = _nvfp4_moe_graph(layer, act_quant=False)
    dq = next(n for n in model.graph.node if n.output[0] == "down")
    dq.attribute[[a.name for a in dq.attribute].index("block_size")].i = 32
    with pytest.raises(DgpipeError, match="blocks of 16 along its last axis"):
        lower_moe(model)
    model, _ = _nvfp4_moe_graph(layer, act_quant=False)
    dq = next(n for n in model.graph.node if n.output[0] == "down")
    dq.input[1] = "down.ws2"  # one-level DQ: no block scales
    with pytest.raises(DgpipeError, match="is not scaled by DequantizeLinear"):
        lower_moe(model)


def test_engine_build_parses_the_lowered_copy(layer, tmp_path):
    """_onnx_for_trt: the export stays as written; TensorRT parses a graph-only copy beside it with the MoE
    lowered and the sampler nodes marked."""
    from onnx import helper

    from pipeline.engine.build_engine import _onnx_for_trt

    x, index, weights = routed(layer, tokens=3)
    onnx, model, _, _ = _moe_graph(layer, x, index, weights)
    model.graph.node.append(helper.make_node("SampleRows", ["out"], ["rows"], domain="dgpipe"))  # parse-only
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    parsed = _onnx_for_trt(path, tmp_path)
    assert parsed != path and parsed.parent == tmp_path
    ops = [n.op_type for n in onnx.load(str(parsed)).graph.node]
    assert "MoE" not in ops and "MoEExperts" in ops
    rows = next(n for n in onnx.load(str(parsed)).graph.node if n.op_type == "SampleRows")
    assert any(a.name == "plugin_namespace" for a in rows.attribute)
    assert "MoE" in [n.op_type for n in onnx.load(str(path)).graph.node]  # the export is untouched


def test_a_routed_export_is_lowered_for_tensorrt(tmp_path):
    """The exporter's own routed graph (one dgpipe::MoE per layer) lowers completely and stays valid ONNX."""
    import inspect

    import onnx

    from pipeline.engine.build_engine import _onnx_for_trt
    from pipeline.onnx.export import export_onnx

    if "moe" not in inspect.signature(export_onnx).parameters:
        pytest.skip("this tree's exporter has no routed MoE form yet (export_onnx(moe=...))")
    model = build_tiny()
    export_onnx(model, tmp_path / "onnx", moe="routed")
    original = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False)
    routed_nodes = [n for n in original.graph.node if n.domain == "dgpipe" and n.op_type == "MoE"]
    assert len(routed_nodes) == model.cfg.num_hidden_layers
    parsed = _onnx_for_trt(tmp_path / "onnx" / "model.onnx", tmp_path / "onnx")
    lowered = onnx.load(str(parsed), load_external_data=False)
    ops = [n.op_type for n in lowered.graph.node]
    assert "MoE" not in ops and ops.count("MoEExperts") == len(routed_nodes)
    onnx.checker.check_model(str(parsed))  # by path: external data resolved beside the model


# ONNX element types as the plugins name TensorRT's (pipeline/engine/plugin.py _dtype_names)
PLUGIN_DTYPES = {"FLOAT": "float32", "BFLOAT16": "bfloat16", "FLOAT16": "float16", "INT64": "int64",
                 "INT32": "int32", "BOOL": "bool", "FLOAT8E4M3FN": "float8e4m3", "FLOAT4E2M1": "float4e2m1"}  # fmt: skip


@pytest.fixture(scope="module", params=["bf16", "fp8", "nvfp4"])
def build_graph(request, tmp_path_factory):
    """What `dgpipe build --precision P` exports for the engines: ModelOpt's own checkpoint of the embedded
    model (bf16: the float checkpoint), exported at the build's graph dtype."""
    from pipeline.engine.build_engine import GRAPH_DTYPE
    from pipeline.onnx.stage import run_export
    from pipeline.resources import EMBEDDED_MODEL

    precision, root = request.param, tmp_path_factory.mktemp(request.param)
    ckpt = EMBEDDED_MODEL
    if precision != "bf16":
        pytest.importorskip("modelopt", reason="needs nvidia-modelopt: pip install 'dgpipe[quantize]'")
        from quantize.run import QuantizeOptions, quantize_checkpoint

        opts = QuantizeOptions(EMBEDDED_MODEL, precision, root / "ckpt", calib_size=8, calib_steps=4)
        ckpt = Path(quantize_checkpoint(opts).output)
    run_export(ckpt, root / "onnx", None, True, stream=True, dtype=GRAPH_DTYPE)  # as the build does
    return precision, Path(ckpt), root / "onnx" / "model.onnx"


def test_the_builds_graph_gives_every_plugin_inputs_it_has_a_kernel_for(build_graph):
    """The checks TensorRT's build runs in each plugin (plugin.py: check_inputs, then the kernel for the
    hidden states' dtype), on the lowered graph's own input types. A fp32 graph fails them for FP8 / NVFP4
    experts (their kernels take bf16 hidden states) and would make a bf16 engine an fp32 one."""
    import onnx

    from pipeline.engine import plugin_spec
    from pipeline.engine.build_engine import _onnx_for_trt, check_export_precision
    from pipeline.model.modelopt import read_packed_linears

    precision, ckpt, path = build_graph
    check_export_precision(path, precision)
    lowered = onnx.shape_inference.infer_shapes(onnx.load(str(_onnx_for_trt(path, path.parent, "sm100"))))
    g = lowered.graph
    types = {v.name: v.type.tensor_type for v in [*g.input, *g.value_info, *g.output]}
    inits = {t.name: t for t in g.initializer}

    def described(name: str) -> tuple[str, int]:
        if name in inits:
            return PLUGIN_DTYPES[onnx.TensorProto.DataType.Name(inits[name].data_type)], len(inits[name].dims)
        t = types[name]
        return PLUGIN_DTYPES[onnx.TensorProto.DataType.Name(t.elem_type)], len(t.shape.dim)

    kernels = set()
    for node in g.node:
        if node.domain != plugin_spec.NAMESPACE:
            continue
        dtypes, ranks = map(list, zip(*(described(i) for i in node.input), strict=True))
        if node.op_type in moe_spec.SPECS:
            moe_spec.check_inputs(node.op_type, dtypes, ranks)
            kernels.add(moe_spec.kernel(node.op_type, dtypes[0]))
        else:
            plugin_spec.check_inputs(node.op_type, dtypes, ranks)
    want = {"bf16": "dg_trt_moe_bf16", "fp8": "dg_trt_moe_bf16_w8a8", "nvfp4": "dg_trt_moe_bf16_w4a4"}
    assert kernels == {want[precision]}
    # the Q/DQ stay fp32 in the bf16 graph (ModelOpt's "QDQ in Float"): one per quantized linear outside
    # the experts, each quantizing a fp32 tensor
    quantize = [n for n in g.node if n.op_type in ("QuantizeLinear", "TRT_FP4DynamicQuantize")]
    assert all(described(n.input[0])[0] == "float32" for n in quantize)
    dense = [p for p in (read_packed_linears(ckpt) if precision != "bf16" else {}) if ".experts." not in p]
    assert len(quantize) == len(dense)


def test_an_engine_is_not_built_from_a_graph_in_another_dtype(build_graph, tmp_path):
    """A strongly typed engine runs the graph's types: an fp32 export for a bf16 / FP8 / NVFP4 engine is
    refused before TensorRT is needed, naming the export that fixes it."""
    from pipeline.engine.build_engine import check_export_precision
    from pipeline.onnx.stage import run_export

    precision, ckpt, _ = build_graph
    run_export(ckpt, tmp_path / "onnx", None, True, dtype="float32")
    with pytest.raises(
        DgpipeError, match=r"is a float32 graph: a strongly typed .* needs a bfloat16 one"
    ) as e:
        check_export_precision(tmp_path / "onnx" / "model.onnx", precision)
    assert "dgpipe export --dtype bfloat16" in e.value.hint
