"""`dgpipe inspect DIR` on the producers' outputs: what each is and what dgpipe does with it."""

from __future__ import annotations

import json
from pathlib import Path

from tests._utils.cli import dgpipe as run_cli

D = Path(__file__).resolve().parents[1] / "data" / "producers"


def test_inspect_says_what_each_dir_is():
    for sub, kind, words in [
        ("base", "hf", "loaded as is"),
        ("automodel-sft", "automodel-sft", "encoder layer_scalar copies restored"),
        ("automodel-lora", "automodel-lora", "alpha/r * B @ A, AutoModel's formula"),
        ("unsloth-lora-rslora-embed", "unsloth-lora", "rsLoRA alpha/sqrt(r)"),
    ]:
        r = run_cli("inspect", str(D / sub), "--json")
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["kind"] == kind and words in got["action"]
    text = run_cli("inspect", str(D / "automodel-lora")).stdout
    assert "NeMo AutoModel LoRA adapter" in text and "pass it as --model, this dir as --adapter" in text


def test_inspect_refuses_an_unknown_dir_in_one_line(tmp_path):
    r = run_cli("inspect", str(tmp_path))
    assert r.returncode == 2 and "not a checkpoint dgpipe knows" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
