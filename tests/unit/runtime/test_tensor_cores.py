"""Tensor-core modules on the CPU: torch's `F.scaled_mm` has CPU kernels for FP8 TensorWise and RowWise, so
`ScaledLinear` runs here for real against the fake-quantized float reference; `F.scaled_grouped_mm` is
CUDA-only, so `ScaledExperts`' operands are checked group by group through `F.scaled_mm` (the grouped GEMM
on a GPU: tests/gpu/test_tensor_cores_cuda.py). And `graph_safe` on quantized embedded models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.checkpoint import load_model
from pipeline.model.fake_quant import fp8_fake_quant, nvfp4_fake_quant
from pipeline.model.modelopt import PackedLinear, read_packed_linears
from pipeline.model.network import gelu_tanh
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime import dispatch as dp
from pipeline.runtime import tensor_cores as tc
from pipeline.runtime.backends import TorchBackend, experts_graph_safe
from tests._utils.quantized import build_quantized_checkpoint, quantize

CPU = torch.device("cpu")
GEN = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: build_quantized_checkpoint(root / fmt, fmt) for fmt in ("fp8", "nvfp4")}


def _packed(fmt: str, n: int = 48, k: int = 64) -> PackedLinear:
    return PackedLinear(fmt.upper(), **quantize(torch.randn(n, k, generator=GEN) * 0.1, fmt))


def test_scaled_linear_fp8_is_the_fake_quant_linear():
    q, x = _packed("fp8"), torch.randn(2, 5, 64, generator=GEN)
    got = tc.ScaledLinear(q, "fp8", CPU, torch.float32)(x)
    want = F.linear(fp8_fake_quant(x, q.input_scale), q.dequantized())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # same operands; accumulation order only


def test_scaled_linear_nvfp4_fallback_requantizes_rows():
    q, x = _packed("nvfp4"), torch.randn(7, 64, generator=GEN)
    got = tc.ScaledLinear(q, "fp8_rowwise", CPU, torch.float32)(x)
    a = nvfp4_fake_quant(x, q.input_scale)
    sa = a.abs().amax(-1, keepdim=True) / 448
    wq, ws = sl.fp8_rowwise_weight(q.dequantized())
    want = F.linear(fp8_fake_quant(a, sa), wq.float() * ws[:, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = F.linear(a, q.dequantized())  # the NVFP4 reference: the fallback's cost in accuracy, bounded
    assert float((got - exact).abs().max()) <= 0.15 * float(exact.abs().max())


def test_scaled_experts_fp8_operands_equal_the_fake_quant_experts():
    """ScaledExperts' buffers, multiplied per expert by F.scaled_mm RowWise (what scaled_grouped_mm does per
    group), equal the fake-quantized expert forward on the dequantized weights."""
    e, d, inner, t = 4, 64, 32, 9
    gate, up, down = (
        [_packed("fp8", n, k) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    m = tc.ScaledExperts(gate, up, down, "fp8", CPU, torch.float32)
    x = torch.randn(t, d, generator=GEN)
    index = torch.randint(0, e, (t, 2), generator=GEN)
    weights = torch.rand(t, 2, generator=GEN)
    order, token_of, offs = sl.expert_order(index, e)
    rows = sl.fp8_quantize(x[token_of], m.in_scale)
    got, start = [], 0
    for g, end in enumerate(offs.tolist()):
        a = rows[start:end]
        s_a = m.in_scale.expand(end - start)[:, None]
        h = F.scaled_mm(
            a,
            m.w13[g].t(),
            s_a,
            F.ScalingType.RowWise,
            m.s13[g][None],
            F.ScalingType.RowWise,
            output_dtype=torch.float32,
        )
        gt, u = h.chunk(2, -1)
        hq = sl.fp8_quantize(gelu_tanh(gt) * u, m.down_in_scale)
        s_h = m.down_in_scale.expand(end - start)[:, None]
        got.append(
            F.scaled_mm(
                hq,
                m.w2[g].t(),
                s_h,
                F.ScalingType.RowWise,
                m.s2[g][None],
                F.ScalingType.RowWise,
                output_dtype=torch.float32,
            )
        )
        start = end
    y = torch.cat(got) * weights.reshape(-1)[order][:, None]
    out = torch.zeros_like(x).index_add_(0, token_of, y)
    want = torch.zeros_like(x)
    for slot in range(t * 2):
        tok, ex = slot // 2, int(index.reshape(-1)[slot])
        w13 = torch.cat([gate[ex].dequantized(), up[ex].dequantized()])
        gt, u = F.linear(fp8_fake_quant(x[tok], m.in_scale), w13).chunk(2, -1)
        want[tok] += (
            F.linear(fp8_fake_quant(gelu_tanh(gt) * u, m.down_in_scale), down[ex].dequantized())
            * weights.reshape(-1)[slot]
        )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_every_vendor_kernel_of_the_table_has_a_module_mode():
    for row in dp.DISPATCH.values():
        for kernel in (row.linears, row.experts):
            assert (tc.kernel_mode(kernel) is None) == kernel.startswith(("F.linear", "F.grouped_mm")), kernel
    assert tc.kernel_mode(dp.dispatch("nvfp4", "sm90").experts) == "fp8_rowwise"
    assert tc.kernel_mode(dp.dispatch("fp8", "sm90").experts) == "fp8"


def test_probe_runs_only_the_forms_the_table_names_for_the_gpu():
    """Hopper never runs the NVFP4 kernels (one left a sticky launch failure on an H200); Blackwell does."""
    assert tc.probe_plan("sm90") == [
        ("linear", "fp8", "fp8"), ("experts", "fp8", "fp8"),
        ("linear", "fp8_rowwise", "nvfp4"), ("experts", "fp8_rowwise", "nvfp4"),
    ]  # fmt: skip
    assert tc.probe_plan("sm100") == [
        ("linear", "fp8", "fp8"),
        ("linear", "nvfp4", "nvfp4"),
        ("experts", "nvfp4", "nvfp4"),
    ]
    assert tc.probe_plan("sm89") == [("linear", "fp8", "fp8"), ("linear", "fp8_rowwise", "nvfp4")]
    assert tc.probe_plan(None) == []


def test_cuda_only_entry_points_say_so_on_cpu(ckpts):
    with pytest.raises(DgpipeError, match="CUDA"):
        tc.probe("cpu")
    model = load_model(ckpts["fp8"])[0]
    with pytest.raises(DgpipeError, match="CUDA model"):
        tc.install_from_checkpoint(model, ckpts["fp8"], tc.Probe("sm90"))
    assert tc.install_from_checkpoint(model, EMBEDDED_MODEL) is None  # unquantized: nothing to do


def test_graph_safe_tells_the_truth_for_every_weight_format(ckpts):
    plain = load_model(EMBEDDED_MODEL)[0]
    assert experts_graph_safe(plain)  # grouped GEMM, no host sync
    for fmt, path in ckpts.items():
        model = load_model(path)[0]
        assert not experts_graph_safe(model), fmt  # fake-quant experts sync through .tolist()
        assert not TorchBackend(model).graph_safe
        packed = read_packed_linears(path)
        mode = "fp8" if fmt == "fp8" else "fp8_rowwise"
        for i, layer in enumerate(model.layers):
            n = layer.experts.num_experts
            per = [
                [packed[f"layers.{i}.experts.{e}.{p}"] for e in range(n)]
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
            layer.experts = tc.ScaledExperts(*per, mode, CPU, torch.float32)
        assert experts_graph_safe(model), fmt  # tensor-core experts keep routing on the device
    assert not TorchBackend(plain).graph_safe  # on the CPU: no fused sampler, nothing to capture
