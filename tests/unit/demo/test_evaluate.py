"""`dgpipe eval sudoku`: bands and arms on the same puzzles, intervals and paired tests in the JSON."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.demo import sudoku
from pipeline.demo.evaluate import eval_sudoku
from pipeline.demo.stats import wilson_interval
from pipeline.runtime.session import load_session


@pytest.mark.slow  # 3 arms x 2 bands through the CLI, then again one by one (~30 s on 2 cores)
def test_bands_and_arms_are_paired_and_match_single_runs():
    args = [
        "eval",
        "sudoku",
        "--n",
        "6",
        "--batch",
        "6",
        "--givens",
        "55-61,30-32",
        "--arms",
        "pinned,unpinned,ar",
    ]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["task"] == "Sudoku solver" and [b["givens"] for b in out["bands"]] == [[55, 61], [30, 32]]
    s = load_session()
    for band in out["bands"]:
        lo, hi = band["givens"]
        puzzles = sudoku.make_dataset(20_000, 6, (lo, hi))
        outcomes = {}
        for arm, decode, infill in [
            ("pinned", "diffusion", True),
            ("unpinned", "diffusion", False),
            ("ar", "ar", True),
        ]:
            ref = eval_sudoku(s.model, puzzles, (lo, hi), s.sampler(), decode=decode, infill=infill, batch=6)
            got = band["arms"][arm]
            assert (got["solve_rate"], got["mean_steps"]) == (ref.solve_rate, ref.mean_steps), arm
            assert got["solve_ci95"] == list(wilson_interval(sum(ref.outcomes), 6))
            outcomes[arm] = ref.outcomes
        tests = {(t["a"], t["b"]): t for t in band["mcnemar"]}
        assert set(tests) == {("pinned", "unpinned"), ("pinned", "ar"), ("unpinned", "ar")}
        t = tests[("pinned", "ar")]
        assert t["only_a"] == sum(a and not b for a, b in zip(outcomes["pinned"], outcomes["ar"]))
        assert t["only_b"] == sum(b and not a for a, b in zip(outcomes["pinned"], outcomes["ar"]))
    # the flat top level is the first band's first arm, for scripts that read one figure
    assert out["solve_rate"] == out["bands"][0]["arms"]["pinned"]["solve_rate"] and out["n"] == 6
    text = CliRunner().invoke(app, args)
    assert (
        text.exit_code == 0 and "Sudoku solver" in text.output and "McNemar pinned vs unpinned" in text.output
    )
    assert "30-32" in text.output


def test_bad_arms_and_bands_are_refused(monkeypatch, capsys):
    """One `error:` line and exit code 2 (the console entry point maps errors), before any model work."""
    from pipeline.cli import main

    for extra, needle in [
        (["--arms", "pinned,bogus"], "choose distinct arms"),
        (["--arms", "pinned,pinned"], "choose distinct arms"),
        (["--arms", "pinned", "--decode", "ar"], "--arms replaces"),
        (["--givens", "45-61,60-50"], "--givens 60-50"),
    ]:
        monkeypatch.setattr(sys, "argv", ["dgpipe", "eval", "sudoku", "--n", "2", *extra])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and needle in err, err


def test_baseline_checkpoint_is_one_more_paired_arm(tmp_path):
    """--baseline DIR: other weights on the same puzzles and seeds, tested against the arms. Here a copy
    with noise added to one weight, so its outcomes differ; each figure equals a direct run."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.runtime.session import default_model_path

    other = tmp_path / "other"
    shutil.copytree(default_model_path(), other)
    state = load_file(other / "model.safetensors")
    name = next(k for k in state if "layers.0.mlp.down_proj" in k)
    gen = torch.Generator().manual_seed(0)
    state[name] = state[name] + state[name].std() * torch.randn(state[name].shape, generator=gen)
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    args = ["eval", "sudoku", "--n", "8", "--batch", "8", "--givens", "36-44", "--arms", "pinned"]
    r = CliRunner().invoke(app, [*args, "--baseline", str(other), "--json"])
    assert r.exit_code == 0, r.output
    band = json.loads(r.output)["bands"][0]
    assert set(band["arms"]) == {"pinned", "baseline"}
    puzzles = sudoku.make_dataset(20_000, 8, (36, 44))
    s, b = load_session(), load_session(other)
    with torch.inference_mode():
        mine = eval_sudoku(s.model, puzzles, (36, 44), s.sampler(), batch=8)
        theirs = eval_sudoku(b.model, puzzles, (36, 44), s.sampler(), batch=8)
    assert (theirs.outcomes, theirs.mean_steps) != (mine.outcomes, mine.mean_steps)  # really other weights
    assert band["arms"]["baseline"]["solve_rate"] == theirs.solve_rate
    assert band["arms"]["baseline"]["mean_steps"] == theirs.mean_steps
    assert band["arms"]["pinned"]["solve_rate"] == mine.solve_rate
    (t,) = band["mcnemar"]
    assert (t["a"], t["b"]) == ("pinned", "baseline")
    assert t["only_a"] == sum(x and not y for x, y in zip(mine.outcomes, theirs.outcomes))
    assert t["only_b"] == sum(y and not x for x, y in zip(mine.outcomes, theirs.outcomes))
