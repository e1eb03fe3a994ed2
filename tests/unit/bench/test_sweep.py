"""`dgpipe bench sweep` on the embedded model: every point is the prompt format's judgement of the same
held-out examples under one step policy; a model whose format cannot judge is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.bench.sweep import SWEEP_JSON, pareto_front, run_sweep
from pipeline.errors import DgpipeError
from pipeline.resources import EMBEDDED_MODEL


def test_sweep_points_are_the_formats_evaluation_per_policy(tmp_path: Path):
    done: list[int] = []
    result = run_sweep(None, [1.0], [1, 48], 3, tmp_path, progress=done.append)
    assert sum(done) == 2 * 3
    assert result["prompt_format"] == "sudoku" and result["n"] == 3
    one, many = result["points"]
    assert (one["max_steps"], many["max_steps"]) == (1, 48)
    assert one["mean_steps"] == 1 and 1 <= many["mean_steps"] <= 48
    for p in result["points"]:
        assert 0 <= p["solve_rate"] <= 1 and p["tokens_per_s"] > 0
    assert many["solve_rate"] >= 2 / 3  # the embedded model solves most puzzles of its band
    assert result["pareto"] == pareto_front(result["points"])
    assert json.loads((tmp_path / SWEEP_JSON).read_text()) == json.loads(json.dumps(result))


def test_a_model_whose_format_cannot_judge_is_refused(tmp_path: Path):
    model = tmp_path / "text-model"
    shutil.copytree(EMBEDDED_MODEL, model)
    meta = json.loads((model / "dgpipe.json").read_text())
    (model / "dgpipe.json").write_text(json.dumps({**meta, "task": "chat", "prompt_format": "text"}))
    with pytest.raises(DgpipeError, match="has no evaluation_examples, evaluate") as e:
        run_sweep(model, [1.0], [2], 1, tmp_path / "out")
    assert "`dgpipe bench sweep` needs" in str(e.value) and "sudoku" not in str(e.value).lower()
    assert not (tmp_path / "out" / SWEEP_JSON).exists()


def test_the_pareto_front_keeps_the_points_no_other_beats_on_both_axes():
    """Fewer mean steps and a higher solve rate are both better: a point is on the front unless another has
    no more steps and a higher rate; ties in steps keep the better rate only."""
    pts = [
        {"name": "a", "mean_steps": 10, "solve_rate": 0.5},
        {"name": "b", "mean_steps": 12, "solve_rate": 0.4},  # beaten by a on both
        {"name": "c", "mean_steps": 20, "solve_rate": 0.9},
        {"name": "d", "mean_steps": 5, "solve_rate": 0.2},
        {"name": "e", "mean_steps": 10, "solve_rate": 0.3},  # same steps as a, lower rate
        {"name": "f", "mean_steps": 30, "solve_rate": 0.9},  # c has the rate in fewer steps
    ]
    assert [p["name"] for p in pareto_front(pts)] == ["d", "a", "c"]
    assert pareto_front([]) == []
