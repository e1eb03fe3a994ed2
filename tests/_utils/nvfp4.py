"""Stacked routed experts quantized to NVFP4 as ModelOpt does and the export stacks them, for the MoE plugin
tests (unit: tests/unit/engine/test_moe.py; GPU: tests/gpu/test_moe_kernel_cuda.py)."""

from __future__ import annotations

import torch

from pipeline.model.fake_quant import E2M1_VALUES, E4M3_MAX, NVFP4_BLOCK


def _quantize(w: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, rows, n] with global scales broadcastable to [E, rows, 1] -> (codes uint8 [E, rows, n/2], two per
    byte, low nibble = even element; E4M3 block scales [E, rows, n/16]): nearest E2M1 of w / (block x global)."""
    blocks = w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK)
    bs = (blocks.abs().amax(-1) / 6.0 / gs).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (bs.float()[..., None] * gs[..., None]).clamp(min=1e-30)
    codes = (scaled.abs()[..., None] - E2M1_VALUES).abs().argmin(-1) + 8 * (scaled < 0)
    codes = codes.reshape(w.shape).to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), bs


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """gate_up [E, 2I, d], down [E, d, I] (float) -> the MoEExpertsW4 plugin's weight inputs by port name, as
    pipeline/onnx/quant.py insert_routed_nvfp4 stores them: global scales amax / (6 * 448) per expert and
    gate|up half ([E, 2, d/16], constant along d/16) and per expert for down ([E])."""
    gu, dn = gate_up.detach().float(), down.detach().float()
    e, two_i, d = gu.shape
    inter = two_i // 2
    ws2_gu = torch.stack([gu[:, :inter].abs().amax((1, 2)), gu[:, inter:].abs().amax((1, 2))], 1) / (
        6 * E4M3_MAX
    )
    per_row = torch.cat([ws2_gu[:, :1].expand(-1, inter), ws2_gu[:, 1:].expand(-1, inter)], 1)  # [E, 2I]
    gu4, gu_bs = _quantize(gu, per_row[..., None])
    ws2_dn = dn.abs().amax((1, 2)) / (6 * E4M3_MAX)
    dn4, dn_bs = _quantize(dn, ws2_dn[:, None, None])
    return {
        "gate_up": gu4,
        "gate_up_block_scale": gu_bs,
        "gate_up_scale": ws2_gu[:, :, None].expand(e, 2, d // NVFP4_BLOCK).contiguous(),
        "down": dn4,
        "down_block_scale": dn_bs,
        "down_scale": ws2_dn,
    }
