"""One layer's attention and experts on each kernel that can run them, timed and compared at the 26B's
shapes: the diagnostics beside a measured pass (`pipeline.bench.gpu.measure`)."""

from __future__ import annotations

import functools
import warnings

import torch

from pipeline.bench.gpu.checks import CONTEXT
from pipeline.errors import error_line


def attention_backends(cfg, batch: int, canvas: int, dev: torch.device, repeats: int = 5) -> list[dict]:
    """Per attention shape of the model (sliding, global) at this batch over CONTEXT cached keys plus the
    canvas: which SDPA kernels torch may pick for the grouped (fewer K/V heads) form, and why not (torch's
    own reasons, from `debug=True`); the ms of that form, of the same attention with K/V expanded to every
    query head (the copy not timed), and with the queries packed along the K/V heads (`network.attend_packed`,
    what the network runs where `network.packs_queries`; its copies of q and the output timed), with the
    largest difference of the other two outputs from the grouped one (all three compute the same attention).
    Each timed as the network's passes run it, without cuDNN (`network.attention_kernels`). q is laid out as
    attention makes it, transposed from [B, Q, H, D]."""
    from torch.backends.cuda import (
        SDPAParams,
        can_use_cudnn_attention,
        can_use_efficient_attention,
        can_use_flash_attention,
    )

    from pipeline.bench.timing import median_seconds
    from pipeline.model.network import attend_packed, attention_kernels

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
        with torch.inference_mode(), attention_kernels(dev):
            want = grouped().float()
            diff = {n: float((f().float() - want).abs().max()) for n, f in forms.items() if n != "grouped"}
            ms = {n: median_seconds(f, dev, repeats) * 1e3 for n, f in forms.items()}
        rows.append({"kind": kind, "q_heads": heads, "kv_heads": kv, "head_dim": hd, "keys": keys, **eligible,
                     "why_not": why, **{f"ms_{n}": t for n, t in ms.items()}, "max_abs_diff": diff["expanded"],
                     "max_abs_diff_packed": diff["packed"],
                     "new_length": new_key_lengths(q, k, v, dev, repeats)})  # fmt: skip
    return rows


BACKENDS = ("flash", "efficient", "cudnn")


def new_key_lengths(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dev: torch.device, repeats: int
) -> list[dict]:
    """Per SDPA backend, the attention the network runs (`network.attend`), unmasked (rows of one length)
    and masked (rows of different lengths: a batch's rows started from other prompts; grouped heads packed
    on CUDA), torch's grouped form with that mask (what the network ran before it packed them, and cuDNN's
    only fused form of it), and the same with K/V expanded to every query head, each first called at a key
    length it has not seen (one key more per call): ms of that first call, wall clock, and of the calls after it. cuDNN builds an execution plan for
    every new shape, keyed on batch and key length, on the host (PyTorch's
    `aten/src/ATen/native/cudnn/MHA.cpp`), and a server meets new key lengths all the time (every prompt
    length, every batch of rows), where the timed passes repeat one shape; the other backends launch the
    same kernels at any length. The network's passes leave cuDNN out (`network.attention_kernels`): these
    rows say what that costs or saves in kernel time, and what a plan build costs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pipeline.bench.timing import median_seconds, seconds
    from pipeline.model.network import attend

    groups = q.shape[1] // k.shape[1]

    def ragged(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Row i of the batch sees all keys but its last i % 8 (the mask `attention_masks` gives rows of
        several lengths): [B, 1, Q, K], True where visible."""
        keys = torch.arange(k.shape[2], device=k.device)
        hidden = torch.arange(q.shape[0], device=k.device) % 8
        visible = keys[None, :] < (k.shape[2] - hidden)[:, None]
        return visible[:, None, None, :].expand(-1, 1, q.shape[2], -1)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    forms = {"network": lambda q, k, v: attend(q, k, v, None),
             "network, masked": lambda q, k, v: attend(q, k, v, ragged(q, k)),
             "grouped, masked": lambda q, k, v: sdpa(q, k, v, attn_mask=ragged(q, k), scale=1.0, enable_gqa=groups > 1),
             "expanded": lambda q, k, v: sdpa(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), scale=1.0)}  # fmt: skip
    which = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION}  # fmt: skip
    rows, extra = [], 0
    for backend in BACKENDS:
        for form, fn in forms.items():
            extra += 1  # a key length no call before this one has used
            k2, v2 = (torch.cat([t, t[:, :, :extra]], 2) for t in (k, v))
            row = {"backend": backend, "form": form, "keys": k2.shape[2]}
            try:
                with sdpa_kernel([which[backend]]), torch.inference_mode():
                    fn(q, k, v)  # the backend's first use in the process (handles, libraries), untimed
                    call = functools.partial(fn, q, k2, v2)
                    row["first_ms"] = seconds(call, dev)[0] * 1e3
                    row["ms"] = median_seconds(call, dev, repeats) * 1e3
            except RuntimeError as e:  # this backend does not take this form here
                row["error"] = error_line(e)
            rows.append(row)
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
                paths.append(("triton_gemms", triton_gemms))
            except Exception as e:  # its own field says why; the other paths still run
                extra["triton_error"] = error_line(e)
            try:  # 64 rows (Hopper's FP8 warpgroup MMA) where its own M tile is smaller: a tile of its own,
                triton_gemms(64)  # which may not fit this GPU's shared memory
                paths.append(("triton_gemms_m64", lambda: triton_gemms(64)))
            except Exception as e:
                extra["triton_m64_error"] = error_line(e)
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
