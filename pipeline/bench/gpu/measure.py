"""The measurements `dgpipe bench gpu` runs in its check subprocesses (`python -m pipeline.bench.gpu.measure
pass <fmt>` / `largest` / `tests`): the 26B-A4B random-weight denoise pass against its floor, with where its
time went, and the largest batch that fits."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.atomic import atomic_write_text
from pipeline.bench.gpu.checks import CONFIG, CONTEXT, FP4_ARCHS, FP8_ARCHS, PASS_BATCHES, gpu_test_args
from pipeline.bench.gpu.layers import attention_backends, bf16_expert_paths, expert_paths
from pipeline.errors import error_line
from pipeline.runtime.device_errors import out_of_memory
from pipeline.runtime.dispatch import arch_of
from pipeline.targets import gpu_named


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
    from pipeline.bench.random_weights import random_packed
    from pipeline.runtime.dispatch import dispatch
    from pipeline.runtime.gpu_load import experts_plan, one_pass
    from pipeline.runtime.kernels.moe_tiles import expert_shapes, measured_triton_rows
    from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear

    dev = next(model.parameters()).device
    row = dispatch(fmt, arch_of(*torch.cuda.get_device_capability(dev)))
    # as the runtime loads: what failed its probe takes its fallback
    pr = probed if probed is not None else _kernels_here(dev, row.arch)
    wanted = row.linear_mode
    lin = wanted if wanted and pr.ok(f"linear:{wanted}") else None
    _, two_i, d = model.layers[0].experts.gate_up_proj.shape
    measured = measured_triton_rows(dev, expert_shapes(d, two_i // 2))
    exp, triton_rows, fell_back = experts_plan(row, pr, measured)
    lin_one_pass, exp_one_pass = one_pass(lin, pr), one_pass(exp, pr)
    kernels = f"{row.linears} / {row.experts}" + (f" ({fell_back})" if fell_back else "")
    if wanted and not lin:  # as the load reports it: the linears stay bf16
        kernels += f" (linears: {row.linears} failed its probe ({pr.results.get(f'linear:{wanted}')}): bf16)"
    if exp and row.splits_passes and measured is not None:
        kernels += f" (Triton up to {triton_rows:g} rows per expert: this GPU's tile table)"
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


def weights_read(model) -> tuple[str, str]:
    """The formats a pass reads the model's linears and experts in, as they were installed (`quantize_random`
    after its fallbacks): a tensor-core module's mode ("fp8", "fp8_rowwise", "nvfp4"), else "bf16". The byte
    model's formats (`dispatch.pass_bytes`): a floor is set by the bytes the pass really reads."""
    from pipeline.runtime.tensor_cores import ScaledExperts, ScaledLinear

    layer = model.layers[0]
    linear = layer.self_attn.q_proj
    return (
        linear.mode if isinstance(linear, ScaledLinear) else "bf16",
        layer.experts.mode if isinstance(layer.experts, ScaledExperts) else "bf16",
    )


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
    # one canvas's fp32 probabilities at a time: all at once, [batch, 256, 262144] twice over, they ran out of
    # memory before the pass did (34 GB each at 128 canvases); the pass itself holds [batch, 256, hidden]
    soft = torch.cat([
        model.soft_embedding(torch.softmax(torch.randn(1, length, cfg.vocab_size, device=dev, generator=gen), -1))
        for _ in range(batch)
    ])  # fmt: skip
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
    """ms per denoise pass (eager and CUDA graph) of the 26B random-weight model in `fmt`, per batch, then
    each batch's diagnostics (where the time went, experts, attention, network kernels); `sink` gets the rows
    so far after each batch's timing and after each batch's diagnostics, so a check killed at its budget
    keeps every time it measured.
    `compiled`: the pass under torch.compile as `dgpipe serve --compile` runs it (its decoder layers: one
    static-shape compile per layer kind and batch, the first call's seconds reported). `config`, `device`:
    another model configuration and device, for testing this function itself off a GPU."""
    from pipeline.bench.model import _graphed, copy_bandwidth, random_model
    from pipeline.bench.timing import median_seconds
    from pipeline.model.config import ModelConfig
    from pipeline.runtime.compiled import compile_model
    from pipeline.runtime.dispatch import compute_ms, dispatch, experts_touched, floor_ms, pass_bytes
    from pipeline.runtime.gpu_load import finish_on_device

    dev = device or torch.device("cuda")
    mcfg = ModelConfig.from_yaml(config)
    model = random_model(mcfg, torch.bfloat16, dev)
    kernels = quantize_random(model, fmt) if fmt != "bf16" else "F.linear bf16 / F.grouped_mm bf16"
    # what the pass reads its weights in, fallbacks taken: its bytes and FLOP rates
    reads = weights_read(model)
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
    row = replace(dispatch(fmt, arch), linear_read=reads[0], expert_read=reads[1])
    bw = copy_bandwidth(dev, 2.0)
    # the datasheet's bandwidth and tensor-core rates set the floors; a GPU configs/targets does not list has
    # none, and its pass is set against the copy bandwidth measured here
    spec = gpu_named(torch.cuda.get_device_name(dev))
    rows, fns = [], {}
    for b in batches:  # every batch's times first: diagnostics come after, so a budget cut keeps them all
        started = {"format": fmt + (" compiled" if compiled else ""), "batch": b, "kernels": kernels}
        # a check killed at its budget before the batch's times still says where it stopped: in the first
        # call (a compile, under torch.compile), or after it, and what that took
        sink([*rows, {**started, "first_call_s": None}])
        with torch.inference_mode():
            fn = fns[b] = passes.pop(b)
            t0 = time.perf_counter()
            finite = bool(torch.isfinite(fn()).all())  # a pass that makes NaNs measures nothing real
            first_s = time.perf_counter() - t0
            sink([*rows, {**started, "first_call_s": first_s, "finite": finite}])
            eager = median_seconds(fn, dev, repeats)
            try:
                graph, graph_error = median_seconds(_graphed(fn, dev), dev, repeats), None
            except Exception as e:  # reported in the row; the eager time still stands
                graph, graph_error = float("nan"), error_line(e)
        # the floors of what is timed: the network's pass, not the sampler or the next step's soft embedding
        nbytes = pass_bytes(
            mcfg.text_config, row.linear_read, row.expert_read, b, mcfg.canvas_length, CONTEXT, step=False
        ).total
        rows.append({**started,
                     "ms_eager": eager * 1e3, "ms_graph": graph * 1e3, "first_call_s": first_s, "finite": finite,
                     "pass_gb": nbytes / 1e9, "spec_gpu": spec.product if spec else None,
                     "floor_ms_spec": floor_ms(nbytes, spec.product) if spec else None,
                     "floor_ms_copy": nbytes / bw * 1e3, "copy_gb_s": bw / 1e9,
                     "compute_ms_spec": compute_ms(mcfg.text_config, row, b, spec.product, mcfg.canvas_length, CONTEXT, step=False)
                     if spec else None,
                     "experts_touched": None,
                     "experts_touched_uniform": experts_touched(mcfg.text_config, b * mcfg.canvas_length),
                     "graph_error": graph_error})  # fmt: skip
        sink(rows)
    for r in rows:
        diagnostics = pass_diagnostics(model, fns.pop(r["batch"]), r["batch"], fmt, compiled, dev)
        for key, diagnose in diagnostics.items():
            try:
                with torch.inference_mode():
                    value = diagnose()
                if value is not None:
                    r[key] = value
            except Exception as e:  # a diagnostic that cannot run here costs itself, not the pass's row
                r[f"{key}_error"] = error_line(e)
            sink(rows)  # each diagnostic as it ends: a check killed at its budget loses only the one running
        with contextlib.suppress(
            RuntimeError
        ):  # whatever a failed capture left: the next rows say what failed
            torch.cuda.empty_cache()
    return rows


