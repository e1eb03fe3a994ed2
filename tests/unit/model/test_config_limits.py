"""Config sanity limits: sizes a corrupt or hostile config.json claims are refused while parsing, before any
allocation (before: `num_hidden_layers: 10**6` made `dgpipe generate` hang instead of refusing)."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import CheckpointError
from pipeline.model.config import MAX_PARAMETERS, ModelConfig
from pipeline.resources import PACKAGE_DIR

SUDOKU = json.loads((PACKAGE_DIR / "models" / "sudoku-tiny" / "config.json").read_text())


def with_text(**fields) -> dict:
    raw = json.loads(json.dumps(SUDOKU))
    raw["text_config"].pop("layer_types", None)
    raw["text_config"].update(fields)
    return raw


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"num_hidden_layers": 10**6}, "num_hidden_layers': Input should be less than or equal to 1024"),
        ({"vocab_size": -1}, "vocab_size': Input should be greater than or equal to 1"),
        ({"hidden_size": 0}, "hidden_size': Input should be greater than or equal to 1"),
        ({"sliding_window": 0}, "sliding_window': Input should be greater than or equal to 1"),
        ({"num_experts": 10**9}, "num_experts': Input should be less than or equal to 4096"),
        # each size within its bound, together far beyond any model
        ({"hidden_size": 2**16, "num_experts": 4096, "moe_intermediate_size": 2**18}, "sanity limit"),
    ],
)
def test_absurd_sizes_are_refused_while_parsing(fields, needle):
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(")):
        ModelConfig.from_dict(with_text(**fields), "config.json")


def test_canvas_length_is_bounded_and_real_configs_pass():
    with pytest.raises(CheckpointError, match="canvas_length"):
        ModelConfig.from_dict({**SUDOKU, "canvas_length": 0})
    cfg = ModelConfig.from_dict(SUDOKU)
    assert 0 < cfg.text_config.parameter_estimate() < MAX_PARAMETERS
    # the transformers defaults (the released model's geometry) are far within every limit
    assert (
        ModelConfig.from_dict(
            {"model_type": "diffusion_gemma", "text_config": {}}
        ).text_config.num_hidden_layers
        == 30
    )
