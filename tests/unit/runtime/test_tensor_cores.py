"""Tensor-core modules on the CPU: torch's `F.scaled_mm` has CPU kernels for FP8 TensorWise and RowWise, so
`ScaledLinear` runs here for real against the fake-quantized float reference; `F.scaled_grouped_mm` is
CUDA-only, so `ScaledExperts` runs with it emulated group by group through `F.scaled_mm` (the grouped GEMM
on a GPU: tests/gpu/test_tensor_cores_cuda.py). And `graph_safe` on quantized embedded models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.errors import DgpipeError
from pipeline.model import scaled_layout as sl
from pipeline.model.checkpoint import load_model
from pipeline.model.fake_quant import fp8_fake_quant, nvfp4_fake_quant
from pipeline.model.modelopt import PackedLinear, QuantizedLoader, is_packed, read_packed_linears
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime import dispatch as dp
from pipeline.runtime import gpu_load
from pipeline.runtime import probe as probing
from pipeline.runtime import tensor_cores as tc
from pipeline.runtime.backends import TorchBackend, experts_graph_safe
from pipeline.runtime.probe.common import fp8_codes_equal
from pipeline.runtime.probe.quant import QUANT_PROBE_VALUES
from tests._utils.compile import compiled_whole, graph_targets
from tests._utils.quantized import build_quantized_checkpoint, grouped_scaled_mm_on_cpu, packed_linear

CPU = torch.device("cpu")
GEN = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {fmt: build_quantized_checkpoint(root / fmt, fmt) for fmt in ("fp8", "nvfp4")}


def _packed(fmt: str, n: int = 48, k: int = 64) -> PackedLinear:
    return packed_linear(fmt, n, k, GEN)


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


def test_scaled_experts_fp8_is_the_fake_quant_expert_loop(monkeypatch):
    """ScaledExperts' forward (tokens quantized once then gathered, grouped GEMMs, outputs permuted back and
    combined per token by one batched product) against the fake-quantized expert loop on the dequantized
    weights; uneven groups and an expert with no token included. Given x as its FP8 operand at the experts'
    input scale (`scaled_layout.QuantizedRows`), the same output bit for bit."""
    from pipeline.model.fake_quant import InputQuantizer
    from pipeline.model.modelopt import _quantized_experts_forward

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu())
    e, d, inner, t = 4, 64, 32, 9
    gate, up, down = (
        [_packed("fp8", n, k) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    m = tc.ScaledExperts(gate, up, down, "fp8", CPU)
    x = torch.randn(t, d, generator=GEN)
    index = torch.randint(0, e - 1, (t, 2), generator=GEN)  # the last expert gets no token
    weights = torch.rand(t, 2, generator=GEN)
    got = m(x, index, weights)
    ref = torch.nn.Module()
    ref.num_experts = e
    ref.gate_up_proj = torch.stack([torch.cat([g.dequantized(), u.dequantized()]) for g, u in zip(gate, up)])
    ref.down_proj = torch.stack([p.dequantized() for p in down])
    quants = {"gate_up": InputQuantizer("fp8", m.in_scale), "down": InputQuantizer("fp8", m.down_in_scale)}
    want = _quantized_experts_forward(quants)(ref, x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    scales = (m.in_scale.float().expand(t),)  # x as the FFN-inputs kernel writes it
    rows = sl.QuantizedRows(sl.fp8_quantize(x, m.in_scale), scales, x.dtype)
    assert torch.equal(m(rows, index, weights), got)


def test_nvfp4_experts_hand_the_grouped_gemm_per_expert_global_scales_made_at_load(monkeypatch):
    """The grouped NVFP4 GEMM reads the activations' global scale as one contiguous value per expert: the
    module's own buffers, made once at load, not an expand-and-copy before each GEMM of every pass."""
    seen: list[torch.Tensor] = []

    def grouped(a, b, scale_a, recipe_a, scale_b, recipe_b, **kw):  # no CPU FP4 kernel: shape only
        seen.append(scale_a[1])
        return torch.zeros(a.shape[0], b.shape[-1], dtype=kw["output_dtype"])

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped)
    ps = [_packed("nvfp4", 64, 64) for _ in range(3)]
    m = tc.ScaledExperts(ps, ps, ps, "nvfp4", CPU)
    m(torch.randn(5, 64, generator=GEN), torch.randint(0, 3, (5, 2), generator=GEN), torch.rand(5, 2))
    assert [t is b for t, b in zip(seen, (m.expert_in_scales, m.expert_down_in_scales), strict=True)] == [
        1,
        1,
    ]
    for held, scalar in ((m.expert_in_scales, m.in_scale), (m.expert_down_in_scales, m.down_in_scale)):
        assert held.shape == (3,) and held.is_contiguous() and torch.equal(held, scalar.expand(3))
    assert tc.per_expert(m.expert_in_scales, 3) is m.expert_in_scales
    expanded = tc.per_expert(m.in_scale, 3)  # a scalar: expanded and copied, as the GEMM reads it
    assert expanded.shape == (3,) and expanded.is_contiguous() and torch.equal(expanded, m.in_scale.expand(3))


def test_fp8_gemms_ask_for_fast_accumulation_and_nvfp4_ones_do_not(monkeypatch):
    """Every FP8 vendor GEMM (linears TensorWise and RowWise, grouped experts) runs with the tensor cores'
    fast accumulation, as `FP8_FAST_ACCUM` says; the NVFP4 block-scaled GEMMs have no such mode and are not
    asked for it (torch documents it for Hopper only)."""
    calls: list[tuple[str, object]] = []
    grouping: list[int] = []
    real_mm, grouped = F.scaled_mm, grouped_scaled_mm_on_cpu()

    def mm(*args, **kw):
        if args[0].dtype == torch.float4_e2m1fn_x2:  # no CPU kernel: shape only
            calls.append(("mm", kw.get("use_fast_accum")))
            return torch.zeros(args[0].shape[0], args[1].shape[1], dtype=kw["output_dtype"])
        if not grouping:
            calls.append(("mm", kw.get("use_fast_accum")))
        return real_mm(*args, **kw)

    def grouped_mm(*args, **kw):
        calls.append(("grouped", kw.get("use_fast_accum")))
        grouping.append(1)  # the CPU stand-in's own per-group F.scaled_mm calls are not the module's
        try:
            return grouped(*args, **kw)
        finally:
            grouping.pop()

    monkeypatch.setattr(F, "scaled_mm", mm)
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_mm)
    assert tc.FP8_FAST_ACCUM is True
    x = torch.randn(5, 64, generator=GEN)
    for mode in ("fp8", "fp8_rowwise"):
        fmt = "fp8" if mode == "fp8" else "nvfp4"
        tc.ScaledLinear(_packed(fmt), mode, CPU, torch.float32)(x)
        ps = [_packed(fmt, 64, 64) for _ in range(2)]
        tc.ScaledExperts(ps, ps, ps, mode, CPU)(
            x, torch.randint(0, 2, (5, 2), generator=GEN), torch.rand(5, 2)
        )
    assert calls == [("mm", True), ("grouped", True), ("grouped", True)] * 2
    calls.clear()
    tc.ScaledLinear(_packed("nvfp4"), "nvfp4", CPU, torch.float32)(x)
    assert calls == [("mm", None)]


