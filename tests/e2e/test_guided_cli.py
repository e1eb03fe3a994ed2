"""`dgpipe generate --json-schema | --regex | --choice` as a user runs it, on a random chat checkpoint (valid
output can only come from the constraint); a schema the compiler cannot honour is one error line."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests._utils.chat import write_chat_checkpoint
from tests._utils.cli import BARE_ENV
from tests._utils.cli import dgpipe as run_dgpipe

# the CLI in a fresh shell (none of this environment's DGPIPE_* settings)
dgpipe = functools.partial(run_dgpipe, base_env=BARE_ENV, timeout=300)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "b"]}}, "required": ["id", "tag"]}  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.mark.slow  # three CLI processes: ~40 s on 2 cores
def test_generate_with_each_constraint_gives_valid_output(ckpt: Path, tmp_path: Path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"item {i}"}) + "\n" for i in range(4)))
    run = ["generate", "--model", str(ckpt), "--max-tokens", "64", "--json"]
    proc = dgpipe(*run, "--file", str(prompts), "--json-schema", str(schema))
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 4
    for row in rows:
        jsonschema.validate(json.loads(row["text"]), SCHEMA)
    regex = json.loads(dgpipe(*run, "x", "--regex", r"[a-f]{3}-\d{2}").stdout)["text"]
    assert re.fullmatch(r"[a-f]{3}-\d{2}", regex)
    assert json.loads(dgpipe(*run, "x", "--choice", "red,green").stdout)["text"] in ("red", "green")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--regex", "(x"], "guided regex '(x' does not compile"),
        (["--regex", "x", "--choice", "a,b"], "--regex and --choice exclude each other"),
        (["--json-schema", "/nonexistent.json"], "no such file"),
        (["--regex", "[0-9]{40}", "--max-tokens", "8"], "needs at least 41 tokens"),
    ],
)
def test_constraints_that_cannot_be_honoured_are_one_error_line(ckpt: Path, args, needle):
    proc = dgpipe("generate", "--model", str(ckpt), "x", *args)
    assert proc.returncode != 0 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_unsupported_schema_keyword_is_named(ckpt: Path, tmp_path: Path):
    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps({"type": "object", "properties": {"n": {"type": "array", "uniqueItems": True}}})
    )
    proc = dgpipe("generate", "--model", str(ckpt), "x", "--json-schema", str(schema))
    assert proc.returncode != 0 and "'uniqueItems' at #/properties/n" in proc.stderr, proc.stderr


def test_the_embedded_models_guided_output_is_the_text_its_guide_admits():
    """The Sudoku format read a guided output's end token as a blank cell: `--choice 1,2` printed "1." and
    `--regex [0-9]{5}` five digits and a dot. The end token reads as nothing, as a tokenizer's special
    tokens do, so the text is one of the choices and matches the regex."""
    from pipeline.demo.sudoku import make_dataset

    puzzle = make_dataset(3, 1, (45, 61))[0][0]
    run = ["generate", "--json", "--max-tokens", "82", puzzle]
    assert json.loads(dgpipe(*run, "--choice", "1,2").stdout)["text"] in ("1", "2")
    assert re.fullmatch(r"[0-9]{5}", json.loads(dgpipe(*run, "--regex", "[0-9]{5}").stdout)["text"])
