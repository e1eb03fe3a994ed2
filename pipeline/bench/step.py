"""`dgpipe bench pass`: one denoise step split into network / self-conditioning / sampler / host, against the
hardware floor, side by side with transformers and the ONNX Runtime backend on the same weights.

The floor is the step's matmul FLOPs (`pipeline.model.cost.denoise_pass_flops`, counted from the config: every GEMM a denoise step with a
self-conditioning signal runs, 2 FLOPs per multiply-add) over the matmul rate measured on this device in
the model dtype (`matmul_rate`). It ignores everything that is not a matmul (norms, softmaxes, the sampler's
transcendental passes), so "step / floor" says how far the whole step is from a pure-GEMM ideal.

Every arm runs the same checkpoint (random weights written once for a `--config`, or a checkpoint dir),
the same prompt, batch and fixed step count; arms are interleaved round by round so load on a shared
machine hits them alike, and every figure is a median over rounds and steps.
  * dgpipe: `BlockDiffusionRuntime` driven one `step()` at a time; each later step (a self-conditioning
    signal present) is timed whole, and timers around the network pass (`DiffusionGemma.denoise_soft`),
    the soft embedding (`soft_embedding`) and the sampler (`sample_step_fused`/`sample_step`,
    `update_stability`, `should_stop`) split it; host = step - the three (scheduler glue, copies).
  * transformers: `generate` for one canvas of N fixed steps; a step = from one decoder forward's start to
    the next one's (steps 2..N-1), its network share = the forward's own time.
  * onnxruntime: the exported graph (dense MoE, sampler as reference functions) driven by the same
    runtime through `OnnxRuntimeBackend`, timed per step like dgpipe (one graph run per step).
For a checkpoint with a prompt format (the embedded model), `generate` adds `dgpipe bench local`'s adaptive
rows: tokens/s of dgpipe's runtime and of transformers' generate on the model's own prompt, one run of each
per round, interleaved.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.local import PassTimer
from pipeline.bench.machine import machine
from pipeline.bench.plots import pass_plot
from pipeline.bench.results import save_result
from pipeline.bench.timing import median_seconds, sync
from pipeline.limits import context_length
from pipeline.model.config import ModelConfig, SamplerConfig
from pipeline.model.cost import denoise_pass_flops

RESULT_FILE, PLOT_FILE = "bench_pass.json", "bench_pass.png"
DGPIPE_GENERATE = "dgpipe diffusion"
COMPILED_GENERATE = "dgpipe diffusion, compiled"
TRANSFORMERS_GENERATE = "transformers generate"


def matmul_rate(dtype: torch.dtype, device: torch.device, shapes: list[tuple[int, int, int]]) -> float:
    """FLOP/s of this device's GEMM in `dtype`: the best median over `shapes` (m, k, n) (a square one and the
    step's largest GEMM, the LM head), 3 timed calls each after a warm-up."""
    best = 0.0
    gen = torch.Generator(device=device).manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen, device=device).to(dtype)
        b = torch.randn(k, n, generator=gen, device=device).to(dtype)
        secs = median_seconds(lambda a=a, b=b: torch.mm(a, b), device, 3)
        best = max(best, 2 * m * k * n / secs)
    return best


@dataclass
class Arm:
    """Per-step samples (seconds) of one system; the split is dgpipe's only."""

    name: str
    step: list[float] = field(default_factory=list)
    network: list[float] = field(default_factory=list)
    soft: list[float] = field(default_factory=list)
    sampler: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        med = lambda xs: 1000 * statistics.median(xs) if xs else None
        step, parts = med(self.step), [med(x) for x in (self.network, self.soft, self.sampler)]
        split = self.soft and self.sampler
        # per step, then the median: medians of the parts need not add up to the median step
        host = med([s - n - e - p for s, n, e, p in zip(*self._parts(), strict=True)]) if split else None
        return {
            "system": self.name,
            "step_ms": step,
            "network_ms": parts[0],
            "soft_embedding_ms": parts[1],
            "sampler_ms": parts[2],
            "host_ms": host,
            "samples": len(self.step),
        }

    def _parts(self) -> tuple[list[float], ...]:
        return self.step, self.network, self.soft, self.sampler


