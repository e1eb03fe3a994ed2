"""`dgpipe bench model`: pass times of a full-size configuration with random weights, against the
memory-bandwidth floor, and diffusion vs autoregressive decoding of the same weights.

No checkpoint is needed: weights are drawn on the device from the config (26B-A4B by default), so the
numbers measure the runtime and the hardware, not a download. A 256-token canvas with top-8 of 128
experts touches essentially every expert, so a batch-1 denoise pass reads ~all weights: the floor is
weight bytes / measured device copy bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipeline.bench.plots import model_plot
from pipeline.bench.results import save_result
from pipeline.bench.timing import median_seconds
from pipeline.limits import context_length
from pipeline.model.config import ModelConfig
from pipeline.model.network import DiffusionGemma, canvas_positions, rope_inv_freq
from pipeline.runtime.backends import SamplerInputs, TorchBackend, sample_logits
from pipeline.runtime.kv_cache import KVCache, attention_masks
from pipeline.sampler.reference import RowKeys

RESULT_FILE, PLOT_FILE = "bench_model.json", "bench_model.png"


@dataclass
class ModelBenchRow:
    batch: int
    ms_per_denoise_pass: float
    ms_per_sampler_step: float
    ms_per_canvas: float  # steps x (pass + sampler) + commit
    diffusion_tokens_per_s: float
    ms_per_ar_token: float
    ar_tokens_per_s: float
    diffusion_over_ar: float
    floor_ms_per_pass: float
    pass_over_floor: float
    runtime_ms_per_canvas_eager: float  # BlockDiffusionRuntime: host sync after every pass, no graphs
    runtime_ms_per_canvas_graph: float | None  # the same requests, device loop + CUDA graphs (None off CUDA)
    graph_speedup: float | None


def _graphed(fn, device: torch.device):
    """fn captured in a CUDA graph (after a warm-up on a side stream), or fn itself off CUDA. A capture that
    fails is undone before it is raised (`device_loop.undo_failed_capture`): what the caller measures next
    runs on the stream and allocator it expects."""
    from pipeline.runtime.device_loop import undo_failed_capture

    if device.type != "cuda":
        return fn
    stream = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        fn()
    stream.wait_stream(side)
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    try:
        with torch.cuda.graph(graph, pool=pool):
            fn()
    except Exception:
        undo_failed_capture(stream, pool)
        raise
    return graph.replay


def runtime_canvas_s(
    model: DiffusionGemma, batch: int, context: int, steps: int, repeats: int, graphs: bool
) -> float:
    """Median seconds for `batch` requests of `context` prompt tokens to produce one canvas each through
    the real runtime (prefill + `steps` fixed passes), minus the prefill measured alone."""
    from pipeline.model.config import SamplerConfig
    from pipeline.runtime.backends import TorchBackend
    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request

    dev, length = next(model.parameters()).device, model.config.canvas_length
    backend = TorchBackend(model)
    fixed = SamplerConfig(max_denoising_steps=steps, confidence_threshold=0.0)
    prompt = [3 + i % (model.cfg.vocab_size - 3) for i in range(context)]

    def run(max_tokens: int, n_steps: int) -> None:
        rt = BlockDiffusionRuntime(
            backend,
            max_batch=batch,
            max_len=context_length(context, 0, length),
            graphs=graphs,
            sync_every=n_steps if graphs else 1,
        )
        sampler = fixed.model_copy(update={"max_denoising_steps": n_steps})
        rt.generate([Request(prompt, max_tokens, sampler, seed=i, request_id=i) for i in range(batch)])

    full = median_seconds(lambda: run(length, steps), dev, repeats)
    one = median_seconds(lambda: run(length, 1), dev, repeats)  # prefill + 1 pass: isolates the per-pass cost
    return (full - one) / (steps - 1) * steps if steps > 1 else full


def random_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> DiffusionGemma:
    """Random weights allocated straight on the device and in `dtype`: the model is cast on the meta
    device (free) before `to_empty` allocates it, so peak memory is the weights in `dtype`, never an fp32
    copy first (the 26B in fp32 is 101 GB). The RoPE tables stay fp32, as `load_model` keeps them."""
    with torch.device("meta"):
        model = DiffusionGemma(config)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
        for name, b in model.named_buffers():
            if "inv_freq" not in name:
                b.fill_(1.0)
    for kind in set(model.layer_types):
        hd = config.text_config.layer_shape(model.layer_types.index(kind)).head_dim
        setattr(model, f"inv_freq_{kind}", rope_inv_freq(config.text_config, kind, hd).to(device))
    return model.eval()


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy (read + write counted once each)."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    secs = median_seconds(lambda: dst.copy_(src), device, 5)
    return 2 * n * 2 / secs


@torch.inference_mode()
def bench_batch(
    model: DiffusionGemma, batch: int, context: int, steps: int, repeats: int, floor_s: float
) -> ModelBenchRow:
    cfg, dev = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    length = model.config.canvas_length
    cache = KVCache(cfg, batch, context + 2 * length + 8, dtype, dev, room=length)
    slots = torch.arange(batch, device=dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (batch, context), device=dev, generator=gen)
    pos = canvas_positions(cache.lengths[slots], context)
    ones = torch.ones_like(pos, dtype=torch.bool)
    _, kv = model.encode(prompt, pos, attention_masks(pos, ones, None, True, cache.window))
    cache.write(slots, kv, pos, ones)

    canvas = torch.randint(0, cfg.vocab_size, (batch, length), device=dev, generator=gen)
    past, meta = cache.read(slots, room=length)  # as the runtime's denoise rounds read it
    cpos = canvas_positions(cache.lengths[slots], length)
    masks = attention_masks(cpos, torch.ones_like(cpos, dtype=torch.bool), meta, False, cache.window)
    probs = torch.softmax(torch.randn(batch, length, cfg.vocab_size, device=dev, generator=gen), -1).to(dtype)
    logits = model.denoise(canvas, probs, cpos, masks, past)
    t_pass = median_seconds(lambda: model.denoise(canvas, probs, cpos, masks, past), dev, repeats)

    # the runtime's own sampler (`TorchBackend`'s choice: the fused CUDA kernels, or the cache-blocked CPU
    # step), with its stability and stop rules, on the pass's logits
    backend = TorchBackend(model)
    inputs = SamplerInputs(
        temperature=torch.full((batch,), 0.6, device=dev),
        bound=torch.full((batch,), 0.1, device=dev),
        keys=RowKeys(*(torch.zeros(batch, dtype=torch.long, device=dev) for _ in range(4))),
        template=None,
        prev_argmax=torch.full((batch, length), -1, dtype=torch.long, device=dev),
        stable_count=torch.zeros(batch, dtype=torch.long, device=dev),
        stability_threshold=torch.full((batch,), 3, dtype=torch.long, device=dev),
        confidence_threshold=torch.zeros(batch, device=dev),
    )
    probs_out = torch.empty(batch * length, cfg.vocab_size, device=dev) if backend.cpu_fused else None

    def sample() -> object:
        return sample_logits(
            logits,
            inputs,
            backend.draws,
            cuda=backend.fused,
            cpu_fused=backend.cpu_fused,
            probs_out=probs_out,
        )

    t_sample = median_seconds(sample, dev, repeats)

    def commit() -> None:
        p = canvas_positions(cache.lengths[slots], length)
        pa, me = cache.read(slots)
        model.encode(
            canvas, p, attention_masks(p, torch.ones_like(p, dtype=torch.bool), me, True, cache.window), pa
        )

    t_commit = median_seconds(commit, dev, repeats)

    tok = canvas[:, :1]

    t_ar = median_seconds(_graphed(ar_step_static(model, cache, slots, tok), dev), dev, repeats)
    canvas_s = steps * (t_pass + t_sample) + t_commit
    eager = runtime_canvas_s(model, batch, context, steps, repeats, graphs=False)
    # CUDA graphs exist on CUDA only: elsewhere there is no second figure to set against the eager one
    graph = (
        runtime_canvas_s(model, batch, context, steps, repeats, graphs=True) if dev.type == "cuda" else None
    )
    diff_tps = batch * length / canvas_s
    ar_tps = batch / t_ar
    return ModelBenchRow(
        batch=batch,
        ms_per_denoise_pass=1000 * t_pass,
        ms_per_sampler_step=1000 * t_sample,
        ms_per_canvas=1000 * canvas_s,
        diffusion_tokens_per_s=diff_tps,
        ms_per_ar_token=1000 * t_ar,
        ar_tokens_per_s=ar_tps,
        diffusion_over_ar=diff_tps / ar_tps,
        floor_ms_per_pass=1000 * floor_s,
        pass_over_floor=t_pass / floor_s,
        runtime_ms_per_canvas_eager=1000 * eager,
        runtime_ms_per_canvas_graph=1000 * graph if graph is not None else None,
        graph_speedup=eager / graph if graph is not None else None,
    )


def ar_step_static(model: DiffusionGemma, cache: KVCache, slots: torch.Tensor, tok: torch.Tensor):
    """One AR decode step (encoder mode over the KV cache) with host work hoisted out, so it can be
    captured in a CUDA graph as a serving AR decoder would be."""
    p = cache.lengths[slots][:, None]
    pa, me = cache.read(slots)
    masks = attention_masks(p, torch.ones_like(p, dtype=torch.bool), me, True, cache.window)

    def step() -> torch.Tensor:
        h, _ = model.encode(tok, p, masks, pa)
        return torch.argmax(model.logits(h[:, -1]), -1)

    return step


def run_bench_model(
    config: str,
    batches: list[int],
    context: int,
    steps: int,
    repeats: int,
    dtype: str,
    device: str,
    out: Path,
) -> dict:
    """Time each batch, write out/bench_model.json and return the result (`dgpipe bench model` prints it)."""
    from pipeline.runtime.session import resolve_device, resolve_dtype

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    mcfg = ModelConfig.from_yaml(config)
    model = random_model(mcfg, dt, dev)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(dev, 2.0 if dev.type == "cuda" else 0.25)
    floor_s = weight_bytes / bandwidth
    rows = [bench_batch(model, b, context, steps, repeats, floor_s) for b in batches]
    result = {
        "config": config,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dt),
        "weight_gb": weight_bytes / 1e9,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "context": context,
        "steps_per_canvas": steps,
        "step_policy": "fixed",
        "rows": [asdict(r) for r in rows],
    }
    save_result(out, RESULT_FILE, result)
    model_plot(result, out / PLOT_FILE)
    return result


def render(r: dict) -> list[str]:
    """The `dgpipe bench model` table: one line per batch, against the bandwidth floor."""
    head = (
        f"{r['config']} random {r['dtype']} on {r['device']}: {r['weight_gb']:.1f} GB weights, copy bandwidth "
        f"{r['copy_bandwidth_gb_s']:.0f} GB/s, context {r['context']}, {r['steps_per_canvas']} fixed steps\n"
        f"{'batch':>5}{'ms/pass':>10}{'floor':>8}{'x floor':>8}{'ms/canvas':>11}{'diff tok/s':>12}{'AR tok/s':>10}"
        f"{'diff/AR':>8}{'rt eager':>10}{'rt graph':>10}{'graph x':>8}"
    )
    return [head] + [
        f"{x['batch']:>5}{x['ms_per_denoise_pass']:>10.2f}{x['floor_ms_per_pass']:>8.2f}{x['pass_over_floor']:>8.2f}"
        f"{x['ms_per_canvas']:>11.1f}{x['diffusion_tokens_per_s']:>12.1f}{x['ar_tokens_per_s']:>10.1f}"
        f"{x['diffusion_over_ar']:>8.2f}{x['runtime_ms_per_canvas_eager']:>10.1f}"
        + (
            f"{x['runtime_ms_per_canvas_graph']:>10.1f}{x['graph_speedup']:>8.2f}"
            if x["runtime_ms_per_canvas_graph"] is not None
            else f"{'-':>10}{'-':>8}"
        )
        for x in r["rows"]
    ]
