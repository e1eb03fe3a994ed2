"""The deploy smoke test: one request that proves a deployed model answers, and the check of its answer.

`dgpipe build` records the test from the checkpoint's prompt format (its `smoke_prompt` and static
`check_answer`: a task format's own prompt and check, a short message and "non-empty" for a chat model)
in the build manifest; `dgpipe manifests` renders it into the smoke Job's args (no shell:
the prompt is one argv item); the Job runs this module in the serving image:

    python3 -m pipeline.deploy.smoke --url http://dgpipe-triton:9000/v1 --format FORMAT --max-tokens 82 -- PROMPT
(the OpenAI-compatible port, with the Bearer key from $DGPIPE_API_KEY, as clients reach the model)

It prints one JSON line (ok, answer, problem) and exits 0 when the answer passes the check, 1 when not.
Nothing here imports torch until the check runs (the prompt format is looked up then).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.endpoints import MODEL_NAME, OPENAI_PORT
from pipeline.errors import DgpipeError

# the Service's OpenAI port (k8s/base/service.yaml), in-namespace
SERVICE_URL = f"http://dgpipe-triton:{OPENAI_PORT}/v1"
MAX_PROMPT_CHARS = 4096
_FORMAT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
DEFAULT_FORMAT = "text"  # pipeline.runtime.prompt_format.DEFAULT, spelled here to stay torch-free


@dataclass(frozen=True)
class SmokeTest:
    prompt_format: str  # the format's name: the Job looks its `check_answer` up by it
    prompt: str
    max_tokens: int  # one canvas, as the Triton warm-up request
    check: str  # what the check accepts, in words

    def __post_init__(self) -> None:
        check_prompt(self.prompt)
        if not _FORMAT_NAME.match(self.prompt_format):
            raise DgpipeError(f"smoke test: prompt format {self.prompt_format!r} is not a format name")
        if not 1 <= self.max_tokens <= 1 << 20:
            raise DgpipeError(f"smoke test: max_tokens {self.max_tokens} out of range")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> SmokeTest:
        try:
            return cls(
                prompt_format=str(d["prompt_format"]),
                prompt=str(d["prompt"]),
                max_tokens=int(d["max_tokens"]),
                check=str(d["check"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise DgpipeError(f"{where}: invalid smoke test record ({e})", "run dgpipe build again") from e

    def with_prompt(self, prompt: str) -> SmokeTest:
        return SmokeTest(self.prompt_format, prompt, self.max_tokens, self.check)

    def args(self, url: str = SERVICE_URL, model: str = MODEL_NAME) -> list[str]:
        """The smoke Job container's args. The kubelet expands $(VAR) in args and reads $$ as $, so every
        $ of the prompt is doubled: the process receives the prompt exactly as recorded."""
        return [
            "--url",
            url,
            "--model",
            model,
            "--format",
            self.prompt_format,
            "--max-tokens",
            str(self.max_tokens),
            "--",
            self.prompt.replace("$", "$$"),
        ]


def check_prompt(prompt: str) -> str:
    """A smoke prompt that renders safely: non-empty, bounded, no control characters (newlines included)."""
    if not prompt.strip():
        raise DgpipeError("smoke prompt must not be empty")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise DgpipeError(f"smoke prompt has {len(prompt)} characters, over {MAX_PROMPT_CHARS}")
    bad = sorted({c for c in prompt if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn")})
    if bad:
        raise DgpipeError(
            f"smoke prompt contains control or unassigned characters ({', '.join(map(ascii, bad))})",
            "pass a single-line prompt of printable text",
        )
    return prompt


# Without a build: the default (plain-text) format's test, for a chat model.
DEFAULT_SMOKE = SmokeTest(DEFAULT_FORMAT, "Why is the sky blue?", 64, "a non-empty answer")
COMMAND = ["python3", "-m", "pipeline.deploy.smoke"]  # k8s/smoke/job.yaml runs this


def smoke_test_for(checkpoint: Any) -> SmokeTest:
    """The smoke test for a checkpoint: its prompt format's smoke prompt (else its example prompt) and check,
    asking for one canvas of tokens."""
    from pipeline.runtime.prompt_format import prompt_format_for, prompt_format_name

    fmt = prompt_format_for(checkpoint, tokenizer=None)
    return SmokeTest(
        prompt_format=prompt_format_name(checkpoint),
        prompt=getattr(fmt, "smoke_prompt", fmt.example_prompt),
        max_tokens=checkpoint.config.canvas_length,
        check=getattr(fmt, "smoke_check", DEFAULT_SMOKE.check),
    )


def check_answer(prompt_format: str, prompt: str, text: str) -> str | None:
    """The named format's verdict on `text` (None: right, else what is wrong); needs no checkpoint. A format
    without `check_answer` accepts any non-empty answer."""
    from pipeline.runtime.prompt_format import TextFormat, known_prompt_formats, prompt_format_factory

    factory = prompt_format_factory(prompt_format)
    if factory is None:
        raise DgpipeError(
            f"unknown prompt format {prompt_format!r}", f"known: {', '.join(known_prompt_formats())}"
        )
    return (getattr(factory, "check_answer", None) or TextFormat.check_answer)(prompt, text)


def run_smoke(
    url: str, prompt_format: str, prompt: str, max_tokens: int, model: str = MODEL_NAME
) -> dict[str, Any]:
    """Send the prompt, check the answer; a refused request is a failed check, not an exception."""
    import os

    from pipeline.serving.client import complete

    if url.rstrip("/").endswith("/v1"):  # the OpenAI frontend: Bearer key, answers with the completion alone
        via: dict[str, Any] = {"api_key": os.environ.get("DGPIPE_API_KEY")}
    else:  # Triton's own endpoints echo the prompt unless told not to
        via = {"exclude_input_in_output": True}
    try:
        answer = complete(url, prompt, max_tokens=max_tokens, model=model, **via).text
    except DgpipeError as e:
        return {"ok": False, "prompt_format": prompt_format, "answer": None, "problem": str(e)}
    problem = check_answer(prompt_format, prompt, answer)
    return {"ok": problem is None, "prompt_format": prompt_format, "answer": answer, "problem": problem}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pipeline.deploy.smoke", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--format", required=True, dest="prompt_format")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--model", default=MODEL_NAME, help="the served model's name")
    p.add_argument("prompt")
    a = p.parse_args(argv)
    result = run_smoke(a.url, a.prompt_format, a.prompt, a.max_tokens, a.model)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
