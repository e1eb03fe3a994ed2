"""`dgpipe bench gpu`: everything only a GPU can show, as one command that ends within 8 minutes.

The checks, in order, each in its own subprocess under its own time budget (the budgets add up to at most
`TOTAL_BUDGET_S`, so the command ends in time by construction, whatever hangs). Time a check leaves unused,
and the budgets of the checks this host skips, go to the checks after it (`run_bench_gpu`): the GPU tests,
which grow with every kernel, get what a quick kernel build and a GPU without FP4 leave over:
1. build the CUDA sampler kernels (torch extension, nvcc + ninja);
2. the GPU tests (tests/gpu, over `GPU_TEST_WORKERS` processes): fused sampler kernels against the PyTorch
   oracle, CUDA-graph runtime against eager, tensor-core linears/experts against the dequantized reference
   (and the TensorRT checks, which skip without TensorRT);
3. the 26B-A4B random-weight denoise pass in bf16, FP8 and (where the GPU has FP4 tensor cores) NVFP4,
   each format through the kernels `pipeline.runtime.dispatch` picks for this GPU, at batch 1 and 16:
   eager and CUDA-graph milliseconds per pass against its floor: the larger of the byte model's HBM time
   (peak bandwidth from configs/targets, and the measured device copy bandwidth) and its matmuls' time at
   the dense tensor-core peak (`dispatch.compute_ms`: 16 canvases are bound by compute on Hopper); with
   diagnostics: where the time went (profiler), one layer's experts and attention on each kernel that
   can run them, its FP8 sibling linears as one GEMM and apart, and each of the network's one-kernel
   chains against its torch form (`gpu_network`);
4. the largest batch whose pass fits in GPU memory (doubling from 16, fastest format).

Needs torch with CUDA, nvcc (and ninja) for the kernels, pytest for the tests; nothing is downloaded.
`--dry-run` lists every check with the reason it would be skipped here, and runs nothing.
Results: `gpu.json` and `gpu.md` (one table) in `--out`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.atomic import atomic_write_text
from pipeline.bench.gpu_network import render_network, render_siblings
from pipeline.bench.results import save_result
from pipeline.errors import error_line
from pipeline.runtime.dispatch import arch_of
from pipeline.targets import precision

RESULT_FILE, TABLE_FILE = "gpu.json", "gpu.md"
LOG_LINES = 200
TOTAL_BUDGET_S = 480  # the whole command, checks and their subprocess start-up included
CONFIG = "diffusiongemma-26b-a4b"
PASS_BATCHES = (1, 16)
CONTEXT = 256  # cached prompt tokens under each measured pass
BF16_NEEDS_GIB = 64  # 26B bf16 weights (~51 GB) plus batch-16 logits and activations
FP4_ARCHS = tuple(precision("nvfp4").native_on)  # GPUs with FP4 tensor cores (configs/precisions)
FP8_ARCHS = tuple(precision("fp8").native_on)


@dataclass(frozen=True)
class GpuCheck:
    name: str
    budget_s: int
    what: str
    argv: tuple[str, ...]  # run as `python <argv...>` from the repository root
    needs: tuple[str, ...]  # "cuda", "nvcc", "ninja", "pytest", "fp8", "fp4", "memory"


def _pass(fmt: str, compiled: bool = False) -> GpuCheck:
    needs = ("cuda", "memory") + {"bf16": (), "fp8": ("fp8",), "nvfp4": ("fp4",)}[fmt]
    batches = ",".join(map(str, PASS_BATCHES))
    if compiled:
        return GpuCheck(
            f"26B pass {fmt} compiled", 135, f"the {fmt} pass under torch.compile (inductor), batch {batches}: compile s, ms vs floor",
            ("-m", "pipeline.bench.gpu", "pass", fmt, "--compile"), needs,
        )  # fmt: skip
    return GpuCheck(
        # each probes and compiles the network's Triton kernels (RoPE, softcap, combine, gated GeLU, residual
        # sum, router input, FFN inputs, layer end, K/V concatenation: cached per host, so the first format
        # pays); FP8 also the Triton MoE GEMM per tile configuration; bf16 compiles that GEMM with bf16
        # operands for its experts' diagnostic and times each network kernel against its torch form
        f"26B pass {fmt}", {"nvfp4": 25, "fp8": 60}.get(fmt, 60), f"26B-A4B random {fmt} weights, batch {batches}: ms vs floor",
        ("-m", "pipeline.bench.gpu", "pass", fmt), needs,
    )  # fmt: skip


CHECKS: tuple[GpuCheck, ...] = (
    GpuCheck(
        "build sampler kernels",
        45,
        "nvcc build of the fused sampler (torch extension)",
        ("-c", "from pipeline.sampler.kernels.build import load_torch_extension as b; b()"),
        ("cuda", "nvcc", "ninja"),
    ),
    GpuCheck(
        # 78 s on the H200 before the Triton GEMM and network kernels' tests (each compiles its kernels);
        # how they run: `gpu_test_args`
        "gpu tests",
        130,
        "tests/gpu: kernels vs PyTorch oracle, CUDA graph vs eager, scaled GEMMs vs reference",
        ("-m", "pipeline.bench.gpu", "tests"),
        ("cuda", "pytest"),
    ),
    _pass("bf16"),
    _pass("fp8"),
    _pass("nvfp4"),
    _pass("fp8", compiled=True),
    GpuCheck(
        "largest batch",
        25,  # 15 s on the H200
        "largest batch whose pass fits, doubling from 16 (fastest format here)",
        ("-m", "pipeline.bench.gpu", "largest"),
        ("cuda", "memory"),
    ),
)
assert sum(c.budget_s for c in CHECKS) <= TOTAL_BUDGET_S

# The GPU tests compile their Triton kernels, on one CPU core per process: spread over this many processes
# (pytest-xdist, where installed; the GPU hosts have 16 cores). No test depends on another's state.
GPU_TEST_WORKERS = 4


def gpu_test_args() -> list[str]:
    """pytest's arguments for tests/gpu: each test's outcome as it ends (a run killed at its budget still
    says how far it got), the ten slowest (for the next budget), and the tests spread over
    `GPU_TEST_WORKERS` processes where pytest-xdist is installed."""
    args = ["-v", "-rfEs", "--tb=short", "--durations=10", "-p", "no:cacheprovider", "tests/gpu"]
    return args + (["-n", str(GPU_TEST_WORKERS), "--dist", "load"] if _has("xdist") else [])


@dataclass
class Env:
    cuda: bool
    gpu: str = ""
    arch: str | None = None
    memory_gib: float = 0.0
    driver: str = ""
    torch: str = ""
    cuda_version: str | None = None
    nvcc: bool = False
    ninja: bool = False
    pytest: bool = False


def detect_env() -> Env:
    from pipeline.sampler.kernels.build import find_nvcc

    tools = {"nvcc": find_nvcc() is not None, "ninja": shutil.which("ninja") is not None or _has("ninja"),
             "pytest": _has("pytest")}  # fmt: skip
    versions = {"torch": torch.__version__, "cuda_version": torch.version.cuda}
    if not torch.cuda.is_available():
        return Env(cuda=False, **versions, **tools)
    p = torch.cuda.get_device_properties(0)
    return Env(
        True, p.name, arch_of(p.major, p.minor), p.total_memory / 2**30, _driver(), **versions, **tools
    )


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _driver() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def skip_reason(check: GpuCheck, env: Env) -> str | None:
    """Why `check` cannot run here (None: it runs)."""
    if "cuda" in check.needs and not env.cuda:
        return f"no CUDA GPU visible (torch {env.torch}, CUDA build {env.cuda_version or 'none'})"
    for tool, hint in (
        ("nvcc", "install the CUDA toolkit"),
        ("ninja", "pip install ninja"),
        ("pytest", "pip install pytest"),
    ):
        if tool in check.needs and not getattr(env, tool):
            return f"{tool} not found ({hint})"  # fmt: skip
    if "fp8" in check.needs and env.arch not in FP8_ARCHS:
        return f"{env.arch or 'this GPU'} has no FP8 tensor cores (sm89+)"
    if "fp4" in check.needs and env.arch not in FP4_ARCHS:
        return f"{env.arch or 'this GPU'} has no FP4 tensor cores (sm100/sm120); the NVFP4 fallback is timed by the fp8 row"
    if "memory" in check.needs and env.memory_gib < BF16_NEEDS_GIB:
        return f"{env.memory_gib:.0f} GiB GPU memory < {BF16_NEEDS_GIB} GiB the 26B random-weight pass needs"
    return None


@dataclass
class CheckResult:
    name: str
    what: str
    budget_s: int
    status: str  # passed | failed | timeout | skipped
    seconds: float = 0.0
    detail: str = ""  # skip reason, or the output's last lines
    log: str = ""  # the output's last LOG_LINES lines, for diagnosing a failure from the JSON alone
    rows: list[dict] = field(default_factory=list)  # pass measurements


def plan(env: Env) -> list[CheckResult]:
    """Every check and whether it would run here (the dry run)."""
    return [
        CheckResult(c.name, c.what, c.budget_s, "skipped" if (r := skip_reason(c, env)) else "would run", detail=r or "")
        for c in CHECKS
    ]  # fmt: skip


def _run(check: GpuCheck, repo: Path, scratch: Path, budget_s: int | None = None) -> CheckResult:
    """Run `check` under `budget_s` seconds (default: its own budget)."""
    budget_s = budget_s or check.budget_s
    res = CheckResult(check.name, check.what, budget_s, "passed")
    rows_file = scratch / f"{check.name.replace(' ', '_')}.json"
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DGPIPE_GPU_ROWS=str(rows_file), PYTHONUNBUFFERED="1")  # fmt: skip
    t0 = time.monotonic()
    try:
        # one stream: a check killed at its budget keeps its warnings and tracebacks too
        out = subprocess.run([sys.executable, *check.argv], cwd=repo, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=budget_s)  # fmt: skip
        text = out.stdout
        res.status = "passed" if out.returncode == 0 else "failed"
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        res.status = "timeout"
    res.seconds = time.monotonic() - t0
    lines = text.strip().splitlines()
    res.detail, res.log = "\n".join(lines[-15:]), "\n".join(lines[-LOG_LINES:])
    if rows_file.is_file():
        res.rows = json.loads(rows_file.read_text())
    return res


def run_bench_gpu(
    out: Path,
    dry_run: bool = False,
    repo: Path | None = None,
    on_check: Callable[[CheckResult], None] | None = None,
) -> dict:
    """Run (or, `dry_run`, list) the checks; write out/gpu.json and out/gpu.md after every check (a host
    that goes away mid-run still leaves the checks done so far); return the result. `on_check` is told
    each check's result as it finishes."""
    env = detect_env()
    repo = repo or Path(__file__).resolve().parents[2]
    result = {"env": asdict(env), "dry_run": dry_run, "budget_s": TOTAL_BUDGET_S, "checks": []}

    def record(r: CheckResult) -> None:
        result["checks"].append(asdict(r))
        save_result(out, RESULT_FILE, result)
        atomic_write_text(out / TABLE_FILE, render(result) + "\n")
        if on_check:
            on_check(r)

    if dry_run:
        for r in plan(env):
            record(r)
        return result
    # what the skipped checks and the checks that finished early leave, handed on to the next one to run:
    # every check's elapsed time stays within the budgets' sum
    spare = float(sum(c.budget_s for c in CHECKS if skip_reason(c, env)))
    with tempfile.TemporaryDirectory(prefix="dgpipe-gpu-") as scratch:
        for c in CHECKS:
            if reason := skip_reason(c, env):
                record(CheckResult(c.name, c.what, c.budget_s, "skipped", detail=reason))
                continue
            r = _run(c, repo, Path(scratch), c.budget_s + int(spare))
            spare = max(0.0, r.budget_s - r.seconds)
            record(r)
    return result


