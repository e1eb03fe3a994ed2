"""Float experts routed on the device (`pipeline.runtime.routed`): on torch's grouped GEMM and on dgpipe's
Triton GEMM (Triton's interpreter here) against the network's own experts and the loader's fake-quantized
expert loop; which layers a GPU load routes, what it reports, and the probe of the Triton bf16 GEMM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.errors import DgpipeError
from pipeline.model.checkpoint import load_model
from pipeline.model.fake_quant import InputQuantizer
from pipeline.model.modelopt import _quantized_experts_forward
from pipeline.model.network import Experts
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime import gpu_load, kernels, routed
from pipeline.runtime import probe as probing
from pipeline.runtime.backends import experts_graph_safe
from tests._utils.compile import compiled_whole, graph_targets
from tests._utils.interpreter_casts import interpreted
from tests._utils.quantized import build_quantized_checkpoint

CPU = torch.device("cpu")
rel = lambda got, want: float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture(scope="module")
def experts() -> Experts:
    """One layer's bf16 experts of the embedded model (96 wide, 4 experts)."""
    return load_model(EMBEDDED_MODEL, torch.bfloat16)[0].layers[0].experts


def _routing(gen, experts: Experts, tokens: int):
    x = torch.randn(tokens, experts.gate_up_proj.shape[-1], generator=gen).bfloat16()
    index = torch.randint(0, experts.num_experts - 1, (tokens, 2), generator=gen)  # the last gets no token
    return x, index, torch.rand(tokens, 2, generator=gen)


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=interpreted)])
def test_routed_experts_compute_what_the_networks_experts_do(monkeypatch, experts, triton):
    """bf16 throughout: within bf16's rounding of the network's grouped experts (the sum order differs),
    with uneven and empty experts; the Triton form never calls torch's grouped GEMM."""
    gen = torch.Generator().manual_seed(0)
    x, index, weights = _routing(gen, experts, 50)
    want = experts(x, index, weights)
    if triton:
        monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    got = routed.RoutedExperts(experts, triton)(x, index, weights)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel(got, want) < 1e-2  # measured 2e-3 to 4e-3 (bf16 outputs, other summation order)


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=interpreted)])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_routed_experts_round_inputs_as_the_fake_quantized_loop_does(experts, triton, fmt):
    """A quantized checkpoint's dequantized experts: the same InputQuantizers as the loader's expert loop
    (`modelopt._quantized_experts_forward`, the oracle), applied once per token before the row gather."""
    gen = torch.Generator().manual_seed(1)
    x, index, weights = _routing(gen, experts, 60)
    quants = {
        "gate_up": InputQuantizer(fmt, torch.tensor(0.01)),
        "down": InputQuantizer(fmt, torch.tensor(0.002)),
    }
    want = _quantized_experts_forward(quants)(experts, x, index, weights)
    got = routed.RoutedExperts(experts, triton, quants)(x, index, weights)
    plain = routed.RoutedExperts(experts, triton)(x, index, weights)
    # bf16 intermediates flip some of the down input's FP8 / FP4 roundings; without the rounding at all
    # the distance is the activation formats' own error, several times larger
    bound = 3e-2 if fmt == "fp8" else 6e-2
    assert rel(got, want) < bound < rel(plain, want)


def test_which_layers_route_on_the_device():
    model = load_model(EMBEDDED_MODEL, torch.bfloat16)[0]
    layers = list(range(len(model.layers)))
    assert routed.host_bound_experts(model, no_grouped_kernel=False) == []  # torch's grouped GEMM serves them
    assert routed.host_bound_experts(model, no_grouped_kernel=True) == layers  # sm89 / sm120
    quants = {"gate_up": InputQuantizer("fp8", torch.tensor(0.01))}
    model.layers[1].experts.forward = _quantized_experts_forward(quants).__get__(model.layers[1].experts)
    assert routed.host_bound_experts(model, no_grouped_kernel=False) == [
        1
    ]  # the loop reads counts on the host
    routed.route_on_device(model, [1], triton=False)
    m = model.layers[1].experts
    assert isinstance(m, routed.RoutedExperts) and m.q_in is quants["gate_up"] and m.q_down is None
    assert m.gate_up_proj is not None and "layers.1.experts.gate_up_proj" in model.state_dict()
    assert routed.host_bound_experts(model, no_grouped_kernel=True) == [i for i in layers if i != 1]
    assert routed.host_bound_experts(load_model(EMBEDDED_MODEL)[0], True) == []  # fp32: the dense form
    half = load_model(EMBEDDED_MODEL, torch.float16)[0]  # fp16: no grouped GEMM kernel on any GPU
    assert routed.host_bound_experts(half, no_grouped_kernel=True) == layers
    model.layers[2].experts.forward = lambda x, index, weights: x  # unknown to `routed`: never replaced
    assert 2 not in routed.host_bound_experts(model, no_grouped_kernel=True)


