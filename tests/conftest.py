from __future__ import annotations

from pathlib import Path

import pytest

from tests._utils.tiny import build_tiny


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Path:
    """A random tiny checkpoint in HF layout, written by dgpipe (tokenizer: the Sudoku character set)."""
    from pipeline.demo import tokenizer as stok
    from pipeline.model.checkpoint import save_checkpoint

    out = tmp_path / "tiny"
    save_checkpoint(build_tiny(), out, generation_config={"max_denoising_steps": 4})
    stok.save_tokenizer(out)
    return out
