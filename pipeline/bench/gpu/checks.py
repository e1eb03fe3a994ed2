"""`dgpipe bench gpu`'s checks: what each runs, what it needs, its time budget, and running them in turn,
each in its own subprocess, within `TOTAL_BUDGET_S` by construction (`run_bench_gpu`)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.atomic import atomic_write_text
from pipeline.bench.gpu.report import render, summary
from pipeline.bench.results import save_result
from pipeline.model.config import FLAGSHIP_CONFIG
from pipeline.resources import PACKAGE_DIR
from pipeline.runtime.dispatch import arch_of
from pipeline.runtime.kernels.moe_tiles import TABLE_DIR, TABLES_ENV, file_name
from pipeline.targets import precision

RESULT_FILE, TABLE_FILE = "gpu.json", "gpu.md"
LOG_LINES = 200
STOP_WAIT_S = 10.0  # reading a killed check's last output, at most
TOTAL_BUDGET_S = 480  # the whole command, checks and their subprocess start-up included
# of the total: the command's own start (imports) before the run, and reading the last check killed
END_MARGIN_S = 5 + STOP_WAIT_S
CONFIG = FLAGSHIP_CONFIG
PASS_BATCHES = (1, 16)
CONTEXT = 256  # cached prompt tokens under each measured pass
# the bf16 check's peak: 26B bf16 weights (47 GiB), batch-16 K/V (4 GiB) and its softcap diagnostic's bf16
# logits and two fp32 results (10 GiB), with room for the CUDA context and the allocator's slack
BF16_NEEDS_GIB = 68
FP4_ARCHS = tuple(precision("nvfp4").native_on)  # GPUs with FP4 tensor cores (configs/precisions)
FP8_ARCHS = tuple(precision("fp8").native_on)
TILES_CHECK = "MoE GEMM tiles"  # leaves its table in `--out`/moe_tiles/, which the checks after it read


@dataclass(frozen=True)
class GpuCheck:
    name: str
    budget_s: int
    what: str
    argv: tuple[str, ...]  # run as `python <argv...>` from the repository root
    needs: tuple[str, ...]  # "cuda", "nvcc", "cxx", "ninja", "pytest", "gpu_tests", "fp8", "fp4", "memory"


def _pass(fmt: str, compiled: bool = False) -> GpuCheck:
    needs = ("cuda", "memory") + {"bf16": (), "fp8": ("fp8",), "nvfp4": ("fp4",)}[fmt]
    batches = ",".join(map(str, PASS_BATCHES))
    if compiled:
        return GpuCheck(
            f"26B pass {fmt} compiled", 100, f"the {fmt} pass under torch.compile (inductor), batch {batches}: compile s, ms vs floor",
            ("-m", "pipeline.bench.gpu.measure", "pass", fmt, "--compile"), needs,
        )  # fmt: skip
    return GpuCheck(
        # each probes and compiles the network's Triton kernels (RoPE, softcap, combine, gated GeLU, residual
        # sum, router input, FFN inputs, layer end, K/V concatenation: cached per host, so the first format
        # pays); FP8 also the Triton MoE GEMM per tile configuration; bf16 compiles that GEMM with bf16
        # operands for its experts' diagnostic and times each network kernel against its torch form
        f"26B pass {fmt}", {"nvfp4": 25, "fp8": 60}.get(fmt, 50), f"26B-A4B random {fmt} weights, batch {batches}: ms vs floor",
        ("-m", "pipeline.bench.gpu.measure", "pass", fmt), needs,
    )  # fmt: skip


CHECKS: tuple[GpuCheck, ...] = (
    GpuCheck(
        "build sampler kernels",
        45,
        "nvcc build of the fused sampler (torch extension)",
        ("-c", "from pipeline.sampler.kernels.build import load_torch_extension as b; b()"),
        ("cuda", "nvcc", "cxx", "ninja"),
    ),
    GpuCheck(
        # 78 s on the H200 before the Triton GEMM and network kernels' tests (each compiles its kernels);
        # how they run: `gpu_test_args`
        "gpu tests",
        130,
        "tests/gpu: kernels vs PyTorch oracle, CUDA graph vs eager, scaled GEMMs vs reference",
        ("-m", "pipeline.bench.gpu.measure", "tests"),
        ("cuda", "pytest", "gpu_tests"),
    ),
    _pass("bf16"),
    GpuCheck(
        # before the FP8 and NVFP4 passes, which then launch with the table it measured (`run_bench_gpu`):
        # it gets what the checks before it left, and uses up to 100 s of it (`measure.TILES_MAX_S`)
        TILES_CHECK,
        30,
        "the Triton MoE GEMM's tiles tuned at the 26B's expert shapes, 1-16 canvases (dgpipe bench moe-tiles)",
        ("-m", "pipeline.bench.gpu.measure", "tiles"),
        ("cuda",),
    ),
    _pass("fp8"),
    _pass("nvfp4"),
    _pass("fp8", compiled=True),
    GpuCheck(
        "largest batch",
        25,  # 15 s on the H200
        "largest batch whose pass fits, doubling from 16, then to within 8 (fastest format here)",
        ("-m", "pipeline.bench.gpu.measure", "largest"),
        ("cuda", "memory"),
    ),
)
# every check's budget fits the time the run loop gives them (the total less its own start and last stop)
assert sum(c.budget_s for c in CHECKS) <= TOTAL_BUDGET_S - END_MARGIN_S

GPU_TESTS = "tests/gpu"  # in a source checkout, beside the package; a wheel ships no tests
# The GPU tests compile their Triton kernels, on one CPU core per process: spread over this many processes
# (pytest-xdist, where installed; the GPU hosts have 16 cores). No test depends on another's state.
GPU_TEST_WORKERS = 4


def gpu_test_args() -> list[str]:
    """pytest's arguments for tests/gpu: each test's outcome as it ends (a run killed at its budget still
    says how far it got), the ten slowest (for the next budget), and the tests spread over
    `GPU_TEST_WORKERS` processes where pytest-xdist is installed."""
    args = ["-v", "-rfEs", "--tb=short", "--durations=10", "-p", "no:cacheprovider", GPU_TESTS]
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
    gpu_tests: bool = False  # GPU_TESTS beside the package (a source checkout)
    cxx: bool = False  # the host C++ compiler torch's extension build calls ($CXX, else c++)


def detect_env() -> Env:
    from pipeline.sampler.kernels.build import find_nvcc

    tools = {"nvcc": find_nvcc() is not None, "cxx": shutil.which(os.environ.get("CXX", "c++")) is not None,
             "ninja": shutil.which("ninja") is not None or _has("ninja"),
             "pytest": _has("pytest"), "gpu_tests": (PACKAGE_DIR.parent / GPU_TESTS).is_dir()}  # fmt: skip
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
    """Why `check` cannot run here, every missing need named, so that one dry run on the host (or on a CPU
    machine set up like it) shows all there is to install (None: it runs)."""
    reasons = []
    if "cuda" in check.needs and not env.cuda:
        reasons.append(f"no CUDA GPU visible (torch {env.torch}, CUDA build {env.cuda_version or 'none'})")
    for need, what, hint in (
        ("nvcc", "nvcc", "install the CUDA toolkit"),
        ("cxx", os.environ.get("CXX", "c++"), "install a host C++ compiler (g++), or set $CXX"),
        ("ninja", "ninja", "pip install ninja"),
        ("pytest", "pytest", "pip install pytest"),
        ("gpu_tests", GPU_TESTS, "they come with a source checkout: git clone, then pip install -e ."),
    ):
        if need in check.needs and not getattr(env, need):
            reasons.append(f"{what} not found ({hint})")
    if env.cuda:  # what the GPU itself has
        if "fp8" in check.needs and env.arch not in FP8_ARCHS:
            reasons.append(f"{env.arch or 'this GPU'} has no FP8 tensor cores (sm89+)")
        if "fp4" in check.needs and env.arch not in FP4_ARCHS:
            reasons.append(
                f"{env.arch or 'this GPU'} has no FP4 tensor cores (sm100/sm120); the NVFP4 fallback is timed by the fp8 row"
            )
        if "memory" in check.needs and env.memory_gib < BF16_NEEDS_GIB:
            reasons.append(
                f"{env.memory_gib:.0f} GiB GPU memory < {BF16_NEEDS_GIB} GiB the 26B random-weight pass needs"
            )
    return "; ".join(reasons) or None


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


def _run(
    check: GpuCheck,
    repo: Path,
    scratch: Path,
    budget_s: int | None = None,
    out: Path | None = None,
    tile_tables: Path | None = None,
) -> CheckResult:
    """Run `check` under `budget_s` seconds (default: its own budget). The check finds where to put its
    rows, its budget and the run's `out` directory (files of its own) in its environment, and, where
    `tile_tables` is given, the MoE GEMM tile tables to launch with first (`moe_tiles.TABLES_ENV`)."""
    budget_s = budget_s or check.budget_s
    res = CheckResult(check.name, check.what, budget_s, "passed")
    rows_file = rows_file_of(check, scratch)
    env = dict(os.environ, PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               DGPIPE_GPU_ROWS=str(rows_file), DGPIPE_GPU_BUDGET_S=str(budget_s),
               DGPIPE_GPU_OUT=str(out or scratch), PYTHONUNBUFFERED="1")  # fmt: skip
    if tile_tables is not None:
        env[TABLES_ENV] = str(tile_tables)
    t0 = time.monotonic()
    # one stream: a check killed at its budget keeps its warnings and tracebacks too; a process group of its
    # own, so that a kill at the budget also ends what it started (pytest-xdist's workers, nvcc), which would
    # otherwise run on beside the next check
    proc = subprocess.Popen([sys.executable, *check.argv], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, encoding="utf-8", errors="replace", start_new_session=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=budget_s)
        res.status = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        text = stop(proc)
        res.status = "timeout"
    except BaseException:
        # the bench itself stopped (a runner's limit, Ctrl-C): the check must not outlive it, as on a GPU it
        # holds memory the next command on the host would run out of
        stop(proc)
        raise
    res.seconds = time.monotonic() - t0
    lines = text.strip().splitlines()
    res.detail, res.log = "\n".join(lines[-15:]), "\n".join(lines[-LOG_LINES:])
    res.rows = read_rows(rows_file)
    return res


def rows_file_of(check: GpuCheck, scratch: Path) -> Path:
    """Where `check` writes its measurements (`DGPIPE_GPU_ROWS`)."""
    return scratch / f"{check.name.replace(' ', '_')}.json"


def read_rows(rows_file: Path) -> list[dict]:
    """A check's measurements so far: it saves each as it is made, atomically, so a killed one keeps them."""
    return json.loads(rows_file.read_text()) if rows_file.is_file() else []


