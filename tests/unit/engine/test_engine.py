"""The TensorRT half without TensorRT: plugin contract, per-target PTX, engine manifest rules, profiles,
CLI validation and the Triton model's backend choice. GPU + TensorRT tests are at the end and skip here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pipeline.engine import plugin_spec as spec
from pipeline.engine.plan_record import (
    EngineManifest,
    PluginRecord,
    check_compatible,
    is_current,
    load_engine_manifest,
    save_engine_manifest,
)
from pipeline.engine.profiles import engine_profiles, eval_dim
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.onnx import contract as onnx_io
from pipeline.resources import EMBEDDED_MODEL
from pipeline.sampler.kernels import build as kbuild
from tests._utils.availability import has_cuda_gpu, has_tensorrt
from tests._utils.cli import dgpipe

needs_nvcc = pytest.mark.skipif(
    kbuild.find_nvcc() is None, reason="nvcc not found (CUDA toolkit not installed)"
)


# ---- plugin contract -------------------------------------------------------------------------------
ONNX_DTYPE = {"FLOAT": "float32", "INT64": "int64", "BOOL": "bool", "BFLOAT16": "bfloat16"}


@pytest.mark.parametrize("op", [onnx_io.SAMPLE_ROWS, onnx_io.SAMPLE_ACCEPT])
def test_plugin_ports_match_the_onnx_contract(op):
    """The plugin's input/output order and dtypes are the ONNX node's: TensorRT passes pointers by position."""
    inputs, outputs = spec.SPECS[op.name]
    assert [p.name for p in inputs] == [t.name for t in op.inputs]
    assert [p.name for p in outputs] == [t.name for t in op.outputs]
    for port, t in [*zip(inputs, op.inputs, strict=True), *zip(outputs, op.outputs, strict=True)]:
        allowed = port.dtype if isinstance(port.dtype, tuple) else (port.dtype,)
        assert ONNX_DTYPE[t.dtype] in allowed, (port.name, t.dtype)
        assert len(port.dims) == len(t.shape), port.name
    assert set(op.attributes) == (set(spec.ACCEPT_ATTRS) if op.name == spec.ACCEPT_OP else set())


def test_plugin_output_shapes_and_dtypes():
    rows = spec.output_shapes(spec.ROWS_OP, 3, 256, 262144)
    assert rows == [
        ((3, 256), "float32"),
        ((3, 256), "float32"),
        ((3, 256), "int64"),
        ((3, 256), "int64"),
        ((3, 256, 262144), "bfloat16"),
    ]
    accept = spec.output_shapes(spec.ACCEPT_OP, 2, 8, None)
    assert accept == [
        ((2, 8), "float32"),
        ((2, 8), "bool"),
        ((2, 8), "int64"),
        ((2, 8), "int64"),
        ((2,), "int64"),
        ((2,), "bool"),
    ]


def test_plugin_input_checks_name_the_bad_port():
    good = (["float32", "float32", "int64", "int64", "int64", "int64"], [3, 1, 1, 1, 1, 1])
    spec.check_inputs(spec.ROWS_OP, *good)
    with pytest.raises(DgpipeError, match="input 'temperature' must be float32, got float16"):
        spec.check_inputs(spec.ROWS_OP, ["float32", "float16", *good[0][2:]], good[1])
    with pytest.raises(DgpipeError, match="input 'logits' must have rank 3, got 2"):
        spec.check_inputs(spec.ROWS_OP, good[0], [2, 1, 1, 1, 1, 1])
    with pytest.raises(DgpipeError, match="takes 13 inputs, the node has 12"):
        spec.check_inputs(spec.ACCEPT_OP, ["float32"] * 12, [2] * 12)
    with pytest.raises(DgpipeError, match="vocab must be in"):
        spec.check_vocab(0)


def test_kernel_choice_and_launch_geometry():
    assert spec.rows_kernel("float32", 262144) == "dg_trt_rows_f32x4"
    assert spec.rows_kernel("float32", 24 + 2) == "dg_trt_rows_f32x1"  # 26 % 4 != 0
    assert spec.rows_kernel("float32", None) == "dg_trt_rows_f32x1"  # unknown at build time: scalar
    assert spec.rows_kernel("bfloat16", 262144) == "dg_trt_rows_bf16x8"
    assert spec.rows_kernel("bfloat16", 12) == "dg_trt_rows_bf16x1"
    assert [spec.accept_block(n) for n in (1, 8, 32, 33, 256, 1000, None)] == [
        32,
        32,
        32,
        64,
        256,
        1024,
        1024,
    ]
    with pytest.raises(DgpipeError, match="outside"):
        spec.accept_block(1025)


# ---- per-target PTX --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plugins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PTX for all three targets (~10 s on two cores)."""
    from pipeline.engine.ptx import build_plugin_ptx

    root = tmp_path_factory.mktemp("plugins")
    for t in ("sm90", "sm100", "sm120"):
        build_plugin_ptx(root, t)
    return root


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@needs_nvcc
@pytest.mark.parametrize(("target", "arch"), [("sm90", "sm_90a"), ("sm100", "sm_100a"), ("sm120", "sm_120a")])
def test_plugin_ptx_per_target(plugins: Path, target: str, arch: str):
    from pipeline.engine import moe_spec
    from pipeline.engine.ptx import ENTRY_POINTS, load_plugin_ptx, sha256_bytes

    info, data = load_plugin_ptx(plugins / target, target)
    text = data.decode()
    assert info.arch == arch and kbuild.ptx_target(plugins / target / info.file) == arch
    assert re.search(rf"^\.target {arch}\b", text, re.MULTILINE)
    # every kernel the plugin can choose at launch is compiled into the PTX the plan embeds (beside the
    # runtime's own dg_* kernels): a kernel renamed in the .cu or a new choice in plugin_spec fails here,
    # not at engine load on a GPU
    chosen = {
        spec.rows_kernel(dtype, vocab)
        for dtype in ("float32", "bfloat16")
        for vocab in (262144, 24, 13, None)
    } | {spec.ACCEPT_KERNEL}
    chosen |= {moe_spec.kernel(op, dt) for op, dt in moe_spec.KERNELS}
    assert len(chosen) == 11, chosen  # 5 sampler, 6 MoE (model dtype, FP8, NVFP4 weights)
    assert chosen <= set(re.findall(r"^\.(?:visible\s+)?\.entry\s+(\w+)\(", text, re.MULTILINE))
    assert set(ENTRY_POINTS) == chosen
    assert info.sha256 == sha256_bytes(data) and len(info.sha256) == 64


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@needs_nvcc
@pytest.mark.parametrize(("target", "arch"), [("sm90", "sm_90a"), ("sm100", "sm_100a"), ("sm120", "sm_120a")])
def test_plugin_ptx_assembles_for_its_gpu(plugins: Path, tmp_path: Path, target: str, arch: str):
    """The PTX the plan embeds is compiled for the GPU when the engine loads: ptxas must accept it for the
    target, and the SASS must hold every plugin entry point."""
    import shutil

    from pipeline.engine.ptx import ENTRY_POINTS

    ptxas = shutil.which("ptxas") or str(Path(kbuild.find_nvcc()).parent / "ptxas")
    out = tmp_path / f"{target}.cubin"
    r = subprocess.run(
        [ptxas, f"-arch={arch}", str(plugins / target / "dg_sampler.ptx"), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    info = kbuild.read_cubin(out)
    assert info.arch == arch and set(ENTRY_POINTS) <= set(info.kernels)  # sampler and MoE entry points
    tool = kbuild.find_cuobjdump()
    if tool is not None:  # NVIDIA's own reader agrees on the SASS architecture
        assert kbuild.cuobjdump_archs(out, cuobjdump=tool) == {arch}
    # the MoE kernels' static shared memory (the ELF's, as cuobjdump --dump-resource-usage reports it) is
    # what the tile's budget leaves room for
    from pipeline.engine import moe_spec

    assert {info.static_shared[k] for k in moe_spec.ENTRY_POINTS} == {moe_spec.STATIC_SHARED}


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@needs_nvcc
def test_plugin_entry_points_take_trt_argument_order(plugins: Path):
    """TensorRT's AOT convention: input pointers, then the int32 extras (length, vocab), then outputs."""
    text = (plugins / "sm90" / "dg_sampler.ptx").read_text()

    def params(entry: str) -> list[str]:
        body = re.search(rf"\.entry\s+{entry}\((.*?)\)", text, re.DOTALL)
        assert body, entry
        return re.findall(r"\.param\s+\.(\w+)", body.group(1))

    # 6 inputs (pointers: u64), length + vocab (u32 / s32), 5 outputs
    rows = params("dg_trt_rows_f32x4")
    assert len(rows) == 13 and rows[6] in ("u32", "s32") and rows[7] in ("u32", "s32")
    assert all(p == "u64" for p in rows[:6] + rows[8:])
    accept = params("dg_trt_accept")
    assert len(accept) == 21 and all(p == "u64" for p in accept[:13] + accept[15:])
    assert accept[13] in ("u32", "s32") and accept[14] in ("u32", "s32")
    # MoE: inputs, six int32 extras (T, K, d, I, E, tile), one output
    from pipeline.engine import moe_spec

    for (op, _), entry in moe_spec.KERNELS.items():
        p, n_in = params(entry), len(moe_spec.SPECS[op])
        assert len(p) == n_in + 6 + 1, entry
        assert all(t == "u64" for t in p[:n_in] + p[-1:]) and all(t in ("u32", "s32") for t in p[n_in:-1])


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@needs_nvcc
def test_plugin_ptx_tamper_and_wrong_target_are_refused(plugins: Path, tmp_path: Path):
    import shutil

    from pipeline.engine.ptx import load_plugin_ptx

    with pytest.raises(DgpipeError, match="is for sm90, not sm100"):
        load_plugin_ptx(plugins / "sm90", "sm100")
    copy = tmp_path / "sm90"
    shutil.copytree(plugins / "sm90", copy)
    (copy / "dg_sampler.ptx").write_text((copy / "dg_sampler.ptx").read_text() + "// edited\n")
    with pytest.raises(DgpipeError, match="sha256 differs"):
        load_plugin_ptx(copy)


# ---- engine manifest -------------------------------------------------------------------------------
def _manifest(**kw) -> EngineManifest:
    base = dict(
        plan_sha256="ab" * 32,
        tensorrt_version="10.13.2.6",
        target="sm90",
        arch="sm_90a",
        compute_capability="9.0",
        gpu_name="NVIDIA H200",
        precision="fp8",
        plugin=PluginRecord(arch="sm_90a", ptx_sha256="cd" * 32, entry_points=["dg_trt_accept"]),
        onnx_sha256="ef" * 32,
        checkpoint_sha256="01" * 32,
        build_flags={"strongly_typed": True},
    )
    return EngineManifest(**{**base, **kw})


def test_engine_manifest_round_trip(tmp_path: Path):
    m = _manifest()
    save_engine_manifest(tmp_path, m)
    back = load_engine_manifest(tmp_path)
    assert back == m
    raw = json.loads((tmp_path / "engine.json").read_text())
    assert raw["tensorrt_version"] == "10.13.2.6" and raw["compute_capability"] == "9.0"
    assert raw["plugin"]["ptx_sha256"] == "cd" * 32 and raw["precision"] == "fp8"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.json"]  # no temp file left
    (tmp_path / "engine.json").write_text("{")
    with pytest.raises(DgpipeError, match="invalid engine manifest"):
        load_engine_manifest(tmp_path)
    del raw["precision"]
    (tmp_path / "engine.json").write_text(json.dumps(raw))
    with pytest.raises(DgpipeError, match=r"invalid engine manifest \(precision: Field required\)"):
        load_engine_manifest(tmp_path)


def test_compatible_plan_passes():
    check_compatible(_manifest(), "10.13.2.6", "9.0", ptx_sha256="cd" * 32)
    check_compatible(_manifest(), "10.13.2.99", "9.0")  # build number is not part of compatibility


@pytest.mark.parametrize(
    ("trt", "cc", "ptx", "message"),
    [
        ("10.14.1.48", "9.0", None, r"built with TensorRT 10\.13\.2\.6, this is TensorRT 10\.14\.1\.48"),
        (None, "9.0", None, r"needs TensorRT 10\.13\.2\.6, and TensorRT is not installed here"),
        ("10.13.2.6", "10.0", None, r"built for compute capability 9\.0 \(sm90\), this GPU is 10\.0"),
        ("10.13.2.6", None, None, r"needs a GPU of compute capability 9\.0; none is visible"),
        ("10.13.2.6", "9.0", "ff" * 32, r"embeds sampler PTX cdcdcdcdcdcd, this dgpipe's is ffffffffffff"),
    ],
)
def test_mismatch_messages_name_what_differs(trt, cc, ptx, message):
    with pytest.raises(DgpipeError, match=message) as e:
        check_compatible(_manifest(), trt, cc, ptx_sha256=ptx)
    if trt is not None and cc is not None:
        assert "dgpipe engine build --target sm90 --precision fp8" in str(e.value)


def test_is_current_decides_rebuild(tmp_path: Path):
    from pipeline.engine.build_engine import write_engine_dir

    profiles = engine_profiles(
        _contract_inputs(), Limits(max_batch=2, max_prompt=64, max_context=256), canvas=8, ring=5
    )
    d = tmp_path / "engines" / "sm90"
    write_engine_dir(d, b"PLAN" * 100, _manifest(profiles=profiles))
    kw = dict(
        tensorrt_version="10.13.2.6",
        gpu_cc="9.0",
        precision="fp8",
        onnx_sha256="ef" * 32,
        ptx_sha256="cd" * 32,
        profiles=profiles,
    )
    ok, why = is_current(d, **kw)
    assert ok, why
    assert sorted(p.name for p in d.parent.iterdir()) == ["sm90"]  # the swap left no temp dirs
    assert is_current(d, **{**kw, "onnx_sha256": "00" * 32}) == (
        False,
        "the ONNX model changed since the plan was built",
    )
    assert is_current(d, **{**kw, "precision": "bf16"})[1] == "the plan is fp8, bf16 was asked for"
    assert "built with TensorRT" in is_current(d, **{**kw, "tensorrt_version": "10.14.0.1"})[1]
    other = engine_profiles(
        _contract_inputs(), Limits(max_batch=4, max_prompt=64, max_context=256), canvas=8, ring=5
    )
    assert "profiles" in is_current(d, **{**kw, "profiles": other})[1]
    (d / "model.plan").write_bytes(b"PLAN")
    assert "sha256 differs" in is_current(d, **kw)[1]
    assert is_current(tmp_path / "nothing", **kw)[0] is False


# ---- profiles --------------------------------------------------------------------------------------
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"]


def _contract_inputs() -> dict[str, list[int | str]]:
    """Graph inputs as the exporter declares them (pipeline/onnx/contract.py), with the tiny model's static dims."""
    static = {
        "vocab": 24,
        "hidden": 20,
        "kv_heads_0": 1,
        "kv_heads_1": 1,
        "kv_heads_2": 1,
        "head_dim_0": 16,
        "head_dim_1": 16,
        "head_dim_2": 32,
    }
    specs = [*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(LAYERS), *onnx_io.SAMPLER_INPUTS]
    return {s.name: [static.get(d, d) if isinstance(d, str) else d for d in s.shape] for s in specs}


def test_profiles_cover_both_passes():
    causal, denoise = engine_profiles(
        _contract_inputs(), Limits(max_batch=4, max_prompt=100, max_context=400), canvas=8, ring=5
    )
    assert (causal.name, denoise.name) == ("causal", "denoise")
    assert causal.shapes["tokens"] == [[1, 1], [1, 100], [4, 100]]
    assert denoise.shapes["tokens"] == [[1, 8], [4, 8], [4, 8]]
    assert causal.shapes["attention_mask.full"] == [[1, 1, 1, 1], [1, 1, 100, 100], [4, 1, 100, 500]]
    assert denoise.shapes["attention_mask.sliding"] == [[1, 1, 8, 8], [4, 1, 8, 13], [4, 1, 8, 13]]
    assert causal.shapes["past.0.key"] == [[1, 1, 0, 16], [1, 1, 0, 16], [4, 1, 5, 16]]
    assert denoise.shapes["past.2.value"] == [[1, 1, 0, 32], [4, 1, 400, 32], [4, 1, 400, 32]]
    assert causal.shapes["sc_embed"] == [[1, 1, 20], [1, 1, 20], [4, 1, 20]]
    assert denoise.shapes["sc_embed"] == [[1, 1, 20], [4, 8, 20], [4, 8, 20]]
    assert causal.shapes["mode"] == [[1]] * 3
    assert (causal.shape_values, denoise.shape_values) == ({"mode": [[0]] * 3}, {"mode": [[1]] * 3})


def test_profile_errors_are_clear():
    assert eval_dim("past_full + seq", {"past_full": (0, 1, 9), "seq": (1, 2, 3)}) == (1, 3, 12)
    with pytest.raises(DgpipeError, match="unknown symbolic dim 'keys'"):
        eval_dim("keys", {"seq": (1, 1, 1)})
    inputs = {"sc_embed": ["batch", "sc_seq", "hidden"]}
    with pytest.raises(DgpipeError, match="unknown symbolic dim 'hidden'"):
        engine_profiles(inputs, Limits(max_batch=1, max_prompt=8, max_context=64), canvas=8, ring=5)
    causal, _ = engine_profiles(
        inputs,
        Limits(max_batch=1, max_prompt=8, max_context=64),
        canvas=8,
        ring=5,
        static={"hidden": 20, "canvas_length": 8},
    )
    assert causal.shapes["sc_embed"] == [[1, 1, 20]] * 3
    with pytest.raises(DgpipeError, match="leaves no room"):
        engine_profiles(
            _contract_inputs(), Limits(max_batch=1, max_prompt=300, max_context=300), canvas=8, ring=5
        )


# ---- CLI validation (no TensorRT, no GPU) ------------------------------------------------------------
def write_contract_onnx(d: Path, vocab: int = 24, canvas: int = 8) -> Path:
    """A graph with the contract's inputs/outputs and a SampleRows/SampleAccept pair: what plan_build reads."""
    import onnx
    from onnx import TensorProto, helper

    d.mkdir(parents=True, exist_ok=True)
    types = {
        "FLOAT": TensorProto.FLOAT,
        "INT64": TensorProto.INT64,
        "BOOL": TensorProto.BOOL,
        "BFLOAT16": TensorProto.BFLOAT16,
        onnx_io.MODEL: TensorProto.FLOAT,
    }
    specs = [*onnx_io.MODEL_INPUTS, *onnx_io.kv_inputs(LAYERS), *onnx_io.SAMPLER_INPUTS]
    inputs = [
        helper.make_tensor_value_info(s.name, types[s.dtype], _contract_inputs()[s.name]) for s in specs
    ]
    rows = helper.make_node(
        "SampleRows",
        ["logits", "temperature", "seed", "request", "canvas", "step"],
        ["entropy", "max_prob", "argmax", "sample", "probs"],
        domain="dgpipe",
    )
    logits = helper.make_node("Cast", ["sc_embed"], ["logits"], to=TensorProto.FLOAT)
    outputs = [helper.make_tensor_value_info("probs", TensorProto.BFLOAT16, ["batch", "head", vocab])]
    graph = helper.make_graph([logits, rows], "contract", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("dgpipe", 1)]
    )
    onnx.save(model, d / "model.onnx")
    (d / "contract.json").write_text(
        json.dumps({"dims": {"canvas_length": canvas, "sliding_window": 6, "vocab": vocab, "hidden": 20}})
    )
    return d / "model.onnx"


def test_cli_refuses_a_canvas_longer_than_the_sampler_plugin_sorts(tmp_path: Path):
    """ModelConfig allows canvases up to 16,384 positions; kernel B sorts one in a thread block of at most
    1,024 threads, and past that would leave positions unwritten: refused before anything is built."""
    onnx_path = write_contract_onnx(tmp_path / "onnx", canvas=1025)
    out = tmp_path / "out"
    r = dgpipe("engine", "build", "--onnx", str(onnx_path), "--target", "sm90", "--precision", "bf16",
               "--output", str(out))  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "exported with 1025-token canvases" in r.stderr and "at most 1024 positions" in r.stderr
    assert "export with canvas_length <= 1024" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_cli_refuses_nvfp4_on_hopper_with_fp8_hint(tmp_path: Path):
    onnx_path = write_contract_onnx(tmp_path / "onnx")
    out = tmp_path / "out"
    r = dgpipe(
        "engine",
        "build",
        "--onnx",
        str(onnx_path),
        "--target",
        "sm90",
        "--precision",
        "nvfp4",
        "--output",
        str(out),
    )
    assert r.returncode == 2, r.stderr
    assert "--precision nvfp4 does not run natively on sm90" in r.stderr
    assert "use --precision fp8 for sm90" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()


def test_cli_unknown_target_and_missing_onnx(tmp_path: Path):
    r = dgpipe(
        "engine", "build", "--onnx", str(tmp_path / "x.onnx"), "--target", "sm75", "--output", str(tmp_path)
    )
    assert r.returncode == 2 and "unknown GPU target 'sm75'" in r.stderr
    r = dgpipe(
        "engine",
        "build",
        "--onnx",
        str(tmp_path / "x.onnx"),
        "--target",
        "sm100",
        "--precision",
        "nvfp4",
        "--output",
        str(tmp_path / "out"),
    )
    assert r.returncode == 2 and f"ONNX model not found: {tmp_path / 'x.onnx'}" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@pytest.mark.skipif(
    has_tensorrt() and has_cuda_gpu(), reason="TensorRT and a GPU are here: the build would run"
)
def test_cli_without_tensorrt_says_where_the_engine_is_built(tmp_path: Path, plugins: Path):
    onnx_path = write_contract_onnx(tmp_path / "onnx")
    out = tmp_path / "out"
    r = dgpipe(
        "engine",
        "build",
        "--onnx",
        str(onnx_path),
        "--target",
        "sm90",
        "--precision",
        "fp8",
        "--output",
        str(out),
        "--plugins",
        str(plugins),
        "--max-prompt",
        "64",
        "--max-context",
        "256",
    )
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip()
    assert err.startswith("error: cannot build the sm90 engine here: ")
    if not has_tensorrt():
        assert "TensorRT (the `tensorrt` Python package) is not installed" in err
    assert "built on the target node" in err and "initContainer or Job" in err
    assert f"dgpipe engine build --onnx {onnx_path} --target sm90 --precision fp8 --plugins {plugins}" in err
    assert len(err.splitlines()) == 1 and not out.exists()  # nothing half-written


@needs_nvcc
def test_cli_dry_run_prints_the_node_build(tmp_path: Path):
    onnx_path = write_contract_onnx(tmp_path / "onnx")
    out = tmp_path / "out"
    r = dgpipe(
        "engine",
        "build",
        "--onnx",
        str(onnx_path),
        "--target",
        "sm120",
        "--output",
        str(out),
        "--max-batch",
        "2",
        "--max-prompt",
        "64",
        "--max-context",
        "256",
        "--dry-run",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["precision"] == "nvfp4" and plan["engine_dir"] == str(out / "engines" / "sm120")
    causal, denoise = plan["profiles"]
    assert causal["shapes"]["tokens"] == [[1, 1], [1, 64], [2, 64]]
    assert denoise["shapes"]["tokens"] == [[1, 8], [2, 8], [2, 8]]
    assert plan["node_command"][:3] == ["dgpipe", "engine", "build"] and "--max-batch" in plan["node_command"]
    assert not out.exists()  # a dry run compiles nothing and writes nothing


def model_vocab(build: Path) -> int:
    return json.loads((build / "onnx" / "contract.json").read_text())["dims"]["vocab"]


def test_onnx_for_trt_marks_the_plugin_nodes(tmp_path: Path):
    import onnx

    from pipeline.engine.build_engine import _onnx_for_trt

    src = write_contract_onnx(tmp_path / "onnx")
    copy = _onnx_for_trt(src, src.parent)
    assert copy != src and copy.parent == src.parent  # beside the model: external data paths stay valid
    node = next(n for n in onnx.load(str(copy)).graph.node if n.op_type == "SampleRows")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    # the parser takes a node with plugin_namespace to the registered plugin; aot=1 asks for its AOT
    # implementation only (the vendor's quickly deployable plugins README)
    assert attrs == {"plugin_namespace": b"dgpipe", "aot": 1}


# ---- Triton: which runtime ------------------------------------------------------------------------
def _repo_with_engines(root: Path, *ccs: tuple[str, str]) -> Path:
    from pipeline.engine.build_engine import write_engine_dir

    for target, cc in ccs:
        write_engine_dir(root / "engines" / target, b"PLAN", _manifest(target=target, compute_capability=cc))
    return root


def test_backend_choice(tmp_path: Path):
    from pipeline.engine.select import choose_backend

    empty = choose_backend(tmp_path, "9.0", "10.13.2.6")
    assert (empty.kind, empty.loud, empty.reason) == (
        "pytorch",
        False,
        "the repository holds no TensorRT engine",
    )
    repo = _repo_with_engines(tmp_path / "1", ("sm90", "9.0"), ("sm100", "10.0"))
    c = choose_backend(repo, "10.0", "10.13.2.6")
    assert (c.kind, c.engine_dir, c.loud) == ("tensorrt", repo / "engines" / "sm100", False)
    assert c.reason == "sm100 plan (TensorRT 10.13.2.6, cc 10.0, fp8)"
    c = choose_backend(repo, "12.0", "10.13.2.6")
    assert (c.kind, c.loud) == ("pytorch", True)
    assert (
        c.reason
        == "no engine for this GPU's compute capability 12.0; the repository has sm100 (cc 10.0), sm90 (cc 9.0)"
    )
    c = choose_backend(repo, "9.0", "10.14.1.48")
    assert (c.kind, c.loud) == ("pytorch", True) and "built with TensorRT 10.13.2.6" in c.reason
    c = choose_backend(repo, "9.0", None)
    assert c.kind == "pytorch" and c.loud and "TensorRT is not installed here" in c.reason
    c = choose_backend(repo, None, "10.13.2.6")
    assert (c.kind, c.reason) == ("pytorch", "TensorRT engines present but no GPU is visible")


def test_a_plan_built_for_less_than_the_server_admits_is_skipped(tmp_path: Path):
    """A config.pbtxt edited past the limits a plan's profiles were built for would fail those requests
    mid-generation ("outside the optimization profile"): the load takes the PyTorch runtime and says why."""
    from pipeline.engine.build_engine import write_engine_dir
    from pipeline.engine.select import choose_backend

    caps = {"max_batch": 8, "max_prompt": 2048, "max_context": 8192}
    write_engine_dir(tmp_path / "engines" / "sm90", b"PLAN", _manifest(limits=caps))
    assert choose_backend(tmp_path, "9.0", "10.13.2.6", caps).kind == "tensorrt"
    c = choose_backend(tmp_path, "9.0", "10.13.2.6", {**caps, "max_batch": 16, "max_context": 9000})
    assert (c.kind, c.loud) == ("pytorch", True)
    assert (
        "--max-batch 16 > 8, --max-context 9000 > 8192" in c.reason
        and "rebuild it with these limits" in c.reason
    )


def test_engine_check_cli_without_tensorrt(tmp_path: Path):
    repo = _repo_with_engines(tmp_path / "b", ("sm90", "9.0"))
    r = dgpipe("engine", "check", "--plan", str(repo))
    assert r.returncode == 2
    if not has_tensorrt():
        assert "needs TensorRT 10.13.2.6, and TensorRT is not installed here" in r.stderr


# ---- on a GPU with TensorRT -------------------------------------------------------------------------
# ---- packaging engines into the Triton repository ----------------------------------------------------
def test_package_ships_engines_per_target(tiny_checkpoint: Path, tmp_path: Path):
    pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'dgpipe[serve]'")
    from pipeline.engine.select import choose_backend
    from pipeline.serving.repository import package

    build = _repo_with_engines(tmp_path / "build", ("sm90", "9.0"), ("sm100", "10.0"))
    repo = package(tiny_checkpoint, tmp_path / "repo", engines=build / "engines")
    version = repo / "dgpipe" / "1"
    assert sorted(p.name for p in (version / "engines").iterdir()) == ["sm100", "sm90"]
    assert sorted(p.name for p in (version / "engines" / "sm90").iterdir()) == ["engine.json", "model.plan"]
    assert choose_backend(version, "9.0", "10.13.2.6").engine_dir == version / "engines" / "sm90"
    with pytest.raises(DgpipeError, match=r"no engines/<target>/engine\.json"):
        package(tiny_checkpoint, tmp_path / "repo2", engines=tmp_path / "nothing")
    assert not (tmp_path / "repo2").exists()


@pytest.mark.slow  # compiles the plugin PTX with nvcc (the module's `plugins` fixture)
@needs_nvcc
@pytest.mark.skipif(
    has_tensorrt() and has_cuda_gpu(), reason="TensorRT and a GPU are here: the stage would build"
)
def test_build_stage_on_a_cpu_machine_defers_the_engine(tmp_path: Path, plugins: Path):
    """`dgpipe build` on CPU: PTX per target + the node step in the build manifest, and a summary saying so."""
    import shutil

    from pipeline.builddir import BuildManifest, load_manifest
    from pipeline.engine.stage import engine_stage

    shutil.copytree(plugins / "sm90", tmp_path / "plugins" / "sm90")  # compiled from these sources: reused
    before = (tmp_path / "plugins" / "sm90" / "dg_sampler.ptx").stat().st_mtime_ns

    write_contract_onnx(tmp_path / "onnx")
    man = BuildManifest(model="tiny", model_sha256="12" * 32, precision="fp8", targets=["sm90", "sm100"])
    result = engine_stage(tmp_path, man, Limits(max_batch=2, max_prompt=64, max_context=256))
    lines = result.summary
    assert result.stage == "engine" and result.paths["plugins"] == tmp_path.resolve() / "plugins"
    assert len(lines) == 2 and lines[0].startswith("engine sm90: not built here (")
    assert (
        "built on the target node" in lines[0]
        and "dgpipe engine build --onnx onnx/model.onnx --target sm90" in lines[0]
    )
    rec = load_manifest(tmp_path).stages["engine"]
    assert rec.outputs == {"plugins": "plugins", "engines": "engines"}
    sm100 = rec.details["engines"]["sm100"]
    assert sm100["status"] == "deferred" and sm100["ptx"] == "plugins/sm100/dg_sampler.ptx"
    assert sm100["command"][:7] == [
        "dgpipe",
        "engine",
        "build",
        "--onnx",
        "onnx/model.onnx",
        "--target",
        "sm100",
    ]
    assert sm100["command"][sm100["command"].index("--output") + 1] == "model_repository/dgpipe/1"
    assert (tmp_path / "plugins" / "sm100" / "dg_sampler.ptx").read_text().count(".entry") >= 5
    assert (tmp_path / "plugins" / "sm90" / "dg_sampler.ptx").stat().st_mtime_ns == before  # not recompiled
    assert not (tmp_path / "engines").exists()
    # the caps are recorded as data, per target and for the run: what package and render read back
    want = {"max_batch": 2, "max_prompt": 64, "max_context": 256}
    assert sm100["limits"] == rec.details["engines"]["sm90"]["limits"] == rec.details["limits"] == want


def test_engine_built_on_its_own_joins_the_stage_record(tmp_path: Path):
    """`dgpipe engine build --build-dir` adds its target to the engine stage's record, the same way the
    stage recorded itself, keeping the other targets' node commands, with the limits its engine.json
    carries as data: rendering and packaging read those back, not the defaults."""
    from pipeline.builddir import BuildManifest, load_manifest, record_stage, save_manifest
    from pipeline.engine.stage import record_built_engine, recorded_limits

    save_manifest(tmp_path, BuildManifest(model="m", precision="fp8", targets=["sm90", "sm100"]))
    deferred = {"status": "deferred", "command": ["dgpipe", "engine", "build"]}
    record_stage(
        tmp_path,
        "engine",
        {"plugins": "plugins", "engines": "engines"},
        inputs={"onnx": "onnx"},
        details={"engines": {"sm90": deferred, "sm100": deferred}},
    )
    built = Limits(max_batch=2, max_prompt=64, max_context=256)
    engine_json = tmp_path / "engines" / "sm90"
    engine_json.mkdir(parents=True)
    save_engine_manifest(engine_json, _manifest(target="sm90", limits=built.engine_values()))
    record_built_engine(tmp_path, load_engine_manifest(engine_json), tmp_path)
    rec = load_manifest(tmp_path).stages["engine"]
    assert rec.outputs == {"plugins": "plugins", "engines": "engines"} and rec.inputs == {"onnx": "onnx"}
    assert rec.details["engines"]["sm100"] == deferred
    assert rec.details["engines"]["sm90"] == {
        "status": "built",
        "tensorrt": "10.13.2.6",
        "cc": "9.0",
        "limits": built.engine_values(),
    }
    assert recorded_limits(load_manifest(tmp_path), "sm90") == built
    assert recorded_limits(load_manifest(tmp_path), "sm100") == Limits()  # recorded without limits


def test_plan_from_a_real_export(tmp_path: Path):
    """The exporter's tiny-model ONNX: every graph input gets a profile, the plugin nodes get marked."""
    import onnx
    import torch

    from pipeline.engine.build_engine import _onnx_for_trt, plan_build
    from pipeline.engine.profiles import onnx_inputs
    from pipeline.onnx.export import export_onnx
    from tests._utils.tiny import build_tiny

    export_onnx(build_tiny().to(torch.bfloat16), tmp_path / "onnx")  # a bf16 engine runs a bf16 graph
    model = tmp_path / "onnx" / "model.onnx"
    if kbuild.find_nvcc() is None:
        pytest.skip("nvcc not found: plan_build needs it when no PTX is prepared")
    plan = plan_build(
        tmp_path / "onnx",
        "sm90",
        "bf16",
        tmp_path,
        limits=Limits(max_batch=2, max_prompt=64, max_context=256),
    )
    causal, denoise = plan.profiles
    assert set(causal.shapes) == set(onnx_inputs(model)) == set(denoise.shapes)
    assert denoise.shapes["attention_mask.full"] == [[1, 1, 8, 8], [2, 1, 8, 264], [2, 1, 8, 264]]
    assert causal.shapes["past.0.key"] == [
        [1, 1, 0, 16],
        [1, 1, 0, 16],
        [2, 1, 5, 16],
    ]  # ring = window - 1 = 5
    assert plan.plugin is None and not (tmp_path / "plugins").exists()  # compiled only when the build runs
    parsed = _onnx_for_trt(model, model.parent)
    m = onnx.load(str(model), load_external_data=False)
    routed = any(n.domain == "dgpipe" and n.op_type == "MoE" for n in m.graph.node)
    assert (parsed == model) is not routed  # marked sampler nodes: parsed as is; routed MoE: a lowered copy
    if routed:
        parsed.unlink()
    nodes = {n.op_type: {a.name: a for a in n.attribute} for n in m.graph.node if n.domain == "dgpipe"}
    assert set(nodes) == {"SampleRows", "SampleAccept", "MoE"}  # MoE: the routed experts (contract.MOE)
    assert all(a["plugin_namespace"].s == b"dgpipe" for a in nodes.values())
    assert nodes["SampleAccept"]["vocab"].i == model_vocab(tmp_path)
    with pytest.raises(DgpipeError, match="was exported at fp32, not fp8"):
        plan_build(tmp_path / "onnx", "sm90", "fp8", tmp_path)


# ---- the TensorRT backend's feeds, run through onnxruntime on the real export ---------------------------
class _FeedsOnOrt:
    """The TensorRT backend's host side (engine_feeds, full-width zero sc, output mapping) with onnxruntime
    executing the graph instead of TensorRT (through the exporter's session runner): checks everything
    TensorRTBackend sends, on a CPU."""

    def __init__(self, onnx_dir: Path, checkpoint: Path) -> None:
        import torch

        from pipeline.onnx.backend import OnnxRuntimeBackend

        self.ort = OnnxRuntimeBackend(onnx_dir, checkpoint)
        self.config, self.device, self.dtype = self.ort.config, torch.device("cpu"), torch.float32
        self.feeds_seen: list[dict] = []

    def _run(self, feeds):
        self.feeds_seen.append({k: tuple(v.shape) for k, v in feeds.items()})
        return self.ort._run(feeds)

    def causal(self, tokens, positions, masks, past):
        import torch

        from pipeline.engine.feeds import engine_feeds
        from pipeline.onnx.backend import kv_from_outputs

        tc = self.config.text_config
        sc = torch.zeros(tokens.shape[0], 1, tc.hidden_size)
        feeds = engine_feeds("causal", tc, self.dtype, "cpu", tokens, positions, masks, past, sc, None)
        return kv_from_outputs(self._run(feeds), len(tc.layer_types))

    def denoise_step(self, canvas, sc_soft, positions, masks, past, sampler, need_soft=True):
        from pipeline.engine.feeds import denoise_sc, engine_feeds
        from pipeline.onnx.backend import denoise_result

        b, q = canvas.shape
        tc = self.config.text_config
        sc = denoise_sc(sc_soft, b, q, tc.hidden_size, self.dtype, "cpu")
        feeds = engine_feeds("denoise", tc, self.dtype, "cpu", canvas, positions, masks, past, sc, sampler)
        return denoise_result(self._run(feeds))


def test_a_recapture_holds_the_graph_it_replaces_until_the_new_one_is_captured(monkeypatch):
    """A TensorRT context recaptures (about once per canvas) into its one pool, and torch's allocator refuses
    a capture into a pool whose every graph is freed: the graph replaced stays alive until its successor is
    captured, then goes."""
    import contextlib
    import weakref
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend

    class Graph:
        pass

    ctx = object.__new__(trt_backend._Context)
    old = Graph()
    ctx.graph, ctx.graph_key, ctx.pool, ctx.device, ctx.host_inputs = old, "canvas 1", (0, 1), "cuda", set()
    ctx.use_graphs, ctx.static = True, {}
    ctx.stream = SimpleNamespace(wait_stream=lambda s: None, synchronize=lambda: None)
    ctx._bind, ctx._execute = (lambda static: {}), (lambda: None)
    replaced, seen = weakref.ref(old), []
    del old
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(
        trt_backend, "captured", lambda step, pool, stream: seen.append(replaced() is not None) or Graph()
    )
    ctx._capture({"canvas": torch.zeros(2, 4)}, "canvas 2")
    assert seen == [True] and ctx.use_graphs and ctx.graph_key == "canvas 2"
    assert isinstance(ctx.graph, Graph) and replaced() is None


def test_a_denoise_step_copies_the_cached_rows_once(monkeypatch):
    """The feeds carry the KV cache's row views as they lie (strided: the rows hold fewer tokens than the
    buffers), so a replayed step copies each layer's K/V once, from the cache into the graph's static inputs,
    and an eager run binds one contiguous copy; the feeds used to be made contiguous first, a second copy
    of the whole context every step."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend
    from pipeline.engine.feeds import engine_feeds
    from pipeline.model.checkpoint import open_checkpoint
    from pipeline.runtime.kv_cache import KVCache

    tc = open_checkpoint(EMBEDDED_MODEL).config.text_config
    cache = KVCache(tc, slots=2, max_len=256, dtype=torch.float32)
    for t in cache.k + cache.v:
        t.normal_()
    cache.lengths[:] = 5

    def feeds():
        past, _ = cache.read(torch.arange(2))
        tokens, positions = torch.zeros(2, 3, dtype=torch.int64), torch.arange(5, 8).expand(2, 3)
        sc = torch.zeros(2, 1, tc.hidden_size)
        return engine_feeds("causal", tc, torch.float32, "cpu", tokens, positions, {}, past, sc, None)

    first = feeds()
    kv = [n for n in first if n.startswith("past.")]
    for i in range(len(tc.layer_types)):
        for name, buffer in ((f"past.{i}.key", cache.k[i]), (f"past.{i}.value", cache.v[i])):
            view = first[name]
            assert view.shape[2] == 5 and not view.is_contiguous()
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    ctx = object.__new__(trt_backend._Context)
    ctx.graph, ctx.graph_key, ctx.pool, ctx.device, ctx.host_inputs = None, None, (0, 1), "cpu", {"mode"}
    ctx.use_graphs, ctx.static, ctx.outputs = True, {}, []
    ctx.stream = SimpleNamespace(wait_stream=lambda s: None, synchronize=lambda: None)
    bound: list[dict] = []
    ctx._bind = lambda tensors: bound.append(dict(tensors)) or {}
    ctx._execute = lambda: None
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_stream=lambda s: None)
    )
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(
        trt_backend, "captured", lambda step, pool, stream: SimpleNamespace(replay=lambda: None)
    )
    ctx.run_graph(first)  # captures: the static inputs are packed copies of the views
    assert all(bound[0][n].is_contiguous() for n in kv)
    for t in cache.k + cache.v:  # the next step: same shapes, new values in the cache
        t.normal_()
    second = feeds()
    copies = []
    copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda dst, src, **kw: copies.append(src) or copy(dst, src, **kw)
    )
    ctx.run_graph(second)
    assert {id(s) for s in copies} >= {id(second[n]) for n in kv}  # straight from the cache's views
    assert all(torch.equal(ctx.static[n], second[n]) for n in kv)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)

    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: None, raising=False)
    # the copies are queued on torch's stream before the context's stream waits for it: a wait orders only
    # the work queued by then, so copies made after it could be read by TensorRT before they are done
    events: list[str] = []
    ctx.stream = SimpleNamespace(wait_stream=lambda s: events.append("wait"), synchronize=lambda: None)
    contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(
        torch.Tensor,
        "contiguous",
        lambda t, *a: (events.append("copy") if not t.is_contiguous() else None) or contiguous(t, *a),
    )
    ctx.run(second)  # eager: the packed copies are what TensorRT is bound to
    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    assert all(bound[-1][n].is_contiguous() and torch.equal(bound[-1][n], second[n]) for n in kv)
    assert "copy" in events and events.index("wait") > max(i for i, e in enumerate(events) if e == "copy")


def test_the_contexts_share_one_activation_buffer(monkeypatch):
    """Both contexts (causal, denoise) run in the order of torch's current stream, never at once, so they
    share one activation buffer of the engine's largest profile (TensorRT's USER_MANAGED allocation) instead
    of one each under the default STATIC strategy."""
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend

    strategies, memory = [], []

    class Context:
        def set_device_memory(self, ptr, size):
            memory.append((ptr, size))

        def set_optimization_profile_async(self, profile, stream):
            return True

    def create_execution_context(strategy):
        strategies.append(strategy)
        return Context()

    engine = SimpleNamespace(
        device_memory_size_v2=4096,
        create_execution_context=create_execution_context,
        num_io_tensors=0,
    )
    trt = SimpleNamespace(
        ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user managed"),
        TensorIOMode=SimpleNamespace(INPUT="in"),
        **{k: k for k in ("float32", "float16", "bfloat16", "int64", "int32", "bool", "int8")},
    )
    monkeypatch.setattr(
        torch.cuda, "Stream", lambda device: SimpleNamespace(cuda_stream=0, synchronize=lambda: None)
    )
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    device = torch.device("cpu")
    shared = trt_backend.activation_buffer(engine, device)
    for profile in trt_backend.PROFILE.values():
        trt_backend._Context(engine, profile, trt, device, shared)
    assert strategies == ["user managed", "user managed"]
    assert memory == [(shared.data_ptr(), 4096)] * 2 and shared.numel() == 4096
    assert shared.data_ptr() % 256 == 0  # TensorRT's alignment, on a CPU allocator's 64-byte blocks too


def test_trt_feeds_drive_the_real_graph_like_onnxruntime_backend(tmp_path: Path):
    """Sudoku infill (templates pinned) through the exported graph fed by engine_feeds: the same tokens and
    steps as the exporter's onnxruntime backend, and every pass had the profile's shapes."""
    pytest.importorskip("onnxruntime")
    from pipeline.demo import sudoku
    from pipeline.demo import tokenizer as stok
    from pipeline.model.checkpoint import load_model
    from pipeline.onnx.backend import OnnxRuntimeBackend
    from pipeline.onnx.export import export_onnx
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from pipeline.runtime.session import load_session

    embedded = EMBEDDED_MODEL
    model = load_model(embedded)[0]
    export_onnx(model, tmp_path / "onnx")
    sampler = load_session(embedded, "auto", "cpu").sampler()
    puzzles = sudoku.make_dataset(7, 2, (45, 61))

    def run(backend):
        rt = BlockDiffusionRuntime(backend, max_batch=2, max_len=stok.PROMPT_LEN + 2 * 82)
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
        return [(r.tokens, r.steps_per_canvas) for r in rt.generate(reqs)]

    ours = _FeedsOnOrt(tmp_path / "onnx", embedded)
    got = run(ours)
    assert got == run(OnnxRuntimeBackend(tmp_path / "onnx", embedded))
    assert all(len(tokens) > 0 and steps for tokens, steps in got)
    # every denoise pass sent full-width sc_embed [B, canvas, hidden]: one shape per canvas, as a CUDA graph
    # needs
    canvas, hidden = model.config.canvas_length, model.config.text_config.hidden_size
    denoise = [f for f in ours.feeds_seen if f["sc_embed"][1] != 1]
    assert denoise and all(f["sc_embed"][1:] == (canvas, hidden) for f in denoise)
    causal = [f for f in ours.feeds_seen if f["sc_embed"][1] == 1]
    assert causal and all(f["template"] == f["tokens"] for f in causal)


# ---- plugin.py through TensorRT's own tensorrt.plugin code (tests/_utils/trt_native.py) ----------------
def test_plugins_pass_tensorrt_registration_and_validation(real_trtp):
    trt, trtp = real_trtp
    lib = trtp._lib
    assert {"dgpipe::SampleRows", "dgpipe::SampleAccept"} <= set(lib.QDP_REGISTRY)
    for op_id in ("dgpipe::SampleRows", "dgpipe::SampleAccept"):
        op = op_id.split("::")[1]
        d = lib.QDP_REGISTRY[op_id]
        assert d.input_tensor_names == [p.name for p in spec.SPECS[op][0]]  # parsed by TensorRT's _validate
        assert d.num_outputs == len(spec.SPECS[op][1])
        assert d.aot_impl_func is not None and d.impl_func is None  # AOT only: the PTX lives in the plan
        assert trt.get_plugin_registry().get_creator(op, "1", "dgpipe") is not None
    assert lib.QDP_REGISTRY["dgpipe::SampleAccept"].input_attrs == {"vocab": int}
    assert lib.QDP_REGISTRY["dgpipe::SampleAccept"].aot_impl_attr_names == ["vocab"]


def test_vendor_validation_is_live(real_trtp):
    """The same decorators refuse what TensorRT refuses: proof the checks above are TensorRT's, not ours."""
    _, trtp = real_trtp
    with pytest.raises(ValueError, match="does not have a type annotation"):
        trtp.register("dgpipe::Bad")(lambda x: x)
    with pytest.raises(ValueError, match="reserved namespace"):

        @trtp.register("tensorrt::Bad")
        def _bad(x: trtp.TensorDesc) -> trtp.TensorDesc:
            return x

    with pytest.raises(ValueError, match="already has a defintion"):  # (sic) TensorRT's spelling

        @trtp.register("dgpipe::SampleRows")
        def _again(x: trtp.TensorDesc) -> trtp.TensorDesc:
            return x


def test_sampler_plugins_at_build_time(real_trtp):
    """TensorRT's build-time call sequence on the wheel's own AOT plugin class: output types and symbolic
    shapes, launch geometry and extra int32 arguments as TensorRT receives them."""
    from tests._utils.trt_native import build_time_call

    trt, _ = real_trtp
    f32, i64, bf16, b = trt.float32, trt.int64, trt.bfloat16, trt.bool
    rows_in = [((2, 8, 24), f32), ((2,), f32), *[((2,), i64)] * 4]
    r = build_time_call(trt, "dgpipe::SampleRows", rows_in)
    assert r["output_types"] == [f32, f32, i64, i64, bf16]
    assert r["output_dims"] == [(2, 8), (2, 8), (2, 8), (2, 8), (2, 8, 24)]
    assert (r["kernel"], r["ptx"]) == (b"dg_trt_rows_f32x4", b"// ptx")
    assert r["launch"] == dict(grid_x=16, grid_y=1, grid_z=1, block_x=512, block_y=1, block_z=1, shared_mem=0)
    assert r["extras"] == [8, 24]
    r = build_time_call(trt, "dgpipe::SampleRows", [((2, 8, 30), bf16), *rows_in[1:]])
    assert r["kernel"] == b"dg_trt_rows_bf16x1"  # 30 is no multiple of 8: scalar loads
    with pytest.raises(DgpipeError, match="input 'temperature' must be float32"):
        build_time_call(trt, "dgpipe::SampleRows", [rows_in[0], ((2,), i64), *rows_in[2:]])

    bl, bb = (2, None), (2,)  # the canvas length dynamic: symbolic through the shapes, block 1024
    acc_in = [(bl, f32), (bl, i64), (bl, i64), (bl, i64), (bb, f32), *[(bb, i64)] * 4, (bl, i64), (bb, i64),
              (bb, i64), (bb, f32)]  # fmt: skip
    r = build_time_call(trt, "dgpipe::SampleAccept", acc_in, {"vocab": 24})
    assert r["output_types"] == [f32, b, i64, i64, i64, b]
    assert r["output_dims"] == [(2, None)] * 4 + [(2,), (2,)]
    assert r["kernel"] == b"dg_trt_accept" and r["launch"]["grid_x"] == 2 and r["launch"]["block_x"] == 1024
    assert r["extras"] == [None, 24]  # length known at run time only; vocab the node's attribute
    static = [((2, 8) if d == bl else d, t) for d, t in acc_in]
    assert build_time_call(trt, "dgpipe::SampleAccept", static, {"vocab": 24})["launch"]["block_x"] == 32
    with pytest.raises(DgpipeError, match="vocab must be in"):
        build_time_call(trt, "dgpipe::SampleAccept", static, {"vocab": 0})


def test_target_for_a_gpu_is_its_exact_compute_capability():
    from pipeline.targets import target_for_compute_capability as for_cc

    assert [for_cc(cc).name for cc in ("8.9", "9.0", "10.0", "12.0")] == ["sm89", "sm90", "sm100", "sm120"]
    assert for_cc("10.3") is None and for_cc("8.0") is None  # no nearest: sm_100a PTX does not load on 10.3


@pytest.mark.parametrize(("cc", "ok", "label"), [("9.0", True, "sm90"), ("10.3", False, "no dgpipe target")])
def test_doctor_names_the_gpus_target(monkeypatch: pytest.MonkeyPatch, cc: str, ok: bool, label: str):
    from pipeline import doctor
    from pipeline.engine import probe

    monkeypatch.setattr(probe, "gpu", lambda: (cc, "Some GPU"))
    check = next(c for c in doctor.check_engine_build() if c.name == "engine target")
    assert check.ok is ok and check.detail == f"Some GPU: cc {cc} -> {label}"


def test_onnx_identity_hash_is_cached_by_size_and_mtime(tmp_path: Path):
    import os

    from pipeline.engine.build_engine import onnx_sha256

    (tmp_path / "model.onnx").write_bytes(b"graph")
    data = tmp_path / "model.onnx.data"
    data.write_bytes(b"weights" * 1000)
    first = onnx_sha256(tmp_path / "model.onnx")
    cache = json.loads((tmp_path / "model.onnx.data.sha256.json").read_text())
    assert cache["size"] == 7000 and len(cache["sha256"]) == 64
    assert onnx_sha256(tmp_path / "model.onnx") == first
    # same size and mtime, other bytes: the cache answers, the weights are not read again
    data.write_bytes(b"w" * 7000)
    os.utime(data, ns=(cache["mtime_ns"], cache["mtime_ns"]))
    assert onnx_sha256(tmp_path / "model.onnx") == first
    data.write_bytes(b"WEIGHTS" * 1000)  # same size, new content and mtime: re-hashed
    os.utime(data, ns=(cache["mtime_ns"] + 10**9, cache["mtime_ns"] + 10**9))
    assert onnx_sha256(tmp_path / "model.onnx") != first
    (tmp_path / "model.onnx").write_bytes(b"graph2")
    assert len({first, onnx_sha256(tmp_path / "model.onnx")}) == 2


def test_the_step_that_captures_runs_the_engine_once(monkeypatch):
    """The run TensorRT needs before a capture computes the step from the same inputs, and a capture records
    without running: the step that captures returns those outputs (the canvas's first denoise step used to
    run twice), the next replays."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend

    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    ctx = object.__new__(trt_backend._Context)
    ctx.graph, ctx.graph_key, ctx.pool, ctx.device, ctx.host_inputs = None, None, (0, 1), "cuda", set()
    ctx.use_graphs, ctx.static, ctx.outputs = True, {}, ["next_canvas"]
    ctx.stream = SimpleNamespace(wait_stream=lambda s: None, synchronize=lambda: None)
    ctx._bind = lambda static: {"next_canvas": torch.zeros(2, 4)}

    def execute():
        calls.append("execute")
        ctx.static["next_canvas"].fill_(7)  # what the engine writes for these inputs

    ctx._execute = execute
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_stream=lambda s: None)
    )
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(trt_backend, "captured", lambda step, pool, stream: Graph())
    feeds = {"canvas": torch.ones(2, 4)}
    first = ctx.run_graph(feeds)
    assert calls == ["execute"] and bool((first["next_canvas"] == 7).all())
    ctx.run_graph(feeds)
    assert calls == ["execute", "replay"]


@pytest.mark.parametrize(
    ("error", "goes_eager"),
    [
        (RuntimeError("operation not permitted when stream is capturing"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    ],
)
def test_only_a_refused_capture_sends_tensorrt_eager(monkeypatch, error, goes_eager):
    """A capture the driver refuses runs the context eagerly from then on; out of memory (or a lost GPU) is
    the step's failure and reaches the request, as in the device loop, instead of silently slowing every
    later step. A failing run before the capture is the engine's error, not a refused capture."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend
    from pipeline.runtime import device_loop

    def context(execute):
        ctx = object.__new__(trt_backend._Context)
        ctx.graph, ctx.graph_key, ctx.pool, ctx.device, ctx.host_inputs = None, None, (0, 1), "cuda", set()
        ctx.use_graphs, ctx.static, ctx.outputs = True, {}, []
        ctx.stream = SimpleNamespace(wait_stream=lambda s: None, synchronize=lambda: None)
        ctx._bind, ctx._execute = (lambda static: {}), execute
        return ctx

    def refuse(step, pool, stream):
        raise error

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(trt_backend, "captured", refuse)
    monkeypatch.setattr(trt_backend, "undo_failed_capture", lambda stream, pool: None)
    monkeypatch.setattr(device_loop, "unusable", lambda device: None)
    ctx = context(lambda: None)
    if goes_eager:
        ctx._capture({"canvas": torch.zeros(2, 4)}, "canvas 1")
        assert not ctx.use_graphs
    else:
        with pytest.raises(RuntimeError, match="out of memory"):
            ctx._capture({"canvas": torch.zeros(2, 4)}, "canvas 1")
        assert ctx.use_graphs

    def engine_fails():
        raise DgpipeError("TensorRT execute_async_v3 failed (see the TensorRT log)")

    ctx = context(engine_fails)
    with pytest.raises(DgpipeError, match="execute_async_v3 failed"):
        ctx._capture({"canvas": torch.zeros(2, 4)}, "canvas 1")
    assert ctx.use_graphs


def test_local_build_needs_the_tensorrt_that_has_aot_plugins(monkeypatch):
    """AOT Python plugins (`tensorrt.plugin.aot_impl`, KernelLaunchParams) arrived in TensorRT 10.9 (its
    release notes); 10.8 would pass a version check at 10.8 and fail in the plugin definitions."""
    from pipeline.engine import build_engine

    monkeypatch.setattr(build_engine, "gpu", lambda: ("9.0", "NVIDIA H200"))
    monkeypatch.setattr(build_engine, "tensorrt_version", lambda: "10.8.0.43")
    assert build_engine.missing_for_local_build() == [
        "TensorRT 10.8.0.43 is too old: AOT Python plugins need >= 10.9"
    ]
    monkeypatch.setattr(build_engine, "tensorrt_version", lambda: "10.13.3.9")
    assert build_engine.missing_for_local_build() == []


def test_each_gpu_model_keeps_its_own_timing_cache(tmp_path: Path):
    """TensorRT refuses a timing cache made on other device properties, and an H100 and an H200 are both
    sm90: each GPU model reads and writes its own file beside the engine dirs."""
    from pipeline.engine.build_engine import timing_cache_file

    h100 = timing_cache_file(tmp_path, "9.0", "NVIDIA H100 80GB HBM3")
    h200 = timing_cache_file(tmp_path, "9.0", "NVIDIA H200")
    assert h100 != h200 and h100.parent == h200.parent == tmp_path
    assert h200.name == "timing.9.0.NVIDIA-H200.cache"


def test_a_refused_binding_is_named_where_it_happens():
    """TensorRT's set_tensor_address returns False for a binding it refuses; the context says which tensor
    instead of failing later in a generic execute_async_v3 error."""
    from types import SimpleNamespace

    import torch

    from pipeline.engine import trt_backend

    ctx = object.__new__(trt_backend._Context)
    ctx.inputs, ctx.outputs = ["tokens"], []
    ctx.ctx = SimpleNamespace(
        set_input_shape=lambda name, shape: True, set_tensor_address=lambda name, ptr: False
    )
    with pytest.raises(DgpipeError, match="TensorRT refused the address of engine tensor tokens"):
        ctx._bind({"tokens": torch.zeros(1, 4, dtype=torch.int64)})
