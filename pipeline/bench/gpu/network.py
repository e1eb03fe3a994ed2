"""`dgpipe bench gpu`'s timing of the network's one-kernel chains (`pipeline.runtime.kernels.chains`) against
the torch forms they replace, at the model's shapes for one batch: what each kernel gains on this GPU, which
the whole pass's time cannot separate, and whether their values agree there as the probe requires.

Each pair runs on the same random inputs: RoPE on the queries of a sliding layer, the norms of a sliding
layer's queries, keys and values with the queries' and keys' RoPE (`head_norms`, against torch's fused norms), the LM head's softcap on
the logits, the experts' combine of rows in slot order, the gated GeLU of the experts' gate|up output (bf16,
and FP8 against the GeLU, product and one-pass quantization it replaces), a layer's residual sum, the
router's input scales, a layer's FFN inputs (the norms and residual sum after attention; and written as the
FP8, NVFP4 and per-row FP8 operands of the dense MLP's and the experts' GEMMs, against its rows then their one-pass
quantizations) and end (its three
last norms, two sums and scale), a layer's input norm written as its FP8 or NVFP4 operand (`norm_fp8`, `norm_nvfp4`, against the
norm then the one-pass quantization), the router's top-k and the experts' order (`pipeline.runtime.kernels.routing`;
on scores without ties, `probe.separated_scores`), and the K/V concatenation of a sliding layer over the benchmark's cached tokens, read
from a cache buffer as the runtime reads it. Apart from the chains, the FP8 pass's sibling linears merged
into one RowWise GEMM against a TensorWise GEMM each (`sibling_paths`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.errors import error_line

Pair = tuple[str, Callable[[], object], Callable[[], object]]


def _pairs(cfg, batch: int, canvas: int, context: int, dev: torch.device) -> list[Pair]:
    """(name and shape, torch form, kernel) for each chain, on inputs drawn on `dev`."""
    from pipeline.model import scaled_layout as sl
    from pipeline.model.network import (
        RMSNorm,
        apply_rope,
        combine_slots,
        ffn_inputs,
        gelu_tanh,
        layer_end,
        route_scores,
    )
    from pipeline.runtime import kernels
    from pipeline.runtime.kernels import chains as tn
    from pipeline.runtime.kernels import routing as tr
    from pipeline.runtime.probe.norms import ffn_probe_layer
    from pipeline.runtime.probe.routing import separated_scores

    gen = torch.Generator(device=dev).manual_seed(5)
    # torch's expert order with the inverse the combine computes from it, which the kernel writes too
    with_rows = lambda routing: routing._replace(rows=sl.slot_rows(routing))
    bf16 = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)
    tokens, d, k = batch * canvas, cfg.hidden_size, cfg.top_k_experts
    sliding = cfg.layer_shape(cfg.layer_types.index("sliding_attention"))
    heads, kv, hd = cfg.num_attention_heads, sliding.num_kv_heads, sliding.head_dim
    q, k_raw, v_raw = bf16(batch, canvas, heads, hd), bf16(batch, canvas, kv, hd), bf16(batch, canvas, kv, hd)
    head_norm, v_norm = (
        RMSNorm(hd, cfg.rms_norm_eps).to(dev, torch.bfloat16),
        RMSNorm(hd, cfg.rms_norm_eps, False),
    )
    angles = torch.rand(batch, canvas, hd // 2, device=dev, generator=gen) * 1e4
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    logits, cap = bf16(tokens, cfg.vocab_size) * 8, float(cfg.final_logit_softcapping)
    y, weights = bf16(tokens * k, d), torch.rand(tokens, k, device=dev, generator=gen)
    gate, up = bf16(tokens * k, 2 * cfg.moe_intermediate_size).chunk(2, dim=-1)
    scale = torch.tensor(0.05, device=dev)
    fp8_scale = torch.tensor(0.01, device=dev)
    residual, x, layer_scale, router_scale = bf16(batch, canvas, d), bf16(batch, canvas, d), bf16(1), bf16(d)
    moe, norms = (
        bf16(batch, canvas, d),
        tuple(RMSNorm(d, cfg.rms_norm_eps).to(dev, torch.bfloat16) for _ in range(3)),
    )
    layer = ffn_probe_layer(d, dev, torch.bfloat16, torch.Generator().manual_seed(6))
    experts = cfg.num_experts
    scores = separated_scores(tokens, experts, torch.Generator().manual_seed(7)).to(dev, torch.bfloat16)
    expert_scale = torch.rand(experts, device=dev, generator=gen).bfloat16() + 0.5
    index = route_scores(scores, k, expert_scale)[2]
    ring = max(cfg.sliding_window - 1, 1)
    cache = bf16(2, batch, kv, ring, hd)  # K|V buffers of a sliding layer, as the runtime's cache holds them
    past = min(context, ring)
    pk, pv = cache[0, :, :, :past], cache[1, :, :, :past]
    new = bf16(2, batch, canvas, kv, hd).transpose(2, 3)

    def ffn_operands(kind: str, fused: bool) -> tuple[torch.Tensor, ...]:
        """The dense MLP's and the experts' operands (codes; NVFP4: and block scales, the MLP's swizzled; the
        per-row FP8 fallback: and row scales) as
        bytes: written by the FFN-inputs kernel, or its rows then each GEMM's one-pass quantization (also
        where the kernel gives rows: the MLP's NVFP4 over fewer rows than a tile)."""
        s = fp8_scale if kind == "fp8" else scale
        got = tn.ffn_inputs(layer, residual, x, *(((kind, s),) * 2 if fused else ()))
        ts: list[torch.Tensor] = []
        for rows, linear in ((got[1], True), (got[2], False)):
            if isinstance(rows, sl.QuantizedRows):
                ts += [rows.operand, *(rows.scales[:1] if kind != "fp8" else ())]
            elif kind == "fp8":
                ts.append(kernels.quant.fp8(rows, s))
            elif kind == "fp8_rowwise":
                ts += kernels.quant.nvfp4_fp8_rows(rows.reshape(-1, d), s)
            else:
                ts += (kernels.quant.nvfp4_blocked if linear else kernels.quant.nvfp4)(rows.reshape(-1, d), s)
        return tuple(t.contiguous().view(torch.uint8).reshape(-1) for t in ts)

    return [
        (f"RoPE q [{batch}, {canvas}, {heads}, {hd}]", lambda: apply_rope(q, cos, sin), lambda: tn.rope(q, cos, sin)),
        (f"head norms q, k, v [{batch}, {canvas}, {heads} + {kv} + {kv}, {hd}]",
         lambda: (apply_rope(head_norm(k_raw), cos, sin), v_norm(v_raw), apply_rope(head_norm(q), cos, sin)),
         lambda: tn.head_norms(k_raw, head_norm, cos, sin, v_raw, v_norm, q, head_norm)),
        (f"softcap [{tokens}, {cfg.vocab_size}]", lambda: logits.float().div_(cap).tanh_().mul_(cap),
         lambda: tn.softcap(logits, cap)),
        (f"combine [{tokens} x {k}, {d}]", lambda: combine_slots(y, weights), lambda: tn.combine(y, None, weights)),
        (f"gated GeLU [{tokens * k}, {gate.shape[1]}]", lambda: gelu_tanh(gate) * up, lambda: tn.geglu(gate, up)),
        (f"gated GeLU to FP8 [{tokens * k}, {gate.shape[1]}]", lambda: kernels.quant.fp8(gelu_tanh(gate) * up, scale),
         lambda: tn.geglu(gate, up, scale)),
        (f"gated GeLU to NVFP4 [{tokens * k}, {gate.shape[1]}]", lambda: kernels.quant.nvfp4(gelu_tanh(gate) * up, scale),
         lambda: tn.geglu_nvfp4(gate, up, scale)),
        (f"residual sum [{tokens}, {d}]", lambda: (residual + x) * layer_scale,
         lambda: tn.add_scaled(residual, x, layer_scale)),
        (f"router input [{tokens}, {d}]", lambda: x.view(tokens, d) * router_scale * d**-0.5,
         lambda: tn.scale_columns(x.view(tokens, d), router_scale, d**-0.5)),
        (f"FFN inputs [{tokens}, {d}]", lambda: ffn_inputs(layer, residual, x), lambda: tn.ffn_inputs(layer, residual, x)),
        *(
            (f"FFN inputs to {name} [{tokens}, {d}]", lambda kind=kind: ffn_operands(kind, False),
             lambda kind=kind: ffn_operands(kind, True))
            for kind, name in (("fp8", "FP8"), ("nvfp4", "NVFP4"), ("fp8_rowwise", "NVFP4 as per-row FP8"))
        ),
        (f"layer end [{tokens}, {d}]", lambda: layer_end(residual, x, moe, norms, layer_scale),
         lambda: tn.layer_end(residual, x, moe, norms, layer_scale)),
        (f"input norm to FP8 [{tokens}, {d}]", lambda: kernels.quant.fp8(norms[0](x.view(tokens, d)), fp8_scale),
         lambda: tn.norm_fp8(x.view(tokens, d), norms[0], fp8_scale)),
        (f"input norm to NVFP4 [{tokens}, {d}]", lambda: kernels.quant.nvfp4_blocked(norms[0](x.view(tokens, d)), scale),
         lambda: tn.norm_nvfp4(x.view(tokens, d), norms[0], scale)),
        (f"router top-k [{tokens}, {experts}] top {k}", lambda: route_scores(scores, k, expert_scale)[1:],
         lambda: tr.top_k(scores, k, expert_scale)),
        (f"expert order [{tokens} x {k}]", lambda: with_rows(sl.expert_order(index, experts)),
         lambda: tr.expert_order(index, experts)),
        (f"K/V concatenation [{batch}, {kv}, {past} + {canvas}, {hd}]",
         lambda: (torch.cat([pk, new[0]], 2), torch.cat([pv, new[1]], 2)), lambda: tn.kv_cat(pk, pv, new[0], new[1])),
    ]  # fmt: skip