@interpreted
def test_a_bf16_checkpoint_on_ada_routes_every_layer_on_the_triton_gemm(monkeypatch):
    """The embedded bf16 model loaded for an sm89 GPU whose probe ran the Triton bf16 GEMM: every layer's
    experts on it (same parameters, graph-safe), reported; a denoise pass through the interpreted kernel,
    torch's grouped GEMM never called, as close to the fp32 model as the bf16 model's own pass on the CPU."""
    model, _, report = gpu_load.load_on_gpu(
        EMBEDDED_MODEL, torch.bfloat16, CPU, probing.Probe("sm89", {"triton:bf16": None})
    )
    layers = len(model.layers)
    assert all(
        isinstance(layer.experts, routed.RoutedExperts) and layer.experts.triton for layer in model.layers
    )
    assert (report.format, report.routed, report.experts, report.fallbacks) == ("bf16", layers, 0, [])
    assert f"{layers} layers' float experts on Triton bf16 MoE GEMM" in report.summary()
    assert experts_graph_safe(model)
    cfg, length = model.cfg, model.config.canvas_length
    tokens = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(3))
    positions, masks = (
        torch.arange(length)[None].expand(2, -1),
        {"full_attention": None, "sliding_attention": None},
    )
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    with torch.inference_mode():
        got = model.denoise_soft(tokens, None, positions, masks, None)
    monkeypatch.undo()
    with torch.inference_mode():
        want = load_model(EMBEDDED_MODEL, torch.bfloat16)[0].denoise_soft(
            tokens, None, positions, masks, None
        )
        exact = load_model(EMBEDDED_MODEL)[0].denoise_soft(tokens, None, positions, masks, None)
    # as close to the fp32 model as the CPU's own bf16 pass: over 3 seeds 0.046-0.062 against 0.048-0.068
    # (0.024-0.040 from each other); a wrong routing is O(1)
    assert rel(got, exact) < 1.2 * rel(want, exact)


@interpreted
def test_an_fp16_model_on_hopper_routes_every_layer_on_the_triton_gemm_in_fp16(monkeypatch):
    """torch's grouped GEMM has no fp16 CUDA kernel on any GPU (its fallback reads the offsets on the host),
    so a model loaded in fp16 routes its experts on the Triton GEMM even on Hopper, whose probe plan (the
    dispatch table's, for bf16) has no Triton float form: the load runs the fp16 form's check itself (here in
    Triton's interpreter). fp16 throughout, graph-safe, reported; as close to the fp32 model as the fp16
    model's own pass on the CPU."""
    planned = {f"{kind}:{mode}": None for kind, mode, _ in probing.probe_plan("sm90")}
    assert "triton:bf16" not in planned and "triton:fp16" not in planned
    probed = probing.Probe("sm90", planned)
    model, _, report = gpu_load.load_on_gpu(EMBEDDED_MODEL, torch.float16, CPU, probed)
    assert probed.results["triton:fp16"] is None and "triton:bf16" not in probed.results
    assert all(isinstance(x.experts, routed.RoutedExperts) and x.experts.triton for x in model.layers)
    assert report.routed == len(model.layers) and report.routed_kernel == "Triton fp16 MoE GEMM"
    assert report.summary().startswith("fp16 on sm90")
    assert experts_graph_safe(model)
    cfg, length = model.cfg, model.config.canvas_length
    tokens = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(length)[None].expand(2, -1)
    masks = {"full_attention": None, "sliding_attention": None}
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: pytest.fail("torch's grouped GEMM ran"))
    with torch.inference_mode():
        got = model.denoise_soft(tokens, None, positions, masks, None)
    monkeypatch.undo()
    with torch.inference_mode():
        want = load_model(EMBEDDED_MODEL, torch.float16)[0].denoise_soft(tokens, None, positions, masks, None)
        exact = load_model(EMBEDDED_MODEL)[0].denoise_soft(tokens, None, positions, masks, None)
    # over 12 seeds 0.005-0.017 from the fp32 model, at most 1.18x the CPU's fp16 pass; a wrong routing is O(1)
    assert rel(got, exact) < 1.5 * rel(want, exact)


