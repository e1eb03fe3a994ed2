"""Prompt formats: how a checkpoint's text becomes prompt tokens and a canvas template, and how generated
tokens become text again.

A checkpoint names its format in dgpipe.json (`prompt_format`; older checkpoints only have a `task`, which
is taken as the format's name when a format of that name exists). The runtime looks the name up here and
never branches on it. Formats are plain text (built in) and those of the `dgpipe.prompt_formats`
entry-point group: installed packages' formats, dgpipe's own demo format included
(`[project.entry-points."dgpipe.prompt_formats"] myformat = "mypkg.fmt:MyFormat"`). A format's module is
imported only when a checkpoint names it, so the runtime neither depends on nor pays for any format but the
one in use.

A checkpoint only ever supplies a *name*: the code behind it is dgpipe's or an installed package's, never
something read from the checkpoint directory (its chat template is data, rendered in jinja2's sandbox).

Chat: a format answers OpenAI-style messages with `encode_messages`. The default format renders them with the
checkpoint's chat template (`pipeline.runtime.chat_template`) when it has one; a task format reads what it
needs from them (a task format may read the last user message as the task).

Task knowledge lives in the format, so no stage branches on a task: a format may also supply the default
calibration set of `dgpipe quantize` (`calibration_prompts`), the accuracy evaluation of `dgpipe eval
quantization` (`evaluation_examples`, `answer_ids`, `evaluate`) and the deploy smoke test (`smoke_prompt`,
`smoke_check`, `check_answer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from pipeline.errors import CheckpointError, DgpipeError, InputError
from pipeline.model.checkpoint import Checkpoint
from pipeline.runtime.chat_template import Message, load_chat_template

ENTRY_POINT_GROUP = "dgpipe.prompt_formats"
DEFAULT = "text"


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as the model takes it: token ids, and the canvas template it implies (pinned ids, -1 free)."""

    ids: list[int]
    template: list[int] | None = None


@dataclass(frozen=True)
class Example:
    """One evaluation item of a task format: a prompt and its reference answer."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class Accuracy:
    """A format's verdict on a model over a set of examples."""

    solve_rate: float  # answers the format judges right
    valid_rate: float  # answers well-formed for the task (right or not)
    mean_steps: float  # denoise steps per canvas
    p90_steps: float
    tokens_per_s: float  # generated tokens per second of the evaluation (the speed side of a trade-off)


class PromptFormat(Protocol):
    needs_tokenizer: bool  # whether text prompts need the checkpoint's tokenizer.json
    example_prompt: str  # a typical prompt: the Triton warm-up request and the benchmark prompt
    smoke_prompt: str  # what the deploy smoke test sends (pipeline.deploy.smoke); optional: example_prompt
    smoke_check: str  # what `check_answer` accepts, in words (deploy --dry-run prints it)

    @staticmethod
    def check_answer(prompt: str, text: str) -> str | None:
        """The smoke test's verdict on the server's answer `text` to `prompt`: None when it is right, else
        what is wrong. A static method: the smoke Job runs it with the format's name alone, without the
        checkpoint. Optional: formats without it accept any non-empty answer."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt text (non-empty) -> prompt token ids; bad text raises InputError."""
        ...

    def encode_messages(self, messages: list[Message]) -> list[int]:
        """Checked messages (chat_template.parse_messages) -> prompt token ids; a format that cannot take
        them raises InputError."""
        ...

    def infill_template(self, text: str) -> list[int] | None:
        """The canvas template this prompt implies (pinned token ids, -1 = free), or None for none."""
        ...

    def decode(self, tokens: Sequence[int]) -> str:
        """Generated canvas tokens -> text."""
        ...

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        """Prompt token ids (from encode_prompt or encode_messages) -> the text the model was prompted with:
        what a server echoes before the answer. Optional: formats without it use `decode`."""
        ...

    def present(self, prompt: str, text: str) -> tuple[str, str | None]:
        """How a person reads the answer to `prompt`: the text to show, and a verdict line (or None)."""
        ...

    # ---- optional: a task format's data and judgement (a plain text format has none) ----
    def calibration_prompts(self, n: int, seed: int) -> list[EncodedPrompt]:
        """`n` prompts of the distribution the model serves, drawn with `seed`: the calibration set of
        `dgpipe quantize` when no --calib-data is given."""
        ...

    def evaluation_examples(self, n: int, seed: int) -> list[Example]:
        """`n` held-out examples drawn with `seed` (a seed other than the calibration one)."""
        ...

    def answer_ids(self, answer: str) -> list[int]:
        """A reference answer as canvas tokens (the fixed canvases the quantization KL is measured on)."""
        ...

    def evaluate(
        self, model: Any, examples: list[Example], sampler: Any, progress: Callable[[int], None] | None
    ) -> Accuracy:
        """Generate an answer to every example with `model` and `sampler` and judge it."""
        ...