COMPARE_VALUES = 1 << 26  # per slice: a batch-16 softcap's [4096, 262144] results compared 256 rows at a time


def _compare(a: object, b: object) -> tuple[bool, float]:
    """(bit for bit, relative L2 distance) of two results (a tensor or a pair of them), FP8 codes as values.
    Slice by slice along the first dimension: whole, the bf16 pass's batch-16 softcap (two 4 GiB fp32
    results beside 51 GB of weights) would add their copies and differences on a GPU with 80 GB."""
    a, b = (list(t) if isinstance(t, tuple) else [t] for t in (a, b))
    same, diff, ref = True, 0.0, 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            raise ValueError(
                f"results differ in shape or dtype: {tuple(x.shape)} {x.dtype}, {tuple(y.shape)} {y.dtype}"
            )
        if x.numel() == 0:
            continue
        rows = max(1, COMPARE_VALUES // max(1, x[0].numel())) if x.dim() else 1
        for xs, ys in zip(x.split(rows), y.split(rows), strict=True) if x.dim() else [(x, y)]:
            same = same and torch.equal(_bits(xs), _bits(ys))
            diff += float((xs.float() - ys.float()).square().sum())
            ref += float(ys.float().square().sum())
    return same, diff**0.5 / max(ref**0.5, 1e-30)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its element size (a view: any layout), so that equal means bit for bit."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def network_paths(
    cfg, batch: int, canvas: int, context: int, dev: torch.device, repeats: int = 5
) -> list[dict]:
    """Per chain: ms of the torch form and of dgpipe's kernel at this batch, and how far apart their values
    are; a chain whose kernel cannot run here (no CUDA, no Triton) says why in its row, the others still run."""
    from pipeline.runtime.kernels.moe import unavailable

    why_not = unavailable(dev)

    def paths(torch_form: Callable[[], object], kernel: Callable[[], object]):
        if why_not:
            raise RuntimeError(why_not)
        return torch_form, kernel

    with torch.inference_mode():
        return [
            _timed(
                {"chain": name, "batch": batch},
                lambda t=t, k=k: paths(t, k),
                ("torch", "triton"),
                dev,
                repeats,
            )
            for name, t, k in _pairs(cfg, batch, canvas, context, dev)
        ]


