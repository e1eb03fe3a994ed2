"""`dgpipe bench export-memory`: peak host RSS of the streaming ONNX export on a 26B-shaped random checkpoint.

The checkpoint is written shard by shard (one decoder layer per shard, random bf16 weights, the model
config's real per-layer shapes at a chosen depth), then exported by `pipeline.onnx.stream.export_streaming`
in a fresh process whose peak RSS (VmHWM, the high-water mark of its own address space) is the figure. The full 30-layer 26B checkpoint is ~50 GB
at bf16 and the export writes as much again. Two ways to fit a disk:

* `--sparse`: the shards hold the real safetensors headers and a file hole for the data (zero weights,
  ~0 bytes on disk), so only the export's ~50 GB is written and the full depth is measured end to end.
  The copy loop's memory does not depend on the values (random vs sparse agree: BENCHMARKS.md).
* a reduced depth at the real shapes, with the weightless trace measured separately at full depth (the
  only part of the export whose memory grows with depth), reporting the extrapolation

    peak(full) ~= peak(stream, L layers) + peak(trace, full depth) - peak(trace, L layers)

  with all three measured numbers. The disk is checked up front against what the run will write.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.bench.results import save_result
from pipeline.errors import DgpipeError
from pipeline.model.checkpoint import hf_state_dict
from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma

RESULT_FILE = "bench_export_memory.json"


def model_config(name: str, layers: int | None, **text: int) -> ModelConfig:
    """A configs/models config at `layers` depth (layer_types refilled: 5 sliding : 1 global, the last
    global), other text_config fields overridden by `text` (the CI test scales vocab and experts)."""
    if layers is not None:
        text = {**text, "num_hidden_layers": layers}
    return ModelConfig.from_yaml(name, **text)


SAFETENSORS_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """A valid safetensors file whose data region is a hole: the real header (names, shapes, dtypes,
    offsets), then the file extended by `truncate` so every tensor reads back as zeros while ~0 bytes are
    allocated on disk. Lets the bench export a full-depth 26B checkpoint (50 GB) on a disk that only has
    room for the export's output. Returns the tensor bytes (the logical data size)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, dtype) in tensors.items():
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPE[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # as safetensors writes it: the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return offset


def checkpoint_shards(config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """shard file name -> {tensor name: shape}: one shard per decoder layer, one for the rest."""
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in hf_state_dict(DiffusionGemma(config)).items()}
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in names.items():
        parts = name.split(".")
        key = f"layer{int(parts[parts.index('layers') + 1]):03d}" if "layers" in parts else "rest"
        groups.setdefault(f"model-{key}.safetensors", {})[name] = shape
    return dict(sorted(groups.items()))


def checkpoint_bytes(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Tensor bytes of `config`'s checkpoint at `dtype` (what the export writes again as external data)."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) * item for shard in checkpoint_shards(config).values() for s in shard.values())


def write_random_checkpoint(
    out: Path,
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    sparse: bool = False,
) -> int:
    """One safetensors shard per decoder layer (+ one for the rest) with random weights; returns bytes.
    Holds one shard's tensors at a time (a 26B layer is ~1.5 GB at bf16). `sparse`: all-zero weights
    stored as holes (`write_sparse_safetensors`), ~0 bytes on disk."""
    out.mkdir(parents=True, exist_ok=True)
    shards = checkpoint_shards(config)
    gen = torch.Generator().manual_seed(seed)
    # Drawing 25B normals takes hours on a shared CPU: each tensor is a window of one 16M-value random block,
    # tiled from a random offset. Values are random-looking; what the bench measures (bytes moved, memory
    # held) does not depend on them.
    block = None if sparse else torch.randn(1 << 24, generator=gen)
    weight_map, total = {}, 0
    for fname, members in shards.items():
        weight_map.update(dict.fromkeys(members, fname))
        if block is None:
            total += write_sparse_safetensors(out / fname, {n: (s, dtype) for n, s in members.items()})
            continue
        state = {}
        for name, shape in members.items():
            scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5  # norms ~1, matrices ~1/sqrt(fan_in)
            numel = math.prod(shape)
            start = int(torch.randint(0, block.numel(), (), generator=gen))
            tiled = (block * scale).to(dtype).roll(-start).repeat(-(-numel // block.numel()))[:numel]
            state[name] = tiled.reshape(shape)
            total += state[name].numel() * state[name].element_size()
        save_file(state, str(out / fname), metadata={"format": "pt"})
        del state
    write_index_and_config(out, weight_map, total, config, dtype)
    return total


def write_index_and_config(
    out: Path,
    weight_map: dict[str, str],
    total: int,
    config: ModelConfig,
    dtype: torch.dtype,
    **extra: object,
) -> None:
    """A sharded checkpoint's model.safetensors.index.json and its config.json (`extra`: more config keys)."""
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    cfg = {**config.to_hf_dict(), "dtype": str(dtype).replace("torch.", ""), **extra}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from pipeline.onnx import stream
def rss_gb(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
mode, src, out, moe = sys.argv[1:5]
base = rss_gb()
t = time.perf_counter()
if mode == "stream":
    stream.export_streaming(Path(src), Path(out), moe=moe)
elif mode in ("fp8", "nvfp4"):  # a ModelOpt checkpoint, as dgpipe build exports it: the bf16 Q/DQ graph
    stream.export_quantized_streaming(Path(src), Path(out), mode, dtype=torch.bfloat16, moe=moe)
else:  # the weightless part at this depth: meta trace + opset conversion
    from pipeline.bench.export_memory import model_config
    m = stream.structure_graph(model_config(src, None if out == "full" else int(out)), moe)
# VmHWM, not ru_maxrss: getrusage's maximum survives fork + exec, so it would report the parent's peak
print(json.dumps({"peak_rss_gb": rss_gb("VmHWM"),
                  "rss_after_imports_gb": base, "seconds": time.perf_counter() - t}))
"""


def _child(*args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"export child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def stream_peak_rss(ckpt: Path, out: Path, moe: str = "routed", quantized: str | None = None) -> dict:
    """Peak RSS (GB, decimal) of a fresh process that streams `ckpt` to `out` (`quantized`: a ModelOpt
    "fp8" / "nvfp4" checkpoint, streamed into its bf16 Q/DQ graph)."""
    return _child(quantized or "stream", str(ckpt), str(out), moe)


def trace_peak_rss(config: str, layers: int | None, moe: str = "routed") -> dict:
    return _child("trace", config, "full" if layers is None else str(layers), moe)


@dataclass
class ExportMemoryResult:
    config: str
    layers_measured: int
    layers_full: int
    checkpoint_gb: float
    stream_peak_rss_gb: float
    stream_seconds: float
    rss_after_imports_gb: float
    trace_peak_rss_gb_measured_depth: float
    trace_peak_rss_gb_full_depth: float
    extrapolated_full_peak_rss_gb: float  # == stream_peak_rss_gb when layers_measured == layers_full
    moe: str
    dtype: str = "bfloat16"
    weights: str = "random"  # or "sparse-zero": the data regions are file holes
    output_gb: float = 0.0  # model.onnx + model.onnx.data as written


def disk_needed(config: ModelConfig, sparse: bool, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the bench writes at once: the checkpoint (0 when sparse) + the export (its weights again) +
    1 GB for the graph, head constants and alignment."""
    size = checkpoint_bytes(config, dtype)
    return (0 if sparse else size) + size + (1 << 30)


def check_disk(work_dir: Path, config: ModelConfig, sparse: bool) -> None:
    """Refuse up front (not 40 minutes into a 50 GB write) when `work_dir`'s disk is too small."""
    need = disk_needed(config, sparse)
    probe = work_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        layers = config.text_config.num_hidden_layers
        raise DgpipeError(
            f"{work_dir}: the {layers}-layer bench needs {need / 1e9:.1f} GB free ({need} bytes: "
            f"{'a sparse' if sparse else 'the random'} checkpoint + the export), the disk has {free / 1e9:.1f} GB",
            ("" if sparse else "pass --sparse (zero weights stored as file holes, ~0 bytes), ")
            + "fewer --layers, or a --work-dir on a larger disk",
        )


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def run(
    config: str,
    layers: int,
    work_dir: Path,
    moe: str = "routed",
    keep: bool = False,
    sparse: bool = False,
    out_dir: Path | None = None,
) -> ExportMemoryResult:
    """Export a random checkpoint of `layers` full-size layers, measuring peak RSS; with `out_dir`, the
    result is written there as RESULT_FILE."""
    cfg = model_config(config, layers)
    full = model_config(config, None).text_config.num_hidden_layers
    if not 1 <= layers <= full:
        raise DgpipeError(f"--layers {layers} is outside 1..{full}", f"{config} has {full} decoder layers")
    check_disk(work_dir, cfg, sparse)
    ckpt, out = work_dir / "checkpoint", work_dir / "onnx"
    try:
        size = write_random_checkpoint(ckpt, cfg, sparse=sparse)
        s = stream_peak_rss(ckpt, out, moe)
        written = _dir_bytes(out)
    finally:
        if not keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    t_l = trace_peak_rss(config, layers, moe)
    t_full = trace_peak_rss(config, None, moe) if layers < full else t_l
    result = ExportMemoryResult(
        config=config,
        layers_measured=layers,
        layers_full=full,
        checkpoint_gb=size / 1e9,
        stream_peak_rss_gb=s["peak_rss_gb"],
        stream_seconds=s["seconds"],
        rss_after_imports_gb=s["rss_after_imports_gb"],
        trace_peak_rss_gb_measured_depth=t_l["peak_rss_gb"],
        trace_peak_rss_gb_full_depth=t_full["peak_rss_gb"],
        extrapolated_full_peak_rss_gb=s["peak_rss_gb"] + t_full["peak_rss_gb"] - t_l["peak_rss_gb"],
        moe=moe,
        weights="sparse-zero" if sparse else "random",
        output_gb=written / 1e9,
    )
    if out_dir is not None:
        save_result(out_dir, RESULT_FILE, as_dict(result))
    return result


def as_dict(r: ExportMemoryResult) -> dict:
    return asdict(r)


def render(r: dict) -> str:
    """The `dgpipe bench export-memory` report: peak RSS, measured or extrapolated to full depth."""
    return (
        f"{r['config']}: {r['layers_measured']} of {r['layers_full']} layers at full shapes, "
        f"{r['checkpoint_gb']:.1f} GB {r['weights']} {r['dtype']} checkpoint, MoE {r['moe']}\n"
        f"  streaming export peak RSS {r['stream_peak_rss_gb']:.2f} GB ({r['stream_seconds']:.0f} s; "
        f"{r['rss_after_imports_gb']:.2f} GB after imports; {r['output_gb']:.1f} GB written)\n"
        f"  weightless trace peak RSS {r['trace_peak_rss_gb_measured_depth']:.2f} GB at {r['layers_measured']} "
        f"layers, {r['trace_peak_rss_gb_full_depth']:.2f} GB at {r['layers_full']}\n"
        + (
            f"  measured full-depth export peak RSS {r['stream_peak_rss_gb']:.2f} GB"
            if r["layers_measured"] == r["layers_full"]
            else f"  extrapolated full-depth export peak RSS {r['extrapolated_full_peak_rss_gb']:.2f} GB"
        )
    )
