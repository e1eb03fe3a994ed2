"""Sibling linears on the GPU path (`pipeline.runtime.shared_input`), run on the CPU: torch's `F.scaled_mm`
has CPU kernels for FP8 TensorWise and RowWise, so sharing a quantization and merging GEMMs run here for
real against the linears computed alone; NVFP4's GEMM is CUDA-only, so its merged layout is checked against
the parts' (the GEMM on a GPU: tests/gpu/test_tensor_cores_cuda.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeline.model import scaled_layout as sl
from pipeline.model.modelopt import PackedLinear
from pipeline.model.network import DiffusionGemma
from pipeline.runtime import shared_input as si
from pipeline.runtime import tensor_cores as tc
from tests._utils.interpreter_casts import rne_casts  # noqa: F401  (fixture)
from tests._utils.quantized import build_quantized_checkpoint, packed_linear

CPU = torch.device("cpu")


def _linears(fmt: str, mode: str, rows: list[int], k: int = 64, seed: int = 0) -> list[tc.ScaledLinear]:
    gen = torch.Generator().manual_seed(seed)
    return [tc.ScaledLinear(packed_linear(fmt, n, k, gen), mode, CPU, torch.float32) for n in rows]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.int32)


def _quantizations(monkeypatch) -> list[str]:
    seen: list[str] = []
    quantize_rows = tc.quantize_rows
    monkeypatch.setattr(
        tc, "quantize_rows", lambda x, s, mode, *a: seen.append(mode) or quantize_rows(x, s, mode, *a)
    )
    return seen


def test_fp8_siblings_with_their_own_weight_scales_share_the_quantization_bit_for_bit(monkeypatch):
    """ModelOpt's FP8 siblings: one input scale, a weight scale each. One quantization, a GEMM each, and
    each output the linear's own, bit for bit."""
    parts = _linears("fp8", "fp8", [48, 32, 32])
    assert len({p.static_scales[1] for p in parts}) == 3 and len({p.static_scales[0] for p in parts}) == 1
    assert si.shares_quantization(parts) and not si.concatenates(parts)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    alone = [p(x) for p in parts]
    seen = _quantizations(monkeypatch)
    together = si.SharedInput(parts, None)(x)
    assert seen == ["fp8"]
    for a, b in zip(alone, together, strict=True):
        assert b.shape == a.shape and torch.equal(_bits(a), _bits(b))


def test_fp8_siblings_with_their_own_weight_scales_are_one_rowwise_gemm_where_it_was_probed(monkeypatch):
    """Where the RowWise FP8 GEMM passed its probe, the same siblings are one GEMM over their stacked codes
    (the checkpoint's, not re-quantized), each column scaled by the input scale times its linear's weight
    scale, each row by 1. Each output within the summation order's noise of the linear's own (torch's CPU
    TensorWise and RowWise kernels sum in other orders: up to 2.1e-7 of the largest output over five seeds;
    a scale out of place is O(1)); the parts keep their scalars and compute alone on their views, bit for
    bit; one quantization for all."""
    parts = _linears("fp8", "fp8", [48, 32, 32])
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    alone = [p(x) for p in parts]
    assert si.concatenates(parts, fp8_columns=True) and not si.concatenates(parts)
    merged = si.concatenate(parts)
    assert merged.mode == "fp8_columns" and merged.out_features == 112
    assert all(p.weight_scale.dim() == 0 and p.mode == "fp8" for p in parts)
    assert [p.weight.data_ptr() for p in parts] == [merged.weight.data_ptr() + o * 64 for o in (0, 48, 80)]
    columns = torch.cat([(p.input_scale * p.weight_scale).expand(p.out_features) for p in parts])
    assert merged.weight_scale.shape == (1, 112) and torch.equal(merged.weight_scale[0], columns)
    seen = _quantizations(monkeypatch)
    together = si.SharedInput(parts, merged)(x)
    assert seen == ["fp8"]
    for a, b, p in zip(alone, together, parts, strict=True):
        assert b.shape == a.shape and torch.equal(p(x), a)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * float(a.abs().max()))
    assert torch.equal(tc._UNIT_ROWS[CPU][:10], torch.ones(10, 1))  # the row scales: a view of one buffer


