"""Every GPU dispatch row's load and denoise pass traced on fake CUDA tensors (no GPU): the GEMM each
projection runs, the weight bytes held against the byte model, no host read or host tensor in the pass."""

from __future__ import annotations

import functools
import json
import re
import types
from copy import deepcopy

import pytest
import torch

from pipeline.bench.gpu import fake_cuda
from pipeline.bench.gpu import trace as gt
from pipeline.model.modelopt import _quantized_experts_forward
from pipeline.runtime import gpu_load, kernels
from pipeline.runtime import probe as probing
from pipeline.runtime.dispatch import DISPATCH, EVERY_PASS

LAYERS = 2  # one sliding and one global layer of the 26B: every layer shape, ~1 s a trace
# quantized linears in those two layers: q, k, v, o + the dense MLP's 3 (sliding); the global layer has no v
QUANTIZED_LINEARS = 7 + 6
# float linears outside them: router (per layer), self-conditioning MLP (3), LM head (1)
FLOAT_LINEARS = LAYERS + 3 + 1
# inputs those quantized linears quantize: q|k|v share one, o, gate|up share one, down; per layer
QUANTIZED_INPUTS = 4 * LAYERS


# GEMMs saved by merging sibling linears in the two layers, in every format: each dense MLP's gate and up
# are one GEMM (one fewer a layer) and each attention's q, k and v (two fewer in the sliding layer, one in the
# global one, which has no v); FP8 ones with a weight scale each (the random model's, as ModelOpt's FP8
# exports) as one RowWise GEMM
MERGED_AWAY = LAYERS + 3


@functools.cache
def _traced(fmt: str, arch: str, batch: int) -> gt.PassTrace:
    return gt.trace_pass(fmt, arch, batch, LAYERS)


def traced(fmt: str, arch: str, batch: int) -> gt.PassTrace:
    """`gt.trace_pass(fmt, arch, batch, LAYERS)`: the row's load with its probe passed and one denoise pass over
    the default context. Where nothing is patched it depends on these arguments alone, so the module traces
    each once (the dispatch rows' test, first, traces all 32) and every caller gets its own copy. A test that
    patches the load or the pass, or hands it a probe, calls `gt.trace_pass` itself."""
    return deepcopy(_traced(fmt, arch, batch))


def experts_gemm(fmt: str, arch: str, batch: int) -> str:
    """The GEMM the dispatch table says runs the experts of a pass of `batch` canvases (256 tokens, top 8
    of 128 experts: 16 rows per expert per canvas)."""
    row = DISPATCH[fmt, arch]
    rows_per_expert = batch * 256 * 8 / 128
    if row.experts.startswith("F.grouped_mm"):
        return "F.grouped_mm"
    if row.triton_rows == EVERY_PASS or row.triton_rows >= rows_per_expert:
        return "Triton MoE GEMM"
    return "F.scaled_grouped_mm"


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize(("fmt", "arch"), list(DISPATCH))
def test_every_dispatch_row_runs_its_kernels_without_reading_the_host(fmt, arch, batch):
    t = traced(fmt, arch, batch)
    assert t.error is None
    assert t.output == f"[{batch}, 256, 262144] float32 cuda"
    gemms = t.gemms()
    assert gemms.pop(experts_gemm(fmt, arch, batch)) == 2 * LAYERS  # gate|up and down, per layer
    assert (
        t.ops["triton::combine"] == LAYERS and "torch.bmm" not in gemms
    )  # each token's k expert rows combined
    linears = DISPATCH[fmt, arch].linears
    if linears.startswith("F.scaled_mm"):  # the self-conditioning's gate and up: one float GEMM
        assert gemms == {"F.scaled_mm": QUANTIZED_LINEARS - MERGED_AWAY, "F.linear": FLOAT_LINEARS - 1}
    else:
        assert gemms == {"F.linear": QUANTIZED_LINEARS + FLOAT_LINEARS - MERGED_AWAY - 1}
    for group in ("linears", "experts"):  # held as the byte model reads them (per-row scales: < 1%)
        # NVFP4's merged gate|up block scales are swizzled anew beside the parts' own (`shared_input`): 2.3%
        apart = 0.025 if group == "linears" and linears.startswith("F.scaled_mm NVFP4") else 0.0
        assert t.resident_gb[group] == pytest.approx(t.expected_gb[group] * (1 + apart), rel=0.01), group


def test_the_byte_model_is_what_the_modules_hold_apart_from_scales():
    fp8, bf16 = traced("fp8", "sm90", 1), traced("bf16", "sm90", 1)
    assert fp8.resident_gb["experts"] == pytest.approx(bf16.resident_gb["experts"] / 2, rel=0.01)
    assert fp8.resident_gb["other"] == pytest.approx(bf16.resident_gb["other"])  # bf16 in every format
    nvfp4 = traced("nvfp4", "sm100", 1)
    # 4 bits a weight plus one E4M3 scale per 16
    assert nvfp4.resident_gb["experts"] == pytest.approx(bf16.resident_gb["experts"] * 0.5625 / 2, rel=0.01)


def test_kernels_that_failed_their_probe_take_the_rows_second_path():
    hopper = gt.passing_probe("sm90")
    hopper.results["triton:fp8"] = "no Triton here"
    t = gt.trace_pass("fp8", "sm90", 1, LAYERS, probed=hopper)
    assert t.error is None and t.gemms()["F.scaled_grouped_mm"] == 2 * LAYERS  # torch's kernel at 1 canvas
    # the one-pass quantization has a probe of its own: o's (the input norm makes q|k|v's, the FFN-inputs
    # kernel gate|up's and the experts' gate|up's, the gated GeLUs the downs')
    assert t.ops["triton::fp8_static_quant"] == LAYERS
    hopper.results["quant:fp8"] = "no Triton here"
    t = gt.trace_pass("fp8", "sm90", 1, LAYERS, probed=hopper)
    assert "triton::fp8_static_quant" not in t.ops  # torch's quantization where that failed too
    thor = gt.passing_probe("sm100")  # compute capability 11.0, or a torch without its grouped FP4 kernels
    thor.results["experts:nvfp4"] = "no grouped FP4 GEMM in this build"
    t = gt.trace_pass("nvfp4", "sm100", 16, LAYERS, probed=thor)
    assert t.error is None and t.gemms()["Triton MoE GEMM"] == 2 * LAYERS
    assert t.resident_gb["experts"] == pytest.approx(t.expected_gb["experts"] * 2 / 1.125, rel=0.01)  # FP8
    assert "Triton FP8 MoE GEMM RowWise (weights re-quantized per row at load)" in t.kernels
    # RTX Blackwell: that path always, torch's grouped GEMMs refusing the GPU; its bytes are the row's own
    t = traced("nvfp4", "sm120", 16)
    assert (
        t.error is None
        and t.gemms()["Triton MoE GEMM"] == 2 * LAYERS
        and "F.scaled_grouped_mm" not in t.gemms()
    )
    assert t.resident_gb["experts"] == pytest.approx(t.expected_gb["experts"], rel=0.01)


