from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # test helpers (hf_reference) import by name

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
    from pipeline.config import ModelConfig
    from pipeline.model import DiffusionGemma

    raw = {**TINY, **{k: v for k, v in overrides.items() if k != "text_config"}}
    raw["text_config"] = {**TINY["text_config"], **overrides.get("text_config", {})}
    model = DiffusionGemma(ModelConfig.from_dict(raw))
    model.init_weights(std=0.5, generator=torch.Generator().manual_seed(seed))
    return model.to(dtype).eval()


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    """A random tiny checkpoint in HF layout, written by dgpipe (tokenizer: the Sudoku character set)."""
    from pipeline import sudoku_tokenizer as stok
    from pipeline.checkpoint import save_checkpoint

    out = tmp_path / "tiny"
    save_checkpoint(build_tiny(), out, generation_config={"max_denoising_steps": 4})
    stok.save_tokenizer(out)
    return out