def _fixed(steps: int) -> SamplerConfig:
    return SamplerConfig(max_denoising_steps=steps, confidence_threshold=0.0)


def time_runtime_steps(backend, prompt: list[int], batch: int, steps: int, arm: Arm, split: bool) -> None:
    """Drive a fresh runtime one `step()` at a time through one canvas of `steps` fixed steps; append the
    times of steps 2..N-1 (a self-conditioning signal present, and a next step to condition: the last step
    skips the soft embedding, and transformers' arm cannot time its last step) and, with `split`, their
    network / soft embedding / sampler shares (the sampler: `sample_logits`, whichever kernels it runs,
    the fused CUDA ones included; on CUDA each share is synchronised)."""
    import pipeline.runtime.backends as backends
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    length = backend.config.canvas_length
    rt = BlockDiffusionRuntime(backend, max_batch=batch, max_len=context_length(len(prompt), 0, length))
    rt.end_ids = set()  # a random model's canvas must not end on an end token mid-measurement
    for i in range(batch):
        rt.submit(Request(prompt, length, _fixed(steps), seed=i, request_id=i))
    timers: list[PassTimer] = []
    if split:
        model = backend.model
        timers = [
            PassTimer(model, "denoise_soft", rt.device),
            PassTimer(model, "soft_embedding", rt.device),
            PassTimer(backends, "sample_logits", rt.device),
        ]
    with torch.inference_mode():
        rt.step()  # admit + prefill + step 1 (no self-conditioning signal yet)
        for _ in range(steps - 2):
            for tm in timers:
                tm.seconds = 0.0
                tm.__enter__()
            try:
                t = time.perf_counter()
                rt.step()
                sync(rt.device)
                arm.step.append(time.perf_counter() - t)
            finally:
                for tm in timers:
                    tm.__exit__()
            if split:
                arm.network.append(timers[0].seconds)
                arm.soft.append(timers[1].seconds)
                arm.sampler.append(sum(tm.seconds for tm in timers[2:]))
        while rt.busy():  # the last step, untimed (no next step to condition), and the canvas's commit
            rt.step()


class CallLog:
    """(start, end) perf_counter of every call of obj.name while active (the device synchronised around
    each call on CUDA)."""

    def __init__(self, obj: Any, name: str, device: torch.device | None = None) -> None:
        self.obj, self.name, self.orig = obj, name, getattr(obj, name)
        self.device = device
        self.calls: list[tuple[float, float]] = []

    def __enter__(self) -> CallLog:
        def logged(*a, **k):
            sync(self.device)
            t = time.perf_counter()
            out = self.orig(*a, **k)
            sync(self.device)
            self.calls.append((t, time.perf_counter()))
            return out

        setattr(self.obj, self.name, logged)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.obj, self.name, self.orig)


def time_transformers_steps(ref, prompt: list[int], batch: int, steps: int, arm: Arm) -> None:
    """One canvas of `steps` fixed steps through transformers' generate. Its denoise steps are back to back
    (forward, then sampling, then the next forward), so a step is the time from one decoder forward's start
    to the next one's; steps 2..N-1 are kept (a self-conditioning signal present; the last one has no
    next forward to end it), the forward's own time being the network share."""
    ids = torch.tensor([prompt] * batch, device=ref.device)
    with CallLog(ref.model.decoder, "forward", ref.device) as log, torch.inference_mode():
        ref.generate(ids, max_new_tokens=ref.config.canvas_length, **_fixed(steps).transformers_kwargs())
    for (start, end), (following, _) in zip(log.calls[1:], log.calls[2:], strict=False):
        arm.step.append(following - start)
        arm.network.append(end - start)


def _checkpoint(config: str | None, model: str | None, scratch: Path) -> tuple[Path, str]:
    """The checkpoint every arm loads: `model` itself, or random fp32 weights for `config` written once."""
    from pipeline.bench.model import random_model
    from pipeline.model.checkpoint import save_checkpoint
    from pipeline.runtime.session import default_model_path

    if config is None:
        path = Path(model) if model else default_model_path()
        return path, str(path)
    mcfg = ModelConfig.from_yaml(config)
    weights = random_model(mcfg, torch.float32, torch.device("cpu"))
    return save_checkpoint(weights, scratch / "checkpoint"), f"{config} (random weights)"