def pass_diagnostics(
    model, fn: Callable[[], torch.Tensor], batch: int, fmt: str, compiled: bool, dev: torch.device
) -> dict[str, Callable[[], object]]:
    """What `measure_pass` records beside a pass's times, by the row key each fills: the kernels and aten
    ops that took the time, the tiles the Triton MoE GEMM launched with, and, eagerly (hooks and extra calls
    would recompile a compiled pass), the experts the routing touched; FP8: ms per canvas through the
    serving runtime (`canvas.canvas_time`), one layer's experts on each kernel that can run them and the
    siblings as one GEMM; bf16: attention's backends, the network kernels against their torch forms, and
    the bf16 experts on both grouped GEMMs."""
    from pipeline.bench.gpu.canvas import canvas_time
    from pipeline.bench.gpu.network import network_paths, sibling_paths

    cfg, length = model.cfg, model.config.canvas_length
    tokens, experts = batch * length, model.layers[0].experts
    diagnostics = {"top_kernels": lambda: top_kernels(fn), "top_ops": lambda: top_ops(fn),
                   "moe_tiles": lambda: moe_tiles_used(model, dev)}  # fmt: skip
    if compiled:
        return diagnostics
    diagnostics["experts_touched"] = lambda: routed_experts(model, fn)
    if fmt == "fp8":  # the format users serve: its experts' kernels, then its canvases through the runtime
        diagnostics["experts"] = lambda: expert_paths(experts, cfg.top_k_experts, tokens, dev)
        diagnostics["siblings"] = lambda: sibling_paths(model, tokens, dev)
        diagnostics["canvas"] = lambda: canvas_time(model, batch, CONTEXT, dev)  # the longest: last
    if fmt == "bf16":  # attention is bf16 in every format: once is enough
        diagnostics["attention"] = lambda: attention_backends(cfg, batch, length, dev)
        diagnostics["network"] = lambda: network_paths(cfg, batch, length, CONTEXT, dev)
        diagnostics["bf16_experts"] = lambda: bf16_expert_paths(experts, cfg.top_k_experts, tokens, dev)
    return diagnostics