@pytest.mark.parametrize("mode", ["fp8", "fp8_rowwise"])
def test_scaled_linear_compiles_into_one_graph_around_the_vendor_gemm(mode):
    """Under --compile the vendor GEMM is one opaque op and everything around it (the activation's
    quantization) is traced: no graph break per linear (the 26B hit dynamo's recompile limit that way)."""
    m = tc.ScaledLinear(_packed("fp8" if mode == "fp8" else "nvfp4"), mode, CPU, torch.float32)
    x = torch.randn(2, 5, 64, generator=GEN)
    compiled, graphs = compiled_whole(m)
    torch.testing.assert_close(compiled(x), m(x), rtol=0, atol=0)
    assert len(graphs) == 1
    targets = graph_targets(graphs[0])
    assert "dgpipe.scaled_gemm.default" in targets and any("clamp" in t for t in targets), targets


def test_scaled_experts_compile_into_one_graph_around_the_grouped_gemms(monkeypatch):
    # bf16 out, as the GPU kernel writes and the op's fake kernel says
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    e, d, inner, t = 4, 64, 32, 9
    gate, up, down = (
        [_packed("fp8", n, k) for _ in range(e)] for n, k in ((inner, d), (inner, d), (d, inner))
    )
    m = tc.ScaledExperts(gate, up, down, "fp8", CPU)
    x, index, weights = (
        torch.randn(t, d, generator=GEN),
        torch.randint(0, e, (t, 2), generator=GEN),
        torch.rand(t, 2),
    )
    compiled, graphs = compiled_whole(m)
    torch.testing.assert_close(compiled(x, index, weights), m(x, index, weights), rtol=0, atol=0)
    targets = graph_targets(graphs[0])
    assert targets.count("dgpipe.grouped_scaled_gemm.default") == 2, targets
    assert any("argsort" in t or "sort" in t for t in targets) and any("bmm" in t for t in targets), targets


@pytest.mark.parametrize("mode", ["fp8", "fp8_rowwise", "nvfp4"])
def test_quantizing_tokens_before_the_gather_equals_quantizing_the_gathered_rows(mode):
    x, scale = torch.randn(11, 64, generator=GEN), torch.tensor(0.02)
    rows = torch.randint(0, 11, (30,), generator=GEN)
    q, qs = tc.quantize_rows(x, scale, mode)
    q2, qs2 = tc.quantize_rows(x[rows], scale, mode)
    assert torch.equal(q[rows].view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(qs[rows].float(), qs2.float())


def test_every_vendor_kernel_of_the_table_has_a_module_mode():
    """Each row's modes (what the loaders build) agree with the kernels it names (what the user reads)."""
    for row in dp.DISPATCH.values():
        assert (row.linear_mode is None) == row.linears.startswith("F.linear"), row.linears
        assert (row.experts_mode is None) == row.experts.startswith(("F.linear", "F.grouped_mm")), row.experts
        if row.experts_mode == "bf16":
            assert row.experts.startswith(dp.TRITON_BF16), row.experts
        for kernel, mode in (
            (row.experts, row.experts_mode),
            (row.experts_fallback, row.experts_fallback_mode),
        ):
            assert ("re-quantized per row" in (kernel or "")) == (mode == "fp8_rowwise"), kernel
    for arch in ("sm90", "sm89"):
        assert dp.dispatch("nvfp4", arch).experts_mode == "fp8_rowwise"
    for arch in ("sm90", "sm89", "sm120"):
        assert dp.dispatch("fp8", arch).experts_mode == "fp8"
    assert dp.dispatch("nvfp4", "sm100").experts_fallback_mode == "fp8_rowwise"


def test_probe_runs_only_the_forms_the_table_names_for_the_gpu():
    """Hopper never runs the NVFP4 kernels (one left a sticky launch failure on an H200); Blackwell does.
    Hopper's FP8 experts also probe the Triton GEMM their few-rows passes take; where torch has no grouped
    GEMM kernel, only the Triton GEMM is probed for the experts, FP8 and bf16. Wherever the linears are FP8,
    their siblings as one RowWise GEMM ("siblings"). Every GPU probes the network's RoPE, softcap and MoE
    combine kernels, whatever the checkpoint's format."""
    net, columns = probing.NETWORK_FORMS, probing.FP8_COLUMNS_FORM
    assert columns == ("siblings", "fp8_columns", "fp8") and probing.FP8_COLUMNS == "siblings:fp8_columns"
    assert probing.probe_plan("sm90") == [
        ("linear", "fp8", "fp8"), ("quant", "fp8", "fp8"), ("experts", "fp8", "fp8"), ("triton", "fp8", "fp8"),
        columns, ("linear", "fp8_rowwise", "nvfp4"), ("quant", "fp8_rowwise", "nvfp4"), ("experts", "fp8_rowwise", "nvfp4"),
        ("triton", "fp8_rowwise", "nvfp4"), *net,
    ]  # fmt: skip
    # activations' one-pass quantization ("quant") is probed wherever a row quantizes them
    assert probing.probe_plan("sm100") == [
        ("linear", "fp8", "fp8"),
        ("quant", "fp8", "fp8"),
        ("triton", "fp8", "fp8"),  # FP8 experts: torch's FP8 grouped GEMM is sm90-only
        columns,
        ("linear", "nvfp4", "nvfp4"),
        ("quant", "nvfp4", "nvfp4"),
        ("experts", "nvfp4", "nvfp4"),
        (
            "triton",
            "fp8_rowwise",
            "nvfp4",
        ),  # NVFP4 experts' second path: FP8 on Triton (Thor; a torch without
        ("quant", "fp8_rowwise", "nvfp4"),  # its grouped NVFP4 kernels)
        *net,
    ]
    # Ada and RTX Blackwell: no grouped GEMM kernel in torch at all, the Triton GEMM takes every pass
    assert probing.probe_plan("sm89") == [
        ("linear", "fp8", "fp8"), ("quant", "fp8", "fp8"), ("triton", "fp8", "fp8"), columns, ("linear", "fp8_rowwise", "nvfp4"),
        ("quant", "fp8_rowwise", "nvfp4"), ("triton", "fp8_rowwise", "nvfp4"), ("triton", "bf16", "bf16"), *net,
    ]  # fmt: skip
    assert probing.probe_plan("sm120") == [
        ("linear", "fp8", "fp8"), ("quant", "fp8", "fp8"), ("triton", "fp8", "fp8"), columns, ("linear", "nvfp4", "nvfp4"), ("quant", "nvfp4", "nvfp4"),
        ("triton", "fp8_rowwise", "nvfp4"), ("quant", "fp8_rowwise", "nvfp4"),  # NVFP4 experts: FP8 on Triton
        ("triton", "bf16", "bf16"), *net,
    ]  # fmt: skip
    assert probing.probe_plan("sm120", formats=("bf16",)) == [
        ("triton", "bf16", "bf16"),
        *net,
    ]  # a bf16 checkpoint's load
    assert probing.probe_plan("sm90", formats=("bf16", "int4_awq")) == [
        *net
    ]  # torch's grouped GEMM serves them
    assert probing.probe_plan(None) == []


def test_cuda_only_entry_points_say_so_on_cpu(ckpts):
    with pytest.raises(DgpipeError, match="CUDA"):
        probing.probe("cpu")
    with pytest.raises(DgpipeError, match="CUDA"):
        gpu_load.load_on_gpu(ckpts["fp8"], torch.bfloat16, CPU)  # no probe: it runs the kernels on a GPU
    assert gpu_load.load_on_gpu(EMBEDDED_MODEL, torch.float32, CPU)[2] is None  # unquantized: a plain load


def test_a_rowwise_gemm_on_a_gpu_writes_bf16_and_casts_to_the_models_dtype(monkeypatch):
    """torch's CUTLASS RowWise kernel (every GPU but Hopper with cuBLAS 12.9+) writes bf16 only: an fp16 or
    fp32 model's RowWise linears ask it for bf16 and cast, within bf16's rounding of the fp32 output."""
    assert tc.rowwise_output_dtype(torch.float32, torch.device("cuda")) is torch.bfloat16
    assert tc.rowwise_output_dtype(torch.float16, torch.device("cuda", 1)) is torch.bfloat16
    assert tc.rowwise_output_dtype(torch.float32, CPU) is torch.float32
    gen = torch.Generator().manual_seed(8)
    linear = tc.ScaledLinear(packed_linear("nvfp4", 32, 64, gen), "fp8_rowwise", CPU, torch.float32)
    x = torch.randn(5, 64, generator=gen)
    exact = linear(x)
    asked: list[torch.dtype] = []
    real = F.scaled_mm
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: asked.append(k["output_dtype"]) or real(*a, **k))
    monkeypatch.setattr(tc, "rowwise_output_dtype", lambda dtype, device: torch.bfloat16)  # as on a GPU
    got = linear(x)
    assert asked == [torch.bfloat16] and got.dtype == torch.float32
    torch.testing.assert_close(got, exact, rtol=2**-8, atol=1e-6)


