"""`dgpipe generate` on a chat checkpoint as a user runs it: --chat, --system, a prompt from stdin, --file
batches as JSON Lines, and a bad line refused before any generation. transformers is the oracle."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests._utils.chat import write_chat_checkpoint
from tests._utils.cli import BARE_ENV
from tests._utils.cli import dgpipe as run_dgpipe

# the CLI in a fresh shell (none of this environment's DGPIPE_* settings); exit 0 unless ok=False
dgpipe = functools.partial(run_dgpipe, ok=True, base_env=BARE_ENV, timeout=300)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> Path:
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")


def template_ids(ckpt: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def generate_json(ckpt: Path, *args: str, stdin: str | None = None) -> dict:
    proc = dgpipe("generate", "--model", str(ckpt), "--max-tokens", "8", "--json", *args, stdin=stdin)
    return json.loads(proc.stdout)


def test_chat_system_and_stdin_prompts_go_through_the_template(chat_ckpt: Path):
    question = "What is 2+2?"
    chat = generate_json(chat_ckpt, "--chat", question)
    assert chat["prompt_tokens"] == len(template_ids(chat_ckpt, [{"role": "user", "content": question}]))
    system = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]
    with_system = generate_json(chat_ckpt, "--system", "Answer briefly.", question)  # --system implies --chat
    assert with_system["prompt_tokens"] == len(template_ids(chat_ckpt, system))
    piped = generate_json(chat_ckpt, "--chat", "-", stdin=question)
    assert piped == {**chat, **{k: piped[k] for k in ("time_to_first_canvas_s", "total_s", "tokens_per_s")}}
    plain = generate_json(chat_ckpt, question)  # no --chat: "<bos>{prompt}", one token per character
    assert plain["prompt_tokens"] == 1 + len(question)


def test_file_batch_prints_one_json_line_per_input_in_order(chat_ckpt: Path, tmp_path: Path):
    rows = [
        {"prompt": "What is 2+2?"},
        {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]},
        {"prompt": "A much longer question about the colour of the sky?"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Parts"}]}]},
        {"prompt": "x"},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps(r) for r in rows[:2])
        + "\n\n"
        + "\n".join(json.dumps(r) for r in rows[2:])
        + "\n"
    )
    proc = dgpipe(
        "generate", "--model", str(chat_ckpt), "--file", str(prompts), "--chat", "--max-tokens", "8", "--json"
    )
    lines = proc.stdout.splitlines()
    assert len(lines) == len(rows)  # the blank line is skipped; one line per input
    assert all(line.startswith("{") and "\n" not in line and ": " not in line for line in lines)  # compact
    got = [json.loads(line) for line in lines]
    want = [r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}] for r in rows]
    assert [g["prompt_tokens"] for g in got] == [len(template_ids(chat_ckpt, m)) for m in want]  # in order
    assert all(g["finish_reason"] in ("stop", "length") and len(g["tokens"]) <= 8 for g in got)
    # batched together, each answer is the one the same prompt gets alone (same seed)
    alone = generate_json(chat_ckpt, "--chat", rows[0]["prompt"])
    assert got[0]["tokens"] == alone["tokens"]


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("{not json", ":2: not valid JSON"),
        ('{"text": "hi"}', ':2: expected {"prompt": "..."} or {"messages": [...]}'),
        ('{"messages": [{"role": "bot", "content": "x"}]}', ":2: messages[0]: unknown role 'bot'"),
    ],
)
def test_a_bad_line_is_one_error_naming_it_before_any_generation(
    chat_ckpt: Path, tmp_path: Path, bad, needle
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "fine"}) + "\n" + bad + "\n" + json.dumps({"prompt": "also"}) + "\n"
    )
    proc = dgpipe("generate", "--model", str(chat_ckpt), "--file", str(prompts), "--json", ok=False)
    assert proc.returncode == 2 and proc.stdout == ""  # nothing generated, not even the good first line
    assert f"{prompts}{needle}" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
