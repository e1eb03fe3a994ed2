"""The routed-experts plugin without a GPU: the PyTorch reference (the kernel's oracle) against the model's
own MoE in float64, the plugin contract and geometry, and TensorRT's registration code on plugin.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine import moe_spec
from pipeline.engine.kernels.moe_reference import moe_experts_reference, moe_reference
from pipeline.errors import DgpipeError
from pipeline.model.fake_quant import fp8_fake_quant
from tests._utils.tiny import build_tiny


@pytest.fixture(scope="module")
def layer():
    return build_tiny(torch.float64, seed=3).layers[0]


def routed(layer, tokens: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layer.experts.gate_up_proj.shape[-1], generator=g, dtype=torch.float64)
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


# ---- contract and geometry ---------------------------------------------------------------------------
def test_kernel_choice_and_tile():
    assert moe_spec.kernel(moe_spec.EXPERTS_OP, "bfloat16") == "dg_trt_moe_bf16"
    assert moe_spec.kernel(moe_spec.W8A8_OP, "bfloat16") == "dg_trt_moe_bf16_w8a8"
    with pytest.raises(DgpipeError, match="export the model in bf16"):
        moe_spec.kernel(moe_spec.W8_OP, "float32")
    assert moe_spec.tile(32, 16, "float32") == 16  # tiny: capped
    assert moe_spec.tile(2816, 704, "bfloat16") == 5  # 26B-A4B: 8448 bytes per token of 48 KiB
    assert moe_spec.shared_bytes(2816, 704, "bfloat16", 5) == 42240 <= moe_spec.SMEM_BUDGET
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
