"""Config sanity limits: sizes a corrupt or hostile config.json claims are refused while parsing, before any
allocation (before: `num_hidden_layers: 10**6` made `dgpipe generate` hang instead of refusing)."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import CheckpointError
from pipeline.model.config import MAX_PARAMETERS, ModelConfig
from pipeline.resources import PACKAGE_DIR, configs_dir

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


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda d: d["text_config"].update(num_layers=d["text_config"].pop("num_hidden_layers")),
         "unknown key 'text_config.num_layers' (did you mean 'text_config.num_hidden_layers'?)"),
        (lambda d: d.update(canvas_len=82), "unknown key 'canvas_len' (did you mean 'canvas_length'?)"),
    ],
)  # fmt: skip
def test_a_misspelt_key_in_a_model_yaml_is_refused_by_name(tmp_path, edit, says):
    """dgpipe's own model YAML (`--config FILE`) is read strictly: every field defaults to the 26B's value,
    so a misspelt `num_hidden_layers` silently made a 30-layer model of the tiny one."""
    import yaml

    from pipeline.model.config import ModelConfig

    raw = yaml.safe_load((configs_dir() / "models" / "sudoku-tiny.yaml").read_text())
    edit(raw)
    f = tmp_path / "mine.yaml"
    f.write_text(yaml.safe_dump(raw))
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_yaml(str(f))
    assert str(e.value) == f"{f}: {says}"
    assert ModelConfig.from_yaml("sudoku-tiny").text_config.num_hidden_layers == 8  # the shipped ones read