def test_fp8_siblings_merge_into_a_rowwise_gemm_only_where_it_writes_the_models_dtype(monkeypatch):
    """On CUDA a RowWise GEMM writes bf16 alone (`rowwise_output_dtype`): siblings of an fp16 or fp32 model
    stay a GEMM each (TensorWise, in the model's dtype) and only share their quantization, since merged
    their outputs would be rounded to bf16 (the tests' quantized model's logits moved by 9% relative L2 in
    fp16, 7% in fp32, with CUDA's output dtype stood in for). A bf16 model merges."""
    monkeypatch.setattr(si, "rowwise_output_dtype", lambda out_dtype, device: torch.bfloat16)  # as on CUDA
    for dtype, merges in ((torch.bfloat16, True), (torch.float16, False), (torch.float32, False)):
        gen = torch.Generator().manual_seed(0)
        parts = [tc.ScaledLinear(packed_linear("fp8", n, 64, gen), "fp8", CPU, dtype) for n in (48, 32)]
        assert si.shares_quantization(parts) and si.concatenates(parts, fp8_columns=True) == merges, dtype


def test_a_rowwise_gemms_unit_row_scales_are_views_of_one_buffer_grown_outside_graph_capture(monkeypatch):
    """Row scales of 1 come as views of one contiguous buffer per device, which grows (at least doubling) to
    the most rows asked for, the buffer it outgrew kept allocated (a graph captured on it reads it at every
    replay); while a CUDA graph is captured a larger ask gets a buffer of its own (its fill runs when the graph
    replays, so eager calls after the capture must not read it)."""
    from pipeline.bench.gpu.fake_cuda import fake_gpu

    monkeypatch.setattr(tc, "_UNIT_ROWS", {})
    monkeypatch.setattr(tc, "_OUTGROWN_ROWS", [])
    eight, five = tc.unit_row_scales(8, CPU), tc.unit_row_scales(5, CPU)
    assert torch.equal(eight, torch.ones(8, 1)) and five.shape == (5, 1) and five.is_contiguous()
    assert five.data_ptr() == eight.data_ptr() == tc._UNIT_ROWS[CPU].data_ptr()
    assert tc.unit_row_scales(12, CPU).shape == (12, 1) and tc._UNIT_ROWS[CPU].shape == (16, 1)
    assert tc.unit_row_scales(20, CPU).shape == (20, 1) and tc._UNIT_ROWS[CPU].shape == (32, 1)
    assert tc._OUTGROWN_ROWS[0].data_ptr() == eight.data_ptr() and len(tc._OUTGROWN_ROWS) == 2
    cuda = torch.device("cuda", 0)
    with fake_gpu("sm90"):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        assert tc.unit_row_scales(4, cuda).shape == (4, 1) and cuda not in tc._UNIT_ROWS
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert tc.unit_row_scales(4, cuda).device == cuda and tc._UNIT_ROWS[cuda].shape == (4, 1)


def test_the_probe_runs_fp8_siblings_as_one_rowwise_gemm_against_the_linears_alone(monkeypatch):
    """The load-time probe of the merged form passes here (torch's CPU RowWise kernel) and fails, naming the
    linear, on column scales without the input scale or with the parts' columns out of place."""
    from pipeline.errors import DgpipeError
    from pipeline.runtime import probe as probing

    probing.check_fp8_columns(CPU)
    concatenate = si.concatenate

    def unscaled(parts):
        merged = concatenate(parts)
        merged.weight_scale = merged.weight_scale / parts[0].input_scale
        return merged

    monkeypatch.setattr(si, "concatenate", unscaled)
    with pytest.raises(DgpipeError, match="differ from linear 0 alone"):
        probing.check_fp8_columns(CPU)
    monkeypatch.setattr(si, "concatenate", lambda parts: concatenate(parts[::-1]))
    with pytest.raises(DgpipeError, match="one RowWise GEMM differ from linear"):
        probing.check_fp8_columns(CPU)