def stop(proc: subprocess.Popen) -> str:
    """Kill a check's process group (what it started too: pytest-xdist's workers, nvcc) and return what it
    wrote. The output is read for at most `STOP_WAIT_S` more: a process that left the group but kept the
    pipe open would hold the run past its budget."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=STOP_WAIT_S)[0] or ""
    except subprocess.TimeoutExpired as e:
        written = e.output or b""
        return written.decode("utf-8", "replace") if isinstance(written, bytes) else written


def run_bench_gpu(
    out: Path,
    dry_run: bool = False,
    repo: Path | None = None,
    on_check: Callable[[CheckResult], None] | None = None,
) -> dict:
    """Run (or, `dry_run`, list) the checks; write out/gpu.json and out/gpu.md after every check (a host
    that goes away mid-run still leaves the checks done so far); return the result. `on_check` is told
    each check's result as it finishes."""
    started = time.monotonic()
    out = out.resolve()  # the checks run from the repository root: a relative `out` would land there
    env = detect_env()
    repo = repo or PACKAGE_DIR.parent
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
    # what the skipped checks and the checks that finished early leave, handed on to the next one to run,
    # and what a killed one overran (its kill and teardown) taken from it: every check's elapsed time stays
    # within the budgets' sum
    spare = float(sum(c.budget_s for c in CHECKS if skip_reason(c, env)))
    # whatever the checks' overruns and the environment's probe took, nothing runs past the total
    deadline = started + TOTAL_BUDGET_S - END_MARGIN_S
    tile_tables = None  # once the tiles check has measured this GPU's table, the passes after it use it
    own_tables = [out / TABLE_DIR / file_name(env.gpu, operand) for operand in ("fp8", "bf16")]
    with tempfile.TemporaryDirectory(prefix="dgpipe-gpu-") as scratch, stopped_by_sigterm():
        for c in CHECKS:
            if reason := skip_reason(c, env):
                record(CheckResult(c.name, c.what, c.budget_s, "skipped", detail=reason))
                continue
            budget = min(max(1, c.budget_s + math.floor(spare)), math.floor(deadline - time.monotonic()))
            if budget < 1:
                record(CheckResult(c.name, c.what, c.budget_s, "skipped", detail="no time left of the command's"
                                   f" {TOTAL_BUDGET_S} s: the checks before it overran"))  # fmt: skip
                continue
            # an earlier run's table of this GPU in `out` must not pass for this run's
            if c.name == TILES_CHECK:
                for table in own_tables:
                    table.unlink(missing_ok=True)
            try:
                r = _run(c, repo, Path(scratch), budget, out, tile_tables)
            except BaseException:  # stopped from outside: what the check measured so far is kept
                rows = read_rows(rows_file_of(c, Path(scratch)))
                record(
                    CheckResult(
                        c.name, c.what, budget, "interrupted", detail="the bench was stopped", rows=rows
                    )
                )
                raise
            if r.status == "passed" and r.rows:  # what it measured, not its output's last line
                r.detail = summary(r.rows)
            spare = r.budget_s - r.seconds
            # the tiles check writes its table as it climbs: one it was killed in the middle of is still no
            # slower than the default tiles, and the passes after it launch with it
            if c.name == TILES_CHECK and any(table.is_file() for table in own_tables):
                tile_tables = out / TABLE_DIR
                if r.status != "passed":
                    kept = f"its table of the tiles timed before it stopped ({tile_tables}) is used by the checks after it"
                    r.detail = f"{kept}\n{r.detail}"
            record(r)
    return result


@contextlib.contextmanager
def stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM (`timeout`'s, a runner's at its limit) raises SystemExit here while the block runs, so that the
    running check is killed and what it measured recorded: Python's default for it ends the process with
    no cleanup, and a check runs in a process group of its own, which the signal does not reach."""

    def exit_by_signal(signum, frame):
        raise SystemExit(128 + signum)  # the shell's exit status for a signal

    if threading.current_thread() is not threading.main_thread():  # only the main thread takes handlers
        yield
        return
    before = signal.signal(signal.SIGTERM, exit_by_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
