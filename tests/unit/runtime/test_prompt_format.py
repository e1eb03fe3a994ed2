"""Prompt formats: the checkpoint names its format, the runtime looks it up and never branches on the task."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pipeline.errors import CheckpointError, InputError
from pipeline.model.checkpoint import open_checkpoint
from pipeline.resources import EMBEDDED_MODEL
from pipeline.runtime import prompt_format as pf

PUZZLE = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"


def _ckpt(**meta):
    ckpt = open_checkpoint(EMBEDDED_MODEL)
    return dataclasses.replace(ckpt, dgpipe=meta)


def test_embedded_task_selects_the_demo_sudoku_format():
    from pipeline.demo import tokenizer as stok
    from pipeline.demo.prompt_format import SudokuFormat

    ckpt = open_checkpoint(EMBEDDED_MODEL)  # dgpipe.json: task "sudoku", no prompt_format
    fmt = pf.prompt_format_for(ckpt, ckpt.tokenizer())
    assert isinstance(fmt, SudokuFormat) and not fmt.needs_tokenizer
    assert fmt.encode_prompt(PUZZLE) == stok.sudoku_prompt_ids(PUZZLE)
    template = fmt.infill_template(PUZZLE)
    assert template == stok.sudoku_infill_template(PUZZLE) and template.count(-1) == PUZZLE.count(".") + 1
    assert fmt.decode(stok.sudoku_target_ids(PUZZLE.replace(".", "5"))) == PUZZLE.replace(".", "5")
    with pytest.raises(InputError, match="puzzle: "):
        fmt.encode_prompt("123")
    explicit = pf.prompt_format_for(_ckpt(prompt_format="sudoku"), None)
    assert isinstance(explicit, SudokuFormat)


def test_text_format_is_the_default_and_unknown_names_are_refused():
    ckpt = open_checkpoint(EMBEDDED_MODEL)
    tok = ckpt.tokenizer()
    for meta in ({}, {"task": "chat"}, {"prompt_format": "text", "prompt_template": "<bos>{prompt}"}):
        fmt = pf.prompt_format_for(_ckpt(**meta), tok)
        assert isinstance(fmt, pf.TextFormat) and fmt.infill_template("x") is None
    fmt = pf.prompt_format_for(_ckpt(prompt_template="<bos><|turn>{prompt}<turn|>"), tok)
    assert fmt.encode_prompt("1") == tok.encode("<bos><|turn>1<turn|>", add_special_tokens=False).ids
    with pytest.raises(InputError, match=r"no tokenizer\.json"):
        pf.prompt_format_for(_ckpt(), None).encode_prompt("1")
    assert pf.prompt_format_for(_ckpt(), None).decode([3, 4]) == "3 4"
    with pytest.raises(CheckpointError, match="unknown prompt_format 'nope'") as err:
        pf.prompt_format_for(_ckpt(prompt_format="nope"), tok)
    assert "sudoku" in str(err.value.hint) and pf.ENTRY_POINT_GROUP in str(err.value.hint)


def test_registered_format_wins_and_session_delegates_to_it(monkeypatch):
    from pipeline.runtime.session import Session

    class Upper:
        needs_tokenizer = False

        def __init__(self, checkpoint, tokenizer):
            self.checkpoint = checkpoint

        def encode_prompt(self, text):
            return [ord(c) for c in text]

        def infill_template(self, text):
            return [-1] * len(text)

        def decode(self, tokens):
            return "".join(map(chr, tokens)).upper()

    monkeypatch.setitem(pf._REGISTRY, "upper", Upper)
    s = Session(model=None, checkpoint=_ckpt(prompt_format="upper"), tokenizer=None)  # type: ignore[arg-type]
    assert isinstance(s.prompt_format, Upper)
    assert s.encode_prompt("ab") == [97, 98] and s.default_template("ab") == [-1, -1]
    assert s.decode([97, 98]) == "AB"
    with pytest.raises(InputError, match="prompt is empty"):
        s.encode_prompt("")


def test_runtime_does_not_import_the_demo_for_other_checkpoints():
    code = (
        "import sys, dataclasses\n"
        "from pipeline.model.checkpoint import open_checkpoint\n"
        "from pipeline.resources import EMBEDDED_MODEL\n"
        "from pipeline.runtime.session import Session\n"
        "ckpt = dataclasses.replace(open_checkpoint(EMBEDDED_MODEL), dgpipe={})\n"
        "Session(model=None, checkpoint=ckpt, tokenizer=None)\n"
        "assert not [m for m in sys.modules if m.startswith('pipeline.demo')], 'demo imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_demo_format_registers_through_the_entry_point_group():
    from importlib.metadata import entry_points

    from pipeline.demo.prompt_format import SudokuFormat

    (ep,) = entry_points(group=pf.ENTRY_POINT_GROUP, name="sudoku")
    assert ep.load() is SudokuFormat and pf.prompt_format_factory("sudoku") is SudokuFormat
    assert "sudoku" in pf.known_prompt_formats()


def test_task_format_draws_calibration_and_evaluation_sets_in_the_checkpoint_band():
    from pipeline.demo import sudoku
    from pipeline.demo import tokenizer as stok

    fmt = pf.prompt_format_for(_ckpt(prompt_format="sudoku", givens_range=[40, 42]), None)
    calib = fmt.calibration_prompts(3, 7)
    assert len(calib) == 3 and calib == fmt.calibration_prompts(3, 7) != fmt.calibration_prompts(3, 8)
    examples = fmt.evaluation_examples(3, 7)
    for p, ex in zip(calib, examples, strict=True):  # same seed, same puzzles
        assert 40 <= 81 - ex.prompt.count(".") <= 42 and sudoku.is_valid_solution(ex.prompt, ex.answer)
        assert p.ids == stok.sudoku_prompt_ids(ex.prompt) and p.template == fmt.infill_template(ex.prompt)
        assert fmt.decode(fmt.answer_ids(ex.answer)) == ex.answer
    default = pf.prompt_format_for(_ckpt(prompt_format="sudoku"), None)
    assert default.givens == sudoku.DEFAULT_GIVENS
    assert not hasattr(pf.TextFormat, "calibration_prompts")  # a text model calibrates on --calib-data


def test_task_format_evaluates_the_embedded_model():
    from pipeline.runtime.session import load_session

    session = load_session(EMBEDDED_MODEL, "float32", "cpu")
    fmt = session.prompt_format
    acc = fmt.evaluate(session.model, fmt.evaluation_examples(4, 20_000), session.sampler(), None)
    assert acc.solve_rate >= 0.5 and acc.valid_rate >= acc.solve_rate and acc.mean_steps >= 1
    assert acc.tokens_per_s > 0
