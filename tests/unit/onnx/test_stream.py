"""Streaming export (pipeline.onnx.stream) and the graph FLOP counter (pipeline.onnx.flops).

* The streamed graph of the embedded model runs bit-identically to the in-memory export in onnxruntime (same ops;
  only constant folding of weight transposes differs), and every bound initializer holds its checkpoint tensor.
* On a 2-layer checkpoint with the 26B's real hidden / expert / head shapes (vocab and expert count scaled so it
  writes ~0.73 GB), the export's peak RSS above the imported baseline stays well under the checkpoint size: it is
  not materialised. The full-size measurement is `dgpipe bench export-memory` (BENCHMARKS.md).
* FLOPs counted from the graph equal the analytic count exactly, routed and dense.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="onnx not installed (pip install dgpipe[engine])")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install dgpipe[engine])")

from onnx import TensorProto  # noqa: E402

from pipeline.model.checkpoint import load_model, open_checkpoint  # noqa: E402
from pipeline.model.cost import denoise_pass_flops  # noqa: E402
from pipeline.onnx import contract as onnx_io  # noqa: E402
from pipeline.onnx.flops import graph_cost, pass_dims  # noqa: E402
from pipeline.resources import EMBEDDED_MODEL  # noqa: E402
from tests._utils.onnx_graphs import random_feeds  # noqa: E402


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from typer.testing import CliRunner

    from pipeline.cli import app
    from pipeline.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("stream")
    args = ["export", "--model", str(EMBEDDED_MODEL), "--output", str(root / "stream"), "--stream", "--json"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["moe"] == "routed"
    export_onnx(load_model(EMBEDDED_MODEL)[0], root / "memory")
    return root


@pytest.mark.slow
def test_streamed_export_runs_bit_identically_to_in_memory_export(exports):
    paths = [str(exports / d / onnx_io.MODEL_FILE) for d in ("memory", "stream")]
    names = [o.name for o in onnx.load(paths[0], load_external_data=False).graph.output if o.name != "probs"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sessions = [ort.InferenceSession(p, opts, providers=["CPUExecutionProvider"]) for p in paths]
    for seed in (0, 1):
        feeds = random_feeds(paths[0], seed)
        ref, got = (s.run(names, feeds) for s in sessions)
        for name, a, b in zip(names, ref, got, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    streamed = onnx.load(paths[1])  # with its data: each bound initializer is its checkpoint tensor
    model = load_model(EMBEDDED_MODEL)[0]
    state = model.state_dict()
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in streamed.graph.initializer}
    for name in ("layers.0.experts.gate_up_proj", "layers.1.self_attn.q_proj.weight", "embed_tokens.weight"):
        np.testing.assert_array_equal(inits[f"model.{name}"], state[name].numpy())
    graph_only = onnx.load(paths[1], load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in graph_only.graph.initializer)
    contract = json.loads((exports / "stream" / onnx_io.CONTRACT_FILE).read_text())
    assert contract["moe"] == "routed" and contract["precision"] == "fp32"
    memory = json.loads((exports / "memory" / onnx_io.CONTRACT_FILE).read_text())
    got, want = contract["flops_per_denoise_pass"], memory["flops_per_denoise_pass"]
    assert got["matmul_flops"] == want["matmul_flops"] and got["kv_bytes"] == want["kv_bytes"]  # same graph
    assert abs(got["weight_bytes"] / want["weight_bytes"] - 1) < 1e-4  # + a few shape constants


def test_streaming_refuses_a_checkpoint_without_weights(tmp_path):
    from pipeline.errors import DgpipeError
    from pipeline.onnx.stream import export_streaming

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text((EMBEDDED_MODEL / "config.json").read_text())
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(DgpipeError, match="no DiffusionGemma tensors"):
        export_streaming(tmp_path / "ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_streaming_export_of_26b_shaped_layers_does_not_materialise(tmp_path):
    from pipeline.bench.export_memory import model_config, stream_peak_rss, write_random_checkpoint

    cfg = model_config("diffusiongemma-26b-a4b", 2, vocab_size=8192, num_experts=16)
    assert cfg.text_config.hidden_size == 2816 and cfg.text_config.moe_intermediate_size == 704
    size = write_random_checkpoint(tmp_path / "ckpt", cfg)
    assert size > 0.7e9
    r = stream_peak_rss(tmp_path / "ckpt", tmp_path / "onnx")
    grew = r["peak_rss_gb"] - r["rss_after_imports_gb"]  # measured ~0.18 GB: the trace + one 64 MiB chunk
    assert grew < 0.45 * size / 1e9, r  # materialising would hold >= the whole checkpoint
    data = tmp_path / "onnx" / onnx_io.WEIGHTS_FILE
    assert data.stat().st_size >= size  # every weight was written (+ RoPE tables, head constants, padding)


@pytest.mark.slow
def test_graph_flops_equal_the_analytic_count_routed_and_dense(exports):
    from pipeline.onnx.stream import structure_graph

    ckpt = open_checkpoint(EMBEDDED_MODEL)
    cfg = ckpt.config.text_config
    routed = onnx.load(str(exports / "stream" / onnx_io.MODEL_FILE), load_external_data=False)
    dense = structure_graph(ckpt.config, "dense", torch.float32)
    for b, s, past in ((1, 16, 40), (3, 8, 5)):
        dims = pass_dims(b, s, past, cfg.sliding_window)
        r = graph_cost(routed, dims, str(exports / "stream"))
        d = graph_cost(dense, dims)
        assert r.matmul_flops == denoise_pass_flops(cfg, b, s, past, routed=True)
        assert d.matmul_flops == denoise_pass_flops(cfg, b, s, past, routed=False)
        assert r.matmul_flops < d.matmul_flops
        assert r.kv_bytes == d.kv_bytes > 0


@pytest.fixture(scope="module", params=["fp8", "nvfp4"])
def quantized_exports(request, tmp_path_factory):
    """ModelOpt's own FP8 / NVFP4 checkpoint of the embedded model, exported in memory and streamed, as the
    fp32 reference graph and as the bf16 graph the engines are built from."""
    pytest.importorskip("modelopt", reason="needs nvidia-modelopt: pip install 'dgpipe[quantize]'")
    from pipeline.onnx.quant import export_fp8, export_nvfp4
    from pipeline.onnx.stream import export_quantized_streaming
    from tests._utils.quantized import modelopt_checkpoint

    fmt, root = request.param, tmp_path_factory.mktemp(f"stream-{request.param}")
    ckpt = modelopt_checkpoint(root / "ckpt", fmt)
    in_memory = export_fp8 if fmt == "fp8" else export_nvfp4
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        paths["memory", dtype] = in_memory(ckpt, root / f"memory-{dtype}", dtype=dtype).path
        paths["stream", dtype] = export_quantized_streaming(
            ckpt, root / f"stream-{dtype}", fmt, dtype=dtype
        ).path
    return fmt, paths


def _initializers(path: str) -> dict[str, np.ndarray]:
    m = onnx.load(path)
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}


def test_a_streamed_quantized_export_is_the_in_memory_one(quantized_exports):
    """Without loading the model, every packed weight, block scale and scale of the Q/DQ graph is the
    in-memory export's byte for byte (the routed experts' stacks too), in fp32 and in the bf16 graph the
    engines are built from, the graph keeps the same Q/DQ and MoE nodes, and the FP8 graph runs in
    onnxruntime bit-identically (onnxruntime cannot run NVFP4's TRT_FP4DynamicQuantize)."""
    fmt, paths = quantized_exports
    for dtype in (torch.float32, torch.bfloat16):
        memory, stream = (_initializers(paths[kind, dtype]) for kind in ("memory", "stream"))
        quantized = [n for n in memory if n.endswith((".weight_scale", ".weight_scale_2", ".input_scale"))]
        quantized += [n.removesuffix("_scale") for n in memory if n.endswith(".weight_scale")]
        quantized += [n for n in memory if "input_scale" in n and n.startswith("qdq.")]
        assert len(quantized) > 100
        for name in quantized:
            a, b = memory[name], stream[name]
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
        ops = [{n.op_type for n in onnx.load(paths[k, dtype], load_external_data=False).graph.node} for k in ("memory", "stream")]  # fmt: skip
        assert {"DequantizeLinear", "MoE"} <= ops[0] and ops[0] - {"Identity"} == ops[1]
    if fmt == "fp8":
        sessions = [ort.InferenceSession(paths[k, torch.float32], providers=["CPUExecutionProvider"]) for k in ("memory", "stream")]  # fmt: skip
        names = [o.name for o in sessions[0].get_outputs() if o.name != "probs"]
        feeds = random_feeds(paths["memory", torch.float32], 0)
        for name, a, b in zip(names, *(s.run(names, feeds) for s in sessions), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_the_stream_refuses_a_dequantized_export(tmp_path):
    """--no-precision-from-checkpoint asks for dequantized float weights, which only the in-memory export
    writes: with --stream it is refused, not silently ignored."""
    pytest.importorskip("modelopt", reason="needs nvidia-modelopt: pip install 'dgpipe[quantize]'")
    from pipeline.errors import DgpipeError
    from pipeline.onnx.stage import run_export
    from tests._utils.quantized import modelopt_checkpoint

    ckpt = modelopt_checkpoint(tmp_path / "ckpt", "fp8")
    with pytest.raises(DgpipeError, match="--stream exports the checkpoint's Q/DQ graph"):
        run_export(ckpt, tmp_path / "onnx", None, from_checkpoint=False, stream=True)


@pytest.mark.slow
def test_a_quantized_export_of_26b_shaped_layers_does_not_materialise(tmp_path):
    """The FP8 checkpoint of the 2-layer 26B-shaped model above (0.47 GB), streamed into the bf16 Q/DQ graph
    the engines are built from: peak RSS grows by ~0.3 GB (the trace and one chunk), where the in-memory
    export held 6.3 GB (the model dequantized, its stand-ins and the graph's tensors)."""
    from pipeline.bench.export_memory import model_config, stream_peak_rss, write_random_checkpoint
    from tests._utils.quantized import build_quantized_checkpoint

    cfg = model_config("diffusiongemma-26b-a4b", 2, vocab_size=8192, num_experts=16)
    write_random_checkpoint(tmp_path / "float", cfg)
    ckpt = build_quantized_checkpoint(tmp_path / "fp8", "fp8", src=tmp_path / "float")
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert size > 0.4e9
    r = stream_peak_rss(ckpt, tmp_path / "onnx", quantized="fp8")
    grew = r["peak_rss_gb"] - r["rss_after_imports_gb"]
    assert grew < 0.8 * size / 1e9, r  # the in-memory export grows by ~13x the checkpoint
    graph = onnx.load(str(tmp_path / "onnx" / onnx_io.MODEL_FILE), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in graph.graph.node) > 0


def test_a_quantized_checkpoint_with_unquantized_experts_streams(tmp_path):
    """ModelOpt writes experts it leaves unquantized (`--exclude '*experts*'`) one float tensor per expert
    and projection, not fused: the stream stacks them into the fused parameters, expert by expert, and the
    graph runs bit-identically to the in-memory export (which fuses them on load)."""
    pytest.importorskip("modelopt", reason="needs nvidia-modelopt: pip install 'dgpipe[quantize]'")
    from pipeline.onnx.quant import export_fp8
    from pipeline.onnx.stream import export_quantized_streaming
    from quantize.run import QuantizeOptions, quantize_checkpoint

    opts = QuantizeOptions(
        EMBEDDED_MODEL, "fp8", tmp_path / "ckpt", calib_size=4, calib_steps=2, exclude=["*experts*"]
    )
    ckpt = quantize_checkpoint(opts).output
    paths = [
        export_fp8(ckpt, tmp_path / "memory").path,
        export_quantized_streaming(ckpt, str(tmp_path / "stream"), "fp8").path,  # a str path too
    ]
    sessions = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]) for p in paths]
    names = [o.name for o in sessions[0].get_outputs() if o.name != "probs"]
    feeds = random_feeds(paths[0], 0)
    for name, a, b in zip(names, *(s.run(names, feeds) for s in sessions), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
