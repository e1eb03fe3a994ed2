"""The served model read back from a repository: the name `package --name` wrote and its limits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("tritonclient", reason="needs tritonclient: pip install 'dgpipe[serve]'")

from pipeline.errors import DgpipeError
from pipeline.limits import Limits
from pipeline.serving.repository import package
from pipeline.serving.served_model import read_repository


def test_name_and_limits_come_from_the_repository(tiny_checkpoint: Path, tmp_path: Path):
    limits = Limits(max_prompt_bytes=5000, max_tokens=300)
    repo = package(tiny_checkpoint, tmp_path / "repo", name="tiny-chat", limits=limits)
    served = read_repository(repo)
    assert served.name == "tiny-chat"
    assert served.limits.max_prompt_bytes == 5000 and served.limits.max_tokens == 300
    assert served.parameters["checkpoint"] == "checkpoint"


def test_zero_or_several_models_are_refused(tiny_checkpoint: Path, tmp_path: Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DgpipeError, match=r"exactly one model.*found none"):
        read_repository(tmp_path / "empty")
    repo = package(tiny_checkpoint, tmp_path / "repo", name="a")
    shutil.copytree(repo / "a", repo / "b")
    with pytest.raises(DgpipeError, match=r"exactly one model.*found a, b"):
        read_repository(repo)


def test_a_config_that_is_not_triton_is_refused(tmp_path: Path):
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text("name: 'm'\nno_such_field: 1\n")
    with pytest.raises(DgpipeError, match="not a readable Triton model config"):
        read_repository(tmp_path / "repo")


def test_a_limit_that_is_not_a_number_is_refused(tmp_path: Path):
    (tmp_path / "repo" / "m").mkdir(parents=True)
    config = 'name: "m"\nparameters { key: "max_prompt_bytes" value { string_value: "lots" } }\n'
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text(config)
    with pytest.raises(DgpipeError, match="not an integer"):
        _ = read_repository(tmp_path / "repo").limits
