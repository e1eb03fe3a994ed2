"""ms per 256-token canvas through the serving runtime, on the model `dgpipe bench gpu` measured a pass of:
what a user of `dgpipe serve` gets, to set beside vLLM's ~146 ms per canvas at 16 denoise steps (FP8, one
H100). A pass's time alone leaves out what the runtime adds to a canvas's steps: the prefill (a restored
prefix here: every request has one prompt), each round's eager warm-up step and CUDA-graph capture, the
host's check every few passes, the sampler's and self-conditioning's work, and the commit pass that writes
the canvas's K/V.

Every canvas takes exactly `STEPS` denoise steps (confidence threshold 0: no adaptive stop) and every request
ignores the end token (random weights end anywhere), so the canvases timed are the canvases asked for. A
warm-up run of the same shapes comes first: the commit pass, the longer past of a later canvas and what
their first call at a shape costs (Triton's specializations, the allocator's first blocks) are paid there,
not in the steady time. A last run with `NEW_LENGTH` prompt tokens more pays for new shapes again, as a
server does for the prompt lengths it has not met (with cuDNN's attention in torch's choice, a plan build
per shape: the network's passes leave it out, `network.attention_kernels`). (`dgpipe bench model`'s
`runtime_canvas_s` isolates the passes instead: one canvas in one round, the prefill subtracted.)
"""

from __future__ import annotations

import torch

from pipeline.errors import error_line

STEPS = 16  # denoise steps per canvas: vLLM's measured step count for this model
CANVASES = 2  # timed per request, after a warm-up run of as many
# prompt tokens more in a last timed run: every key length in it new to the process, as a server meets new
# prompt lengths (what a first call at a shape costs; the steady run reuses its shapes)
# not a multiple of 16: Triton's kernels take token counts unspecialized, so it should compile nothing new
NEW_LENGTH = 13


def canvas_time(
    model, batch: int, context: int, dev: torch.device, steps: int = STEPS, canvases: int = CANVASES
) -> dict:
    """`batch` requests, each a `context`-token prompt and `canvases` canvases of `steps` steps, through a
    `BlockDiffusionRuntime` over `model` as `dgpipe serve` builds it (CUDA graphs and the fused sampler where
    the backend allows them, the load's warm-up passes, timed), after a warm-up run of the same requests: ms
    per canvas (every request's canvases run side by side), output tokens per second, and what the runtime
    ran; then ms per canvas of the same requests with `NEW_LENGTH` prompt tokens more, where every shape is
    new (or why that run failed)."""
    from pipeline.bench.timing import seconds
    from pipeline.model.config import SamplerConfig
    from pipeline.runtime.backends import TorchBackend
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    backend, length = TorchBackend(model), model.config.canvas_length
    rt = BlockDiffusionRuntime(backend, max_batch=batch, max_len=context + NEW_LENGTH + canvases * length)
    sampler = SamplerConfig(max_denoising_steps=steps, confidence_threshold=0.0)
    prompt = [3 + i % (model.cfg.vocab_size - 3) for i in range(context + NEW_LENGTH)]

    def timed(tokens: int, first_id: int) -> tuple[float, list]:
        """Seconds for `batch` requests of a `tokens`-token prompt and `canvases` canvases each, and their
        results; min_tokens = max_tokens: the end token never stops a request."""
        out = canvases * length
        reqs = [Request(prompt[:tokens], max_tokens=out, min_tokens=out, sampler=sampler, seed=i,
                        request_id=first_id + i) for i in range(batch)]  # fmt: skip
        return seconds(lambda: rt.generate(reqs), dev)

    # what `dgpipe serve`'s load adds: the experts' GEMM paths compiled (`BlockDiffusionRuntime.warm_kernels`)
    warm_s, warmed = seconds(rt.warm_kernels, dev)
    timed(context, 0)  # the prefill, the sampler's load, every shape's first run
    loop = rt.loop
    before, captured, warm = dict(rt.passes), loop.captures, (loop.warmups, loop.warmup_s, loop.capture_s)
    wall, results = timed(context, batch)
    tokens = sum(len(r.tokens) for r in results)
    row = {"batch": batch, "steps": steps, "canvases": canvases, "ms_per_canvas": wall * 1e3 / canvases,
            "tokens_per_s": tokens / wall, "tokens": tokens, "graphs": rt.loop.graphs, "fused_sampler": backend.fused,
            "captures": loop.captures - captured, "capture_error": loop.capture_error,
            # per round, the host's time before its replays: the eager step's launches and the capture
            "warmup_ms_per_round": _per(loop.warmup_s - warm[1], loop.warmups - warm[0]),
            "capture_ms_per_round": _per(loop.capture_s - warm[2], loop.captures - captured),
            "passes": {k: v - before.get(k, 0) for k, v in rt.passes.items()},
            "steps_per_canvas": sorted({s for r in results for s in r.steps_per_canvas}),
            "load_warm_s": warm_s, "load_warm_tokens": warmed}  # fmt: skip
    try:  # a failure here keeps the steady run's row
        new_wall, _ = timed(context + NEW_LENGTH, 2 * batch)
    except Exception as e:
        return {**row, "new_lengths_error": error_line(e)}
    return {**row, "ms_per_canvas_new_lengths": new_wall * 1e3 / canvases}


def _per(seconds: float, n: int) -> float | None:
    return seconds * 1e3 / n if n else None


def render_canvas(rows: list[tuple[str, dict, float]]) -> list[str]:
    """The canvases' markdown table, each beside its pass's CUDA-graph ms times the steps (fmt, canvas
    row, graph ms per pass); runs from before the check say nothing."""
    if not rows:
        return []
    lines = ["", "| through the runtime | batch | steps per canvas | ms per canvas | at new lengths | steps x graph "
             "pass ms | output tokens/s | CUDA graphs (captures) | host ms per round: eager step / capture | fused "
             "sampler | denoise / commit passes | load warm-up s (pass tokens) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|---|---|"]  # fmt: skip
    cell = lambda text: str(text).replace("|", "/")[:80]
    ms = lambda v: "—" if v is None or v != v else f"{v:.1f}"
    for fmt, x, pass_ms in rows:
        if "error" in x:
            lines.append(f"| {fmt} | {x['batch']} | — | — | — | — | — | — | — | — | — | {cell(x['error'])} |")
            continue
        p, steps = x["passes"], "/".join(map(str, x["steps_per_canvas"]))
        why = f": {cell(x['capture_error'])}" if x.get("capture_error") else ""
        graphs = f"yes ({x['captures']})" if x["graphs"] else f"no{why}"
        host = f"{ms(x.get('warmup_ms_per_round'))} / {ms(x.get('capture_ms_per_round'))}"
        warmed = x.get("load_warm_tokens")
        load = "—" if warmed is None else f"{x['load_warm_s']:.1f} ({', '.join(map(str, warmed)) or 'none'})"
        lines.append(f"| {fmt} | {x['batch']} | {steps} | {x['ms_per_canvas']:.1f} "
                     f"| {ms(x.get('ms_per_canvas_new_lengths'))} | {ms(x['steps'] * pass_ms)} "
                     f"| {x['tokens_per_s']:.0f} | {graphs} | {host} | {'yes' if x['fused_sampler'] else 'no'} "
                     f"| {p.get('denoise', 0)} / {p.get('commit', 0)} | {load} |")  # fmt: skip
    return [*lines, "", "vLLM, for comparison: ~146 ms per 256-token canvas at 16 steps (FP8, one H100)."]