@pytest.mark.parametrize(("fmt", "mode"), [("fp8", "fp8"), ("nvfp4", "fp8_rowwise")])
def test_gate_and_up_merge_into_one_gemm_whose_columns_are_theirs(monkeypatch, fmt, mode):
    """Equal FP8 weight scales, or the per-row FP8 of the NVFP4 fallback: one GEMM, split into views. The
    parts' weights become views of the merged one, so each still computes alone and nothing is held twice."""
    gate, up = parts = _linears(fmt, mode, [40, 40])
    if mode == "fp8":
        up.weight_scale, up.static_scales = gate.weight_scale.clone(), gate.static_scales
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(2))
    alone = [p(x) for p in parts]
    assert si.concatenates(parts)
    merged = si.concatenate(parts)
    assert merged.out_features == 80 and merged.weight.shape == (80, 64)
    storage = lambda t: t.untyped_storage().data_ptr()
    for p in parts:
        assert storage(p.weight) == storage(merged.weight)
        if mode == "fp8_rowwise":  # per-row scales [1, N]; FP8's per-tensor one is shared as it is
            assert storage(p.weight_scale) == storage(merged.weight_scale)
    assert mode == "fp8_rowwise" or merged.weight_scale is gate.weight_scale
    seen = _quantizations(monkeypatch)
    together = si.SharedInput(parts, merged)(x)
    assert seen == [mode]
    for a, b, p in zip(alone, together, parts, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # the same operands; summation order only
        torch.testing.assert_close(p(x), a, rtol=0, atol=0)  # the part alone, on its view


@pytest.mark.parametrize("rows", [[256, 128], [2112, 2112]])
def test_nvfp4_gate_and_up_concatenate_to_their_weights_and_block_scales(rows):
    """NVFP4 siblings with one global scale (ModelOpt's): the merged codes and swizzled block scales are the
    parts' stacked by row. In whole 128-row tiles they are the parts' tiles one after another (views); the
    26B's 2,112 rows end inside a tile, so the merged scales are swizzled anew and held apart."""
    gen = torch.Generator().manual_seed(3)
    k, gs = 64, torch.tensor(0.01)
    packed = []
    for n in rows:
        codes, bs = sl.nvfp4_quantize(torch.randn(n, k, generator=gen) * 0.1, gs)
        packed.append(PackedLinear("NVFP4", codes, bs, gs, torch.tensor(0.02)))
    parts = [tc.ScaledLinear(p, "nvfp4", CPU, torch.bfloat16) for p in packed]
    assert si.concatenates(parts)
    merged = si.concatenate(parts)
    raw = torch.cat([p.weight_scale for p in packed]).view(torch.uint8)
    assert torch.equal(sl.from_blocked(merged.weight_scale.view(torch.uint8), sum(rows), k // 16), raw)
    codes = torch.cat([p.weight for p in packed])
    assert torch.equal(merged.weight.view(torch.uint8), codes)
    whole_tiles = all(n % sl.TILE_ROWS == 0 for n in rows)
    shares = (
        parts[0].weight_scale.untyped_storage().data_ptr() == merged.weight_scale.untyped_storage().data_ptr()
    )
    assert shares == whole_tiles
    assert si.SharedInput(parts, merged).held_apart == (0 if whole_tiles else merged.weight_scale.numel())
    for p, q in zip(parts, packed, strict=True):  # each part keeps its own layout
        assert torch.equal(p.weight_scale.view(torch.uint8), sl.to_blocked(q.weight_scale.view(torch.uint8)))


def test_float_gate_and_up_merge_and_different_input_scales_do_not_share():
    gen = torch.Generator().manual_seed(4)
    gate, up = nn.Linear(64, 40, bias=False), nn.Linear(64, 40, bias=False)
    x = torch.randn(3, 64, generator=gen)
    alone = [gate(x), up(x)]
    merged = si.concatenate([gate, up])
    got = si.SharedInput([gate, up], merged)(x)
    for a, b in zip(alone, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert gate.weight.untyped_storage().data_ptr() == merged.weight.untyped_storage().data_ptr()
    q, k = _linears("fp8", "fp8", [32, 32])
    k.static_scales = (k.static_scales[0] * 2, k.static_scales[1])
    assert not si.shares_quantization([q, k]) and not si.concatenates([q, k])
    assert not si.shares_quantization([gate, up])  # float linears quantize nothing


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return build_quantized_checkpoint(Path(tmp_path_factory.mktemp("q")) / "fp8", "fp8")


def _load_fp8(path: Path) -> DiffusionGemma:
    from pipeline.runtime import gpu_load
    from pipeline.runtime import probe as probing

    probed = probing.Probe("sm90", {"linear:fp8": None, "experts:fp8": "no grouped GEMM on the CPU"})
    return gpu_load.load_on_gpu(path, torch.float32, CPU, probed)[0]


@pytest.fixture(scope="module")
def fp8_model(fp8_checkpoint) -> DiffusionGemma:
    return _load_fp8(fp8_checkpoint)


def test_the_embedded_fp8_model_keeps_its_logits_with_shared_inputs(fp8_model):
    """Every layer's q/k/v and gate/up on one quantization (the checkpoint's FP8 linears have a weight scale
    each, as ModelOpt's: no merged GEMM) and the float self-conditioning's gate and up in one GEMM: the same
    logits (bit for bit on this repository's CI machine; the merged float GEMM may sum in another order)."""
    model = fp8_model
    gen = torch.Generator().manual_seed(5)
    canvas = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=gen)
    soft = torch.randn(2, 12, model.cfg.hidden_size, generator=gen)
    positions = torch.arange(12).expand(2, 12)
    with torch.inference_mode():
        before = model.denoise_soft(canvas, soft, positions, {k: None for k in set(model.layer_types)}, None)
        shared, saved = si.share_inputs(model, merge_qkv=True)
        after = model.denoise_soft(canvas, soft, positions, {k: None for k in set(model.layer_types)}, None)
    assert shared == 2 * len(model.layers) and saved == 1
    assert all(isinstance(layer.self_attn.qkv_kernel, si.SharedInput) for layer in model.layers)
    assert model.self_conditioning.gate_up_kernel.merged is not None
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-5)
    layer = model.layers[0]
    assert layer.mlp.gate_up_kernel.merged is None


def test_dequantized_siblings_whose_inputs_are_rounded_by_a_hook_stay_apart(fp8_checkpoint):
    """Where the FP8 linear fails its probe the load dequantizes the linears and hooks their inputs' FP8
    rounding on (`QuantizedLoader.install`; an AWQ checkpoint's pre_quant_scale likewise). A merged GEMM
    would skip the hooks: such siblings stay apart and the logits stay (only the unhooked float
    self-conditioning's gate and up merge)."""
    from pipeline.runtime import gpu_load
    from pipeline.runtime import probe as probing

    probed = probing.Probe("sm90", {"linear:fp8": "failed here", "experts:fp8": "no grouped GEMM on the CPU"})
    model = gpu_load.load_on_gpu(fp8_checkpoint, torch.float32, CPU, probed)[0]
    gate = model.layers[0].mlp.gate_proj
    assert type(gate) is nn.Linear and gate._forward_pre_hooks
    assert not si.concatenates([gate, model.layers[0].mlp.up_proj])
    gen = torch.Generator().manual_seed(6)
    canvas = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=gen)
    soft = torch.randn(2, 12, model.cfg.hidden_size, generator=gen)
    positions, masks = torch.arange(12).expand(2, 12), {k: None for k in set(model.layer_types)}
    with torch.inference_mode():
        before = model.denoise_soft(canvas, soft, positions, masks, None)
        assert si.share_inputs(model, merge_qkv=True) == (0, 1)
        after = model.denoise_soft(canvas, soft, positions, masks, None)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-5)