def render(result: dict) -> str:
    """One markdown table: every check, and below it one line per measured pass."""
    e = result["env"]
    head = (f"GPU: {e['gpu'] or 'none'} ({e['arch'] or '-'}, {e['memory_gib']:.0f} GiB), driver {e['driver'] or '-'}, "
            f"torch {e['torch']} (CUDA {e['cuda_version'] or 'none'}){' — dry run' if result['dry_run'] else ''}")  # fmt: skip
    lines = [head, "", "| check | status | s / budget | detail |", "|---|---|---:|---|"]
    for c in result["checks"]:
        detail = c["detail"].splitlines()[-1] if c["detail"] else ""
        lines.append(
            f"| {c['name']} | {c['status']} | {c['seconds']:.0f} / {c['budget_s']} | {detail.replace('|', '/')} |"
        )
    rows = [r for c in result["checks"] for r in c["rows"] if "ms_eager" in r]
    for r in (r for c in result["checks"] for r in c["rows"] if "largest_batch" in r):
        lines += [
            "",
            f"Largest batch whose {r['format']} pass fits: {r['largest_batch']} (tried up to {r['tried_up_to']}).",
        ]
    if rows:
        lines += ["", "| format | batch | kernels | ms eager | ms graph | floor ms (HBM, spec) | floor ms (matmuls, "
                  "spec) | x floor | floor ms (copy bw) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in rows:
            compute = r.get("compute_ms_spec")
            lines.append(
                f"| {r['format']} | {r['batch']} | {r['kernels']} | {r['ms_eager']:.2f} | {r['ms_graph']:.2f} "
                f"| {r['floor_ms_spec']:.2f} | {'—' if compute is None else f'{compute:.2f}'} "
                f"| {_best_ms(r) / max(r['floor_ms_spec'], compute or 0.0):.2f} | {r['floor_ms_copy']:.2f} |"
            )
    experts = [(r["batch"], r["experts"]) for r in rows if "experts" in r]
    if experts:
        lines += ["", "| one layer's FP8 experts | batch | rows per expert | ms FP8 module | ms torch grouped GEMMs "
                  "(fast / promoted accumulation) | fast vs promoted (rel L2) | ms Triton GEMMs (own M tile / 64) | Triton vs torch "
                  "(rel L2) | ms bf16 grouped (dequantized) | ms dequantize | bf16 vs FP8 (rel L2) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        why = lambda x, key: f"— | {_error_cell(x, key)}"
        for b, x in experts:
            torch_gemms = (f"{x['ms_fp8_gemms']:.2f} / {x['ms_fp8_gemms_exact_accum']:.2f} | {x['rel_l2_fast_vs_exact_accum']:.1e}"
                           if "ms_fp8_gemms" in x else why(x, "torch_error"))  # fmt: skip
            triton = (f"{x['ms_triton_gemms']:.2f} / {x['ms_triton_gemms_m64']:.2f} | {x.get('rel_l2_triton_vs_torch', float('nan')):.1e}"
                      if "ms_triton_gemms" in x else why(x, "triton_error"))  # fmt: skip
            lines.append(f"| layer 0 | {b} | {x['rows_per_expert']:.0f} | {x['ms_fp8_module']:.2f} "
                         f"| {torch_gemms} | {triton} | {x['ms_bf16_grouped']:.2f} "
                         f"| {x['ms_dequantize']:.2f} | {x['rel_l2_bf16_vs_fp8']:.3f} |")  # fmt: skip
    attention = [(r["batch"], a) for r in rows for a in r.get("attention", [])]
    if attention:
        lines += ["", "| attention | batch | heads q/kv x dim | keys | kernels torch may pick (grouped) | ms grouped "
                  "| ms K/V expanded | ms queries packed |", "|---|---:|---|---:|---|---:|---:|---:|"]  # fmt: skip
        for b, a in attention:
            picks = ", ".join(k for k in ("flash", "efficient", "cudnn") if a[k]) or "math only"
            packed = f"{a['ms_packed']:.2f}" if "ms_packed" in a else "—"  # runs from before the packed form
            lines.append(f"| {a['kind']} | {b} | {a['q_heads']}/{a['kv_heads']} x {a['head_dim']} | {a['keys']} "
                         f"| {picks} | {a['ms_grouped']:.2f} | {a['ms_expanded']:.2f} | {packed} |")  # fmt: skip
    lines += render_siblings([s for r in rows for s in r.get("siblings", [])])
    lines += render_network([n for r in rows for n in r.get("network", [])])
    bf16 = [(r["batch"], r["bf16_experts"]) for r in rows if "bf16_experts" in r]
    if bf16:
        lines += ["", "| one layer's bf16 experts | batch | rows per expert | ms torch F.grouped_mm | ms Triton MoE GEMM "
                  "| Triton vs torch (rel L2) |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        ms = lambda x, k: f"{x[f'ms_{k}']:.2f}" if f"ms_{k}" in x else f"— {_error_cell(x, f'{k}_error')}"
        for b, x in bf16:
            lines.append(f"| layer 0 | {b} | {x['rows_per_expert']:.0f} | {ms(x, 'torch')} | {ms(x, 'triton')} "
                         f"| {x.get('rel_l2_triton_vs_torch', float('nan')):.1e} |")  # fmt: skip
    return "\n".join(lines)


def _error_cell(x: dict, key: str) -> str:
    """A diagnostic's error for a markdown cell: no column separators, 80 characters at most."""
    return str(x.get(key)).replace("|", "/")[:80]


def _best_ms(row: dict) -> float:
    """The pass time set against the floor: the CUDA-graph time, or eager where the graph did not run."""
    return row["ms_graph"] if row["ms_graph"] == row["ms_graph"] else row["ms_eager"]


# ---- the measurements, run in the check subprocesses ------------------------------------------------------
def _kernels_here(dev: torch.device, arch: str):
    """The load-time probe on a GPU; off one (this module's own tests), the vendor kernels' CPU stand-ins
    count as run and dgpipe's Triton kernels as failed with the reason they cannot run here."""
    from pipeline.runtime import kernels
    from pipeline.runtime.probe import NETWORK_FORMS, Probe, probe, probe_plan

    if dev.type == "cuda":
        return probe(dev)
    why = kernels.moe.unavailable(dev)
    triton_kinds = {"triton", *(kind for kind, _, _ in NETWORK_FORMS)}  # dgpipe's own kernels
    plan = probe_plan(arch)
    return Probe(arch, {f"{kind}:{mode}": why if kind in triton_kinds else None for kind, mode, _ in plan})


def quantize_random(model, fmt: str, probed=None, seed: int | None = 0) -> str:
    """Swap a random bf16 model's linears and experts for tensor-core modules with random `fmt` weights,
    following the dispatch row of this GPU; returns the kernels used. `probed`: the probe's results (default:
    probe this GPU); `seed`: None draws without a seeded generator (fake tensors have none)."""
    from pipeline.runtime.dispatch import dispatch
    from pipeline.runtime.gpu_load import experts_plan, one_pass
    from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear, kernel_mode, random_packed

    dev = next(model.parameters()).device
    row = dispatch(fmt, arch_of(*torch.cuda.get_device_capability(dev)))
    # as the runtime loads: what failed its probe takes its fallback
    pr = probed if probed is not None else _kernels_here(dev, row.arch)
    lin = kernel_mode(row.linears)
    lin = lin if lin and pr.ok(f"linear:{lin}") else None
    exp, triton_rows, fell_back = experts_plan(row, pr)
    lin_one_pass, exp_one_pass = one_pass(lin, pr), one_pass(exp, pr)
    kernels = f"{row.linears} / {row.experts}" + (f" ({fell_back})" if fell_back else "")
    gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
    for layer in model.layers:
        if lin:
            for parent in (layer.self_attn, layer.mlp):
                linears = [(n, m) for n, m in parent.named_children() if isinstance(m, torch.nn.Linear)]
                for i, (name, m) in enumerate(linears):
                    q = random_packed(fmt, m.out_features, m.in_features, dev, gen, weight_scale=1 + i / 16)
                    setattr(parent, name, ScaledLinear(q, lin, dev, torch.bfloat16, lin_one_pass))
        if exp:
            e, two_i, d = layer.experts.gate_up_proj.shape
            mk = lambda n, k, e=e: [random_packed(fmt, n, k, dev, gen) for _ in range(e)]
            layer.experts = ScaledExperts(
                mk(two_i // 2, d), mk(two_i // 2, d), mk(d, two_i // 2), exp, dev, triton_rows,
                one_pass=exp_one_pass,
            )  # fmt: skip
        torch.cuda.empty_cache()
    return kernels


def spec_gpu(device_name: str, arch: str):
    """The configs/targets GPU entry this device is (its bandwidth is the floor's): by product name
    ("NVIDIA H200" -> H200-SXM-141GB), else the arch's first GPU."""
    from pipeline.targets import target

    gpus = target(arch).gpus
    return next((g for g in gpus if g.product.split("-")[0].lower() in device_name.lower()), gpus[0])


def _pass_setup(model, batch: int):
    from pipeline.model.network import canvas_positions
    from pipeline.runtime.kv_cache import KVCache, attention_masks

    cfg, dev, length = model.cfg, next(model.parameters()).device, model.config.canvas_length
    cache = KVCache(cfg, batch, CONTEXT + length + 8, torch.bfloat16, dev, room=length)
    slots = torch.arange(batch, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (batch, CONTEXT), device=dev, generator=gen)
    pos = canvas_positions(cache.lengths[slots], CONTEXT)
    ones = torch.ones_like(pos, dtype=torch.bool)
    with torch.inference_mode():
        cache.write(
            slots,
            model.encode_kv(prompt, pos, attention_masks(pos, ones, None, True, cache.window)),
            pos,
            ones,
        )
    canvas = torch.randint(0, cfg.vocab_size, (batch, length), device=dev, generator=gen)
    past, meta = cache.read(slots, room=length)  # as the runtime's denoise rounds read it
    cpos = canvas_positions(cache.lengths[slots], length)
    masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, cache.window)
    soft = model.soft_embedding(
        torch.softmax(torch.randn(batch, length, cfg.vocab_size, device=dev, generator=gen), -1)
    )
    return lambda: model.denoise_soft(canvas, soft, cpos, masks, past)


def measure_pass(
    fmt: str,
    batches: tuple[int, ...] = PASS_BATCHES,
    repeats: int = 5,
    sink: Callable[[list[dict]], None] = print,
    compiled: bool = False,
    config: str = CONFIG,
    device: torch.device | None = None,
) -> list[dict]:
    """ms per denoise pass (eager and CUDA graph) of the 26B random-weight model in `fmt`, per batch; `sink`
    gets the rows so far after each batch (a check killed at its budget keeps the batches it finished).
    `compiled`: the pass under torch.compile as `dgpipe serve --compile` runs it (its decoder layers: one
    static-shape compile per layer kind and batch, the first call's seconds reported). `config`, `device`:
    another model configuration and device, for testing this function itself off a GPU."""
    from pipeline.bench.gpu_network import network_paths, sibling_paths
    from pipeline.bench.model import _graphed, copy_bandwidth, random_model
    from pipeline.bench.timing import median_seconds
    from pipeline.model.config import ModelConfig
    from pipeline.resources import load_yaml
    from pipeline.runtime.compiled import compile_model
    from pipeline.runtime.dispatch import compute_ms, dispatch, experts_touched, floor_ms, pass_bytes
    from pipeline.runtime.gpu_load import finish_on_device

    dev = device or torch.device("cuda")
    mcfg = ModelConfig.from_dict(load_yaml("models", config), source=config)
    model = random_model(mcfg, torch.bfloat16, dev)
    kernels = quantize_random(model, fmt) if fmt != "bf16" else "F.linear bf16 / F.grouped_mm bf16"
    # as the runtime loads it: float experts that would read the routing on the host route on the device,
    # RoPE in one kernel where probed
    routed = finish_on_device(model, dev, None, None)
    if routed is not None:
        kernels += f" ({routed.summary()})"
    # every batch's prompt prefilled first, eagerly: compiled, the prefill would compile layer graphs of its
    # own (causal, no past) that the measured denoise pass never runs
    with torch.inference_mode():
        passes = {b: _pass_setup(model, b) for b in batches}
    if compiled:
        compile_model(model, dynamic=False)  # one static graph per measured batch
    arch = arch_of(*torch.cuda.get_device_capability(dev))
    row = dispatch(fmt, arch)
    bw = copy_bandwidth(dev, 2.0)
    spec = spec_gpu(torch.cuda.get_device_name(dev), arch)
    rows = []
    for b in batches:
        with torch.inference_mode():
            fn = passes.pop(b)
            t0 = time.perf_counter()
            finite = bool(torch.isfinite(fn()).all())  # a pass that makes NaNs measures nothing real
            first_s = time.perf_counter() - t0
            eager = median_seconds(fn, dev, repeats)
            try:
                graph, graph_error = median_seconds(_graphed(fn, dev), dev, repeats), None
            except Exception as e:  # reported in the row; the eager time still stands
                graph, graph_error = float("nan"), error_line(e)
            touched = None if compiled else routed_experts(model, fn)  # (hooks would recompile)
        nbytes = pass_bytes(
            mcfg.text_config, row.linear_read, row.expert_read, b, mcfg.canvas_length, CONTEXT
        ).total
        rows.append({"format": fmt + (" compiled" if compiled else ""), "batch": b, "kernels": kernels,
                     "ms_eager": eager * 1e3, "ms_graph": graph * 1e3, "first_call_s": first_s, "finite": finite,
                     "pass_gb": nbytes / 1e9, "floor_ms_spec": floor_ms(nbytes, spec.product),
                     "spec_gpu": spec.product, "floor_ms_copy": nbytes / bw * 1e3, "copy_gb_s": bw / 1e9,
                     "compute_ms_spec": compute_ms(mcfg.text_config, row, b, spec.product, mcfg.canvas_length, CONTEXT),
                     "experts_touched": touched,
                     "experts_touched_uniform": experts_touched(mcfg.text_config, b * mcfg.canvas_length),
                     "graph_error": graph_error, "top_kernels": top_kernels(fn), "top_ops": top_ops(fn)})  # fmt: skip
        if fmt == "fp8" and not compiled:
            try:
                rows[-1]["experts"] = expert_paths(model.layers[0].experts, mcfg.text_config.top_k_experts,
                                                   b * mcfg.canvas_length, dev)  # fmt: skip
            except Exception as e:
                rows[-1]["experts_error"] = error_line(e)
            rows[-1]["siblings"] = sibling_paths(model, b * mcfg.canvas_length, dev)
        if fmt == "bf16" and not compiled:  # attention is bf16 in every format: once is enough
            try:
                rows[-1]["attention"] = attention_backends(model.cfg, b, mcfg.canvas_length, dev)
            except Exception as e:  # a diagnostic that cannot run here costs itself, not the pass's row
                rows[-1]["attention_error"] = error_line(e)
            try:
                rows[-1]["network"] = network_paths(model.cfg, b, mcfg.canvas_length, CONTEXT, dev)
            except Exception as e:
                rows[-1]["network_error"] = error_line(e)
            try:
                rows[-1]["bf16_experts"] = bf16_expert_paths(model.layers[0].experts, mcfg.text_config.top_k_experts,
                                                             b * mcfg.canvas_length, dev)  # fmt: skip
            except Exception as e:
                rows[-1]["bf16_experts_error"] = error_line(e)
        sink(rows)
        torch.cuda.empty_cache()
    return rows


def attention_backends(cfg, batch: int, canvas: int, dev: torch.device, repeats: int = 5) -> list[dict]:
    """Per attention shape of the model (sliding, global) at this batch over CONTEXT cached keys plus the
    canvas: which SDPA kernels torch may pick for the grouped (fewer K/V heads) form, and why not (torch's
    own reasons, from `debug=True`); the ms of that form, of the same attention with K/V expanded to every
    query head (the copy not timed), and with the queries packed along the K/V heads (`network.attend_packed`,
    what the network runs where `network.packs_queries`; its copies of q and the output timed), with the
    largest difference of the other two outputs from the grouped one (all three compute the same attention).
    q is laid out as attention makes it, transposed from [B, Q, H, D]."""
    from torch.backends.cuda import (
        SDPAParams,
        can_use_cudnn_attention,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    from pipeline.bench.timing import median_seconds
    from pipeline.model.network import attend_packed

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    gen = torch.Generator(device=dev).manual_seed(2)
    for kind in dict.fromkeys(cfg.layer_types):
        shape = cfg.layer_shape(cfg.layer_types.index(kind))
        heads, kv, hd = cfg.num_attention_heads, shape.num_kv_heads, shape.head_dim
        keys = (min(CONTEXT, cfg.sliding_window - 1) if kind == "sliding_attention" else CONTEXT) + canvas
        q, k, v = (torch.randn(batch, n, h, hd, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                   for h, n in ((heads, canvas), (kv, keys), (kv, keys)))  # fmt: skip
        k, v = k.contiguous(), v.contiguous()  # as the K/V concatenation writes them
        params = SDPAParams(q, k, v, None, 0.0, False, kv != heads)
        eligible, why = {}, []
        for name, can in (("flash", can_use_flash_attention), ("efficient", can_use_efficient_attention),
                          ("cudnn", can_use_cudnn_attention)):  # fmt: skip
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                eligible[name] = bool(can(params, True))
            why += [f"{name}: {str(w.message).splitlines()[0][:160]}" for w in seen if not eligible[name]]
        grouped = lambda q=q, k=k, v=v, g=kv != heads, sdpa=sdpa: sdpa(q, k, v, scale=1.0, enable_gqa=g)
        ke, ve = (t.repeat_interleave(heads // kv, dim=1) for t in (k, v))
        expanded = lambda q=q, ke=ke, ve=ve, sdpa=sdpa: sdpa(q, ke, ve, scale=1.0)
        packed = lambda q=q, k=k, v=v: attend_packed(q, k, v, None)
        forms = {"grouped": grouped, "expanded": expanded, "packed": packed}
        with torch.inference_mode():
            want = grouped().float()
            diff = {n: float((f().float() - want).abs().max()) for n, f in forms.items() if n != "grouped"}
            ms = {n: median_seconds(f, dev, repeats) * 1e3 for n, f in forms.items()}
        rows.append({"kind": kind, "q_heads": heads, "kv_heads": kv, "head_dim": hd, "keys": keys, **eligible,
                     "why_not": why, **{f"ms_{n}": t for n, t in ms.items()}, "max_abs_diff": diff["expanded"],
                     "max_abs_diff_packed": diff["packed"]})  # fmt: skip
    return rows


def expert_paths(experts, top_k: int, tokens: int, dev: torch.device, repeats: int = 5) -> dict:
    """One layer's FP8 experts (`ScaledExperts`, mode "fp8") on `tokens` tokens routed uniformly at random:
    ms of the module as the pass runs it; of its two grouped GEMMs alone, token-row gather included, on
    torch's kernel (with the fast accumulation the module uses, and with promoted fp32 accumulation) and on
    `kernels.moe`'s kernel (which gathers in the kernel); of the same experts dequantized to bf16 through
    `F.grouped_mm` (`network.grouped_experts`, weights dequantized beforehand) and of that dequantization.
    Distances (relative L2): bf16 against FP8 (the FP8 activations' rounding), fast against promoted
    accumulation, Triton against torch. Which kernel should take which batch: on an H200 torch's kernel ran
    at 44% of HBM at one canvas and, with promoted accumulation, at 9% of the FP8 rate at 16."""
    from pipeline.bench.timing import median_seconds
    from pipeline.model import scaled_layout as sl
    from pipeline.model.network import grouped_experts
    from pipeline.runtime import kernels
    from pipeline.runtime.tensor_cores import grouped_gemm, quantize_rows

    if experts.mode != "fp8":
        raise ValueError(f"expert paths time FP8 experts, not {experts.mode!r}")
    gen = torch.Generator(device=dev).manual_seed(3)
    num, d = experts.num_experts, experts.w13.shape[-1]
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16, generator=gen)
    scores = torch.rand(tokens, num, device=dev, generator=gen)
    weights, index = scores.topk(top_k, dim=-1)
    weights = weights.softmax(-1)
    dequantize = lambda: ((experts.w13.float() * experts.s13[..., None]).bfloat16(),
                          (experts.w2.float() * experts.s2[..., None]).bfloat16())  # fmt: skip
    _, token_of, offs, _ = sl.expert_order(index, num)
    q, qs = quantize_rows(x, experts.in_scale, "fp8")
    inner = experts.w2.shape[-1]
    h = torch.randn(token_of.shape[0], inner, device=dev, dtype=torch.bfloat16, generator=gen)
    q2, qs2 = quantize_rows(h, experts.down_in_scale, "fp8")

    gate_up = (experts.w13, experts.s13, None, experts.in_scale, offs, "fp8")
    down = (experts.w2, experts.s2, None, experts.down_in_scale, offs, "fp8")

    def gemms(fast_accum: bool = True) -> torch.Tensor:
        grouped_gemm(q[token_of], qs[token_of], *gate_up, fast_accum)
        return grouped_gemm(q2, qs2, *down, fast_accum)

    def triton_gemms(block_m: int | None = None) -> torch.Tensor:  # the token gather inside the kernel
        kernels.moe.moe_gemm(q, qs, token_of, experts.w13, experts.s13, offs, block_m)
        return kernels.moe.moe_gemm(q2, qs2, None, experts.w2, experts.s2, offs, block_m)

    rel = lambda a, b: float((a - b).norm() / b.norm().clamp(min=1e-30))
    with torch.inference_mode():
        w13, w2 = dequantize()
        fp8_out, bf16_out = (
            experts(x, index, weights).float(),
            grouped_experts(x, index, weights, w13, w2).float(),
        )
        paths = [("fp8_module", lambda: experts(x, index, weights)),
                 ("bf16_grouped", lambda: grouped_experts(x, index, weights, w13, w2)), ("dequantize", dequantize)]  # fmt: skip
        extra: dict = {"rel_l2_bf16_vs_fp8": rel(bf16_out, fp8_out), "torch_error": None}
        try:  # torch's grouped FP8 GEMM exists on sm90 only (the dispatch table)
            fast = gemms(True).float()
            extra["rel_l2_fast_vs_exact_accum"] = rel(fast, gemms(False).float())
            paths += [("fp8_gemms", gemms), ("fp8_gemms_exact_accum", lambda: gemms(False))]
        except Exception as e:  # its own field says why; the other paths still run
            fast, extra["torch_error"] = None, error_line(e)
        extra["triton_error"] = kernels.moe.unavailable(dev)
        if extra["triton_error"] is None:
            try:
                out = triton_gemms().float()
                if fast is not None:
                    extra["rel_l2_triton_vs_torch"] = rel(out, fast)
                # its own M tile, and 64 rows (Hopper's FP8 warpgroup MMA) where it picks a smaller one
                paths += [("triton_gemms", triton_gemms), ("triton_gemms_m64", lambda: triton_gemms(64))]
            except Exception as e:  # its own field says why; the other paths still run
                extra["triton_error"] = error_line(e)
        ms = {name: median_seconds(fn, dev, repeats) * 1e3 for name, fn in paths}
    return {"tokens": tokens, "rows_per_expert": tokens * top_k / num, **{f"ms_{k}": v for k, v in ms.items()}, **extra}  # fmt: skip


def bf16_expert_paths(experts, top_k: int, tokens: int, dev: torch.device, repeats: int = 5) -> dict:
    """One layer's bf16 experts on `tokens` tokens routed uniformly at random, as torch's `F.grouped_mm`
    runs them (`network.grouped_experts`; on sm89/sm120 its per-expert fallback) and as dgpipe's Triton MoE
    GEMM does (`pipeline.runtime.routed`, what Ada and RTX Blackwell load): ms of each and their distance.
    On a GPU where both run (Hopper, B200), the measure of the Triton kernel against CUTLASS's."""
    from pipeline.bench.timing import median_seconds
    from pipeline.model.network import grouped_experts
    from pipeline.runtime import kernels, routed

    gen = torch.Generator(device=dev).manual_seed(4)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    x = torch.randn(tokens, gate_up.shape[-1], device=dev, dtype=torch.bfloat16, generator=gen)
    weights, index = torch.rand(tokens, gate_up.shape[0], device=dev, generator=gen).topk(top_k, dim=-1)
    weights = weights.softmax(-1)
    out: dict = {"tokens": tokens, "rows_per_expert": tokens * top_k / gate_up.shape[0],
                 "triton_error": kernels.moe.unavailable(dev)}  # fmt: skip
    paths = {"torch": lambda: grouped_experts(x, index, weights, gate_up, down)}
    if out["triton_error"] is None:
        paths["triton"] = lambda: routed.routed_experts(x, index, weights, gate_up, down, triton=True)
    with torch.inference_mode():
        results = {}
        for name, fn in list(paths.items()):
            try:
                results[name] = fn().float()
            except Exception as e:  # its own field says why; the other path still runs
                out[f"{name}_error"] = error_line(e)
                del paths[name]
        if len(results) == 2:
            want = results["torch"]
            out["rel_l2_triton_vs_torch"] = float(
                (results["triton"] - want).norm() / want.norm().clamp(min=1e-30)
            )
        out.update({f"ms_{name}": median_seconds(fn, dev, repeats) * 1e3 for name, fn in paths.items()})
    return out


def routed_experts(model, fn) -> float:
    """Mean distinct experts a layer's routing touches in one pass (the byte model assumes uniform routing;
    a random-weight model that routed every token to a few experts would read far fewer bytes)."""
    seen: list[torch.Tensor] = []
    # the experts module's (x, index, weights): what every layer's routing chose, whichever kernels routed
    hooks = [
        layer.experts.register_forward_pre_hook(lambda m, a: seen.append(a[1])) for layer in model.layers
    ]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    n = model.cfg.num_experts
    counts = [int((torch.bincount(idx.reshape(-1), minlength=n) > 0).sum()) for idx in seen]
    return sum(counts) / max(len(counts), 1)


def top_ops(fn, n: int = 15) -> list[dict]:
    """Device time per aten op in one eager pass (the ops that launched the kernels `top_kernels` lists)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with (
            torch.inference_mode(),
            profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        ):
            fn()
            torch.cuda.synchronize()
    except Exception as e:
        return [{"op": f"(profiler failed: {type(e).__name__}: {e})"[:200], "ms": 0.0, "calls": 0}]
    dev_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
    ops = sorted((e for e in prof.key_averages() if e.key.startswith(("aten::", "dgpipe::")) and dev_us(e) > 0),
                 key=dev_us, reverse=True)  # fmt: skip
    return [{"op": e.key, "ms": dev_us(e) / 1e3, "calls": e.count} for e in ops[:n]]


def top_kernels(fn, n: int = 12) -> list[dict]:
    """Where one eager pass spends its GPU time: the `n` kernels with the most device time (torch profiler),
    ms per pass each, and the share of all kernel time; the first place to look when a pass misses its floor."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # a profiler that cannot run here costs the breakdown, not the timings
        return [
            {
                "kernel": f"(profiler failed: {type(e).__name__}: {e})"[:200],
                "ms": 0.0,
                "calls": 0,
                "share": 0.0,
            }
        ]
    kernel_us = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
    events = sorted((e for e in prof.key_averages() if kernel_us(e) > 0), key=kernel_us, reverse=True)
    total = sum(kernel_us(e) for e in events) or 1.0
    rows = [{"kernel": e.key[:90], "ms": kernel_us(e) / 1e3, "calls": e.count, "share": kernel_us(e) / total}
            for e in events[:n]]  # fmt: skip
    return [
        {"kernel": "(all kernels)", "ms": total / 1e3, "calls": sum(e.count for e in events), "share": 1.0},
        *rows,
    ]


def largest_batch(start: int = 16, limit: int = 1024) -> list[dict]:
    """Double the batch from `start` until a pass runs out of GPU memory; fastest format on this GPU."""
    from pipeline.bench.model import random_model
    from pipeline.model.config import ModelConfig
    from pipeline.resources import load_yaml

    dev = torch.device("cuda")
    arch = arch_of(*torch.cuda.get_device_capability(dev))
    fmt = "nvfp4" if arch in FP4_ARCHS else "fp8" if arch in FP8_ARCHS else "bf16"
    mcfg = ModelConfig.from_dict(load_yaml("models", CONFIG), source=CONFIG)
    model = random_model(mcfg, torch.bfloat16, dev)
    if fmt != "bf16":
        quantize_random(model, fmt)
    fits, b = 0, start
    while b <= limit:
        try:
            with torch.inference_mode():
                _pass_setup(model, b)()
            torch.cuda.synchronize()
            fits = b
        except torch.OutOfMemoryError:
            break
        finally:
            torch.cuda.empty_cache()
        b *= 2
    return [{"format": fmt, "largest_batch": fits, "tried_up_to": min(b, limit)}]


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.bench.gpu pass <fmt>` / `largest`: one measurement, rows to $DGPIPE_GPU_ROWS;
    `tests`: tests/gpu (pytest's exit status)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["tests"]:
        import pytest

        return int(pytest.main(gpu_test_args()))
    out = os.environ.get("DGPIPE_GPU_ROWS")

    def sink(rows: list[dict]) -> None:
        text = json.dumps(rows, indent=2)
        if out:
            atomic_write_text(Path(out), text)
        sys.stdout.write(text + "\n")

    if args[:1] == ["pass"]:
        measure_pass(args[1], sink=sink, compiled="--compile" in args)
    else:
        sink(largest_batch())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