def moe_tiles_used(model, dev: torch.device) -> str | None:
    """Which tiles the pass's Triton MoE GEMMs launch with (`moe_tiles.tiles_source`), or None where its
    experts never run on that GEMM: tensor-core experts with Triton rows (FP8 operands), or float experts
    routed on it (bf16 operands)."""
    from pipeline.runtime.kernels.moe_tiles import tiles_source

    experts = model.layers[0].experts
    if getattr(experts, "triton_rows", 0) > 0:
        return tiles_source(dev, "fp8")
    if getattr(experts, "triton", False):
        return tiles_source(dev, "bf16")
    return None


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


BATCH_STEP = 8  # canvases: how close the largest batch that fits is found


def largest_batch(
    start: int = 16,
    limit: int = 1024,
    sink: Callable[[list[dict]], None] = print,
    config: str = CONFIG,
    device: torch.device | None = None,
) -> list[dict]:
    """Double the batch from `start` until a pass runs out of GPU memory, then halve the gap between the
    largest batch that fit and the first that did not down to `BATCH_STEP` canvases; fastest format on this
    GPU, loaded as the runtime loads it (`finish_on_device`). `sink` gets the row after each batch that fits
    (a check killed at its budget keeps the largest batch found so far). `config`, `device`: another model
    configuration and device, for testing this function itself off a GPU."""
    from pipeline.bench.model import random_model
    from pipeline.model.config import ModelConfig
    from pipeline.runtime.gpu_load import finish_on_device

    dev = device or torch.device("cuda")
    arch = arch_of(*torch.cuda.get_device_capability(dev))
    fmt = "nvfp4" if arch in FP4_ARCHS else "fp8" if arch in FP8_ARCHS else "bf16"
    mcfg = ModelConfig.from_yaml(config)
    model = random_model(mcfg, torch.bfloat16, dev)
    if fmt != "bf16":
        quantize_random(model, fmt)
    finish_on_device(model, dev, None, None)
    row = {"format": fmt, "largest_batch": 0, "tried_up_to": start}

    def fits(batch: int) -> bool:
        row["tried_up_to"] = max(row["tried_up_to"], batch)
        try:
            with torch.inference_mode():
                _pass_setup(model, batch)()
            torch.cuda.synchronize(dev)
        except Exception as e:
            if not out_of_memory(e):
                raise
            return False
        finally:
            torch.cuda.empty_cache()
        row["largest_batch"] = batch
        sink([row])
        return True

    fit, over = 0, start  # over: the smallest batch known not to fit, or past `limit`
    while over <= limit and fits(over):
        fit, over = over, min(over * 2, limit + 1)
    while fit and over - fit > BATCH_STEP:
        mid = (fit + over) // 2
        fit, over = (mid, over) if fits(mid) else (fit, mid)
    return [row]