def _timed(
    row: dict, make: Callable[[], tuple[Callable[[], object], Callable[[], object]]], names: tuple[str, str],
    dev: torch.device, repeats: int,
) -> dict:  # fmt: skip
    """`row` with two paths' distance (`bit_equal`, `rel_l2`) and ms (`ms_<name>`), `make` giving the paths
    (first, second); what stops them fills `error` (a path that cannot run here costs its own row)."""
    from pipeline.bench.timing import median_seconds

    try:
        first, second = make()
        row["bit_equal"], row["rel_l2"] = _compare(second(), first())
        for name, fn in zip(names, (first, second), strict=True):
            row[f"ms_{name}"] = median_seconds(fn, dev, repeats) * 1e3
    except Exception as e:
        row["error"] = error_line(e)
    return row


def render_network(rows: list[dict]) -> list[str]:
    """The markdown table of `network_paths`' rows (empty if none)."""
    if not rows:
        return []
    lines = ["", "| network chain | batch | ms torch form | ms Triton kernel | torch / Triton | bit for bit | rel L2 |",
             "|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for r in rows:
        if "ms_triton" not in r:
            lines.append(
                f"| {r['chain']} | {r['batch']} | — | — | — | {str(r.get('error')).replace('|', '/')[:80]} | — |"
            )
            continue
        lines.append(f"| {r['chain']} | {r['batch']} | {r['ms_torch']:.3f} | {r['ms_triton']:.3f} "
                     f"| {r['ms_torch'] / r['ms_triton']:.2f} | {'yes' if r['bit_equal'] else 'no'} | {r['rel_l2']:.1e} |")  # fmt: skip
    return lines


def sibling_paths(model, tokens: int, dev: torch.device, repeats: int = 5) -> list[dict]:
    """The first layer's FP8 q|k|v and its dense MLP's gate|up (a weight scale each, as ModelOpt's FP8) on
    `tokens` tokens: as the load merged them (one RowWise GEMM, `pipeline.runtime.shared_input`) against
    one TensorWise GEMM each on the same shared operand, ms of each and their distance. What the merge
    bets (one GEMM wide enough for every SM against a launch each on the per-tensor kernel) the whole
    pass's time cannot separate. Siblings the load left apart (their probe failed, or not on CUDA) say so."""
    from pipeline.runtime.shared_input import SharedInput

    layer, gen = model.layers[0], torch.Generator(device=dev).manual_seed(6)

    def paths(siblings) -> tuple[Callable[[], object], Callable[[], object]]:
        if not isinstance(siblings, SharedInput) or getattr(siblings.merged, "mode", "") != "fp8_columns":
            raise RuntimeError("not one RowWise GEMM on this load (FP8 on CUDA, where probed)")
        first, sizes = siblings.parts[0], _columns(siblings)
        x = torch.randn(tokens, first.weight.shape[1], device=dev, dtype=torch.bfloat16, generator=gen)
        a, s = first.quantize(x)
        apart = lambda: tuple(p.gemm(a, s) for p in siblings.parts)
        return apart, lambda: siblings.merged.gemm(a, s).split(sizes, dim=-1)

    groups = (("q, k, v", layer.self_attn.qkv_kernel), ("gate, up", layer.mlp.gate_up_kernel))
    with torch.inference_mode():
        return [
            _timed({"siblings": name, "tokens": tokens, "columns": _columns(siblings)},
                   lambda siblings=siblings: paths(siblings), ("apart", "merged"), dev, repeats)
            for name, siblings in groups
        ]  # fmt: skip


def _columns(siblings) -> list[int]:
    """Each part's output columns (none where the slot holds no `SharedInput`)."""
    return [p.out_features for p in getattr(siblings, "parts", [])]


def render_siblings(rows: list[dict]) -> list[str]:
    """The markdown table of `sibling_paths`' rows (empty if none)."""
    if not rows:
        return []
    lines = ["", "| FP8 siblings, layer 0 | tokens | columns | ms a TensorWise GEMM each | ms one RowWise GEMM "
             "| apart / merged | rel L2 |", "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "ms_merged" not in r:
            error = str(r.get("error")).replace("|", "/")[:80]
            lines.append(f"| {r['siblings']} | {r['tokens']} | — | — | — | {error} | — |")
            continue
        lines.append(f"| {r['siblings']} | {r['tokens']} | {' + '.join(map(str, r['columns']))} | {r['ms_apart']:.3f} "
                     f"| {r['ms_merged']:.3f} | {r['ms_apart'] / r['ms_merged']:.2f} | {r['rel_l2']:.1e} |")  # fmt: skip
    return lines