# (checkpoint, tokenizers.Tokenizer or None) -> PromptFormat
PromptFormatFactory = Callable[[Checkpoint, Any], PromptFormat]


class TextFormat:
    """The default: a plain prompt through dgpipe.json's `prompt_template` ("<bos>{prompt}" when absent),
    messages through the checkpoint's chat template; both tokenized by tokenizer.json."""

    needs_tokenizer = True
    example_prompt = "Hello"
    smoke_prompt = "Why is the sky blue?"
    smoke_check = "a non-empty answer"

    def __init__(self, checkpoint: Checkpoint, tokenizer: Any) -> None:
        self.template = checkpoint.dgpipe.get("prompt_template", "<bos>{prompt}")
        self.tokenizer = tokenizer
        self.chat_template = load_chat_template(checkpoint.path)  # None: plain prompts only

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer.json", "pass token ids instead of text")
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        return self._encode(self.template.format(prompt=text))

    def encode_messages(self, messages: list[Message], tools: list | None = None) -> list[int]:
        if self.chat_template is None:
            raise InputError(
                "this checkpoint has no chat template (chat_template.jinja or tokenizer_config.json)",
                "send a plain prompt (without --chat / messages)",
            )
        # the rendered text holds the template's special tokens already: none are added again
        return self._encode(self.chat_template.render(messages, add_generation_prompt=True, tools=tools))

    def infill_template(self, text: str) -> list[int] | None:
        return None

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, tokens))
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def decode_prompt(self, prompt_ids: Sequence[int]) -> str:
        # a plain prompt reads back as given; a chat as its rendered template without special tokens
        return self.decode(prompt_ids)

    def present(self, prompt: str, text: str) -> tuple[str, str | None]:
        return text, None

    @staticmethod
    def check_answer(prompt: str, text: str) -> str | None:
        return None if text.strip() else "the answer is empty"


_REGISTRY: dict[str, PromptFormatFactory] = {DEFAULT: TextFormat}  # and each installed format once loaded


def prompt_format_factory(name: str) -> PromptFormatFactory | None:
    """The factory built in or installed under `name`; None when there is none."""
    if name not in _REGISTRY:
        found = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
        if not found:
            return None
        _REGISTRY[name] = found[0].load()
    return _REGISTRY[name]


def known_prompt_formats() -> list[str]:
    return sorted({*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))})


def require_hooks(fmt: PromptFormat, hooks: Sequence[str], what: str, model: object) -> None:
    """Refuse, naming what is missing, when `what` (a command that needs the task knowledge of `model`'s
    format) finds one of the optional `hooks` absent: a plain text model has no examples to draw or judge."""
    missing = [h for h in hooks if not callable(getattr(fmt, h, None))]
    if missing:
        raise DgpipeError(
            f"{model}: its prompt format {type(fmt).__name__} has no {', '.join(missing)}",
            f"{what} needs a prompt format that supplies {', '.join(hooks)} (a task format, like the "
            f"embedded model's)",
        )


def prompt_format_name(checkpoint: Checkpoint) -> str:
    """The name of the format the checkpoint names (dgpipe.json `prompt_format`, else a format named like
    its `task`, else plain text)."""
    name = checkpoint.dgpipe.get("prompt_format")
    if name is not None:
        if prompt_format_factory(str(name)) is None:
            raise CheckpointError(
                f"{checkpoint.path / 'dgpipe.json'}: unknown prompt_format {name!r}",
                f"known: {', '.join(known_prompt_formats())} (installed packages add formats under the "
                f"'{ENTRY_POINT_GROUP}' entry-point group)",
            )
        return str(name)
    task = checkpoint.dgpipe.get("task")
    return str(task) if task and prompt_format_factory(str(task)) is not None else DEFAULT


def prompt_format_for(checkpoint: Checkpoint, tokenizer: Any) -> PromptFormat:
    """The format the checkpoint names (`prompt_format_name`)."""
    factory = prompt_format_factory(prompt_format_name(checkpoint))
    assert factory is not None  # prompt_format_name only answers names that resolve
    return factory(checkpoint, tokenizer)