def test_the_embedded_fp8_model_keeps_its_logits_with_its_siblings_one_rowwise_gemm_each(fp8_checkpoint):
    """Where the RowWise FP8 GEMM passed its probe, every layer's q/k/v and gate/up (a weight scale each, as
    ModelOpt's FP8) run as one GEMM each: the same logits as the linears alone (bit for bit on this
    repository's CI machine; torch's CPU TensorWise and RowWise kernels may sum in other orders)."""
    model = _load_fp8(fp8_checkpoint)
    gen = torch.Generator().manual_seed(5)
    canvas = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=gen)
    soft = torch.randn(2, 12, model.cfg.hidden_size, generator=gen)
    positions = torch.arange(12).expand(2, 12)
    run = lambda: model.denoise_soft(canvas, soft, positions, dict.fromkeys(set(model.layer_types)), None)
    with torch.inference_mode():
        before = run()
        shared, saved = si.share_inputs(model, merge_qkv=True, fp8_columns=True)
        after = run()
    qkv = sum(len(layer.self_attn.qkv_kernel.parts) for layer in model.layers)
    assert shared == 2 * len(model.layers) and saved == qkv - len(model.layers) + len(model.layers) + 1
    for layer in model.layers:
        assert layer.self_attn.qkv_kernel.merged.mode == layer.mlp.gate_up_kernel.merged.mode == "fp8_columns"
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter runs the kernel here"
)
def test_the_embedded_fp8_model_keeps_its_logits_with_its_mlps_operand_from_the_ffn_inputs_kernel(
    tmp_path,
    monkeypatch,
    rne_casts,  # noqa: F811
):
    """The embedded FP8 model in bf16, gate and up sharing one quantization in one pass (as on CUDA), every
    layer's FFN-inputs kernel writing the dense MLP's input as their FP8 operand (`gpu_load.ffn_inputs_for`):
    the same logits bit for bit as the kernel writing the rows and gate and up quantizing them."""
    from pipeline.runtime import gpu_load, kernels
    from pipeline.runtime import probe as probing

    path = build_quantized_checkpoint(tmp_path / "fp8", "fp8")
    probed = probing.Probe("sm90", {"linear:fp8": None, "experts:fp8": "no grouped GEMM on the CPU"})
    model = gpu_load.load_on_gpu(path, torch.bfloat16, CPU, probed)[0]
    si.share_inputs(model, merge_qkv=False)
    gen = torch.Generator().manual_seed(10)
    canvas = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=gen)
    soft = torch.randn(2, 12, model.cfg.hidden_size, generator=gen).bfloat16()
    positions = torch.arange(12).expand(2, 12)
    run = lambda: model.denoise_soft(canvas, soft, positions, dict.fromkeys(set(model.layer_types)), None)
    for layer in model.layers:
        for part in layer.mlp.gate_up_kernel.parts:
            part.triton = True  # as the GPU loader sets it where the one-pass quantization passed its probe
        layer.ffn_inputs_kernel = kernels.chains.ffn_inputs_or_torch
    kernel, quantized = kernels.chains.ffn_inputs, []
    monkeypatch.setattr(
        kernels.chains, "ffn_inputs", lambda *a: quantized.append(a[3] is not None) or kernel(*a)
    )
    with torch.inference_mode():
        before = run()
        for layer in model.layers:
            layer.ffn_inputs_kernel = gpu_load.ffn_inputs_for(layer)
        after = run()
    assert quantized == [False] * len(model.layers) + [True] * len(model.layers)
    assert torch.equal(after, before)