def test_a_gpu_whose_torch_has_no_grouped_kernel_routes_bf16_experts_on_the_triton_gemm(monkeypatch):
    """A GPU that shares a dispatch row with one torch serves but is not one (compute capability 11.0 reads
    as sm100; torch's grouped GEMM takes 9.x and 10.x alone): the device decides, so its float experts take
    the Triton GEMM, whose check the load runs, instead of torch's host-reading fallback under a graph."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (11, 0))
    assert gpu_load.grouped_kernel_missing(cuda, "sm100", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # a B200
    assert not gpu_load.grouped_kernel_missing(cuda, "sm100", torch.bfloat16)
    assert gpu_load.grouped_kernel_missing(cuda, "sm100", torch.float16)
    monkeypatch.undo()
    monkeypatch.setattr(gpu_load, "grouped_kernel_missing", lambda device, arch, dtype: True)  # the 11.0 GPU
    checked = []
    monkeypatch.setattr(gpu_load, "run_forms", lambda p, dev, forms, dtype: checked.append(forms) or
                        p.results.update({f"{k}:{m}": None for k, m, _ in forms}))  # fmt: skip
    model, _, report = gpu_load.load_on_gpu(EMBEDDED_MODEL, torch.bfloat16, CPU, probing.Probe("sm100"))
    assert checked == [[("triton", "bf16", "bf16")]]
    assert all(isinstance(x.experts, routed.RoutedExperts) and x.experts.triton for x in model.layers)
    assert report.routed_kernel == "Triton bf16 MoE GEMM"


def test_a_bf16_load_routes_nothing_where_torch_serves_it_and_reports_a_failed_probe():
    model, _, report = gpu_load.load_on_gpu(EMBEDDED_MODEL, torch.bfloat16, CPU, probing.Probe("sm90"))
    assert report is None and all(type(layer.experts) is Experts for layer in model.layers)
    probed = probing.Probe("sm120", {"triton:bf16": "out of resources: shared memory"})
    model, _, report = gpu_load.load_on_gpu(EMBEDDED_MODEL, torch.bfloat16, CPU, probed)
    assert all(type(layer.experts) is Experts for layer in model.layers) and report.routed == 0
    assert report.fallbacks == [
        "float experts: Triton bf16 MoE GEMM failed its probe (out of resources: shared memory): "
        "torch's per-expert loop, host sync, no CUDA graphs"
    ]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    return build_quantized_checkpoint(tmp_path_factory.mktemp("fp8") / "fp8", "fp8")


def test_fp8_experts_dequantized_on_b200_route_on_torchs_grouped_gemm(fp8_checkpoint):
    """FP8 on sm100: no FP8 grouped GEMM in torch, so the experts load dequantized, and instead of the
    fake-quantized loop (a host sync per layer, no CUDA graph) they take torch's bf16 grouped GEMM with the
    loop's own input rounding; the linears stay FP8."""
    probed = probing.Probe("sm100", {"linear:fp8": None})
    model, _, report = gpu_load.load_on_gpu(fp8_checkpoint, torch.bfloat16, CPU, probed)
    assert all(isinstance(layer.experts, routed.RoutedExperts) for layer in model.layers)
    assert not any(layer.experts.triton for layer in model.layers)
    assert all(layer.experts.q_in is not None and layer.experts.q_down is not None for layer in model.layers)
    assert (report.routed, report.routed_kernel, report.experts) == (
        len(model.layers),
        "F.grouped_mm bf16",
        0,
    )
    assert report.linears > 0 and experts_graph_safe(model)
    loop = load_model(fp8_checkpoint, torch.bfloat16)[0]  # the fake-quantized loop
    exact = load_model(fp8_checkpoint)[0]  # the same loop in fp32
    cfg, length = model.cfg, model.config.canvas_length
    tokens = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(4))
    args = (
        tokens,
        None,
        torch.arange(length)[None],
        {"full_attention": None, "sliding_attention": None},
        None,
    )
    with torch.inference_mode():
        got, want, ref = model.denoise_soft(*args), loop.denoise_soft(*args), exact.denoise_soft(*args)
    # as close to the fp32 model as the loop's own bf16 pass: 0.94-1.09 times its distance over 8 seeds
    # (both 0.06-0.16 from fp32: bf16 flips FP8 roundings through 8 layers); a wrong routing is O(1)
    assert rel(got, ref) < 1.2 * rel(want, ref)