def run_bench_pass(
    config: str | None,
    model: str | None,
    batch: int,
    context: int,
    steps: int,
    rounds: int,
    reference: bool,
    onnx: bool,
    generate: bool,
    dtype: str,
    device: str,
    out: Path,
    progress=None,
    compile: bool = False,
) -> dict[str, Any]:
    """Measure, write out/bench_pass.json and return the result (`dgpipe bench pass` prints it).
    `compile`: the generate rows gain dgpipe with its passes compiled (`pipeline.runtime.compiled`),
    compiled before the timed rounds."""
    from pipeline.model.checkpoint import load_model
    from pipeline.runtime.backends import TorchBackend
    from pipeline.runtime.session import resolve_device, resolve_dtype

    if steps < 3:
        from pipeline.errors import DgpipeError

        raise DgpipeError("--steps must be >= 3 (steps 2..N-1 are timed on every system)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    with tempfile.TemporaryDirectory() as scratch:
        path, label = _checkpoint(config, model, Path(scratch))
        net, ckpt = load_model(path, dt, dev)
        net.eval()
        cfg = net.config
        vocab, length = cfg.text_config.vocab_size, cfg.canvas_length
        prompt = [3 + (7 * i) % (vocab - 3) for i in range(context)]
        arms = {"dgpipe": Arm("dgpipe (PyTorch)")}
        runners = {"dgpipe": lambda a: time_runtime_steps(TorchBackend(net), prompt, batch, steps, a, True)}
        if reference:
            from transformers import DiffusionGemmaForBlockDiffusion
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dt).to(dev).eval()
            arms["transformers"] = Arm("transformers generate")
            runners["transformers"] = lambda a: time_transformers_steps(ref, prompt, batch, steps, a)
        if onnx:
            from pipeline.onnx.backend import OnnxRuntimeBackend
            from pipeline.onnx.export import export_onnx

            export_onnx(net, Path(scratch) / "onnx")
            ort = OnnxRuntimeBackend(Path(scratch) / "onnx", cfg)
            arms["onnxruntime"] = Arm("onnxruntime (exported graph)")
            runners["onnxruntime"] = lambda a: time_runtime_steps(ort, prompt, batch, steps, a, False)
        tokens = batch * length
        shapes = [(1024, 1024, 1024), (tokens, cfg.text_config.hidden_size, vocab)]
        rates = []
        for _ in range(rounds):  # the matmul rate is measured in every round too, beside the systems
            for name, run in runners.items():
                run(arms[name])
                if progress is not None:
                    progress()
            rates.append(matmul_rate(dt, dev, shapes))
        flops = denoise_pass_flops(cfg.text_config, batch, cfg.canvas_length, context)
        rate = statistics.median(rates)
        gen_rows = []
        if generate and config is None and ckpt.has_tokenizer:
            gen_rows = _generate_rows(path, dt, dev, reference, rounds, compile)
    rows = {name: arm.row() for name, arm in arms.items()}
    floor_ms = 1000 * flops / rate
    ours = rows["dgpipe"]
    ratios: dict[str, float | None] = {
        "step_over_floor": ours["step_ms"] / floor_ms,
        "network_over_floor": ours["network_ms"] / floor_ms,
        "sampler_share_of_step": ours["sampler_ms"] / ours["step_ms"],
    }
    if "transformers" in rows:
        ratios["dgpipe_over_transformers_step"] = ours["step_ms"] / rows["transformers"]["step_ms"]
    if "onnxruntime" in rows:
        ratios["pytorch_over_onnxruntime_step"] = ours["step_ms"] / rows["onnxruntime"]["step_ms"]
    by_system = {g["system"]: g["tokens_per_s"] for g in gen_rows}
    if TRANSFORMERS_GENERATE in by_system:
        for system, key in ((DGPIPE_GENERATE, "dgpipe"), (COMPILED_GENERATE, "dgpipe_compiled")):
            if system in by_system:
                ratios[f"{key}_over_transformers_tokens_per_s"] = (
                    by_system[system] / by_system[TRANSFORMERS_GENERATE]
                )
    result = {
        "model": label,
        "parameters": net.num_parameters(),
        "dtype": str(dt),
        "device": str(dev),
        "machine": machine(),
        "batch": batch,
        "context": context,
        "canvas_length": length,
        "steps_per_canvas": steps,
        "step_policy": "fixed (steps 2..N-1 timed: a self-conditioning signal present, and a next step)",
        "rounds": rounds,
        "flops_per_step": flops,
        "matmul_gflop_s": rate / 1e9,
        "matmul_gflop_s_per_round": [x / 1e9 for x in rates],
        "floor_ms": floor_ms,
        "rows": list(rows.values()),
        "generate": gen_rows,
        "ratios": ratios,
    }
    save_result(out, RESULT_FILE, result)
    pass_plot(result, out / PLOT_FILE)
    return result


