"""`dgpipe bench load-memory`: peak memory of loading an FP8 / NVFP4 checkpoint with the model's real shapes.

A quantized checkpoint in ModelOpt's layout (one 2-D tensor per expert and projection, packed weights with
their scales and input scales, the rest bf16) is written shard by shard with random weights at a chosen
depth, then loaded in a fresh process per route; the figure is that process's peak RSS (VmHWM) and, on a
GPU, torch's peak allocated GPU memory:

* `cpu`: `load_model` in bf16 on the CPU, the route of the CPU runtime (weights dequantized on load);
* `tensor-cores`: `gpu_load.load_on_gpu`, the route of a CUDA host: packed weights to their
  tensor-core modules as stored. On a GPU it runs there; without one the host stands in for the GPU (the
  kernels' probe taken as passed on Hopper's row), so RSS counts every byte the route would put on the GPU.

The bf16 model size and the packed checkpoint size are reported beside them: the first is what a load that
dequantizes the whole model must hold, the second what the weights take on tensor cores.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.bench.export_memory import (
    checkpoint_bytes,
    checkpoint_shards,
    model_config,
    write_index_and_config,
)
from pipeline.bench.results import save_result
from pipeline.errors import DgpipeError
from pipeline.model.config import ModelConfig
from pipeline.model.files import DECODER

RESULT_FILE = "bench_load_memory.json"
FORMATS = {"fp8": "FP8", "nvfp4": "NVFP4"}  # --format -> ModelOpt quant_algo
ROUTES = ("cpu", "tensor-cores")
QUANTIZED = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)  # fmt: skip  (ModelOpt's quantized linears)


LAYER_TENSOR = re.compile(r"^layers\.\d+\.(.+)$")


def _packed(fmt: str, shape: tuple[int, ...], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One random quantized linear [out, in] as ModelOpt stores it: suffix -> tensor."""
    from pipeline.bench.random_weights import random_packed

    q = random_packed(fmt, shape[0], shape[1], torch.device("cpu"), gen)
    tensors = {"weight": q.weight, "weight_scale": q.weight_scale, "weight_scale_2": q.weight_scale_2,
               "input_scale": q.input_scale}  # fmt: skip
    return {k: v for k, v in tensors.items() if v is not None}


def shard_tensors(
    members: dict[str, tuple[int, ...]], fmt: str, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A shard's tensors (`members`: name -> shape of the bf16 checkpoint): ModelOpt's quantized linears
    packed, the fused experts split into one linear per expert and projection, the rest random bf16."""
    state: dict[str, torch.Tensor] = {}
    for name, shape in members.items():
        m = LAYER_TENSOR.match(name.removeprefix(DECODER))
        rest = m.group(1) if m else ""
        if rest.removesuffix(".weight") in QUANTIZED:
            stem = name.removesuffix("weight")
            state.update({stem + k: v for k, v in _packed(fmt, shape, gen).items()})
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):
            stem = name.removesuffix(rest) + "experts"
            projs = ("gate_proj", "up_proj") if rest == "experts.gate_up_proj" else ("down_proj",)
            rows = shape[1] // len(projs)
            for e in range(shape[0]):
                for proj in projs:
                    packed = _packed(fmt, (rows, shape[2]), gen)
                    state.update({f"{stem}.{e}.{proj}.{k}": v for k, v in packed.items()})
        else:
            scale = 1.0 if len(shape) == 1 else shape[-1] ** -0.5  # norms ~1, matrices ~1/sqrt(fan_in)
            state[name] = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
    return state


def write_quantized_checkpoint(out: Path, config: ModelConfig, fmt: str, seed: int = 0) -> int:
    """A random `fmt` checkpoint of `config` in ModelOpt's layout, one shard per decoder layer (holding one
    shard's tensors at a time); returns its tensor bytes."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for fname, members in checkpoint_shards(config).items():
        state = shard_tensors(members, fmt, gen)
        save_file(state, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, fname))
        total += sum(t.numel() * t.element_size() for t in state.values())
        del state
    quant = {"quant_method": "modelopt", "quant_algo": FORMATS[fmt]}
    write_index_and_config(out, weight_map, total, config, torch.bfloat16, quantization_config=quant)
    (out / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": FORMATS[fmt]}}) + "\n"
    )
    return total