def _leave_the_loaders_loop(model, device, probed, report):
    """A load that left every layer's experts on the CPU path's fake-quantized loop (`.tolist()`)."""
    for layer in model.layers:
        layer.experts.forward = types.MethodType(_quantized_experts_forward({}), layer.experts)
    return report


def test_a_host_read_in_the_pass_is_reported(monkeypatch):
    monkeypatch.setattr(gpu_load, "route_float_experts", _leave_the_loaders_loop)
    t = gt.trace_pass("bf16", "sm90", 1, LAYERS)
    assert t.error is not None and t.error.startswith("host read in the pass")
    assert t.output == ""


HOST_CONSTANT = torch.tensor(1.0)


def test_a_host_tensor_copied_into_the_pass_is_reported(monkeypatch):
    """A constant kept on the host and copied to the GPU on every call: a CUDA graph cannot capture it."""

    def copy_a_constant(model, device, probed, report):
        norm = model.layers[0].input_layernorm
        forward = norm.forward
        norm.forward = lambda x: forward(x) * HOST_CONSTANT.to(x.device)
        return report

    monkeypatch.setattr(gpu_load, "route_float_experts", copy_a_constant)
    t = gt.trace_pass("bf16", "sm90", 1, LAYERS)
    assert t.error == "host tensor in the pass: torch.Tensor.to reads a cpu tensor of shape []"


def test_triton_launches_are_counted_and_checked(monkeypatch):
    t = traced("fp8", "sm89", 16)
    # o's input: FP8 in one pass; q|k|v's is written by the input norm, gate|up's and the experts' gate|up's
    # by the FFN-inputs kernel, the experts' and the dense MLP's down inputs by the gated GeLUs that make them
    assert t.ops["triton::fp8_static_quant"] == LAYERS
    assert t.ops["triton::moe_gemm"] == 2 * LAYERS
    launcher = fake_cuda.Launcher(
        "moe_gemm", types.SimpleNamespace(counting=True, ops=t.ops, bytes=t.traffic)
    )
    with pytest.raises(RuntimeError, match="launched with a cpu tensor"):
        launcher[(1,)](torch.zeros(1))