def _generate_rows(
    path: Path, dt: torch.dtype, dev: torch.device, reference: bool, rounds: int, compile: bool = False
) -> list[dict]:
    """`dgpipe bench local`'s adaptive rows on the checkpoint's own prompt: dgpipe (eager), dgpipe with
    compiled passes when `compile`, then transformers, one measured run of each per round (interleaved),
    medians over the rounds. The compiled session compiles (and is checked to give the eager tokens) in
    warm-up runs before the first round."""
    from pipeline.bench.local import dgpipe_runner, interleaved, median_row, transformers_runner
    from pipeline.runtime.session import load_session

    session = load_session(path, str(dt).removeprefix("torch."), str(dev))
    prompt = session.prompt_format.example_prompt
    ids = session.encode_prompt(prompt)
    template = session.default_template(prompt)
    max_tokens = session.model.config.canvas_length * (1 if template is not None else 2)
    sampler = session.sampler()
    runners = {DGPIPE_GENERATE: dgpipe_runner(session, ids, template, sampler, max_tokens, 1)}
    if compile:
        compiled = load_session(path, str(dt).removeprefix("torch."), str(dev), compile=True)
        runners[COMPILED_GENERATE] = dgpipe_runner(compiled, ids, template, sampler, max_tokens, 1)
        runners[COMPILED_GENERATE](0)  # the compile, outside the timed rounds
    if reference:
        runners[TRANSFORMERS_GENERATE] = transformers_runner(path, dt, dev, ids, max_tokens, 1)(sampler)
    samples = interleaved(runners, rounds)
    return [asdict(median_row(name, sampler, measured)) for name, measured in samples.items()]


def render(r: dict) -> list[str]:
    """The `dgpipe bench pass` table: one line per system, where a step's time goes against the floor."""
    ms = lambda v: f"{v:>10.1f}" if v is not None else f"{'-':>10}"
    lines = [
        f"{r['model']} ({r['parameters'] / 1e6:.0f}M params), {r['dtype']} on {r['device']}, "
        f"{r['machine']['threads']} thread(s), batch {r['batch']}, context {r['context']}, "
        f"{r['steps_per_canvas']} fixed steps, medians of {r['rounds']} interleaved rounds\n"
        f"floor: {r['flops_per_step'] / 1e9:.1f} GFLOP per step / {r['matmul_gflop_s']:.1f} GFLOP/s matmul "
        f"= {r['floor_ms']:.1f} ms\n"
        f"{'system':<30}{'step ms':>10}{'network':>10}{'soft emb':>10}{'sampler':>10}{'host':>10}{'x floor':>9}"
    ]
    for x in r["rows"]:
        lines.append(
            f"{x['system']:<30}{ms(x['step_ms'])}{ms(x['network_ms'])}{ms(x['soft_embedding_ms'])}"
            f"{ms(x['sampler_ms'])}{ms(x['host_ms'])}{x['step_ms'] / r['floor_ms']:>9.2f}"
        )
    for g in r["generate"]:
        lines.append(f"generate {g['system']:<24} {g['policy']:<16} {g['tokens_per_s']:>8.1f} tokens/s")
    lines += [f"{k}: {v:.3f}" for k, v in r["ratios"].items() if v is not None]
    return lines
