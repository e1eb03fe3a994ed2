"""`dgpipe engine build`: ONNX + sampler PTX -> `engines/<target>/model.plan` + `engine.json`.

Everything that can be decided without a GPU is decided first (`plan_build`: target, precision on that
target, ONNX present, PTX compiled and hashed, profiles from the ONNX dims), so a CPU machine validates a
build completely and can hand it to the target node as one command. `build` then needs TensorRT >= 10.9
(AOT Python plugins) and a GPU of the target's compute capability; it writes into a temporary directory
and renames it into place, so an interrupted build leaves no plan that a loader could trust.

TensorRT specifics, all from the vendor API:
  * the network is STRONGLY_TYPED: every tensor's type comes from the ONNX graph (ModelOpt's Q/DQ nodes
    for FP8 / NVFP4 / INT4), so no precision flags (FP16/BF16/FP8) are set on the builder config;
  * the sampler nodes are imported as the `dgpipe` plugins, not as their ONNX local functions: the parser
    takes a node carrying `plugin_namespace` to a registered plugin of that name (the exporter writes it;
    onnx-tensorrt's parseNode), and the graph-only copy it parses (beside the model, sharing its external
    data) gives each plugin node `aot=1`, the quickly deployable plugins' request for the AOT
    implementation (a build fails loudly rather than taking another). No ENABLE_PLUGIN_OVERRIDE (TensorRT
    >= 10.15): it is not needed for such nodes, and it would send every node to the plugin registry first;
  * two optimization profiles (pipeline.engine.profiles); `mode` is a shape tensor and gets values too;
  * a timing cache per GPU model (TensorRT refuses a cache from other device properties: an H100 and an
    H200 are both sm90) is loaded from / saved beside the engine directories so rebuilds are faster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.atomic import atomic_write_bytes
from pipeline.builddir import HASH_CACHE_SUFFIX, LAYOUT, hash_files, target_engine_dir, target_plugin_dir
from pipeline.engine import plugin_spec
from pipeline.engine.plan_record import (
    ENGINE_MANIFEST,
    PLAN_NAME,
    EngineManifest,
    PluginRecord,
    ProfileRecord,
    is_current,
    save_engine_manifest,
)
from pipeline.engine.probe import gpu, tensorrt_version
from pipeline.engine.profiles import engine_profiles, onnx_inputs
from pipeline.engine.ptx import PluginPtx, build_plugin_ptx, load_plugin_ptx
from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.onnx.contract import MODEL_FILE as ONNX_FILE
from pipeline.sampler.kernels.build import find_nvcc
from pipeline.targets import Target, check_precision_on_target
from pipeline.targets import target as get_target

MIN_TENSORRT = (10, 9)  # tensorrt.plugin.aot_impl (AOT Python plugins): TensorRT 10.9.0 release notes


def timing_cache_file(engines_dir: Path, compute_capability: str, gpu_name: str) -> Path:
    """The timing cache of one GPU model beside its engine dirs: `timing.<cc>.<gpu name>.cache`."""
    slug = "".join(c if c.isalnum() else "-" for c in gpu_name.strip()).strip("-")
    return engines_dir / f"timing.{compute_capability}.{slug}.cache"


NODE_STEP = (
    "the engine is built on the target node, in the serving image (which has TensorRT and the GPU): "
    "a Kubernetes initContainer or Job runs `{command}`"
)


@dataclass
class BuildPlan:
    """A fully validated engine build, ready to run where TensorRT and the GPU are."""

    target: Target
    precision: str
    onnx: Path
    onnx_sha256: str
    plugin: PluginPtx | None  # None: not compiled yet (ensure_ptx compiles it once the build can run)
    plugin_dir: Path
    engine_dir: Path
    profiles: list[ProfileRecord]
    limits: Limits
    checkpoint_sha256: str | None = None
    workspace_gib: float = 16.0
    builder_optimization_level: int = 3
    extra_flags: dict[str, Any] = field(default_factory=dict)

    def command(self) -> list[str]:
        """The CLI line that runs this build on the target node (the k8s engineer's Job uses it verbatim)."""
        return [
            "dgpipe",
            "engine",
            "build",
            "--onnx",
            str(self.onnx),
            "--target",
            self.target.name,
            "--precision",
            self.precision,
            "--plugins",
            str(self.plugin_dir.parent),
            "--output",
            str(self.engine_dir.parent.parent),
            *self.limits.engine_flags(),
        ]

    def build_flags(self) -> dict[str, Any]:
        return {
            "strongly_typed": True,
            "workspace_gib": self.workspace_gib,
            "builder_optimization_level": self.builder_optimization_level,
            "timing_cache": "per GPU model",
            **self.extra_flags,
        }


def model_dims(onnx_path: Path) -> tuple[int, int, dict[str, int]]:
    """(canvas length, sliding ring size, all dims) from the exporter's contract.json beside the model."""
    contract = onnx_path.parent / "contract.json"
    if not contract.is_file():
        raise DgpipeError(
            f"{contract}: missing (the ONNX export writes it beside the model)", hint="re-run the export"
        )
    dims = json.loads(contract.read_text()).get("dims", {})
    canvas = dims.get("canvas_length") or dims.get("canvas")
    window = dims.get("sliding_window")
    ring = dims.get("ring") or (max(int(window) - 1, 1) if window else None)
    if not canvas or not ring:
        raise DgpipeError(f"{contract}: dims lack canvas_length / sliding_window (got {sorted(dims)})")
    return int(canvas), int(ring), dims


UNQUANTIZED = {"fp32", "bf16", "fp16"}
# The model dtype of the graph every engine is built from (`dgpipe export --dtype`; the build exports it):
# a strongly typed network runs the graph's own types, so a bf16 engine runs in the dtype it was exported
# at, and the FP8 / NVFP4 expert plugins take bf16 hidden states (moe_spec).
GRAPH_DTYPE = "bfloat16"
_ONNX_DTYPES = {"FLOAT": "float32", "BFLOAT16": "bfloat16", "FLOAT16": "float16"}


def onnx_sha256(onnx: Path) -> str:
    """Identity of the model: sha256 over the graph file and its external data. The data file of a 26B model
    is ~50 GB, so its hash is cached beside it keyed by (size, mtime): a pod restart on the node checks the
    plan without re-reading the weights from the volume."""
    import hashlib

    h = hashlib.sha256(hash_files([onnx]).encode())
    for data in sorted(onnx.parent.glob(f"{onnx.name}.data")):
        st = data.stat()
        cache = data.with_name(data.name + HASH_CACHE_SUFFIX)
        key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        digest = None
        if cache.is_file():
            try:
                cached = json.loads(cache.read_text())
                digest = cached["sha256"] if {k: cached.get(k) for k in key} == key else None
            except (ValueError, KeyError):
                digest = None
        if digest is None:
            digest = hash_files([data])
            with contextlib.suppress(OSError):  # read-only volume: hash again next time
                cache.write_text(json.dumps({**key, "sha256": digest}) + "\n")
        h.update(digest.encode())
    return h.hexdigest()


def check_export_precision(onnx_path: Path, precision: str) -> None:
    """A strongly typed engine runs the types in the graph, so the ONNX must have been exported at the
    precision asked for (any unquantized export for an unquantized precision), in GRAPH_DTYPE."""
    contract = json.loads((onnx_path.parent / "contract.json").read_text())
    exported = contract.get("precision")
    if not (
        exported is None or exported == precision or (exported in UNQUANTIZED and precision in UNQUANTIZED)
    ):
        raise DgpipeError(
            f"{onnx_path} was exported at {exported}, not {precision}: a strongly typed engine takes its "
            "types from the graph",
            hint=f"export the {precision} checkpoint (dgpipe build --precision {precision}) or pass "
            f"--precision {exported}",
        )
    sc_embed = next((i for i in contract.get("inputs", []) if i.get("name") == "sc_embed"), {})
    graph = _ONNX_DTYPES.get(sc_embed.get("dtype"))
    if graph is not None and graph != GRAPH_DTYPE:
        raise DgpipeError(
            f"{onnx_path} is a {graph} graph: a strongly typed {precision} engine needs a {GRAPH_DTYPE} one "
            "(it runs the graph's types, and the FP8 / NVFP4 expert plugins take bf16 hidden states)",
            hint=f"export it with `dgpipe export --dtype {GRAPH_DTYPE}` (dgpipe build does)",
        )


def plan_build(
    onnx: Path,
    target_name: str,
    precision: str,
    output: Path,
    *,
    plugins: Path | None = None,
    limits: Limits | None = None,
    checkpoint_sha256: str | None = None,
) -> BuildPlan:
    """Validate a build without TensorRT: every user mistake is reported here, before any TensorRT import.

    The PTX comes from `plugins/<target>/` when it is there (prepared by `dgpipe build` on the CPU
    machine); else nvcc must be present and `ensure_ptx` compiles it into `output/plugins/<target>/` once
    the build can actually run, so a refused build writes nothing."""
    target = get_target(target_name)
    check_precision_on_target(precision, target.name)
    onnx = Path(onnx)
    if onnx.is_dir():
        onnx = onnx / ONNX_FILE
    if not onnx.is_file():
        raise DgpipeError(
            f"ONNX model not found: {onnx}", hint="run `dgpipe export` (or `dgpipe build`) first"
        )
    limits = limits or Limits()
    canvas, ring, dims = model_dims(onnx)
    if canvas > plugin_spec.MAX_CANVAS:
        raise DgpipeError(
            f"{onnx} was exported with {canvas}-token canvases: the engine's sampler plugin sorts a canvas's "
            f"entropies in one thread block, at most {plugin_spec.MAX_CANVAS} positions",
            hint=f"export with canvas_length <= {plugin_spec.MAX_CANVAS}, or serve this model with the PyTorch "
            "runtime (no engine)",
        )
    check_export_precision(onnx, precision)
    profiles = engine_profiles(onnx_inputs(onnx), limits, canvas, ring, static=dims)
    plugins_root = Path(plugins) if plugins else Path(output) / LAYOUT["plugins"]
    plugins_dir = target_plugin_dir(plugins_root, target.name)
    info: PluginPtx | None = None
    if (plugins_dir / "plugin.json").is_file():
        info, _ = load_plugin_ptx(plugins_dir, target.name)
    elif find_nvcc() is None:
        raise DgpipeError(
            f"no sampler plugin PTX in {plugins_dir} and no nvcc to compile it",
            hint="pass --plugins DIR holding <target>/dg_sampler.ptx (written by `dgpipe build`), or install nvcc",
        )
    return BuildPlan(
        target=target,
        precision=precision,
        onnx=onnx,
        onnx_sha256=onnx_sha256(onnx),
        plugin=info,
        plugin_dir=plugins_dir,
        engine_dir=target_engine_dir(Path(output), target.name),
        profiles=profiles,
        limits=limits,
        checkpoint_sha256=checkpoint_sha256,
    )


# ---- what this machine has (pipeline.engine.probe) -----------------------------------------------------
def missing_for_local_build(target: Target | None = None) -> list[str]:
    """What this machine lacks to build an engine (empty: it can). Shared by the CLI and `dgpipe doctor`."""
    missing = []
    v = tensorrt_version()
    if v is None:
        missing.append("TensorRT (the `tensorrt` Python package) is not installed")
    elif tuple(int(p) for p in v.split(".")[:2]) < MIN_TENSORRT:
        missing.append(
            f"TensorRT {v} is too old: AOT Python plugins need >= {'.'.join(map(str, MIN_TENSORRT))}"
        )
    g = gpu()
    if g is None:
        missing.append("no CUDA GPU is visible")
    elif target is not None and g[0] != target.compute_capability:
        missing.append(
            f"the GPU is {g[1]} (compute capability {g[0]}), not a {target.name} GPU ({target.compute_capability})"
        )
    return missing


def ensure_ptx(plan: BuildPlan) -> PluginPtx:
    if plan.plugin is None:
        plan.plugin = build_plugin_ptx(plan.plugin_dir.parent, plan.target.name)
    return plan.plugin


def require_local_build(plan: BuildPlan) -> tuple[str, tuple[str, str]]:
    missing = missing_for_local_build(plan.target)
    if missing:
        raise DgpipeError(
            f"cannot build the {plan.target.name} engine here: {'; '.join(missing)}",
            hint=NODE_STEP.format(command=" ".join(plan.command())),
        )
    return tensorrt_version() or "", gpu() or ("", "")


# ---- the TensorRT build -----------------------------------------------------------------------------
def _onnx_for_trt(onnx: Path, tmp_dir: Path, target: str | None = None) -> Path:
    """The model to parse: a graph-only copy written BESIDE the original (external data paths are relative
    to the model file) whose sampler nodes carry plugin_namespace="dgpipe" (the exporter adds it), so the
    parser imports them as plugins and not as their reference functions, every plugin node `aot=1`, and
    each dgpipe::MoE node lowered to the expert plugin + ReduceSum + CastLike (pipeline/engine/moe_graph.py;
    NVFP4 experts only on a `target` that runs NVFP4)."""
    import onnx as onnx_lib

    from pipeline.engine.moe_graph import lower_moe

    model = onnx_lib.load(str(onnx), load_external_data=False)
    nodes = [
        n for n in model.graph.node if n.domain == plugin_spec.NAMESPACE and n.op_type in plugin_spec.SPECS
    ]
    if not nodes:
        raise DgpipeError(f"{onnx}: no dgpipe::SampleRows / SampleAccept nodes: not a dgpipe export?")
    for node in nodes:
        names = {a.name for a in node.attribute}
        if "plugin_namespace" not in names:
            node.attribute.append(onnx_lib.helper.make_attribute("plugin_namespace", plugin_spec.NAMESPACE))
        if "aot" not in names:
            node.attribute.append(onnx_lib.helper.make_attribute("aot", 1))
    lower_moe(model, target)
    fd, name = tempfile.mkstemp(prefix=".trt.", suffix=".onnx", dir=tmp_dir)
    os.close(fd)
    onnx_lib.save(model, name)  # external_data entries are kept as references, weights are not rewritten
    return Path(name)


def _parse(trt: Any, builder: Any, logger: Any, onnx: Path) -> tuple[Any, Any]:
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    if hasattr(trt.NetworkDefinitionCreationFlag, "PREFER_AOT_PYTHON_PLUGINS"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise DgpipeError(f"TensorRT could not parse {onnx}: {' | '.join(errors[:5])}")
    return network, parser


def build(plan: BuildPlan, *, force: bool = False, log_level: str = "WARNING") -> tuple[EngineManifest, bool]:
    """Build (or keep) the plan. Returns (manifest, built) where built is False when an up-to-date plan was
    kept. Needs TensorRT >= 10.9 and a GPU of the target's compute capability."""
    trt_version, (cc, gpu_name) = require_local_build(plan)
    ptx_info = ensure_ptx(plan)
    if not force:
        current, _ = is_current(
            plan.engine_dir,
            tensorrt_version=trt_version,
            gpu_cc=cc,
            precision=plan.precision,
            onnx_sha256=plan.onnx_sha256,
            ptx_sha256=ptx_info.sha256,
            profiles=plan.profiles,
        )
        if current:
            from pipeline.engine.plan_record import load_engine_manifest

            return load_engine_manifest(plan.engine_dir), False

    import tensorrt as trt

    from pipeline.engine import plugin

    _, ptx = load_plugin_ptx(plan.plugin_dir, plan.target.name)
    plugin.register(ptx, ptx_info.arch)

    logger = trt.Logger(getattr(trt.Logger, log_level))
    builder = trt.Builder(logger)
    trt_onnx = _onnx_for_trt(plan.onnx, plan.onnx.parent, plan.target.name)
    try:
        network, _parser = _parse(trt, builder, logger, trt_onnx)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(plan.workspace_gib * (1 << 30)))
        config.builder_optimization_level = plan.builder_optimization_level
        for record in plan.profiles:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in record.shapes.items():
                profile.set_shape(name, tuple(lo), tuple(opt), tuple(hi))
            for name, (lo, opt, hi) in record.shape_values.items():
                profile.set_shape_input(name, lo, opt, hi)
            if config.add_optimization_profile(profile) < 0:
                raise DgpipeError(f"TensorRT rejected the {record.name} optimization profile")
        cache_file = timing_cache_file(plan.engine_dir.parent, cc, gpu_name)
        cache = config.create_timing_cache(cache_file.read_bytes() if cache_file.is_file() else b"")
        if not config.set_timing_cache(cache, ignore_mismatch=False):  # unreadable or another device's
            config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise DgpipeError(f"TensorRT failed to build the {plan.target.name} engine (see the log above)")
        plan_bytes = bytes(memoryview(serialized))
        built_cache = config.get_timing_cache()
        timing = bytes(memoryview(built_cache.serialize())) if built_cache is not None else None
    finally:
        trt_onnx.unlink(missing_ok=True)

    manifest = EngineManifest(
        plan_sha256="",
        tensorrt_version=trt_version,
        target=plan.target.name,
        arch=plan.target.arch,
        compute_capability=cc,
        gpu_name=gpu_name,
        precision=plan.precision,
        plugin=PluginRecord(
            arch=plan.plugin.arch, ptx_sha256=ptx_info.sha256, entry_points=plan.plugin.entry_points
        ),
        onnx_sha256=plan.onnx_sha256,
        checkpoint_sha256=plan.checkpoint_sha256,
        build_flags=plan.build_flags(),
        limits=plan.limits.engine_values(),
        profiles=plan.profiles,
    )
    write_engine_dir(plan.engine_dir, plan_bytes, manifest)
    if timing is not None:
        atomic_write_bytes(cache_file, timing)
    return manifest, True


def write_engine_dir(engine_dir: Path, plan_bytes: bytes, manifest: EngineManifest) -> None:
    """Write plan + manifest into a temp dir, then swap it in: readers see the old pair or the new pair."""
    engine_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}.", dir=engine_dir.parent))
    try:
        (tmp / PLAN_NAME).write_bytes(plan_bytes)
        manifest.plan_sha256 = hash_files([tmp / PLAN_NAME])
        save_engine_manifest(tmp, manifest)
        old = engine_dir.parent / f".{engine_dir.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if engine_dir.exists():
            engine_dir.rename(old)
        tmp.rename(engine_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert (engine_dir / ENGINE_MANIFEST).is_file()