_CHILD = r"""
import json, sys, time
import torch
def rss_gb(field="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
route, ckpt = sys.argv[1:3]
torch.set_num_threads(int(sys.argv[3]))
base, t = rss_gb(), time.perf_counter()
cuda = torch.cuda.is_available()
if route == "cpu":
    from pipeline.model.checkpoint import load_model
    model, _ = load_model(ckpt, torch.bfloat16, "cpu")
else:
    from pipeline.runtime import gpu_load
    from pipeline.runtime import probe as probing
    dev = torch.device("cuda" if cuda else "cpu")
    # off a GPU the host stands in for it: the kernels' probe taken as passed on Hopper's row
    probed = None if cuda else probing.Probe("sm90", {f"{k}:{m}": None for k in ("linear", "experts") for m in ("fp8", "fp8_rowwise")})
    model, _, report = gpu_load.load_on_gpu(ckpt, torch.bfloat16, dev, probed)
seconds = time.perf_counter() - t
print(json.dumps({"peak_rss_gb": rss_gb("VmHWM"), "rss_after_imports_gb": base, "seconds": seconds,
                  "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda and route != "cpu" else None,
                  "device": "cpu" if route == "cpu" else torch.cuda.get_device_name() if cuda else "cpu, standing in for the GPU"}))
"""


def load_peak(route: str, ckpt: Path, threads: int = 2) -> dict:
    """Peak memory (GB, decimal) and seconds of a fresh process loading `ckpt` by `route`."""
    res = subprocess.run([sys.executable, "-c", _CHILD, route, str(ckpt), str(threads)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    if res.returncode != 0:
        raise DgpipeError(f"the {route} load failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@dataclass
class LoadMemoryResult:
    config: str
    format: str
    layers: int
    checkpoint_gb: float  # the packed checkpoint's tensors
    bf16_model_gb: float  # the same model dequantized to bf16
    routes: dict[str, dict]  # route -> load_peak's figures


def run(
    config: str,
    layers: int,
    fmt: str,
    work_dir: Path,
    routes: tuple[str, ...] = ROUTES,
    out_dir: Path | None = None,
) -> LoadMemoryResult:
    """Load a random `fmt` checkpoint of `layers` full-size layers by each route, measuring peak memory;
    with `out_dir`, the result is written there as RESULT_FILE."""
    if fmt not in FORMATS:
        raise DgpipeError(f"--format {fmt!r} is not a quantized format", f"one of: {', '.join(FORMATS)}")
    full = model_config(config, None).text_config.num_hidden_layers
    if not 1 <= layers <= full:
        raise DgpipeError(f"--layers {layers} is outside 1..{full}", f"{config} has {full} decoder layers")
    cfg = model_config(config, layers)
    ckpt = work_dir / f"checkpoint-{fmt}"
    free = shutil.disk_usage(work_dir if work_dir.exists() else Path(work_dir.anchor)).free
    if free < checkpoint_bytes(cfg):
        raise DgpipeError(f"{work_dir}: {free / 1e9:.1f} GB free, the checkpoint needs up to "
                          f"{checkpoint_bytes(cfg) / 1e9:.1f} GB", "fewer --layers or another --work-dir")  # fmt: skip
    try:
        size = write_quantized_checkpoint(ckpt, cfg, fmt)
        measured = {r: load_peak(r, ckpt) for r in routes}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    result = LoadMemoryResult(config, fmt, layers, size / 1e9, checkpoint_bytes(cfg) / 1e9, measured)
    if out_dir is not None:
        save_result(out_dir, RESULT_FILE, as_dict(result))
    return result


def as_dict(r: LoadMemoryResult) -> dict:
    return asdict(r)


def render(r: dict) -> str:
    lines = [
        f"{r['config']}, {r['layers']} layers at full shapes: {r['checkpoint_gb']:.2f} GB {r['format']} checkpoint "
        f"({r['bf16_model_gb']:.2f} GB as a bf16 model)",
        "| route | device | peak RSS GB | peak GPU GB | RSS after imports GB | seconds |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for route, m in r["routes"].items():
        gpu = "—" if m["peak_gpu_gb"] is None else f"{m['peak_gpu_gb']:.2f}"
        lines.append(f"| {route} | {m['device']} | {m['peak_rss_gb']:.2f} | {gpu} | "
                     f"{m['rss_after_imports_gb']:.2f} | {m['seconds']:.1f} |")  # fmt: skip
    return "\n".join(lines)