def test_dgpipe_bench_gpu_trace_writes_json_and_table(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli import app

    args = ["bench", "gpu-trace", "--layers", "1", "--batch", "1", "--out", str(tmp_path), "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["failed"] == 0 and len(result["traces"]) == len(DISPATCH)
    assert result["config"] == "diffusiongemma-26b-a4b, 1 layers"
    assert (tmp_path / gt.TABLE_FILE).read_text().count("\n") == len(DISPATCH) + 2
    assert json.loads((tmp_path / gt.RESULT_FILE).read_text()) == result


def test_nvfp4_activations_take_one_launch_each_as_fp8s_do():
    """torch's element-wise NVFP4 quantization is ~50 launches an input (~13,000 a 26B pass); the kernels of
    `pipeline.runtime.kernels.quant` make it one, so Hopper's NVFP4 pass launches about what its FP8 pass
    does: two more for the experts' and the dense MLP's down inputs, which FP8 quantizes inside the gated
    GeLUs, and one more for q|k|v's, which FP8's input norm writes. Gate|up's and the experts' gate|up's
    inputs come from the FFN-inputs kernel in both, and both merge gate and up, and q, k and v."""
    inputs = QUANTIZED_INPUTS + 2 * LAYERS  # every quantized input and both expert projections'
    hopper, fp8 = traced("nvfp4", "sm90", 1), traced("fp8", "sm90", 1)
    assert hopper.ops["triton::nvfp4_fp8_rows"] == inputs - 2 * LAYERS
    assert hopper.launches == fp8.launches + 3 * LAYERS
    b200 = traced("nvfp4", "sm100", 1)
    # a linear's quantization writes its scales swizzled, padding included, the dense MLP's down operand
    # comes from its gated GeLU so; the experts' inputs are quantized (gate|up's on their own, down's in
    # the gated GeLU), then their scales gathered and swizzled by expert group: no zero-filled outputs
    # q|k|v's from the input norm, gate|up's and the experts' from the FFN-inputs kernel: o's alone
    assert b200.ops["triton::nvfp4_quant_blocked"] == QUANTIZED_INPUTS - 3 * LAYERS == LAYERS
    assert b200.ops["triton::norm_nvfp4"] == b200.ops["triton::ffn_inputs"] == LAYERS
    assert "triton::nvfp4_quant" not in b200.ops
    assert b200.ops["triton::geglu_nvfp4"] == b200.ops["triton::blocked_scales"] == 2 * LAYERS
    assert "aten::zeros" not in b200.ops
    no_kernel = gt.passing_probe("sm100")
    no_kernel.results["quant:nvfp4"] = "failed"
    torch_form = gt.trace_pass("nvfp4", "sm100", 1, LAYERS, probed=no_kernel)
    nvfp4_kernels = {"triton::nvfp4_quant", "triton::nvfp4_quant_blocked", "triton::geglu_nvfp4"}
    assert not nvfp4_kernels & set(torch_form.ops)
    assert torch_form.launches > b200.launches + 40 * inputs


def test_rope_takes_one_launch_per_tensor_where_probed():
    """torch's RoPE is five launches for q and five for k a layer (the multiplies, `rotate_half`'s negation
    and concatenation, the sum); `pipeline.runtime.kernels.chains` makes each one (where the head-norms kernel,
    which rotates too, failed its probe). A failed probe keeps torch's."""
    base = gt.passing_probe("sm90")
    base.results[probing.HEAD_NORMS] = "failed"
    fused = gt.trace_pass("bf16", "sm90", 1, LAYERS, probed=base)
    assert fused.ops["triton::rope"] == 2 * LAYERS and "aten::neg" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results.update(base.results, **{probing.ROPE: "failed"})
    torch_form = gt.trace_pass("bf16", "sm90", 1, LAYERS, probed=no_kernel)
    assert "triton::rope" not in torch_form.ops and torch_form.ops["aten::neg"] == 2 * LAYERS
    assert torch_form.launches - fused.launches == 8 * LAYERS


def test_the_logit_softcap_takes_one_launch_where_probed():
    """torch's softcap is the logits' widening to fp32 and three in-place passes over them; the kernel of
    `pipeline.runtime.kernels.chains` widens and caps in one."""
    fused = traced("fp8", "sm90", 1)
    assert fused.ops["triton::softcap"] == 1 and "aten::tanh_" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results[probing.SOFTCAP] = "failed"
    torch_form = gt.trace_pass("fp8", "sm90", 1, LAYERS, probed=no_kernel)
    assert [torch_form.ops[op] for op in ("aten::div_", "aten::tanh_", "aten::mul_")] == [1, 1, 1]
    assert torch_form.ops["aten::to"] == fused.ops["aten::to"] + 1  # the widening
    assert "triton::softcap" not in torch_form.ops and torch_form.launches - fused.launches == 3


def test_traffic_counts_each_operand_read_and_each_result_written_once():
    """Element-wise: inputs plus output (a broadcast operand at its own size, an in-place result as a write of
    its argument, a copy's destination not read); a gather: its indices and the rows it takes, twice; a
    Triton launch: its tensors once."""
    import torch.nn.functional as F

    with fake_cuda.fake_gpu("sm90") as (_, counter, _calls):
        x = torch.empty(1024, 512, device="cuda", dtype=torch.bfloat16)
        row = torch.empty(512, device="cuda", dtype=torch.bfloat16)
        table, idx = (
            torch.empty(1000, 64, device="cuda", dtype=torch.bfloat16),
            torch.zeros(10, dtype=torch.long, device="cuda"),
        )
        counter.counting = True
        _ = x + row[None, :]
        x.mul_(2)
        F.embedding(idx, table)
        fake_cuda.Launchers(counter).softcap[(1,)](x, torch.empty(1024, 512, device="cuda"), 1, 0.5, 2.0)
        x[:512].copy_(x[512:])
        counter.counting = False
    mb = 1024 * 512 * 2
    assert counter.bytes["aten::add"] == mb + 1024 + mb
    assert counter.bytes["aten::mul_"] == 2 * mb
    assert counter.bytes["aten::embedding"] == 80 + 2 * 10 * 64 * 2
    assert counter.bytes["triton::softcap"] == mb + 2 * mb and counter.ops["triton::softcap"] == 1
    assert counter.bytes["aten::copy_"] == mb  # half read, half written: what it overwrites is not read


def test_copies_behind_aliasing_schemas_are_counted_and_views_are_not():
    """`reshape`, `contiguous`, `flatten` and `to` may return their input or a view of it (no work) or a
    copy (a launch): counted where they copied. SDPA's result has the fused CUDA kernels' layout, so
    attention's transpose and reshape of it is a view, as on the GPU."""
    import torch.nn.functional as F

    with fake_cuda.fake_gpu("sm90") as (_, counter, _calls):
        x = torch.empty(4, 16, 8, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # [4, 8, 16]
        q = torch.empty(1, 256, 16, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        counter.counting = True
        with torch.inference_mode():  # as the traced pass runs: composite ops reach the counter whole
            views = (
                x.reshape(4, 8, 16),
                x.flatten(0, 0),
                x.to(torch.bfloat16),
                x.transpose(1, 2).contiguous(),
            )
            copies = (x.reshape(4, 128), x.contiguous(), x.flatten(1, 2), x.to(torch.float32))
            out = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(1, 256, -1)
        counter.counting = False
    assert {k: v for k, v in counter.ops.items() if k != "aten::scaled_dot_product_attention"} == {
        "aten::reshape": 1, "aten::contiguous": 1, "aten::flatten": 1, "aten::to": 1
    }  # fmt: skip
    assert all(v.untyped_storage()._cdata == x.untyped_storage()._cdata for v in views)
    assert len(copies) == 4 and counter.bytes["aten::contiguous"] == 2 * 4 * 16 * 8 * 2
    assert out.shape == (1, 256, 1024) and counter.ops["aten::scaled_dot_product_attention"] == 1


def test_a_pass_moves_at_least_its_weights():
    """At one canvas every expert is touched: the eager pass reads every weight the model holds on the
    device, plus the tied embedding once more as the LM head (what it moves beyond that is activations)."""
    for fmt, arch in (("bf16", "sm90"), ("fp8", "sm90"), ("nvfp4", "sm100")):
        t = traced(fmt, arch, 1)
        weights = t.resident_gb["linears"] + t.resident_gb["experts"] + t.resident_gb["other"]
        assert weights < t.moved_gb < 1.3 * weights + 1.0, (fmt, t.moved_gb, weights)


def test_the_moe_combine_takes_one_launch_and_reads_the_rows_where_they_are():
    """torch's combine gathers the experts' outputs back to slot order and takes a batched product; the
    kernel of `pipeline.runtime.kernels.chains` reads them in place (at 16 canvases on Hopper, torch's
    grouped GEMM's rows in expert order: a [slots, hidden] copy a layer fewer)."""
    fused = traced("fp8", "sm90", 16)
    assert fused.ops["triton::combine"] == LAYERS and "aten::bmm" not in fused.ops
    assert "aten::index_select" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results[probing.COMBINE] = "failed"
    torch_form = gt.trace_pass("fp8", "sm90", 16, LAYERS, probed=no_kernel)
    assert torch_form.ops["aten::bmm"] == torch_form.ops["aten::index_select"] == LAYERS
    slots_gb = 16 * 256 * 8 * 2816 * 2 / 1e9  # one layer's expert outputs, bf16
    assert torch_form.moved_gb - fused.moved_gb == pytest.approx(LAYERS * 2 * slots_gb, rel=0.01)


# torch's routing a layer: softmax, top-k, the renormalisation's sum and division, the scales' gather and
# product; the stable sort of the slots by expert, an arange, each slot's token, the offsets' search
ROUTING_OPS = ("aten::softmax", "aten::topk", "aten::sum", "aten::div", "aten::index", "aten::sort",
               "aten::arange", "aten::floor_divide", "aten::searchsorted")  # fmt: skip


@pytest.mark.parametrize(("fmt", "batch"), [("fp8", 1), ("fp8", 16), ("bf16", 1)])
def test_a_layers_routing_takes_two_launches_where_probed(fmt, batch):
    """The router's top-k is one launch a layer where torch's form is six, the experts' order one where it
    is four (the sort itself more than one kernel on a GPU), on every experts module: FP8 on dgpipe's MoE
    GEMM (1 canvas) and on torch's grouped GEMM (16), bf16 on `F.grouped_mm`. Where the combine gathers
    the rows of torch's grouped GEMMs back to slot order, the order kernel also writes the order's inverse,
    two launches more in torch's form (an arange and a scatter)."""
    fused = traced(fmt, "sm90", batch)
    assert fused.ops["triton::top_k"] == fused.ops["triton::expert_order"] == LAYERS
    assert "aten::topk" not in fused.ops and "aten::sort" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results.update({probing.TOP_K: "failed", probing.EXPERT_ORDER: "failed"})
    torch_form = gt.trace_pass(fmt, "sm90", batch, LAYERS, probed=no_kernel)
    inverse = not (fmt == "fp8" and batch == 1)  # the Triton MoE GEMM writes its rows in slot order
    # (the gathers of torch's grouped GEMMs index too)
    for op in (*ROUTING_OPS, "aten::mul", "aten::index_put_"):  # the scales' product, the inverse's scatter
        more = {"aten::arange": 1 + inverse, "aten::index_put_": inverse}.get(op, 1)
        assert torch_form.ops.get(op, 0) == fused.ops.get(op, 0) + more * LAYERS, op
    assert "triton::top_k" not in torch_form.ops and "triton::expert_order" not in torch_form.ops
    assert torch_form.launches == fused.launches + (8 + 2 * inverse) * LAYERS


@pytest.mark.parametrize("batch", [1, 16])
def test_attentions_head_norms_take_one_launch_a_layer_where_probed(batch):
    """q's, k's and v's norms and q's and k's RoPE are one launch, where torch's forms are five (three norms,
    two RoPE kernels), and the normed q and k are no longer written and read back. Without
    the kernel q, k and v are three GEMMs (two more in the sliding layer, one in the global one): torch's
    norms would copy the merged GEMM's column views; the global layer's q is copied into the packed
    queries' layout, which the kernel writes directly (head-major); and K and V are copied into the cache's
    room, where the kernel writes them directly."""
    fused = traced("fp8", "sm90", batch)
    assert fused.ops["triton::head_norms"] == LAYERS and "triton::rope" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results[probing.HEAD_NORMS] = "failed"
    torch_form = gt.trace_pass("fp8", "sm90", batch, LAYERS, probed=no_kernel)
    assert torch_form.ops["aten::rms_norm"] == fused.ops["aten::rms_norm"] + 3 * LAYERS
    assert torch_form.ops["triton::rope"] == 2 * LAYERS and "triton::head_norms" not in torch_form.ops
    assert torch_form.ops["aten::reshape"] == 1 and "aten::reshape" not in fused.ops
    assert torch_form.ops["aten::copy_"] == 2 * LAYERS and "aten::copy_" not in fused.ops
    assert torch_form.launches == fused.launches + 4 * LAYERS + 3 + 1 + 2 * LAYERS
    # q (16 heads) and k (8 sliding, 2 global heads) of 256 and 512: each normed once more, written and read
    heads = (16 + 8) * 256 + (16 + 2) * 512
    normed_gb = 2 * batch * 256 * heads * 2 / 1e9
    operand_gb = 3 * batch * 256 * 2816 / 1e9  # q|k|v's FP8 operand read by the GEMMs that merged away
    # cos and sin (256- and 512-wide) read by q's RoPE and by k's, and once by the one launch
    rope_gb = batch * 256 * (256 + 512) * 2 * 2 / 1e9
    packing_gb = 2 * batch * 256 * 16 * 512 * 2 / 1e9  # the global layer's q read and written packed
    room_gb = 2 * batch * 256 * (8 * 256 + 2 * 512) * 2 * 2 / 1e9  # K and V read and written into the room
    want_gb = normed_gb + operand_gb + rope_gb + packing_gb + room_gb
    assert torch_form.moved_gb - fused.moved_gb == pytest.approx(want_gb, rel=0.05)


@pytest.mark.parametrize(("fmt", "arch"), [("bf16", "sm90"), ("nvfp4", "sm100"), ("nvfp4", "sm90")])
def test_q_k_and_v_are_one_gemm_where_the_head_norms_kernel_reads_their_columns(fmt, arch):
    """Where their weights concatenate (float, NVFP4 with one global scale, per-row FP8), q, k and v are
    one GEMM whose columns the head-norms kernel reads in place; where that kernel failed its probe they
    stay three GEMMs (torch's norms would copy the columns), and the pass has the torch forms' three
    launches a layer more, the two GEMMs of the sliding layer and one of the global one, the copy of the
    global layer's q into the packed queries' layout and those of K and V into the cache's room (which the
    kernel writes directly)."""
    fused = traced(fmt, arch, 1)
    no_kernel = gt.passing_probe(arch)
    no_kernel.results[probing.HEAD_NORMS] = "failed"
    torch_form = gt.trace_pass(fmt, arch, 1, LAYERS, probed=no_kernel)
    gemm = "F.linear" if fmt == "bf16" else "F.scaled_mm"
    assert torch_form.gemms()[gemm] == fused.gemms()[gemm] + 3
    assert torch_form.launches == fused.launches + 4 * LAYERS + 3 + 1 + 2 * LAYERS
    for copy in ("aten::clone", "aten::contiguous"):  # no copies of the columns
        assert torch_form.ops.get(copy, 0) == fused.ops.get(copy, 0)
    assert torch_form.ops["aten::reshape"] == fused.ops.get("aten::reshape", 0) + 1  # q packed


@pytest.mark.parametrize(
    ("fmt", "arch", "batch", "alone"),
    [("fp8", "sm90", 1, 1), ("fp8", "sm90", 16, 1), ("fp8", "sm100", 1, 1), ("nvfp4", "sm100", 16, 1),
     ("nvfp4", "sm90", 1, 4)],
)  # fmt: skip
def test_the_ffn_inputs_kernel_writes_the_operands_of_the_mlp_and_the_experts(
    monkeypatch, fmt, arch, batch, alone
):
    """FP8, NVFP4 or the Hopper NVFP4 fallback's per-row FP8 gate|up and experts read their inputs as the
    FFN-inputs kernel writes them (on Hopper at 16 canvases too, where torch's grouped GEMM takes the
    experts): two quantizations a layer fewer, and each of the two inputs written once as its operand where
    it was written in bf16, read back and quantized (4 bytes a value fewer). `alone`: the quantizations a
    layer left (attention's output; the per-row fallback's q|k|v input and both down inputs too)."""
    fused = traced(fmt, arch, batch)
    quantize = (
        "triton::fp8_static_quant",
        "triton::nvfp4_quant_blocked",
        "triton::nvfp4_quant",
        "triton::nvfp4_fp8_rows",
    )
    assert sum(fused.ops.get(op, 0) for op in quantize) == alone * LAYERS
    monkeypatch.setattr(gpu_load, "ffn_inputs_for", lambda layer: kernels.chains.ffn_inputs_or_torch)
    rows = gt.trace_pass(fmt, arch, batch, LAYERS)
    assert sum(rows.ops.get(op, 0) for op in quantize) == (alone + 2) * LAYERS
    assert rows.ops["triton::ffn_inputs"] == LAYERS and rows.launches == fused.launches + 2 * LAYERS
    values = batch * 256 * 2816  # one input's values
    assert rows.moved_gb - fused.moved_gb == pytest.approx(LAYERS * 2 * 4 * values / 1e9, rel=0.05)


NORM_OPERANDS = {"fp8": ("triton::norm_fp8", probing.NORM_FP8, "triton::fp8_static_quant"),
                 "nvfp4": ("triton::norm_nvfp4", probing.NORM_NVFP4, "triton::nvfp4_quant_blocked")}  # fmt: skip


@pytest.mark.parametrize(
    ("fmt", "arch"), [("fp8", "sm90"), ("fp8", "sm100"), ("nvfp4", "sm100"), ("nvfp4", "sm90")]
)
def test_a_layers_input_norm_writes_its_qkv_operand_where_probed(fmt, arch):
    """FP8 and NVFP4 q, k and v read their shared operand straight from the layer's un-normed input (one
    launch where torch's norm and the quantization are two, and the normed bf16 rows never written); the
    Hopper/Ada NVFP4 fallback's per-row FP8 operand keeps the norm, then its own quantization."""
    t = traced(fmt, arch, 16)
    kernel, form, superseded = NORM_OPERANDS[fmt]
    if arch == "sm90" and fmt == "nvfp4":
        assert not {"triton::norm_fp8", "triton::norm_nvfp4"} & set(t.ops)
        return
    assert t.ops[kernel] == LAYERS
    no_kernel = gt.passing_probe(arch)
    no_kernel.results[form] = "failed"
    torch_form = gt.trace_pass(fmt, arch, 16, LAYERS, probed=no_kernel)
    assert kernel not in torch_form.ops
    assert torch_form.ops["aten::rms_norm"] == t.ops["aten::rms_norm"] + LAYERS
    assert torch_form.ops[superseded] == t.ops.get(superseded, 0) + LAYERS
    assert torch_form.launches == t.launches + LAYERS
    row_gb = 16 * 256 * 2816 * 2 / 1e9  # the normed rows, bf16, written and read back
    assert torch_form.moved_gb - t.moved_gb == pytest.approx(LAYERS * 2 * row_gb, rel=0.05)


def test_ops_a_cpu_build_cannot_run_on_fake_cuda_tensors_run_on_meta_ones():
    """Indexing, `copy_`, `sort` and in-place writes need a CUDA device guard a CPU build of torch lacks:
    they run on meta stand-ins with the same layout, and an in-place op returns its own argument."""
    with fake_cuda.fake_gpu("sm90"):
        x = torch.empty(6, 4, device="cuda", dtype=torch.bfloat16)
        rows = torch.zeros(3, dtype=torch.long, device="cuda")
        assert x[rows].shape == (3, 4) and x[rows].device.type == "cuda"
        assert x.t().contiguous().shape == (4, 6)
        assert torch.sort(x[:, 0]).values.shape == (6,)
        y = torch.empty(6, 4, device="cuda", dtype=torch.bfloat16)
        assert y.copy_(x) is y
        x[rows] = 1.0
        assert x.device.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def test_the_gated_gelus_take_one_launch_where_probed():
    """torch's gated GeLU is two launches (the GeLU, the product) in each layer's dense MLP and experts and in
    the self-conditioning, and FP8 experts and dense MLPs quantize the product in a third for their down
    projection; the kernel makes each one."""
    fused = traced("fp8", "sm90", 1)
    assert fused.ops["triton::geglu"] == 2 * LAYERS + 1 and "aten::gelu" not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results[probing.GEGLU] = "failed"
    torch_form = gt.trace_pass("fp8", "sm90", 1, LAYERS, probed=no_kernel)
    assert "triton::geglu" not in torch_form.ops and torch_form.ops["aten::gelu"] == 2 * LAYERS + 1
    assert (
        torch_form.launches == fused.launches + (2 * LAYERS + 1) + 2 * LAYERS
    )  # one saved a site, and the experts' and the dense MLP's quantizations
    assert torch_form.moved_gb > fused.moved_gb


@pytest.mark.parametrize(
    ("form", "kernel", "torch_op", "more"),
    [
        (probing.RESIDUAL, "triton::add_scaled", "aten::mul", 1),  # the residual sum and the layer scale
        (probing.ROUTER, "triton::scale_columns", "aten::mul", 2),  # the router input's two products
    ],
)
def test_a_two_kernel_chain_takes_one_launch_a_layer_where_probed(form, kernel, torch_op, more):
    """Each chain is one kernel a layer; where its probe failed, torch's form runs `more` of `torch_op` a
    layer instead, one launch more in all. (The residual sum and the router's input run on their own kernels
    where the layer end's and the FFN inputs', which compute them too, failed their probes.)"""
    base = gt.passing_probe("sm90")
    wider = {probing.RESIDUAL: probing.LAYER_END, probing.ROUTER: probing.FFN_INPUTS}
    if form in wider:
        base.results[wider[form]] = "failed"
    fused = gt.trace_pass("bf16", "sm90", 1, LAYERS, probed=base)
    assert fused.ops[kernel] == LAYERS
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results.update(base.results, **{form: "failed"})
    torch_form = gt.trace_pass("bf16", "sm90", 1, LAYERS, probed=no_kernel)
    assert torch_form.ops[torch_op] == fused.ops.get(torch_op, 0) + more * LAYERS
    assert kernel not in torch_form.ops and torch_form.launches == fused.launches + LAYERS


@pytest.mark.parametrize(
    ("form", "kernel", "superseded", "norms", "quantized", "rows"),
    [
        # after attention: its output's norm, the residual sum, the dense MLP's, the experts' and the router's
        # norms of it, the router's scales (on their own kernel where probed): six launches, then the FP8
        # quantization of the MLP's and the experts' inputs, which the kernel writes as such (4 bf16 rows' bytes)
        (probing.FFN_INPUTS, "triton::ffn_inputs", "triton::scale_columns", 4, 2, 7 + 4),
        # after the FFN branches: three norms, their sum, the residual sum and scale (on their own kernel where
        # probed): five launches
        (probing.LAYER_END, "triton::layer_end", "triton::add_scaled", 3, 0, 8),
    ],
)
def test_a_layers_norm_chains_take_one_launch_where_probed(form, kernel, superseded, norms, quantized, rows):
    """Each chain is one launch a layer on its kernel, `norms` RMSNorms, two more launches and `quantized`
    quantizations in torch's form, and `rows` [tokens, hidden] bf16 passes through memory fewer (each
    intermediate written and read back)."""
    fused = traced("fp8", "sm90", 16)
    assert fused.ops[kernel] == LAYERS and superseded not in fused.ops
    no_kernel = gt.passing_probe("sm90")
    no_kernel.results[form] = "failed"
    torch_form = gt.trace_pass("fp8", "sm90", 16, LAYERS, probed=no_kernel)
    assert torch_form.ops["aten::rms_norm"] == fused.ops["aten::rms_norm"] + norms * LAYERS
    assert torch_form.ops[superseded] == LAYERS and kernel not in torch_form.ops
    assert torch_form.launches == fused.launches + (norms + 1 + quantized) * LAYERS
    row_gb = 16 * 256 * 2816 * 2 / 1e9  # one [tokens, hidden] bf16 tensor at 16 canvases
    assert torch_form.moved_gb - fused.moved_gb == pytest.approx(LAYERS * rows * row_gb, rel=0.05)


@pytest.mark.parametrize(
    ("fmt", "arch", "fewer"),
    [("fp8", "sm90", 5 + 3 + 2 + 2 + 3), ("nvfp4", "sm100", 5 + 3 + 3 + 2 + 2), ("bf16", "sm90", 3 + 3)],
)
def test_sibling_linears_share_their_input_quantization_and_gate_and_up_one_gemm(
    monkeypatch, fmt, arch, fewer
):
    """q, k and v quantize their input once (two fewer in a sliding layer, one in a global one), gate and up
    once (one fewer); FP8's and NVFP4's shared q|k|v operand comes from the input norm, and their shared
    gate|up operand from the FFN-inputs kernel (one fewer a layer each). Gate and up are one GEMM in the
    float self-conditioning and in each dense MLP (FP8's, a weight scale each, one RowWise GEMM), and so
    are q, k and v (two fewer in a sliding layer, one in a global one). Without sharing, every linear
    quantizes and runs alone."""
    shared = traced(fmt, arch, 1)
    monkeypatch.setattr(gpu_load, "share_inputs", lambda model, merge_qkv, fp8_columns: (0, 0))
    alone = gt.trace_pass(fmt, arch, 1, LAYERS)
    assert alone.launches - shared.launches == fewer
    assert alone.gemms()["F.linear"] - shared.gemms()["F.linear"] == 1 + (fmt == "bf16") * (LAYERS + 3)
    assert shared.resident_gb["experts"] == alone.resident_gb["experts"]
    assert shared.resident_gb["linears"] == pytest.approx(
        alone.resident_gb["linears"], rel=0.03
    )  # NVFP4's scales


def test_attention_reads_the_cached_and_new_k_v_in_the_caches_buffers():
    """A denoise pass concatenates no K/V: the head-norms kernel writes the canvas's K and V into the room the
    cache keeps after the cached tokens (`network.PastWithRoom`) and attention reads the buffers in place;
    the global layer's 16 query heads (head dim 512) read its 2 K/V heads with no copy per query head, its
    queries packed along them as the kernel writes q (head-major: a view), the output copied out once. The
    only concatenations left are the RoPE tables' (one a layer kind)."""
    trace = traced("bf16", "sm90", 1)
    assert "triton::kv_cat" not in trace.ops and trace.ops["aten::cat"] == 2
    assert "aten::repeat_interleave" not in trace.ops and "aten::reshape" not in trace.ops
    assert trace.ops["aten::contiguous"] == 1 and "aten::copy_" not in trace.ops


def test_nvfp4_experts_copy_no_scales_in_the_pass():
    """The grouped NVFP4 GEMMs read their activations' global scales per expert as the experts hold them:
    the only `contiguous` copy left in the B200 pass is the packed attention's output."""
    trace = traced("nvfp4", "sm100", 16)
    assert trace.ops["aten::contiguous"] == 1


def test_attention_on_cuda_runs_without_cudnns_plans_and_packs_masked_grouped_heads(monkeypatch):
    """Every attention call of a pass on CUDA runs with cuDNN's kernel out of torch's choice (a plan built
    on the host per new shape) and flash's and the memory-efficient kernel's in it, the backends restored
    after the pass; with rows of several lengths (masks), grouped heads are packed for the memory-efficient
    kernel (flash takes no mask, and without cuDNN torch 2.11 would run grouped heads with a mask on the math
    path), q written head-major by the head-norms kernel so its packing is a view."""
    import torch.nn.functional as F

    calls: list[dict] = []
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kw):
        cuda = torch.backends.cuda
        calls.append({"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
                      "efficient": cuda.mem_efficient_sdp_enabled(), "grouped": q.shape[1] != k.shape[1],
                      "masked": attn_mask is not None})  # fmt: skip
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    past_of = gt._past

    def ragged(mcfg, batch, fake, *args):
        """The cache as `_past` reads it, its rows taken as of several lengths (a mask for each kind)."""
        past, positions, masks = past_of(mcfg, batch, fake, *args)
        kinds = mcfg.text_config.layer_types
        keys = {kind: past[kinds.index(kind)].k.shape[2] for kind in masks}
        q = positions.shape[1]
        return (
            past,
            positions,
            {k: torch.ones(batch, 1, q, n, dtype=torch.bool, device="cuda") for k, n in keys.items()},
        )

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    for masked in (False, True):
        calls.clear()
        if masked:
            monkeypatch.setattr(gt, "_past", ragged)
        trace = gt.trace_pass("bf16", "sm90", 2, LAYERS)
        assert trace.error is None and len(calls) == LAYERS
        assert all(c["efficient"] and c["flash"] and not c["cudnn"] for c in calls), calls
        assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the pass
        # unmasked: the sliding layer's grouped heads of 256 on flash, the global layer's of 512 packed
        assert [c["grouped"] for c in calls] == [not masked, False]
        assert all(c["masked"] == masked for c in calls)
        # K/V read once per K/V head, q packed as a view (the copies behind a reshape are counted)
        assert "aten::repeat_interleave" not in trace.ops and "aten::reshape" not in trace.ops


@pytest.mark.parametrize(("fmt", "arch"), [("fp8", "sm90"), ("nvfp4", "sm100"), ("bf16", "sm89")])
def test_a_passs_triton_kernels_compile_once_for_every_prompt_and_context_length(fmt, arch):
    """Triton compiles a kernel again, on the host and in the middle of the pass that launches it, for every
    new compile key, and a key holds whether each int argument is 1 or a multiple of 16 unless the kernel
    says not to (`fake_cuda.specialization`). A server meets new prompt and context lengths all the time:
    the token counts the kernels take are not specialized on, so a denoise pass over any context, and a
    causal pass (prefill chunk, commit) of any length over any context, launch the binaries the first one
    did. (Rows per expert choose the MoE GEMM's tile, a handful of binaries: the lengths here keep one.)"""
    denoise = [gt.trace_pass(fmt, arch, 1, LAYERS, context=c) for c in (256, 263, 1000)]
    # token counts of each class: neither 1 nor a multiple of 16, multiples of 16 (a prompt of 48; a context
    # of 64 and its total of 112), 1
    lengths = ((256, 37), (263, 48), (64, 48), (1001, 1))
    causal = [gt.trace_pass(fmt, arch, 1, LAYERS, context=c, prompt=p) for c, p in lengths]
    for traces in (denoise, causal):
        assert all(t.error is None for t in traces) and traces[0].binaries
        assert all(t.binaries == traces[0].binaries for t in traces), [t.binaries for t in traces]
    assert "kv_cat" in causal[0].binaries and "head_norms" in causal[0].binaries  # the token counts' kernels


def _keys(trace: gt.PassTrace) -> set[tuple]:
    assert trace.error is None, trace.error
    return {(name, key) for name, keys in trace.binaries.items() for key in keys}


@pytest.mark.parametrize(
    ("fmt", "arch", "counts"),
    [
        ("fp8", "sm90", [1, 129, 385, 1025]),  # 16-, 32- and 64-row tiles, then torch's grouped GEMM
        ("bf16", "sm89", [1, 129, 385]),  # the Triton GEMM every pass: its three tiles
    ],
)
def test_after_the_warm_up_no_pass_of_any_batch_or_length_compiles(fmt, arch, counts):
    """Rows per expert choose the experts' GEMMs (the Triton GEMM's tile, or torch's grouped GEMM and its
    combine), so a first batch of two canvases, or of five, compiled new binaries mid-request. After the
    load's warm-up (`warm.warm_experts`: one K/V pass per path, at the fewest tokens that take it) and the
    server's warm-up request (a prompt's prefill, one canvas's denoise pass), denoise passes of 2 to 16
    canvases, a commit of two, and prefills of 400 and 2,000 tokens compile nothing."""
    warmed, warm = gt.trace_warm(fmt, arch, 16 * 256, LAYERS)
    ready = _keys(warm)  # (its error, if the warm-up failed)
    assert warmed == counts
    request = [
        gt.trace_pass(fmt, arch, 1, LAYERS, context=0, prompt=37),
        gt.trace_pass(fmt, arch, 1, LAYERS, context=37),
    ]
    ready |= set().union(*map(_keys, request))
    passes = {f"denoise {b}": gt.trace_pass(fmt, arch, b, LAYERS, context=37) for b in (2, 5, 16)}
    passes |= {f"prefill {p}": gt.trace_pass(fmt, arch, 1, LAYERS, context=37, prompt=p) for p in (400, 2000)}
    passes["commit 2"] = gt.trace_pass(fmt, arch, 2, LAYERS, context=37, prompt=256)
    new = {label: sorted({name for name, _ in _keys(t) - ready}) for label, t in passes.items()}
    assert not any(new.values()), new
    # without the load's passes, a batch of two canvases would compile the 64-row tile
    unwarmed = _keys(passes["denoise 2"]) - set().union(*map(_keys, request))
    assert {name for name, _ in unwarmed} == {"moe_gemm"}


def test_a_launchs_compile_key_is_the_one_tritons_binder_makes():
    """Ints by whether they are 1 or multiples of 16 unless the kernel says not to (kv_cat's token counts),
    tensors by dtype and 16-byte alignment, the launch options too."""
    kv_cat = kernels.chains._kernels().kv_cat
    x = torch.zeros(64, dtype=torch.bfloat16)

    def key(heads=16, past=37, total=48, t=x):
        ints = (heads, past, total, 16, 16, 16, 16, 16, 16)
        return fake_cuda.specialization(
            kv_cat, "sm90", (t,) * 6 + ints, {"D": 8, "D_P2": 8, "BLOCK_T": 4, "num_warps": 4}
        )

    first = key()
    assert ("num_warps", 4) in first and ("constexpr", 8) in first
    assert key(past=38, total=51) == key(past=1, total=2) == first  # token counts: one binary
    assert key(heads=9) != first and key(heads=1) != key(heads=9)  # a multiple of 16, neither, 1
    assert key(t=x[4:]) != first and key(t=x[8:]) == first  # 8 bytes off is unaligned, 16 is aligned


def test_torchs_grouped_gemms_are_traced_as_the_gpu_runs_them():
    """What fake tensors cannot tell, as each GPU's torch does it: the scaled grouped GEMMs refuse every GPU
    but compute capability 9.x and 10.x; `F.grouped_mm` elsewhere, or in a dtype other than bf16, takes its
    fallback, which reads the group offsets on the host; a block-scaled operand takes a swizzle per scale."""
    calls = []
    grouped = lambda a, b, *rest, **kw: calls.append(a.dtype) or "ran"
    bf16, fp16 = torch.empty(2, dtype=torch.bfloat16), torch.empty(2, dtype=torch.float16)
    assert fake_cuda.cuda_grouped_checks(grouped, "sm90")(bf16, None) == "ran"
    assert fake_cuda.cuda_grouped_checks(grouped, "sm100", "scaled")(fp16, None) == "ran"
    for arch in ("sm89", "sm120"):
        with pytest.raises(RuntimeError, match=r"compute capability = \[9.0, 10.0\]"):
            fake_cuda.cuda_grouped_checks(grouped, arch, "scaled")(bf16, None)
        with pytest.raises(fake_cuda.GroupedFallbackReadsHost):
            fake_cuda.cuda_grouped_checks(grouped, arch)(bf16, None)
    with pytest.raises(fake_cuda.GroupedFallbackReadsHost):
        fake_cuda.cuda_grouped_checks(grouped, "sm90")(fp16, None)
    assert calls == [torch.bfloat16, torch.float16]
    # NVFP4's two-level recipe in the grouped form: the swizzle pair, as newer ATen requires it
    two_level = [
        torch.nn.functional.ScalingType.BlockWise1x16.value,
        torch.nn.functional.ScalingType.TensorWise.value,
    ]
    checked = fake_cuda.cuda_scaled_mm_checks(lambda *a, **k: "ran")
    with pytest.raises(ValueError, match="swizzle_b must have 2 values, got 1"):
        checked(None, None, [1, 2], two_level, [1, 0], [1, 2], two_level, [1], None)
    # bf16 experts on Ada whose Triton GEMM failed its probe: torch's fallback loop, a host read in the pass
    ada = gt.passing_probe("sm89")
    ada.results["triton:bf16"] = "no Triton here"
    t = gt.trace_pass("bf16", "sm89", 1, LAYERS, probed=ada)
    assert t.error is not None and t.error.startswith("host read in the pass"), t.error


def test_the_fp8_grouped_gemm_on_fake_cuda_checks_what_cuda_checks():
    """The rehearsal's grouped scaled GEMM refuses what CUDA's row-wise kernel refuses and a meta function
    need not (a broadcast scale, a row-major weight, an fp32 result), so `bench gpu-trace` fails here where
    the GPU would; the arguments the runtime passes (`tensor_cores`) go through."""
    import torch.nn.functional as F

    rowwise = F.ScalingType.RowWise
    with fake_cuda.fake_gpu("sm90"):
        m, k, n, e = 64, 128, 96, 4
        q = torch.empty(m, k, device="cuda", dtype=torch.float8_e4m3fn)
        w = torch.empty(e, n, k, device="cuda", dtype=torch.float8_e4m3fn)
        qs = torch.empty(m, device="cuda")
        s = torch.empty(e, n, device="cuda")
        offs = torch.empty(e, device="cuda", dtype=torch.int32)

        def gemm(weight=w.transpose(-2, -1), a_scale=qs, out=torch.bfloat16):
            return F.scaled_grouped_mm(q, weight, a_scale, rowwise, s, rowwise, offs=offs, output_dtype=out)

        assert gemm().shape == (m, n)
        for bad, needs in (
            ({"a_scale": torch.empty(1, device="cuda").expand(m)}, f"scale_a fp32 [{m}] contiguous"),
            ({"weight": torch.empty(e, k, n, device="cuda", dtype=torch.float8_e4m3fn)}, "b's groups column-major"),
            ({"out": torch.float32}, "a bf16 result"),
        ):  # fmt: skip
            with pytest.raises(RuntimeError, match=re.escape(needs)):
                gemm(**bad)
