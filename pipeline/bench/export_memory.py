"""`dgpipe bench export-memory`: peak host RSS of the streaming ONNX export on a 26B-shaped random checkpoint.

The checkpoint is written shard by shard (one decoder layer per shard, random bf16 weights, the model
config's real per-layer shapes at a chosen depth), then exported by `pipeline.onnx.stream.export_streaming`
in a fresh process whose peak RSS (VmHWM, the high-water mark of its own address space) is the figure. The full 30-layer 26B checkpoint is ~50 GB
at bf16 and the export writes as much again, so on a small disk the bench measures a reduced depth at the
real shapes, and separately the weightless trace at full depth (the only part of the export whose memory
grows with depth), and reports the extrapolation

    peak(full) ~= peak(stream, L layers) + peak(trace, full depth) - peak(trace, L layers)

stating all three measured numbers with it.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.model.checkpoint import hf_state_dict
from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma
from pipeline.resources import load_yaml

RESULT_FILE = "bench_export_memory.json"


def model_config(name: str, layers: int | None, **text: int) -> ModelConfig:
    """A configs/models config at `layers` depth (layer_types refilled: 5 sliding : 1 global, the last
    global), other text_config fields overridden by `text` (the CI test scales vocab and experts)."""
    raw = load_yaml("models", name)
    if layers is not None:
        text = {**text, "num_hidden_layers": layers}
    raw["text_config"] = {**raw["text_config"], **text}
    return ModelConfig.from_dict(raw, source=name)


def write_random_checkpoint(
    out: Path, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> int:
    """One safetensors shard per decoder layer (+ one for the rest) with random weights; returns bytes.
    Holds one shard's tensors at a time (a 26B layer is ~1.5 GB at bf16)."""
    out.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in hf_state_dict(DiffusionGemma(config)).items()}
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        key = f"layer{int(parts[parts.index('layers') + 1]):03d}" if "layers" in parts else "rest"
        groups.setdefault(key, []).append(name)
    gen = torch.Generator().manual_seed(seed)
    # Drawing 25B normals takes hours on a shared CPU: each tensor is a window of one 16M-value random block,
    # tiled from a random offset. Values are random-looking; what the bench measures (bytes moved, memory
    # held) does not depend on them.
    block = torch.randn(1 << 24, generator=gen)
    weight_map, total = {}, 0
    for key, members in sorted(groups.items()):
        fname = f"model-{key}.safetensors"
        state = {}
        for name in members:
            shape = names[name]
            scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5  # norms ~1, matrices ~1/sqrt(fan_in)
            numel = math.prod(shape)
            start = int(torch.randint(0, block.numel(), (), generator=gen))
            tiled = (block * scale).to(dtype).roll(-start).repeat(-(-numel // block.numel()))[:numel]
            state[name] = tiled.reshape(shape)
            weight_map[name] = fname
            total += state[name].numel() * state[name].element_size()
        save_file(state, str(out / fname), metadata={"format": "pt"})
        del state
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    cfg = config.to_hf_dict()
    cfg["dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return total


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


def stream_peak_rss(ckpt: Path, out: Path, moe: str = "routed") -> dict:
    """Peak RSS (GB, decimal) of a fresh process that streams `ckpt` to `out`."""
    return _child("stream", str(ckpt), str(out), moe)


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
    extrapolated_full_peak_rss_gb: float
    moe: str
    dtype: str = "bfloat16"


def run(
    config: str, layers: int, work_dir: Path, moe: str = "routed", keep: bool = False
) -> ExportMemoryResult:
    cfg = model_config(config, layers)
    full = model_config(config, None).text_config.num_hidden_layers
    ckpt, out = work_dir / "checkpoint", work_dir / "onnx"
    try:
        size = write_random_checkpoint(ckpt, cfg)
        s = stream_peak_rss(ckpt, out, moe)
    finally:
        if not keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
    t_l = trace_peak_rss(config, layers, moe)
    t_full = trace_peak_rss(config, None, moe) if layers < full else t_l
    return ExportMemoryResult(
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
    )


def as_dict(r: ExportMemoryResult) -> dict:
    return asdict(r)
