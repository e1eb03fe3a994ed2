"""Linears that read one input, computed together on the GPU: each attention layer's q, k and v projections,
and each gated MLP's gate and up projections (the dense MLP's and the self-conditioning's).

Quantized linears that agree on the mode and the input scale share one quantization of the input: the same
operand and scales each of them would compute, so their outputs are unchanged bit for bit, for one
quantization instead of three (q, k, v) or two (gate, up). ModelOpt's export gives such siblings one input
scale (`modelopt.torch.export.quant_utils.preprocess_linear_fusion` sets the maximum of their calibrated
amaxes, as TensorRT-LLM and vLLM run them fused), and the NVFP4 ones one global weight scale too.

Siblings are also one GEMM where their weights concatenate exactly: float weights, FP8 ones with equal
per-tensor weight scales, NVFP4 ones with equal global scales, the Hopper/Ada NVFP4 fallback's per-row FP8
ones. ModelOpt's FP8 exports keep each linear's own weight scale: there the merged GEMM is RowWise, each
column scaled by its linear's input scale times its weight scale (`ScaledLinear` mode "fp8_columns"), where
the probe ran that form (`probe.check_fp8_columns`); elsewhere they share the quantization only. The codes
stay the checkpoint's. vLLM does the same where its kernel takes per-channel scales (`convert_to_channelwise`),
and for per-tensor GEMMs re-quantizes fused shards to the largest of their scales (`requantize_with_max_scale`,
both in vllm/model_executor/layers/quantization/utils/w8a8_utils.py), which rounds the others' weights again.
The merged output is split into column views read in place: gate and up by the gated GeLU, q, k and v by
attention's head-norms kernel (`kernels.chains.head_norms`, tokens one stride apart). q, k and v merge only
where that kernel is installed: torch's RMSNorm copies a non-contiguous input (`expect_contiguous` in its
CUDA norm), which would give back the launches saved.

Merged weights are one allocation: the linears' own weights become views of it, so they still compute alone
(`Attention.project_kv`, torch.compile's graphs) and the model holds no second copy. One exception: NVFP4
block scales are swizzled in 128-row tiles, and where a part's rows end inside a tile (the 26B's 2,112-row
gate and up) the merged scales are swizzled anew and the parts keep theirs (1/8 of the FP4 weight bytes;
`SharedInput.held_apart`). The merged module is not a submodule of the model (this object is a plain
callable), so the model's parameters and buffers count each byte once. CUDA only, through
`gpu_load.finish_on_device`: the CPU path is untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model import scaled_layout as sl
from pipeline.model.network import DiffusionGemma
from pipeline.runtime.tensor_cores import ScaledLinear, in_one_pass, rowwise_output_dtype

# (un-normed rows [M, K], their norm, a quantized linear) -> the linear's GEMM operand of the normed rows and
# its scales, as `ScaledLinear.quantize` gives them
NormQuant = Callable[[torch.Tensor, nn.Module, ScaledLinear], tuple[torch.Tensor, list[torch.Tensor]]]


def norm_operand(
    mode: str,
    fp8_kernel: Callable[[torch.Tensor, nn.Module, torch.Tensor], torch.Tensor] | None,
    nvfp4_kernel: Callable[[torch.Tensor, nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None,
) -> NormQuant | None:
    """The operand of norm(rows) in one pass for linears in `mode` from the kernels the GPU loader installs
    where probed (`kernels.chains.norm_fp8_or_torch`, `norm_nvfp4_or_torch`; None: not probed): FP8 codes at
    the static input scale, or NVFP4 codes and block scales swizzled for `F.scaled_mm` under the global
    scale. None for other modes (the Hopper/Ada NVFP4 fallback's per-row FP8): the norm, then `quantize`."""
    if mode == "fp8" and fp8_kernel is not None:
        return lambda rows, norm, linear: (fp8_kernel(rows, norm, linear.input_scale), [linear.input_scale])
    if mode == "nvfp4" and nvfp4_kernel is not None:

        def nvfp4(
            rows: torch.Tensor, norm: nn.Module, linear: ScaledLinear
        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
            a, scales = nvfp4_kernel(rows, norm, linear.input_scale)
            return a, [scales.view(torch.float8_e4m3fn), linear.input_scale]

        return nvfp4
    return None


class SharedInput:
    """x -> each linear's output (`network.SharedInputKernel`) from one quantization of x and, where
    `merged` is set, one GEMM whose output is split into the linears' columns."""

    def __init__(self, parts: Sequence[nn.Module], merged: nn.Module | None) -> None:
        self.parts, self.merged = list(parts), merged
        self.sizes = [p.out_features for p in parts]
        # bytes held here and by none of the model's modules: NVFP4 block scales swizzled anew (`concatenate`)
        reswizzled = isinstance(merged, ScaledLinear) and merged.mode == "nvfp4" and not _whole_tiles(parts)
        self.held_apart = merged.weight_scale.numel() if reswizzled else 0
        # (rows, norm, first part) -> `quantize`'s operand of norm(rows) in one pass (`norm_operand`), set by the
        # GPU loader for parts that quantize in one pass, where probed; None: the norm, then `quantize`
        self.norm_quant: NormQuant | None = None

    def __call__(
        self, x: torch.Tensor | sl.QuantizedRows, norm: nn.Module | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Each part's output of x, or of norm(x) where `norm` is given (x the un-normed rows). x may come as
        the operand the parts' `quantize` would make of it (`scaled_layout.QuantizedRows`: `gpu_load.ffn_inputs_for`)."""
        gemms = [self.merged] if self.merged is not None else self.parts
        first = self.parts[0]
        if isinstance(x, sl.QuantizedRows):  # made by the kernel that wrote the rows
            a, a_scales = x.operand, list(x.scales)
            outs = [g.gemm(a.reshape(-1, a.shape[-1]), a_scales) for g in gemms]
            return self._split(outs, a.shape)
        x2 = x.reshape(-1, x.shape[-1])
        if norm is not None and self.norm_quant is not None and in_one_pass(first.triton, x2):
            a, a_scales = self.norm_quant(x2, norm, first)
            outs = [g.gemm(a, a_scales) for g in gemms]
        elif isinstance(gemms[0], ScaledLinear):
            a, a_scales = first.quantize(x2 if norm is None else norm(x2))
            outs = [g.gemm(a, a_scales) for g in gemms]
        else:
            x2 = x2 if norm is None else norm(x2)
            outs = [F.linear(x2, g.weight, g.bias) for g in gemms]
        return self._split(outs, x.shape)

    def _split(self, outs: list[torch.Tensor], shape: torch.Size) -> tuple[torch.Tensor, ...]:
        """The parts' outputs [..., out_features] from the GEMMs' [rows, N] (the merged one's column views)."""
        if self.merged is not None:
            outs = list(outs[0].split(self.sizes, dim=-1))
        return tuple(o.view(*shape[:-1], o.shape[-1]) for o in outs)


def shares_quantization(parts: Sequence[nn.Module]) -> bool:
    """Quantized linears whose operand of one input is the same: one mode, input scale, kernel and dtype."""
    first = parts[0]
    if not all(isinstance(p, ScaledLinear) for p in parts):
        return False
    same = lambda p: (p.mode, p.triton, p.out_dtype, p.static_scales[0])
    return all(same(p) == same(first) for p in parts)


def concatenates(parts: Sequence[nn.Module], fp8_columns: bool = False) -> bool:
    """Linears whose weights, stacked by output row, are one linear computing all their outputs exactly.
    `fp8_columns`: FP8 ones with a weight scale each too, as one RowWise GEMM (where it passed its probe)."""
    first = parts[0]
    if all(type(p) is nn.Linear for p in parts):
        if any(p._forward_pre_hooks or p._forward_hooks for p in parts):
            return False  # a dequantized linear's input rounding (`QuantizedLoader.install`): not in a merged GEMM
        kinds = {(p.weight.dtype, p.weight.device, p.in_features, p.bias is None) for p in parts}
        return len(kinds) == 1
    if not shares_quantization(parts):
        return False
    if first.mode == "fp8_rowwise":  # per-row weight scales
        return True
    if all(p.static_scales == first.static_scales for p in parts):
        return True
    # one RowWise GEMM: only where it writes the model's dtype itself (on CUDA bf16 alone,
    # `rowwise_output_dtype`); an fp16 or fp32 model's merged outputs would be rounded to bf16, which each
    # linear alone (TensorWise, writing the model's dtype) is not
    rowwise_out = rowwise_output_dtype(first.out_dtype, first.weight.device)
    return fp8_columns and first.mode == "fp8" and rowwise_out == first.out_dtype


def concatenate(parts: Sequence[nn.Module]) -> nn.Module:
    """One linear computing `parts` side by side (`concatenates` holds): its weights and per-row scales are
    the parts' stacked by output row, per-tensor scales shared; each part's tensors become views of it. FP8
    parts with a weight scale each give an "fp8_columns" linear: per-column scales [1, N], the input scale
    times the part's weight scale (the parts keep their scalars)."""
    first = parts[0]
    columns = (
        isinstance(first, ScaledLinear)
        and first.mode == "fp8"
        and not all(p.static_scales == first.static_scales for p in parts)
    )
    if type(first) is nn.Linear:
        merged = nn.Linear(first.in_features, 1, bias=first.bias is not None, device="meta")
    else:
        merged = ScaledLinear.__new__(ScaledLinear)
        nn.Module.__init__(merged)
        merged.mode = "fp8_columns" if columns else first.mode
        merged.out_dtype, merged.triton = first.out_dtype, first.triton
        merged.static_scales = first.static_scales[:1] if columns else first.static_scales  # the input's
    merged.out_features = sum(p.out_features for p in parts)
    for name, t in [*first.named_parameters(recurse=False), *first.named_buffers(recurse=False)]:
        if name == "weight_scale" and columns:
            per_column = [(p.input_scale * p.weight_scale).float().expand(p.out_features) for p in parts]
            merged.register_buffer(name, torch.cat(per_column).reshape(1, -1))
            continue
        if t.dim() == 0:  # a per-tensor scale, equal across the parts
            merged.register_buffer(name, t)
            continue
        if name == "weight_scale" and first.mode == "nvfp4" and not _whole_tiles(parts):
            _assign(merged, name, _reswizzled(parts))  # the parts keep their own (1/8 of the FP4 bytes)
            continue
        dim = t.dim() - 1 if name == "weight_scale" and first.mode == "fp8_rowwise" else 0  # [1, N]
        pieces = [getattr(p, name) for p in parts]
        whole = _cat(pieces, dim)
        views = whole.split([piece.shape[dim] for piece in pieces], dim=dim)
        for p, view in zip(parts, views, strict=True):
            _assign(p, name, view)
        _assign(merged, name, whole)
    return merged


def _whole_tiles(parts: Sequence[ScaledLinear]) -> bool:
    """NVFP4 block scales swizzled in 128-row tiles, row tile after row tile: where every part fills whole
    tiles, the merged layout is the parts' one after another."""
    return all(p.out_features % sl.TILE_ROWS == 0 for p in parts)


def _reswizzled(parts: Sequence[ScaledLinear]) -> torch.Tensor:
    """The merged NVFP4 block scales, swizzled anew from the parts' (their rows end inside a tile)."""
    cols = parts[0].weight.shape[1] * 2 // 16  # [N, K/2] packed pairs; one scale per 16 values
    raw = [sl.from_blocked(p.weight_scale.view(torch.uint8), p.out_features, cols) for p in parts]
    return sl.to_blocked(torch.cat(raw)).view(torch.float8_e4m3fn)


def _cat(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, through a uint8 view for one-byte dtypes (FP8 codes, packed FP4 pairs)."""
    if pieces[0].element_size() != 1:
        return torch.cat(pieces, dim)
    return torch.cat([t.view(torch.uint8) for t in pieces], dim).view(pieces[0].dtype)


def _assign(module: nn.Module, name: str, t: torch.Tensor) -> None:
    if name in module._parameters:
        setattr(module, name, nn.Parameter(t, requires_grad=False))
    else:
        module.register_buffer(name, t)


def sibling_linears(
    model: DiffusionGemma, merge_qkv: bool
) -> Iterator[tuple[nn.Module, str, list[nn.Module], bool]]:
    """(module, its `SharedInputKernel` slot, the linears that read one input, whether they may merge)."""
    for layer in model.layers:
        attn = layer.self_attn
        qkv = [attn.q_proj, attn.k_proj, *([attn.v_proj] if attn.v_proj is not None else [])]
        yield attn, "qkv_kernel", qkv, merge_qkv
        yield layer.mlp, "gate_up_kernel", [layer.mlp.gate_proj, layer.mlp.up_proj], True
    sc = model.self_conditioning
    yield sc, "gate_up_kernel", [sc.gate_proj, sc.up_proj], True


def share_inputs(model: DiffusionGemma, merge_qkv: bool, fp8_columns: bool = False) -> tuple[int, int]:
    """Every layer's q/k/v and every gated MLP's gate/up on `SharedInput` where they gain from it: quantized
    linears sharing the quantization, gate and up also merged where `concatenates` (`fp8_columns`: FP8 ones
    with a weight scale each too), and q, k and v where `merge_qkv` (the head-norms kernel reads their
    columns). Returns (groups sharing a quantization, GEMMs saved by merging)."""
    shared = saved = 0
    for owner, slot, parts, may_merge in sibling_linears(model, merge_qkv):
        merged = concatenate(parts) if may_merge and concatenates(parts, fp8_columns) else None
        if merged is None and not shares_quantization(parts):
            continue
        setattr(owner, slot, SharedInput(parts, merged))
        shared += isinstance(parts[0], ScaledLinear)
        saved += 0 if merged is None else len(parts) - 1
    return shared, saved
