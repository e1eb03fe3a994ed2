"""Tiny random DiffusionGemma models for tests: small enough for float64 oracles, shaped like the real one
(sliding + global layers, MoE, tied encoder/decoder)."""

from __future__ import annotations

import torch

TINY = {
    "model_type": "diffusion_gemma",
    "canvas_length": 8,
    "text_config": {
        "vocab_size": 24,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "sliding_window": 6,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
        "max_position_embeddings": 256,
        "eos_token_id": [1, 4],
    },
}


def build_tiny(dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    from pipeline.model.config import ModelConfig
    from pipeline.model.network import DiffusionGemma

    raw = {**TINY, **{k: v for k, v in overrides.items() if k != "text_config"}}
    raw["text_config"] = {**TINY["text_config"], **overrides.get("text_config", {})}
    model = DiffusionGemma(ModelConfig.from_dict(raw))
    model.init_weights(std=0.5, generator=torch.Generator().manual_seed(seed))
    return model.to(dtype).eval()
