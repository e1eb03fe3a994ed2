"""The shipped YAML configs, and a user's own config file named in their place."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import DgpipeError
from pipeline.resources import load_yaml


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a: [1, 2\nb: :\n", "not valid YAML (while parsing a flow sequence"),
        ("", "expected a mapping of keys to values, found NoneType"),
        ("- 1\n- 2\n", "expected a mapping of keys to values, found list"),
    ],
)
def test_a_damaged_yaml_config_is_one_error_naming_the_file(tmp_path: Path, text: str, says: str):
    """`--config FILE` (quantize --estimate, train, bench) reads the user's file: a damaged one is an error
    naming it (exit 2), not a parser traceback or a TypeError further on."""
    f = tmp_path / "model.yaml"
    f.write_text(text)
    with pytest.raises(DgpipeError) as e:
        load_yaml("models", str(f))
    assert str(e.value).startswith(f"{f}: {says}") and e.value.hint == "fix the file"


def test_a_config_file_is_read_as_a_mapping(tmp_path: Path):
    f = tmp_path / "model.yaml"
    f.write_text("canvas_length: 8\n")
    assert load_yaml("models", str(f)) == {"canvas_length": 8}