def test_fp8_rows_made_by_the_kernel_before_are_the_operand_the_siblings_read():
    """Gate and up given their input as the FP8 operand the FFN-inputs kernel writes
    (`scaled_layout.QuantizedRows` at their input scale): the outputs they compute from the rows themselves,
    bit for bit, without quantizing again."""
    parts = _linears("fp8", "fp8", [40, 40])
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(8))
    shared = si.SharedInput(parts, None)
    want = shared(x)
    scale = parts[0].input_scale
    rows = sl.QuantizedRows(sl.fp8_quantize(x, scale), (scale,), x.dtype)
    got = shared(rows)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape == (2, 3, 40) and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize(
    ("mlp_one_pass", "experts_one_pass"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_the_ffn_inputs_come_as_fp8_operands_only_to_gemms_that_would_make_them(
    mlp_one_pass, experts_one_pass
):
    """`gpu_load.ffn_inputs_for`: the dense MLP's input as FP8 where its gate and up share one FP8 input scale
    and quantize in one pass (the scale theirs), the experts' where they are FP8 and quantize in one pass
    (the scale theirs); else the rows, and without either the plain kernel."""
    from types import SimpleNamespace

    from pipeline.runtime import gpu_load, kernels

    gen = torch.Generator().manual_seed(9)
    parts = [tc.ScaledLinear(packed_linear("fp8", 32, 64, gen), "fp8", CPU, torch.bfloat16, triton=mlp_one_pass)
             for _ in range(2)]  # fmt: skip
    experts = tc.ScaledExperts(*([[packed_linear("fp8", n, k, gen)] * 2 for n, k in ((32, 64), (32, 64), (64, 32))]),
                               "fp8", CPU, one_pass=experts_one_pass)  # fmt: skip
    layer = SimpleNamespace(mlp=SimpleNamespace(gate_up_kernel=si.SharedInput(parts, None)), experts=experts)
    kernel = gpu_load.ffn_inputs_for(layer)
    if not (mlp_one_pass or experts_one_pass):
        assert kernel is kernels.chains.ffn_inputs_or_torch
        return
    assert kernel.func is kernels.chains.ffn_inputs_or_torch
    assert kernel.keywords["mlp_form"] == (("fp8", parts[0].input_scale) if mlp_one_pass else None)
    assert kernel.keywords["experts_form"] == (("fp8", experts.in_scale) if experts_one_pass else None)
    layer.mlp.gate_up_kernel = None  # gate and up on their own: they take rows, the experts as before
    alone = gpu_load.ffn_inputs_for(layer)
    if not experts_one_pass:
        assert alone is kernels.chains.ffn_inputs_or_torch
        return
    assert alone.func is kernels.chains.ffn_inputs_or_torch and alone.keywords["mlp_form"] is None
    assert alone.keywords["experts_form"] == ("fp8", experts.in_scale)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_the_fixture_checkpoints_siblings_share_what_modelopts_export_makes_them_share(tmp_path, fmt):
    """As a real ModelOpt export of the embedded model has them: NVFP4 q, k, v (and gate, up) with one global
    scale, so on tensor cores they are one GEMM each (`concatenates`); FP8 ones with a weight scale each, one
    RowWise GEMM only where that form passed its probe."""
    from pipeline.model.modelopt import read_packed_linears

    path = build_quantized_checkpoint(tmp_path / fmt, fmt)
    packed = read_packed_linears(path)
    mode = fmt
    for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        parent = "self_attn" if names[0] == "q_proj" else "mlp"
        parts = [tc.ScaledLinear(packed[f"layers.0.{parent}.{n}"], mode, CPU, torch.float32) for n in names]
        assert si.concatenates(parts) == (fmt == "nvfp4"), names
        assert si.concatenates(parts, fp8_columns=True) or fmt != "fp8"