@interpreted
def test_the_triton_bf16_experts_compile_as_two_opaque_ops(experts):
    gen = torch.Generator().manual_seed(5)
    m = routed.RoutedExperts(experts, triton=True)
    x, index, weights = _routing(gen, experts, 20)
    compiled, graphs = compiled_whole(m)
    with torch.no_grad():  # as the runtime runs it (the op has no backward)
        torch.testing.assert_close(compiled(x, index, weights), m(x, index, weights), rtol=0, atol=0)
    assert graph_targets(graphs[0]).count("dgpipe.moe_gemm.default") == 2


@interpreted
def test_the_probe_holds_the_triton_bf16_gemm_to_the_float_product(monkeypatch):
    """The load-time check of the bf16 form, here on the interpreted kernel: it passes; a GEMM wrong at any
    one M tile, or experts wrong only on the tile the pass picks, fail with an error naming the kernel."""
    probing.check_triton_float(CPU, torch.bfloat16)
    real_launch, real_gemm = kernels.moe.launch, kernels.moe.moe_gemm

    def wrong_at(tile):  # rows reversed at one tile
        def launch(t, a, a_scale, rows, w, w_scale, offs, out_rows=None):
            rows = rows.flip(0) if t == tile and rows is not None else rows
            return real_launch(t, a, a_scale, rows, w, w_scale, offs, out_rows)

        return launch

    for tile in kernels.moe.probe_tiles(CPU, 2):
        monkeypatch.setattr(kernels.moe, "launch", wrong_at(tile))
        with pytest.raises(DgpipeError, match=rf"Triton bf16 MoE GEMM \({tile.short()} tiles\) differs"):
            probing.check_triton_float(CPU, torch.bfloat16)

    def wrong_in_fp16(t, a, a_scale, rows, w, w_scale, offs, out_rows=None):  # a model loaded in fp16
        rows = rows.flip(0) if a.dtype == torch.float16 and rows is not None else rows
        return real_launch(t, a, a_scale, rows, w, w_scale, offs, out_rows)

    monkeypatch.setattr(kernels.moe, "launch", wrong_in_fp16)
    probing.check_triton_float(CPU, torch.bfloat16)  # each dtype is its own form
    with pytest.raises(DgpipeError, match=r"Triton fp16 MoE GEMM \([^)]+ tiles\) differs"):
        probing.check_triton_float(CPU, torch.float16)
    monkeypatch.setattr(kernels.moe, "launch", real_launch)

    def wrong_in_the_pass(a, a_scale, rows, w, w_scale, offs, block_m=None, out_rows=None):
        return real_gemm(
            a, a_scale, rows.flip(0) if rows is not None else rows, w, w_scale, offs, block_m, out_rows
        )

    monkeypatch.setattr(kernels.moe, "moe_gemm", wrong_in_the_pass)
    with pytest.raises(DgpipeError, match="bf16 experts on the Triton MoE GEMM differ"):
        probing.check_triton_float(CPU, torch.bfloat16)