TILES_MARGIN_S = 15  # of the check's budget: the subprocess's start (torch, CUDA) and writing the table
TILES_MAX_S = 100  # of what the checks before it left: the rest goes on to the passes after it


def tune_tiles(started: float, save: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """`dgpipe bench moe-tiles` within the check's budget ($DGPIPE_GPU_BUDGET_S, at most `TILES_MAX_S`,
    counted from the process's start), its files in $DGPIPE_GPU_OUT/moe_tiles (the table to ship:
    configs/moe_tiles; the passes after this check launch with it); its rows, handed to `save` too each time
    the files are written, so that a check killed at its budget keeps the rows of its table."""
    from pipeline.bench.gpu.tiles import run_moe_tiles

    budget = min(float(os.environ.get("DGPIPE_GPU_BUDGET_S", "60")), TILES_MAX_S)
    budget -= TILES_MARGIN_S + (time.monotonic() - started)
    out = Path(os.environ.get("DGPIPE_GPU_OUT", ".")) / "moe_tiles"

    def rows_of(result: dict) -> list[dict]:
        tags = {"device": result["device"], "operand": result["operand"], "layers": result["layers"],
                "timed": result["timed"], "candidates": result["candidates"], "triton_rows": result["triton_rows"],
                "complete": result["complete"], "table_file": result["table_files"][0]}  # fmt: skip
        return [{**r, **tags} for r in result["rows"]]

    on_result = (lambda result: save(rows_of(result))) if save else None
    return rows_of(run_moe_tiles(out, None, CONFIG, budget_s=max(budget, 1.0), on_result=on_result))


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.bench.gpu.measure pass <fmt>` / `largest` / `tiles`: one measurement, rows to
    $DGPIPE_GPU_ROWS; `tests`: tests/gpu (pytest's exit status)."""
    started = time.monotonic()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["tests"]:
        import pytest

        return int(pytest.main(gpu_test_args()))
    out = os.environ.get("DGPIPE_GPU_ROWS")

    def save(rows: list[dict]) -> None:
        if out:
            atomic_write_text(Path(out), json.dumps(rows, indent=2))

    def sink(rows: list[dict]) -> None:
        save(rows)
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")

    if args[:1] == ["pass"]:
        rows = measure_pass(args[1], sink=sink, compiled="--compile" in args)
        nan = [r["batch"] for r in rows if not r["finite"]]
        if nan:  # its times stand in the rows, marked; the check fails
            sys.stderr.write(
                f"the {args[1]} pass made NaN or inf at batch {nan}: its times measure nothing real\n"
            )
            return 1
    elif args[:1] == ["tiles"]:
        sink(tune_tiles(started, save))
    else:
        sink(largest_batch(sink=sink))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
