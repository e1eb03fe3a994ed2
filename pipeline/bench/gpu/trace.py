"""Every GPU dispatch row's load and denoise pass, traced on a machine without a GPU.

Most rows of `pipeline.runtime.dispatch` have never run on their GPU (no Ada, B200 or RTX Blackwell has been
reachable). A trace runs the CUDA path's own code on torch's fake tensors (shapes, dtypes and devices, no
data) at the full 26B-A4B configuration: the tensor-core modules as `bench gpu` installs them from random
packed weights (`gpu.quantize_random`, the constructors the checkpoint loader uses), the routed float
experts (`gpu_load.route_float_experts`), the network's CUDA branches (fused norms, expanded K/V, the gather
combine) and dgpipe's Triton launch code up to the launch. For each (format, arch) it shows:

* which GEMM runs the linears and the expert projections (aten op or Triton launch), against the row;
* what the model holds in GPU memory, linears and experts apart, against the formats the byte model reads;
* that nothing in the pass reads the device from the host (`.item()`, `.tolist()`, `torch.equal`, a
  data-dependent shape: fake tensors raise) and that no host tensor enters it: either would break CUDA-graph
  capture;
* how many operations launch work on the GPU: an estimate of the pass's kernel launches (some aten ops
  launch more than one; `bench gpu`'s profile counts the real ones).

What it cannot show: numerics, speed, a vendor kernel's own argument checks (fake tensors run torch's meta
functions), or whether a kernel exists in the host's build (the load-time probe, `pipeline.runtime.probe`).

How: `pipeline.bench.gpu.fake_cuda` (fake CUDA tensors in a CPU build of torch, Triton launches counted). The
device capability is the traced arch's, and every probed kernel counts as passed unless a `Probe` says
otherwise.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)

from pipeline.atomic import atomic_write_text
from pipeline.bench.gpu.fake_cuda import HostTensorInPass, fake_gpu, to_fake_cuda
from pipeline.bench.results import save_result
from pipeline.errors import error_line
from pipeline.model.config import FLAGSHIP_CONFIG, ModelConfig
from pipeline.model.network import DiffusionGemma, PastWithRoom, canvas_positions
from pipeline.runtime.dispatch import DISPATCH, dispatch, weight_bytes
from pipeline.runtime.kv_cache import KVCache, attention_masks
from pipeline.runtime.probe import Probe, probe_plan
from pipeline.runtime.shared_input import SharedInput
from pipeline.runtime.tensor_cores import unit_row_scales

CONFIG = FLAGSHIP_CONFIG
CONTEXT = 256  # cached prompt tokens under the traced pass, as `bench gpu` measures it
# the GEMMs, by the name the dispatch table gives them
GEMMS = {
    "aten::_scaled_mm_v2": "F.scaled_mm",
    "aten::_scaled_grouped_mm_v2": "F.scaled_grouped_mm",
    "aten::_grouped_mm": "F.grouped_mm",
    "triton::moe_gemm": "Triton MoE GEMM",
    "aten::linear": "F.linear",
    "aten::mm": "torch.mm",
    "aten::bmm": "torch.bmm",
}


@dataclass
class PassTrace:
    format: str
    arch: str
    batch: int
    layers: int
    kernels: str  # the load's own description of its kernels and fallbacks
    resident_gb: dict[str, float]  # what the model holds on the device: linears, experts, other
    expected_gb: dict[str, float]  # the byte model's linears and experts in the formats the row reads
    ops: Counter = field(default_factory=Counter)  # operations of one denoise pass that launch work
    traffic: Counter = field(default_factory=Counter)  # bytes each operation moves (`fake_cuda.traffic`)
    output: str = ""  # the logits' shape, dtype and device
    error: str | None = None  # a host read or host tensor in the pass, or anything else that stopped it
    # each Triton kernel's compile keys (`fake_cuda.specialization`): the binaries the pass needs
    binaries: dict[str, set[tuple]] = field(default_factory=dict, repr=False)

    @property
    def launches(self) -> int:
        return sum(self.ops.values())

    @property
    def moved_gb(self) -> float:
        """GB the eager pass moves if every operation reads each operand and writes each result once."""
        return sum(self.traffic.values()) / 1e9

    def gemms(self) -> dict[str, int]:
        return {GEMMS[op]: n for op, n in self.ops.items() if op in GEMMS}


def trace_config(layers: int | None = None, config: str = CONFIG) -> ModelConfig:
    """The model configuration; `layers`: only the first layer of each kind (sliding, global), the same
    shapes per layer (the tests trace every row on two layers)."""
    cfg = ModelConfig.from_yaml(config)
    if layers is None:
        return cfg
    kinds = list(dict.fromkeys(cfg.text_config.layer_types or []))[:layers]
    return ModelConfig.from_yaml(config, num_hidden_layers=len(kinds), layer_types=kinds)


def passing_probe(arch: str) -> Probe:
    """Every kernel the dispatch table names for `arch` ran."""
    return Probe(arch, {f"{kind}:{mode}": None for kind, mode, _ in probe_plan(arch)})


def _group(name: str) -> str:
    """The weight group of a parameter or buffer name: routed experts, the quantized linears (attention
    projections, dense MLP), or everything else (embedding, norms, router, self-conditioning)."""
    if ".experts." in name:
        return "experts"
    if ".mlp." in name or (".self_attn." in name and "_norm" not in name):
        return "linears"
    return "other"


def resident_gb(model: DiffusionGemma) -> dict[str, float]:
    """GB the model holds on the device, by `_group` (and what sibling linears' merged GEMMs hold apart)."""
    out = {"linears": 0.0, "experts": 0.0, "other": 0.0}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[_group(name)] += t.numel() * t.element_size() / 1e9
    for module in model.modules():
        shared = [v for v in vars(module).values() if isinstance(v, SharedInput)]
        out["linears"] += sum(s.held_apart for s in shared) / 1e9
    return out


def _past(
    mcfg: ModelConfig, batch: int, fake: FakeTensorMode, context: int = CONTEXT, prompt: int | None = None
):
    """A cache holding `context` prompt tokens per row, read as the runtime reads it before a step (with room
    for the canvas's K/V), or before a causal pass of `prompt` tokens per row (a prefill chunk, a commit:
    without room, the masks causal): K/V on meta tensors, lengths and ring positions real, so `KVCache.read`
    and `attention_masks` run as written."""
    cfg, length = mcfg.text_config, mcfg.canvas_length
    room = length if prompt is None else 0
    with unset_fake_temporarily():
        cache = KVCache(cfg, batch, context + (prompt or length) + 8, torch.bfloat16, "meta", room=room)
        cache.lengths = torch.full((batch,), context)
        held = torch.arange(max(0, context - cache.ring), context)
        cache.ring_pos = torch.full((batch, cache.ring), -1)
        cache.ring_pos[:, held % cache.ring] = held
        slots = torch.arange(batch)
        past, meta = cache.read(slots, room=room)
        if prompt is None:
            positions = canvas_positions(cache.lengths[slots], length)
        else:
            positions = cache.lengths[slots, None] + torch.arange(prompt)[None]
        masks = attention_masks(
            positions, torch.ones_like(positions, dtype=torch.bool), meta, prompt is not None, cache.window
        )
    to_cuda = lambda t: None if t is None else fake.fake_tensor_converter.from_meta_and_device(fake, t.to("meta"), torch.device("cuda"))  # fmt: skip
    return (
        [
            PastWithRoom(to_cuda(p.k), to_cuda(p.v), p.length) if room else (to_cuda(p[0]), to_cuda(p[1]))
            for p in past
        ],
        to_cuda(positions),
        {k: to_cuda(m) for k, m in masks.items()},
    )


def trace_pass(
    fmt: str,
    arch: str,
    batch: int,
    layers: int | None = None,
    probed: Probe | None = None,
    config: str = CONFIG,
    context: int = CONTEXT,
    prompt: int | None = None,
) -> PassTrace:
    """Load the random-weight model in `fmt` as on a GPU of `arch` and trace one denoise pass of `batch`
    canvases over `context` cached tokens, or (`prompt`) a causal pass of that many tokens per row over them
    (`encode_kv`: a prefill chunk, a commit). `probed`: the load-time probe's results (default: all passed)."""
    with _loaded(fmt, arch, batch, layers, probed, config) as (model, trace, fake, ops, calls):
        mcfg = model.config
        past, positions, masks = _past(mcfg, batch, fake, context, prompt)
        tokens = torch.zeros(positions.shape, dtype=torch.long, device="cuda")
        # the pass as it runs after its first, whose RowWise GEMMs made their row scales of 1 once
        unit_row_scales(tokens.numel(), tokens.device)
        calls.loading, fake.allow_non_fake_inputs, ops.counting = False, False, True
        with _traced(trace, ops), torch.inference_mode():
            if prompt is None:
                hidden = mcfg.text_config.hidden_size
                soft = torch.empty(*tokens.shape, hidden, dtype=torch.bfloat16, device="cuda")
                out = model.denoise_soft(tokens, soft, positions, masks, past)
            else:
                out = model.encode_kv(tokens, positions, masks, past)[-1][0]  # the last layer's K
            trace.output = f"{list(out.shape)} {str(out.dtype).removeprefix('torch.')} {out.device.type}"
    return trace


def trace_warm(
    fmt: str, arch: str, most: int, layers: int | None = None, config: str = CONFIG
) -> tuple[list[int], PassTrace]:
    """`warm.warm_experts` on the model loaded as in `trace_pass`, for passes of up to `most` tokens: the token
    counts of its passes, and their trace (`binaries`: what they compile)."""
    from pipeline.runtime.warm import warm_experts

    counts: list[int] = []
    with _loaded(fmt, arch, 1, layers, None, config) as (model, trace, fake, ops, calls):
        calls.loading, fake.allow_non_fake_inputs, ops.counting = False, False, True
        with _traced(trace, ops):
            counts = warm_experts(model, torch.device("cuda"), most)
    return counts, trace


@contextlib.contextmanager
def _loaded(fmt: str, arch: str, batch: int, layers: int | None, probed: Probe | None, config: str):
    """The random-weight model loaded in `fmt` as on a GPU of `arch`, inside `fake_cuda.fake_gpu`: (model,
    its `PassTrace` with the load's kernels and resident bytes, the fake mode, the op counter, the
    function mode)."""
    from pipeline.bench.gpu.measure import quantize_random  # the benchmark's own load
    from pipeline.runtime.gpu_load import finish_on_device

    mcfg = trace_config(layers, config)
    row, probed = dispatch(fmt, arch), probed or passing_probe(arch)
    with torch.device("meta"):
        model = DiffusionGemma(mcfg).to(torch.bfloat16).eval()
    with fake_gpu(arch) as (fake, ops, calls):
        to_fake_cuda(model, fake)
        quantized = fmt in ("fp8", "nvfp4")
        kernels = (
            quantize_random(model, fmt, probed, seed=None) if quantized else f"{row.linears} / {row.experts}"
        )
        routed = finish_on_device(model, torch.device("cuda"), probed, None)
        if routed is not None:
            kernels += f" ({routed.summary()})"
        expected = weight_bytes(mcfg.text_config, row)
        trace = PassTrace(fmt, arch, batch, mcfg.text_config.num_hidden_layers, kernels, resident_gb(model),
                          {k: v / 1e9 for k, v in expected.items()}, ops.ops, ops.bytes)  # fmt: skip
        yield model, trace, fake, ops, calls


@contextlib.contextmanager
def _traced(trace: PassTrace, ops):
    """Record in `trace` why the block stopped, if it did, and the compile keys its launches met."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        trace.error = f"host read in the pass: {error_line(e)}"
    except HostTensorInPass as e:
        trace.error = f"host tensor in the pass: {e}"
    except Exception as e:  # a shape, dtype or device error: what would fail on the GPU too
        trace.error = error_line(e)
    finally:
        ops.counting = False
        trace.binaries = {name: set(keys) for name, keys in ops.compiles.items()}


def trace_all(
    batches: tuple[int, ...] = (1, 16),
    layers: int | None = None,
    on_trace: Callable[[PassTrace], None] | None = None,
) -> list[PassTrace]:
    """Every dispatch row at every batch; `on_trace` hears of each as it ends."""
    out = []
    for fmt, arch in DISPATCH:
        for b in batches:
            out.append(trace_pass(fmt, arch, b, layers))
            if on_trace is not None:
                on_trace(out[-1])
    return out


RESULT_FILE, TABLE_FILE = "gpu_trace.json", "gpu_trace.md"


def run(
    out_dir: Path,
    batches: tuple[int, ...] = (1, 16),
    layers: int | None = None,
    on_trace: Callable[[PassTrace], None] | None = None,
) -> dict:
    """`dgpipe bench gpu-trace`: every row traced, written as JSON and a markdown table to `out_dir`."""
    traces = trace_all(batches, layers, on_trace)
    result = {
        "config": f"{CONFIG}, {trace_config(layers).text_config.num_hidden_layers} layers",
        "context": CONTEXT,
        "torch": torch.__version__,
        "traces": [
            {
                **asdict(t),
                "ops": dict(t.ops),
                "traffic": dict(t.traffic),
                "launches": t.launches,
                "moved_gb": t.moved_gb,
                "gemms": t.gemms(),
                "binaries": {name: len(keys) for name, keys in t.binaries.items()},
            }
            for t in traces
        ],
        "failed": sum(t.error is not None for t in traces),
    }
    save_result(out_dir, RESULT_FILE, result)
    atomic_write_text(out_dir / TABLE_FILE, render(result["traces"]) + "\n")
    return result


def render(rows: list[dict]) -> str:
    """Markdown: one line per traced row (`run`'s "traces": format, arch, batch, ...)."""
    lines = [
        "| format | arch | batch | GEMMs per pass | launches per pass | GB moved per pass (eager) | linears GB (byte model) | experts GB (byte model) | host reads |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    for t in rows:
        gemms = ", ".join(f"{name} {n}" for name, n in sorted(t["gemms"].items()))
        gb = lambda k, t=t: f"{t['resident_gb'][k]:.2f} ({t['expected_gb'][k]:.2f})"
        lines.append(
            f"| {t['format']} | {t['arch']} | {t['batch']} | {gemms} | {t['launches']:,} | {t['moved_gb']:.1f} | {gb('linears')} "
            f"| {gb('experts')} | {t['error'] or 'none'} |"
        )
    return "\n".join(lines)
