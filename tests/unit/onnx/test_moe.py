"""The routed `dgpipe::MoE` node: its reference function against the PyTorch oracle, and routed vs dense exports.

Oracle: `pipeline.model.network.Experts.forward` in float64 (the same maths the runtime runs). The function runs in
onnxruntime in fp32; bounds are a few fp32 ulps of the output scale (each output is a sum of K * I products, summed in
another order than the oracle's). The fp8 activation variant is compared with `fp8_fake_quant` applied per expert
in fp32 PyTorch (the same rounding points), so it must agree to fp32 noise too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install dgpipe[engine])")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install dgpipe[engine])")

from onnx import TensorProto, helper  # noqa: E402

from pipeline.model.config import TextConfig  # noqa: E402
from pipeline.model.fake_quant import fp8_fake_quant  # noqa: E402
from pipeline.model.network import Experts, gelu_tanh  # noqa: E402
from pipeline.onnx import contract as onnx_io  # noqa: E402
from pipeline.onnx.moe import moe_function, routed_reference  # noqa: E402
from pipeline.resources import EMBEDDED_MODEL  # noqa: E402


def _moe_session(act_quant: str, top_k: int, e: int, inner: int) -> ort.InferenceSession:
    names = [s.name for s in onnx_io.MOE.inputs]
    if act_quant == "none":
        names = names[:-1]
    types = {
        "hidden": TensorProto.FLOAT,
        "expert_index": TensorProto.INT64,
        "expert_weight": TensorProto.FLOAT,
        "gate_up": TensorProto.FLOAT,
        "down": TensorProto.FLOAT,
        "input_scale": TensorProto.FLOAT,
    }
    node = helper.make_node(
        "MoE",
        names,
        ["out"],
        domain=onnx_io.DOMAIN,
        num_experts=e,
        top_k=top_k,
        expert_hidden=inner,
        activation="gelu_tanh",
        act_quant=act_quant,
        **onnx_io.PLUGIN_ATTRIBUTES,
    )
    graph = helper.make_graph(
        [node],
        "moe",
        [
            helper.make_tensor_value_info(s.name, types[s.name], list(s.shape))
            for s in onnx_io.MOE.inputs
            if s.name in names
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["tokens", "d"])],
    )
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", onnx_io.OPSET), helper.make_opsetid(onnx_io.DOMAIN, 1)],
        functions=[moe_function(onnx_io.OPSET, act_quant)],
        ir_version=onnx_io.IR_VERSION,
    )
    onnx.checker.check_model(m, full_check=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _case(t: int, d: int, inner: int, e: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen, dtype=torch.float64)
    index = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # distinct, like TopK
    weight = torch.rand(t, k, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(e, 2 * inner, d, generator=gen, dtype=torch.float64) / d**0.5
    down = torch.randn(e, d, inner, generator=gen, dtype=torch.float64) / inner**0.5
    return x, index, weight, gate_up, down


@pytest.mark.parametrize(("t", "d", "inner", "e", "k", "seed"), [(7, 16, 8, 4, 2, 0), (33, 24, 12, 16, 8, 1)])
def test_moe_function_matches_experts_oracle(t, d, inner, e, k, seed):
    x, index, weight, gate_up, down = _case(t, d, inner, e, k, seed)
    cfg = TextConfig(hidden_size=d, moe_intermediate_size=inner, num_experts=e, top_k_experts=k)
    experts = Experts(cfg).double()
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        experts.grouped = False
        want = experts(x, index, weight).numpy()
        mine = routed_reference(x, index, weight, gate_up, down).numpy()  # what the trace's forward computes
    f32 = {
        n: v.float().numpy()
        for n, v in zip(("hidden", "expert_weight", "gate_up", "down"), (x, weight, gate_up, down))
    }
    got = _moe_session("none", k, e, inner).run(None, {**f32, "expert_index": index.numpy()})[0]
    scale = np.abs(want).max()
    np.testing.assert_allclose(mine, want, rtol=0, atol=1e-12 * scale)
    err = np.abs(got - want).max()
    assert err <= 64 * np.finfo(np.float32).eps * scale, (err, scale)
    # a dense (every expert) sum would differ: the routing really selects
    dense = sum(
        torch.nn.functional.linear(
            gelu_tanh(torch.nn.functional.linear(x, gate_up[j, :inner]))
            * torch.nn.functional.linear(x, gate_up[j, inner:]),
            down[j],
        )
        for j in range(e)
    ).numpy()
    assert np.abs(dense - want).max() > 0.1 * scale


def test_moe_function_fp8_activations_match_fake_quant_reference():
    t, d, inner, e, k = 19, 32, 16, 8, 2
    x, index, weight, gate_up, down = (
        v.float() if v.is_floating_point() else v for v in _case(t, d, inner, e, k, 2)
    )
    gen = torch.Generator().manual_seed(3)
    input_scale = (
        torch.rand(3, e, generator=gen) * 0.02 + 0.005
    ).float()  # small: values saturate/round visibly
    want = torch.zeros(t, d)
    for row in range(t):
        for slot in range(k):
            j = int(index[row, slot])
            xg = fp8_fake_quant(x[row], input_scale[0, j])
            xu = fp8_fake_quant(x[row], input_scale[1, j])
            a = gelu_tanh(gate_up[j, :inner] @ xg) * (gate_up[j, inner:] @ xu)
            want[row] += weight[row, slot] * (down[j] @ fp8_fake_quant(a, input_scale[2, j]))
    feeds = {
        "hidden": x.numpy(),
        "expert_index": index.numpy(),
        "expert_weight": weight.numpy(),
        "gate_up": gate_up.numpy(),
        "down": down.numpy(),
        "input_scale": input_scale.numpy(),
    }
    got = _moe_session("fp8", k, e, inner).run(None, feeds)[0]
    unquant = _moe_session("none", k, e, inner).run(
        None, {n: v for n, v in feeds.items() if n != "input_scale"}
    )[0]
    scale = float(want.abs().max())
    assert np.abs(got - want.numpy()).max() <= 1e-4 * scale
    assert np.abs(unquant - want.numpy()).max() > 1e-3 * scale  # the fake quant is really applied


def _moe_model_nvfp4(top_k: int, e: int, inner: int, d: int) -> onnx.ModelProto:
    """One dgpipe::MoE node, act_quant nvfp4, opset 23 (its function casts to FLOAT4E2M1)."""
    names = [s.name for s in onnx_io.MOE.inputs]
    node = helper.make_node(
        "MoE",
        names,
        ["out"],
        domain=onnx_io.DOMAIN,
        num_experts=e,
        top_k=top_k,
        expert_hidden=inner,
        activation="gelu_tanh",
        act_quant="nvfp4",
        **onnx_io.PLUGIN_ATTRIBUTES,
    )
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {
        "hidden": (f, ["tokens", d]),
        "expert_index": (i64, ["tokens", top_k]),
        "expert_weight": (f, ["tokens", top_k]),
        "gate_up": (f, [e, 2 * inner, d]),
        "down": (f, [e, d, inner]),
        "input_scale": (f, [3, e]),
    }
    graph = helper.make_graph(
        [node],
        "moe",
        [helper.make_tensor_value_info(n, *shapes[n]) for n in names],
        [helper.make_tensor_value_info("out", f, ["tokens", d])],
    )
    m = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", onnx_io.OPSET_NVFP4), helper.make_opsetid(onnx_io.DOMAIN, 1)],
        functions=[moe_function(onnx_io.OPSET_NVFP4, "nvfp4")],
        ir_version=11,
    )
    onnx.checker.check_model(m, full_check=True)
    return m


def test_moe_function_nvfp4_activations_match_fake_quant_reference():
    """act_quant nvfp4: every routed copy of x (gate/up) and of the GELU product (down) is NVFP4 fake-quantized
    (dynamic E4M3 scale per 16, the expert's global input_scale). onnxruntime 1.32 (CPU) has no FLOAT4E2M1
    Cast kernel, so onnx's reference evaluator runs the function; it must match nvfp4_fake_quant per expert
    to fp32 noise, and differ visibly from the unquantized node."""
    import onnx.inliner
    from onnx.reference import ReferenceEvaluator

    from pipeline.model.fake_quant import nvfp4_fake_quant

    t, d, inner, e, k = 13, 32, 16, 8, 2
    x, index, weight, gate_up, down = (
        v.float() if v.is_floating_point() else v for v in _case(t, d, inner, e, k, 4)
    )
    # global scales amax / (6 * 448) of the calibrated inputs, some smaller so blocks saturate at 448
    input_scale = (torch.rand(3, e, generator=torch.Generator().manual_seed(5)) + 0.1).float() * 4 / 2688
    want = torch.zeros(t, d)
    for row in range(t):
        for slot in range(k):
            j = int(index[row, slot])
            xg = nvfp4_fake_quant(x[row], input_scale[0, j])
            xu = nvfp4_fake_quant(x[row], input_scale[1, j])
            a = gelu_tanh(gate_up[j, :inner] @ xg) * (gate_up[j, inner:] @ xu)
            want[row] += weight[row, slot] * (down[j] @ nvfp4_fake_quant(a, input_scale[2, j]))
    mine = routed_reference(x, index, weight, gate_up, down, input_scale, "nvfp4")
    feeds = {
        "hidden": x.numpy(),
        "expert_index": index.numpy(),
        "expert_weight": weight.numpy(),
        "gate_up": gate_up.numpy(),
        "down": down.numpy(),
        "input_scale": input_scale.numpy(),
    }
    flat = onnx.inliner.inline_local_functions(_moe_model_nvfp4(k, e, inner, d))  # typed: Gelu expands
    got = ReferenceEvaluator(flat).run(None, feeds)[0]
    unquant = routed_reference(x, index, weight, gate_up, down).numpy()
    scale = float(want.abs().max())
    assert np.abs(mine.numpy() - want.numpy()).max() <= 1e-5 * scale
    assert np.abs(got - want.numpy()).max() <= 1e-5 * scale, np.abs(got - want.numpy()).max() / scale
    assert np.abs(unquant - want.numpy()).max() > 1e-2 * scale  # NVFP4 (E2M1: 8 magnitudes) really rounds
    with pytest.raises(ValueError, match="opset >= 23"):
        moe_function(onnx_io.OPSET, "nvfp4")


@pytest.mark.slow
def test_routed_and_dense_exports_agree_and_cli_records_form(tmp_path):
    """Same model, same inputs: the routed graph (dgpipe::MoE) and the dense one give the same logits to
    fp32 noise and identical samples; `dgpipe export --moe dense` records the form in manifest + contract."""
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.model.checkpoint import load_model
    from pipeline.onnx.export import export_onnx

    model = load_model(EMBEDDED_MODEL)[0]
    routed = export_onnx(model, tmp_path / "routed")
    build = tmp_path / "build"
    res = CliRunner().invoke(
        app, ["export", "--model", str(EMBEDDED_MODEL), "--build-dir", str(build), "--moe", "dense", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (
        out["moe"] == "dense"
        and "dgpipe::MoE" not in out["custom_ops"]
        and "dgpipe::MoE" in routed.custom_ops
    )
    manifest = json.loads((build / "build_manifest.json").read_text())
    assert manifest["stages"]["export"]["details"]["moe"] == "dense"
    assert json.loads((build / "onnx" / onnx_io.CONTRACT_FILE).read_text())["moe"] == "dense"
    dense_m = onnx.load(out["path"], load_external_data=False)
    assert not any(n.op_type == "MoE" for n in dense_m.graph.node)

    from pipeline.demo import sudoku
    from pipeline.demo import tokenizer as stok
    from pipeline.onnx.backend import OnnxRuntimeBackend
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from pipeline.runtime.session import load_session

    sampler = load_session(EMBEDDED_MODEL, "auto", "cpu").sampler()
    puzzles = sudoku.make_dataset(30_000, 6, (45, 61))

    def run(onnx_dir) -> list[list[int]]:
        be = OnnxRuntimeBackend(onnx_dir, EMBEDDED_MODEL)
        rt = BlockDiffusionRuntime(be, max_batch=len(puzzles), max_len=stok.PROMPT_LEN + 2 * 82)
        reqs = [
            Request(
                prompt_ids=stok.sudoku_prompt_ids(p),
                max_tokens=stok.TARGET_LEN,
                sampler=sampler,
                request_id=i,
                template=stok.sudoku_infill_template(p),
            )
            for i, (p, _) in enumerate(puzzles)
        ]
        return [r.tokens for r in rt.generate(reqs)]

    assert run(tmp_path / "routed") == run(build / "onnx")  # token for token