def test_a_quant_algo_the_runtime_does_not_run_is_the_cpu_loads_error_on_a_gpu(ckpts, tmp_path):
    """ModelOpt's per-channel FP8 (and NVFP4_AWQ, MIXED_PRECISION): the same one-line error as the CPU load,
    naming what dgpipe runs, not an AttributeError from the tensor-core loader."""
    import json
    import shutil

    path = Path(shutil.copytree(ckpts["fp8"], tmp_path / "fp8_pc_pt"))
    for name in ("hf_quant_config.json", "config.json"):
        text = (
            (path / name)
            .read_text()
            .replace('"quant_algo": "FP8"', '"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"')
        )
        (path / name).write_text(text)
    assert (
        json.loads((path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        == "FP8_PER_CHANNEL_PER_TOKEN"
    )
    for load in (
        lambda: load_model(path),
        lambda: gpu_load.load_on_gpu(path, torch.float32, CPU, probing.Probe("sm90")),
    ):
        with pytest.raises(
            DgpipeError, match="quant_algo 'FP8_PER_CHANNEL_PER_TOKEN' is not supported by dgpipe's runtime"
        ):
            load()


def test_a_linear_with_an_awq_pre_quant_scale_stays_on_the_float_path_that_applies_it(
    ckpts, tmp_path, monkeypatch
):
    """The tensor-core modules read no pre_quant_scale: a linear that has one loads dequantized with its
    input hook (`QuantizedLoader.install`), and one on a routed expert is refused as on the CPU, not taken
    onto tensor cores without it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.model.files import DECODER

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    path = Path(shutil.copytree(ckpts["fp8"], tmp_path / "awq_scaled"))
    state = load_file(path / "model.safetensors")
    width = state[f"{DECODER}layers.0.mlp.gate_proj.weight"].shape[1]
    state[f"{DECODER}layers.0.mlp.gate_proj.pre_quant_scale"] = torch.full((width,), 0.5)
    save_file(state, str(path / "model.safetensors"))
    model = gpu_load.load_on_gpu(path, torch.bfloat16, CPU, probing.Probe("sm90", dict(SM90_PROBED)))[0]
    mlp = model.layers[0].mlp
    assert type(mlp.gate_proj) is torch.nn.Linear and mlp.gate_proj._forward_pre_hooks
    assert isinstance(mlp.up_proj, tc.ScaledLinear) and isinstance(
        model.layers[1].mlp.gate_proj, tc.ScaledLinear
    )
    expert = f"{DECODER}layers.0.experts.0.gate_proj"
    state[f"{expert}.pre_quant_scale"] = torch.full((state[f"{expert}.weight"].shape[1],), 0.5)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(DgpipeError, match="pre_quant_scale on a routed expert"):
        gpu_load.load_on_gpu(path, torch.bfloat16, CPU, probing.Probe("sm90", dict(SM90_PROBED)))


def test_fp8_weights_with_a_scale_per_output_row_load_dequantized_as_on_the_cpu(ckpts, tmp_path, monkeypatch):
    """The CPU load dequantizes an FP8 weight whose scale is one per output row; the tensor-core modules read
    one per tensor (ModelOpt's export). Such a linear, and a layer with such an expert, take the float path
    on a GPU too, named in the report, and the model computes what the CPU load's does. Before, the linear
    failed the load and the experts spread the down projection's [E, N] scales as one per expert, so every
    expert read rows of expert 0's."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from pipeline.model.files import DECODER

    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    path = Path(shutil.copytree(ckpts["fp8"], tmp_path / "per_row"))
    state = load_file(path / "model.safetensors")
    per_row = [f"{DECODER}layers.0.self_attn.q_proj"] + [
        n.removesuffix(".weight_scale") for n in state if re.match(rf"{DECODER}layers\.0\.experts\.\d+\.down_proj\.weight_scale$", n)
    ]  # fmt: skip
    for e, name in enumerate(per_row):  # the experts' scales apart, so that reading another's shows
        rows, scale = (
            state[f"{name}.weight"].shape[0],
            state[f"{name}.weight_scale"].reshape(()) * (1 + e % 3),
        )
        state[f"{name}.weight_scale"] = scale.expand(rows).clone()
    save_file(state, str(path / "model.safetensors"))
    model, _, report = gpu_load.load_on_gpu(
        path, torch.float32, CPU, probing.Probe("sm90", dict(SM90_PROBED))
    )
    first, second = model.layers[0], model.layers[1]
    assert type(first.self_attn.q_proj) is torch.nn.Linear and isinstance(
        first.self_attn.k_proj, tc.ScaledLinear
    )
    assert not isinstance(first.experts, tc.ScaledExperts) and isinstance(second.experts, tc.ScaledExperts)
    assert report.experts == len(model.layers) - 1
    assert any(
        f.startswith(f"{len(per_row)} FP8 weights with a scale per output row") for f in report.fallbacks
    )
    cpu = load_model(path)[0]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cpu.cfg.vocab_size, (1, cpu.config.canvas_length), generator=g)
    positions = torch.arange(cpu.config.canvas_length)[None]
    masks = {"full_attention": None, "sliding_attention": None}
    with torch.inference_mode():
        got, want = (m.denoise_soft(tokens, None, positions, masks, None) for m in (model, cpu))
    assert float((got - want).norm() / want.norm()) < 0.12  # FP8 GEMMs against fake-quant, as for per-tensor
    with pytest.raises(ValueError, match="one per expert expected"):  # never spread as one per expert
        sl.fp8_expert_row_scales(torch.ones(3, 8), 8)


SM90_PROBED = {
    "linear:fp8": None,
    "experts:fp8": None,
    "linear:fp8_rowwise": None,
    "experts:fp8_rowwise": None,
}


def _spy_dequantized(monkeypatch) -> list[str]:
    """The modules whose packed weights the loader dequantizes to floats, as they are read."""
    names: list[str] = []
    real = QuantizedLoader.weight

    def weight(self, name, t, fetch):
        if is_packed(t):
            names.append(name.removesuffix(".weight"))
        return real(self, name, t, fetch)

    monkeypatch.setattr(QuantizedLoader, "weight", weight)
    return names


@pytest.mark.parametrize(("fmt", "mode"), [("fp8", "fp8"), ("nvfp4", "fp8_rowwise")])
def test_gpu_load_takes_every_packed_weight_as_stored_and_builds_what_a_float_load_then_swap_builds(
    ckpts, monkeypatch, fmt, mode
):
    """On Hopper's row every quantized linear and expert goes from the file to its tensor-core module
    without a float copy, and the model is the one the dequantize-then-replace route builds, tensor for
    tensor (that route, `_install`, reads the checkpoint twice and holds the float model in between)."""
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    dequantized = _spy_dequantized(monkeypatch)
    model, _, report = gpu_load.load_on_gpu(
        ckpts[fmt], torch.bfloat16, CPU, probing.Probe("sm90", dict(SM90_PROBED))
    )
    assert dequantized == []
    layers = len(model.layers)
    assert (report.format, report.arch, report.experts) == (fmt, "sm90", layers)
    assert report.linears == sum(isinstance(m, tc.ScaledLinear) for m in model.modules()) > layers
    assert all(isinstance(layer.experts, tc.ScaledExperts) for layer in model.layers)
    want = _install(load_model(ckpts[fmt])[0].to(torch.bfloat16), ckpts[fmt], mode)
    kinds = lambda m: [
        (type(x), getattr(x, "mode", None), getattr(x, "triton", None), getattr(x, "triton_rows", None))
        for x in m.modules()
    ]
    assert kinds(model) == kinds(want)  # same modules, same kernels: with equal tensors, equal passes
    got, ref = model.state_dict(), want.state_dict()
    assert got.keys() == ref.keys()
    bits = lambda t: t.flatten().view(torch.uint8)  # bit for bit, NaN and -0.0 included
    for name, t in ref.items():
        assert t.dtype == got[name].dtype and torch.equal(bits(t), bits(got[name])), name


def test_gpu_load_leaves_what_failed_its_probe_or_has_no_kernel_to_the_float_path(ckpts, monkeypatch):
    dequantized = _spy_dequantized(monkeypatch)
    probed = probing.Probe("sm90", {"linear:fp8": "no kernel image", "experts:fp8": None})
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    model, _, report = gpu_load.load_on_gpu(ckpts["fp8"], torch.bfloat16, CPU, probed)
    linears = [n for n in dequantized if not gpu_load.EXPERT.match(n)]
    assert linears == dequantized and len(linears) > len(model.layers)  # linears as floats, experts packed
    assert report.linears == 0 and report.experts == len(model.layers)
    assert any("failed its probe (no kernel image)" in f for f in report.fallbacks)
    assert "no kernel image" in report.summary()
    dequantized.clear()
    # FP8 on Blackwell: torch has no FP8 grouped GEMM there, so the experts are dequantized (bf16), the
    # linears stay FP8
    model, _, report = gpu_load.load_on_gpu(
        ckpts["fp8"], torch.bfloat16, CPU, probing.Probe("sm100", {"linear:fp8": None})
    )
    assert dequantized and all(gpu_load.EXPERT.match(n) for n in dequantized)
    assert len(dequantized) == 3 * model.cfg.num_experts * len(model.layers)
    assert report.experts == 0 and report.linears > 0
    assert any("sm90-only" in f for f in report.fallbacks)
    assert not any(isinstance(layer.experts, tc.ScaledExperts) for layer in model.layers)


def test_a_hopper_load_takes_the_crossover_its_gpus_tile_table_measured(ckpts, monkeypatch):
    """An FP8 checkpoint on sm90 whose GPU model has a tile table with torch's timings: every layer's experts
    take the Triton GEMM up to the measured rows per expert, not the row's 64, and the load says so."""
    monkeypatch.setattr(F, "scaled_grouped_mm", grouped_scaled_mm_on_cpu(torch.bfloat16))
    probed = probing.Probe("sm90", {"linear:fp8": None, "experts:fp8": None, "triton:fp8": None})
    model, _, report = gpu_load.load_on_gpu(ckpts["fp8"], torch.bfloat16, CPU, probed)
    assert {layer.experts.triton_rows for layer in model.layers} == {dp.TRITON_MAX_ROWS_PER_EXPERT}
    assert report.measured_rows is None and "tile table" not in report.summary()
    monkeypatch.setattr(gpu_load, "measured_triton_rows", lambda device, shapes: 256.0)
    model, _, report = gpu_load.load_on_gpu(ckpts["fp8"], torch.bfloat16, CPU, probed)
    assert {layer.experts.triton_rows for layer in model.layers} == {256.0}
    assert "Triton MoE GEMM up to 256 rows per expert (this GPU's tile table)" in report.summary()


@pytest.mark.parametrize(
    ("fmt", "arch", "mode"),
    [("fp8", "sm89", "fp8"), ("fp8", "sm120", "fp8"), ("nvfp4", "sm89", "fp8_rowwise")],
)
def test_ada_and_rtx_blackwell_load_experts_onto_the_triton_gemm_for_every_pass(
    ckpts, monkeypatch, fmt, arch, mode
):
    """No grouped GEMM kernel in torch there: with the Triton GEMM probed, every layer's experts load packed
    onto it for every pass (nothing dequantized, no fallback, graph-safe) and the linears onto F.scaled_mm;
    a denoise pass through the interpreted kernel stays within the FP8 rounding of the CPU path's
    fake-quantized model as closely as torch's Hopper route does, and torch's grouped GEMM never runs."""
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    dequantized = _spy_dequantized(monkeypatch)
    probed = probing.Probe(arch, {f"linear:{mode}": None, f"triton:{mode}": None})
    model, _, report = gpu_load.load_on_gpu(ckpts[fmt], torch.float32, CPU, probed)
    assert dequantized == []
    row = dp.dispatch(fmt, arch)
    assert report.experts == len(model.layers)
    assert report.fallbacks == ([] if fmt == "fp8" else [f"fp8 re-quantization: {row.note}"])  # the row's own
    assert all(
        layer.experts.triton_rows == dp.EVERY_PASS and layer.experts.mode == mode for layer in model.layers
    )
    assert experts_graph_safe(model)
    if os.environ.get("TRITON_INTERPRET") != "1":
        return  # a GPU host: the same pass on CUDA is tests/gpu's
    cfg, batch, length = model.cfg, 2, model.config.canvas_length
    tokens = torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(length)[None].expand(batch, -1)
    masks = {"full_attention": None, "sliding_attention": None}
    with torch.inference_mode():
        got = model.denoise_soft(tokens, None, positions, masks, None)
        want = load_model(ckpts[fmt])[0].denoise_soft(tokens, None, positions, masks, None)
    # the embedded model's 8 layers carry the bf16 intermediates' FP8 flips to the logits: 0.062-0.087
    # relative L2 over 4 seeds, as far as torch's Hopper route is (0.064-0.087); NVFP4 re-quantized to FP8,
    # the fallback's own cost: 0.36-0.46 either way. Rows routed to the wrong experts: 0.65 and 0.74.
    rel = float((got - want).norm() / want.norm())
    assert rel < (0.12 if fmt == "fp8" else 0.55), rel


def test_the_experts_plan_follows_the_row_and_the_probe():
    """Every outcome of `experts_plan`: the row's kernel with its Triton threshold; torch's kernel alone when
    dgpipe's Triton kernels failed (Hopper); the second quantized path (RTX Blackwell NVFP4); the
    dequantized float path; and no tensor-core kernel at all (B200 FP8)."""
    plan = lambda fmt, arch, results: gpu_load.experts_plan(
        dp.dispatch(fmt, arch), probing.Probe(arch, results)
    )
    assert plan("fp8", "sm90", {"experts:fp8": None, "triton:fp8": None}) == (
        "fp8",
        dp.TRITON_MAX_ROWS_PER_EXPERT,
        None,
    )
    # this GPU model's tile table measured where the tuned Triton GEMM stops beating torch's: that count
    # replaces the row's threshold where the row splits passes between them, and only there
    measured = lambda fmt, arch, results: gpu_load.experts_plan(
        dp.dispatch(fmt, arch), probing.Probe(arch, results), 256.0
    )[1]
    assert measured("fp8", "sm90", {"experts:fp8": None, "triton:fp8": None}) == 256.0
    assert measured("nvfp4", "sm90", {"experts:fp8_rowwise": None, "triton:fp8_rowwise": None}) == 256.0
    assert measured("fp8", "sm89", {"triton:fp8": None}) == dp.EVERY_PASS
    assert measured("nvfp4", "sm100", {"experts:nvfp4": None}) == 0.0
    mode, rows, line = plan("fp8", "sm90", {"experts:fp8": None, "triton:fp8": "PTX error"})
    assert (mode, rows) == (
        "fp8",
        0.0,
    ) and "(PTX error): torch's grouped GEMM and quantization run every pass" in line
    assert plan("fp8", "sm89", {"triton:fp8": None}) == ("fp8", dp.EVERY_PASS, None)
    mode, rows, line = plan("fp8", "sm89", {})
    assert (mode, rows) == (None, 0.0) and line.endswith("failed its probe (not run): dequantized float path")
    mode, rows, line = plan("nvfp4", "sm100", {"experts:nvfp4": "no kernel", "triton:fp8_rowwise": None})
    assert (mode, rows) == ("fp8_rowwise", dp.EVERY_PASS) and line.endswith(
        f"(no kernel): {dp.TRITON_MOE_EVERY_PASS_REQ}"
    )
    assert plan("nvfp4", "sm120", {"triton:fp8_rowwise": None}) == ("fp8_rowwise", dp.EVERY_PASS, None)
    assert plan("nvfp4", "sm100", {"experts:nvfp4": None}) == ("nvfp4", 0.0, None)
    assert plan("fp8", "sm100", {"triton:fp8": None}) == ("fp8", dp.EVERY_PASS, None)
    mode, rows, line = plan("fp8", "sm100", {"triton:fp8": "PTX error"})  # B200: torch's bf16 grouped GEMM
    assert (mode, rows) == (None, 0.0) and line.endswith("(PTX error): dequantized float path")


@pytest.mark.parametrize("arch", ["sm100", "sm120"])
def test_nvfp4_experts_without_torchs_grouped_fp4_keep_fp8_on_the_triton_gemm(ckpts, monkeypatch, arch):
    """Where torch's grouped NVFP4 GEMM does not run (RTX Blackwell always: torch's grouped GEMMs refuse
    it; on sm100 where its probe fails: Thor, a torch without its MSLK/FBGEMM kernels), the experts are
    re-quantized to FP8 per row on the Triton GEMM for every pass (1 B/param, not bf16's 2), nothing
    dequantized to a float model, the linears still NVFP4; without a working Triton GEMM either, they load
    dequantized."""
    monkeypatch.setattr(F, "scaled_grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    dequantized = _spy_dequantized(monkeypatch)
    failed = "NotImplementedError: nvfp4 grouped gemm is not supported"
    row = dp.dispatch("nvfp4", arch)
    probed = probing.Probe(arch, {"linear:nvfp4": None, "triton:fp8_rowwise": None})
    if arch == "sm100":
        probed.results["experts:nvfp4"] = failed
    model, _, report = gpu_load.load_on_gpu(ckpts["nvfp4"], torch.bfloat16, CPU, probed)
    assert dequantized == [] and report.experts == len(model.layers)
    assert all(
        (layer.experts.mode, layer.experts.triton_rows) == ("fp8_rowwise", dp.EVERY_PASS)
        for layer in model.layers
    )
    assert {m.mode for m in model.modules() if isinstance(m, tc.ScaledLinear)} == {"nvfp4"}
    assert report.fallbacks == (
        [f"experts: {dp.GROUPED_FP4} failed its probe ({failed}): {dp.TRITON_MOE_EVERY_PASS_REQ}"]
        if arch == "sm100"
        else [f"experts: fp8 re-quantization: {row.note}"]
    )
    probed.results["triton:fp8_rowwise"] = "compile error"
    model, _, report = gpu_load.load_on_gpu(ckpts["nvfp4"], torch.bfloat16, CPU, probed)
    assert len(dequantized) == 3 * model.cfg.num_experts * len(model.layers) and report.experts == 0
    failed_first = failed if arch == "sm100" else "compile error"
    assert any(f.endswith(f"({failed_first}): dequantized float path") for f in report.fallbacks)


def test_ada_without_a_working_triton_gemm_loads_the_experts_dequantized(ckpts, monkeypatch):
    dequantized = _spy_dequantized(monkeypatch)
    probed = probing.Probe("sm89", {"linear:fp8": None, "triton:fp8": "ptxas fatal: out of resources"})
    model, _, report = gpu_load.load_on_gpu(ckpts["fp8"], torch.bfloat16, CPU, probed)
    assert len(dequantized) == 3 * model.cfg.num_experts * len(model.layers)
    assert all(gpu_load.EXPERT.match(n) for n in dequantized)
    assert report.experts == 0 and report.linears > 0
    assert any(
        "failed its probe (ptxas fatal: out of resources): dequantized float path" in f
        for f in report.fallbacks
    )
    linears = [m for m in model.modules() if isinstance(m, tc.ScaledLinear)]
    assert linears and not any(m.triton for m in linears)  # torch's quantization in the linears too


def _install(model, path: Path, mode: str, linears: bool = True):
    """A float-loaded model with the checkpoint's experts (and linears) swapped for `mode` tensor-core
    modules on the CPU, built from a second, separate read of the packed weights: an independent route to
    the model `load_on_gpu` builds in one read."""
    packed = read_packed_linears(path)
    for name, q in packed.items():
        if linears and not gpu_load.EXPERT.match(name) and q.input_scale is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, tc.ScaledLinear(q, mode, CPU, torch.bfloat16))
    for i, layer in enumerate(model.layers):
        n = layer.experts.num_experts
        per = [
            [packed[f"layers.{i}.experts.{e}.{p}"] for e in range(n)]
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        layer.experts = tc.ScaledExperts(*per, mode, CPU)
    return model


def test_graph_safe_tells_the_truth_for_every_weight_format(ckpts):
    plain = load_model(EMBEDDED_MODEL)[0]
    assert experts_graph_safe(plain)  # grouped GEMM, no host sync
    for fmt, path in ckpts.items():
        model = load_model(path)[0]
        assert not experts_graph_safe(model), fmt  # fake-quant experts sync through .tolist()
        assert not TorchBackend(model).graph_safe
        _install(model, path, "fp8" if fmt == "fp8" else "fp8_rowwise", linears=False)
        assert experts_graph_safe(model), fmt  # tensor-core experts keep routing on the device
    assert not TorchBackend(plain).graph_safe  # on the CPU: no fused sampler, nothing to capture


class CaptureAudit(TorchDispatchMode):
    """What a CUDA graph capture refuses, seen on the meta device: a host tensor copied to the device
    (capture forbids pageable host-to-device copies: the NVFP4 rounding's constant tables failed an H200
    capture that way) or used with device tensors, beyond the 0-dim host scalars torch passes by value.
    Reading a value on the host (`.item()`, `.tolist()`, `nonzero`) already raises on meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [*args, *(kwargs or {}).values()]
        tensors = [
            t
            for a in flat
            for t in (a if isinstance(a, (list, tuple)) else [a])
            if isinstance(t, torch.Tensor)
        ]
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (list, tuple)) else [out]
        on_meta = any(t.device.type == "meta" for t in [*tensors, *outs] if isinstance(t, torch.Tensor))
        if on_meta and func is torch.ops.aten._to_copy.default and tensors[0].device.type == "cpu":
            self.host.append(f"{func} (host to device)")
        elif on_meta and any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
            self.host.append(f"{func} (host tensor)")
        return out


def test_capture_audit_flags_host_tables_and_allows_host_scalars():
    x = torch.empty(4, 8, device="meta")
    with CaptureAudit() as audit:
        x * torch.tensor(2.0)  # a 0-dim host scalar: passed by value, capture-safe
    assert audit.host == []
    with CaptureAudit() as audit:
        x + torch.tensor([0.5, 1.0, 2.0, 3.0]).to(x.device)[:, None]  # a host table copied per call
    assert audit.host == ["aten._to_copy.default (host to device)"]
    with CaptureAudit() as audit:
        x[torch.tensor([0, 2])]  # host indices: on CUDA, copied to the device inside the op
    assert audit.host == ["aten.index.Tensor (host tensor)"]


@pytest.mark.parametrize(("fmt", "mode"), [("fp8", "fp8"), ("nvfp4", "fp8_rowwise"), ("nvfp4", "nvfp4")])
def test_a_denoise_pass_on_tensor_cores_holds_nothing_a_cuda_graph_refuses(ckpts, monkeypatch, fmt, mode):
    """The quantized embedded model with every linear and expert on its tensor-core module (FP8; NVFP4
    re-quantized to FP8 for Hopper; NVFP4 native for Blackwell), one denoise pass on the meta device: no
    host value read, no host tensor copied to or used with the device. `graph_safe = True` rests on this;
    torch's grouped scaled GEMM has no meta kernel, so it is a shape-only stand-in here (a vendor op,
    outside what this audits)."""
    monkeypatch.setattr(
        F,
        "scaled_grouped_mm",
        lambda a, b, *_, **__: a.new_empty((a.shape[0], b.shape[-1]), dtype=torch.bfloat16),
    )
    model = _install(load_model(ckpts[fmt])[0].to(torch.bfloat16), ckpts[fmt], mode).to("meta")
    cfg, batch, length, cached = model.cfg, 2, model.config.canvas_length, 16
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, device="meta", dtype=dtype)
    past = [
        (meta(batch, s.num_kv_heads, cached, s.head_dim), meta(batch, s.num_kv_heads, cached, s.head_dim))
        for s in map(cfg.layer_shape, range(cfg.num_hidden_layers))
    ]
    tokens = meta(batch, length, dtype=torch.long)
    masks = {"full_attention": None, "sliding_attention": None}
    with torch.inference_mode(), CaptureAudit() as audit:
        logits = model.denoise_soft(tokens, meta(batch, length, cfg.hidden_size), tokens, masks, past)
    assert logits.shape == (batch, length, cfg.vocab_size)
    assert audit.host == []


@pytest.mark.parametrize(("k", "fast_bound", "promoted_bound"), [(512, 5e-3, None), (2816, 1e-2, 1e-3)])
def test_gpu_fast_accumulation_bounds_sit_above_the_modelled_error(k, fast_bound, promoted_bound):
    """The bounds tests/gpu sets on FP8 GEMMs with fast accumulation (K = 512: the linear test; K = 2,816:
    the 26B's depth) and with promoted accumulation, against a model of Hopper's ~14-bit accumulator:
    at least twice what the model gives at 13 bits, and the fast mode's extra error grows with K."""
    from tests._utils.accumulation import truncating_matmul

    gen = torch.Generator().manual_seed(4)
    a = (torch.randn(64, k, generator=gen) * 16).to(torch.float8_e4m3fn).float()
    b = (torch.randn(k, 128, generator=gen) * 16).to(torch.float8_e4m3fn).float()
    exact = a.double() @ b.double()
    rel = lambda x: float((x - exact).norm() / exact.norm())
    fast = {bits: rel(truncating_matmul(a, b, bits)) for bits in (13, 14)}
    assert 0 < fast[14] < fast[13] <= fast_bound / 2, fast
    if promoted_bound is not None:
        promoted = rel(truncating_matmul(a, b, 13, interval=128))
        assert promoted <= promoted_bound / 2 and promoted < fast[13] / 10, (promoted, fast)


def test_fp8_codes_compare_equal_up_to_nans_sign_and_the_probe_values_cover_every_case():
    """The probe's bit-for-bit check of the Triton quantization: a NaN's sign may differ (torch keeps the
    input's, the hardware writes 0x7F), nothing else may; its values land on a subnormal, a tie, the
    saturation bound and NaN after torch's quantization."""
    v = torch.tensor(QUANT_PROBE_VALUES)
    codes = sl.fp8_quantize(torch.cat([v, -v]), torch.tensor(0.5))
    canonical = codes.view(torch.uint8).clone()
    canonical[(canonical & 0x7F) == 0x7F] = 0x7F
    assert fp8_codes_equal(codes, canonical.view(torch.float8_e4m3fn))
    off_by_one = canonical.clone()
    off_by_one[4] += 1
    assert not fp8_codes_equal(codes, off_by_one.view(torch.float8_e4m3fn))
    values = codes.float()[: len(v)].tolist()
    assert values[3] == 3 * 2.0**-9 and values[6] == 2.0  # a subnormal, a tie to even
    assert values[7:10] == [448.0] * 3  # E4M3's largest, and two beyond it saturated
    assert values[10] == 448.0 and values[11] != values[11]  # inf saturates, NaN stays NaN


@pytest.mark.parametrize("one_pass", [True, False])
def test_an_fp8_dense_down_takes_its_operand_from_the_gated_gelu_kernel(monkeypatch, one_pass):
    """A gated MLP's FP8 down projection (CPU `F.scaled_mm` TensorWise): with the gated GeLU kernel writing
    its E4M3 operand (here its torch form, `network.gelu_tanh` then `sl.fp8_quantize`), the linear's own
    output bit for bit with one quantization fewer; where the linear does not quantize in one pass (under
    torch.compile, or asked not to), the product and the linear as before. Per-row FP8 downs and float ones
    keep their linear."""
    from pipeline.model.network import GatedMLP, gelu_tanh

    gen = torch.Generator().manual_seed(3)
    down = tc.ScaledLinear(packed_linear("fp8", 32, 48, gen), "fp8", CPU, torch.bfloat16, triton=one_pass)
    calls: list[object] = []

    def kernel(gate, up, scale=None):
        calls.append(scale)
        h = gelu_tanh(gate) * up
        return h if scale is None else sl.fp8_quantize(h, scale)

    fused = tc.down_from_geglu(down, kernel)
    gate, up = (torch.randn(2, 5, 96, generator=gen) * 2).bfloat16().chunk(2, dim=-1)  # views of gate|up
    want = down(gelu_tanh(gate) * up)  # on the CPU: torch's quantization
    monkeypatch.setattr(tc, "in_one_pass", lambda triton, t: triton)  # as on CUDA
    quantized = []
    quantize_rows = tc.quantize_rows
    monkeypatch.setattr(tc, "quantize_rows", lambda *a: quantized.append(a[2]) or quantize_rows(*a))
    got = fused(gate, up)
    assert got.shape == want.shape == (2, 5, 32) and torch.equal(got, want)
    assert calls == [down.input_scale] if one_pass else calls == [None]
    assert quantized == ([] if one_pass else ["fp8"])
    rowwise = tc.ScaledLinear(packed_linear("nvfp4", 32, 48, gen), "fp8_rowwise", CPU, torch.bfloat16)
    mlp = GatedMLP(48, 48)
    assert tc.down_from_geglu(rowwise, kernel) is tc.down_from_geglu(mlp.down_proj, kernel) is None
    assert tc.down_from_geglu(down, None) is None


def test_an_nvfp4_down_projection_takes_its_operand_from_the_gated_gelu(monkeypatch):
    """The dense MLP's NVFP4 down projection: the gated GeLU's NVFP4 codes and block scales, swizzled for the
    linear, go straight to its GEMM with the linear's global scale (torch's forms here; the kernel's equality
    with them: tests/unit/runtime/kernels/test_chains.py), the operand its own quantization would make."""
    from pipeline.model.network import gelu_tanh

    gen = torch.Generator().manual_seed(4)
    down = tc.ScaledLinear(packed_linear("nvfp4", 32, 48, gen), "nvfp4", CPU, torch.bfloat16, triton=True)

    def nvfp4_kernel(gate, up, gs, blocked):
        q, s = sl.nvfp4_quantize(gelu_tanh(gate) * up, gs)
        return q, sl.to_blocked(s.reshape(-1, s.shape[-1]).view(torch.uint8)) if blocked else s

    operands = []
    monkeypatch.setattr(tc, "in_one_pass", lambda triton, t: triton)  # as on CUDA
    monkeypatch.setattr(
        down, "gemm", lambda a, scales: operands.append((a, scales)) or torch.zeros(a.shape[0], 32)
    )
    gate, up = (torch.randn(2, 5, 96, generator=gen) * 2).bfloat16().chunk(2, dim=-1)
    assert tc.down_from_geglu(down, None, nvfp4_kernel)(gate, up).shape == (2, 5, 32)
    ((a, (block_scales, global_scale)),) = operands
    want_a, want_s = sl.nvfp4_quantize((gelu_tanh(gate) * up).reshape(10, 48), down.input_scale)
    assert torch.equal(a, want_a) and global_scale is down.input_scale
    assert torch.equal(block_scales.view(torch.uint8), sl.to_blocked(want_s.view(torch.uint8)))
    assert tc.down_from_geglu(down, None, None) is None  # no kernel: the linear quantizes


def test_nvfp4_linears_give_cudas_kernel_one_swizzle_per_scale(monkeypatch):
    """NVFP4's two-level recipe (block scales, global scale) takes two swizzles per operand on CUDA, where
    torch's meta function, and so every CPU test, reads the first alone: the check CUDA makes, as the CPU
    rehearsals make it (`fake_cuda.cuda_scaled_mm_checks`), on the arguments the linear gives."""
    from pipeline.bench.gpu.fake_cuda import cuda_scaled_mm_checks

    seen = []

    def kernel(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias, out_dtype, *rest):
        seen.append((recipe_a, swizzle_a, recipe_b, swizzle_b))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    checked = cuda_scaled_mm_checks(kernel)
    with pytest.raises(ValueError, match="swizzle_a must have 2 values, got 1"):
        checked(None, None, [1, 2], [2, 0], [1], [1, 2], [2, 0], [1, 0], None, None)
    monkeypatch.setattr(torch, "_scaled_mm_v2", checked)
    tc.ScaledLinear(_packed("nvfp4"), "nvfp4", CPU, torch.float32)(torch.randn(5, 64, generator=GEN))
    two_level = [F.ScalingType.BlockWise1x16.value, F.ScalingType.TensorWise.value]
    assert seen == [(two_level, [1, 0], two_level, [1, 0])]  # SWIZZLE_32_4_4, then NO_SWIZZLE


def test_rowwise_quantization_of_an_all_zero_row_is_zero_with_a_positive_scale():
    """A row of zeros (a padded canvas row, a token whose gated activation is exactly 0) gets a tiny positive
    scale, not 0: x / 0 would be NaN codes, and a NaN in one row of the GEMM operand poisons that token's
    output (and the batch's, through attention). Its codes are exact zeros; other rows are unaffected."""
    x = torch.zeros(3, 32)
    x[1] = torch.linspace(-1, 1, 32)
    q, scales = tc.quantize_rows(x, torch.tensor(0.01), "fp8_rowwise")
    codes = q.float()
    assert torch.isfinite(codes).all() and torch.isfinite(scales).all()
    assert (scales > 0).all() and scales[0] == scales[2] == 1e-12
    assert torch.equal(codes[0], torch.zeros(32)) and torch.equal(codes[2], torch.zeros(32))
    assert codes[1].abs().max() == 448.0  # the non-zero row still spans E4M3's range


def test_unit_row_scales_grow_to_the_rows_asked_for_and_reuse_a_buffer_large_enough(monkeypatch):
    """A RowWise GEMM's row scales must have one row per operand row: a view too short (the buffer of an
    earlier, smaller batch) fails the GEMM or scales rows with stale memory. An ask the buffer already
    holds, to its last row, reuses it without growing (no new buffer kept alive for a graph)."""
    monkeypatch.setattr(tc, "_UNIT_ROWS", {})
    monkeypatch.setattr(tc, "_OUTGROWN_ROWS", [])
    four = tc.unit_row_scales(4, CPU)
    again = tc.unit_row_scales(4, CPU)
    assert again.data_ptr() == four.data_ptr() and tc._OUTGROWN_ROWS == []
    ten = tc.unit_row_scales(10, CPU)
    assert ten.shape == (10, 1) and torch.equal(ten, torch.ones(10, 1))
    assert tc._UNIT_ROWS[CPU].shape == (10, 1) and len(tc._OUTGROWN_ROWS) == 1
