"""Chat templates: a checkpoint's `chat_template.jinja` (or `chat_template` in tokenizer_config.json) rendered
as transformers' `apply_chat_template(messages, add_generation_prompt=True)` renders it, and the messages
it takes, checked once for every caller (CLI, `--file` batches, the Triton model's `messages` input).

The environment is transformers' own: jinja2's ImmutableSandboxedEnvironment (templates come from model
repositories, so they are untrusted code) with `trim_blocks`, `lstrip_blocks`, the loop-control extension,
`raise_exception`, `strftime_now`, a `tojson` filter that does not escape HTML, and the tokenizer config's
named special tokens (`bos_token`, `eos_token`, ...) as variables. The rendered text already holds the
template's special tokens, so it is tokenized without adding them again.

Light at import (stdlib only): jinja2 is imported when a template is first compiled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.errors import CheckpointError, InputError
from pipeline.runtime.content_format import ContentFormat, content_format

TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template sees as variables
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
ROLES = ("system", "developer", "user", "assistant", "tool")

Message = dict[str, Any]


class MessagesError(InputError):
    """Messages that are not a list of {"role", "content"} objects; the message names the first problem."""


def parse_messages(raw: str | bytes | list[Any]) -> list[Message]:
    """OpenAI-style messages (a JSON string or an already-parsed list) checked: a non-empty list of objects
    with a known `role` and a `content` that is a string or a list of {"type": "text", "text": ...} parts
    (kept as a list of such parts, `_text_parts`: how it reaches a template is the template's choice, see
    `ChatTemplate.render`). Keys whose value is null are dropped, as transformers does before rendering, and
    an assistant's earlier tool calls carry their arguments as objects (`_call_arguments`)."""
    if isinstance(raw, bytes | str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise MessagesError(
                f"messages: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
            ) from e
    if not isinstance(raw, list):
        raise MessagesError(f"messages: must be a JSON list of messages (got {type(raw).__name__})")
    if not raw:
        raise MessagesError("messages: the list is empty", "send at least one user message")
    out = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise MessagesError(
                f"{where}: must be an object with 'role' and 'content' (got {type(msg).__name__})"
            )
        msg = {k: v for k, v in msg.items() if v is not None}
        role = msg.get("role")
        if not isinstance(role, str):
            raise MessagesError(f"{where}: 'role' is missing or not a string")
        if role not in ROLES:
            raise MessagesError(f"{where}: unknown role {role!r}", f"roles: {', '.join(ROLES)}")
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = _text_parts(content, where)
        elif not isinstance(content, str) and not (role == "assistant" and "tool_calls" in msg):
            raise MessagesError(f"{where}: 'content' is missing or not a string or a list of text parts")
        if role == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_call_arguments(call) for call in msg["tool_calls"]]
        out.append(msg)
    return out


def _call_arguments(call: Any) -> Any:
    """An earlier tool call with its `function.arguments` as the object it encodes. OpenAI's messages carry
    them as a JSON string; tool-use chat templates expect the object (transformers' chat-template docs, and
    vLLM's `_postprocess_messages` parses them so): passed as the string, a Hermes template writes the call
    twice encoded, unlike the calls the model was trained on. Empty arguments are {}; a string that is not
    JSON (a model can write one) is left as it is."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or isinstance(function.get("arguments"), dict):
        return call
    arguments = function.get("arguments")
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return call
    return {**call, "function": {**function, "arguments": arguments}}


def _text_parts(parts: list[Any], where: str) -> list[dict[str, str]]:
    """A content-part list checked: text parts only, each as {"type": "text", "text": ...}. Any other part
    type (image_url, input_audio, file, ...) is refused naming it: this model reads text only."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"part type {kind!r}" if isinstance(kind, str) else "a part without a 'type'"
            raise MessagesError(
                f"{where}.content[{j}]: {what} is not supported: this model reads text parts only "
                '({"type": "text", "text": "..."})'
            )
        if not isinstance(part.get("text"), str):
            raise MessagesError(f"{where}.content[{j}]: a text part needs 'text' (a string)")
        texts.append({"type": "text", "text": part["text"]})
    return texts


def message_text(message: Message) -> str:
    """A message's text: its content, or its text parts joined with "\n" (as vLLM reads them)."""
    content = message.get("content", "")
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content if isinstance(content, str) else ""


def last_user_text(messages: list[Message]) -> str:
    """The text of the last user message: what a format without a chat template (the Sudoku puzzle) reads."""
    for msg in reversed(messages):
        if msg.get("role") == "user":
            return message_text(msg)
    raise MessagesError("messages: there is no user message")


def chat_messages(prompt: str, system: str | None = None) -> list[Message]:
    """A one-turn conversation: the optional system message, then the prompt as the user's."""
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the Jinja text
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: variables the template may read

    @property
    def content_format(self) -> ContentFormat:
        """How the template reads a message's content (`pipeline.runtime.content_format`): "openai", a list of
        parts it loops over; "string", one string."""
        return _content_format(self.source)

    @property
    def tool_call_format(self) -> str | None:
        """The tool-call format the template declares, which a reply's tool calls are parsed by: "hermes"
        (calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Hermes' and Qwen's templates), or
        None when the template declares none (the model has no way of its own to call a tool)."""
        return "hermes" if "<tool_call>" in self.source else None

    def render(
        self, messages: list[Message], add_generation_prompt: bool = True, tools: list | None = None
    ) -> str:
        """The prompt text transformers' `apply_chat_template(..., tokenize=False, tools=tools)` gives for
        `messages` (a template that never reads `tools` renders the same text without them). Content parts
        reach a template that loops over them as the list they are, as transformers passes them; any other
        template gets their texts joined with "\n", as vLLM does (it would otherwise print the list)."""
        import jinja2

        if self.content_format == "string":
            messages = [
                {**m, "content": message_text(m)} if isinstance(m.get("content"), list) else m
                for m in messages
            ]

        try:
            return _compile(self.source).render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:  # raise_exception() in the template: the messages do not fit it
            raise InputError(f"messages: the chat template refused them ({e})") from e


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(f: Path) -> dict[str, Any]:
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from e
    return data if isinstance(data, dict) else {}


def tokenizer_config(checkpoint_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json, with special_tokens_map.json filling named tokens it lacks (legacy layout)."""
    config = _read_json(checkpoint_dir / "tokenizer_config.json")
    for name, value in _read_json(checkpoint_dir / "special_tokens_map.json").items():
        config.setdefault(name, value)
    return config


def load_chat_template(checkpoint_dir: Path) -> ChatTemplate | None:
    """The checkpoint's chat template (`chat_template.jinja`, else tokenizer_config.json's `chat_template`,
    the one named "default" when it lists several); None when it has none."""
    config = tokenizer_config(checkpoint_dir)
    f = checkpoint_dir / TEMPLATE_FILE
    if f.is_file():
        source, origin = f.read_text(encoding="utf-8"), str(f)
    else:
        source, origin = config.get("chat_template"), str(checkpoint_dir / "tokenizer_config.json")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
    specials = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_content(config.get(n))) is not None}
    try:
        _compile(source)
    except Exception as e:  # jinja2.TemplateSyntaxError: the checkpoint's fault, said once at load
        raise CheckpointError(f"{origin}: the chat template does not compile ({e})") from e
    return ChatTemplate(source=source, special_tokens=specials)


def end_token_ids(
    checkpoint_dir: Path, declared: list[int], generation_config: dict[str, Any], tokenizer
) -> list[int]:
    """Where generation stops: the model config's end tokens, generation_config.json's `eos_token_id` (a
    chat model lists its end-of-turn token there, Gemma's `<end_of_turn>`/`<turn|>`) and the tokenizer
    config's `eos_token`, in that order, without repeats."""
    ids = list(declared)
    gen = generation_config.get("eos_token_id")
    ids += [gen] if isinstance(gen, int) else [i for i in gen or [] if isinstance(i, int)]
    eos = _token_content(tokenizer_config(checkpoint_dir).get("eos_token"))
    if eos is not None and tokenizer is not None and (tid := tokenizer.token_to_id(eos)) is not None:
        ids.append(tid)
    return list(dict.fromkeys(ids))


@cache
def _content_format(source: str) -> ContentFormat:
    template = _compile(source)
    return content_format(template.environment.parse(source))


@cache
def _compile(source: str):
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class TemplateNamespace(jinja2.utils.Namespace):
        """transformers' namespace: no underscore-prefixed attributes (no way to CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers) renders its body unchanged."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` without the type itself (as transformers)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)
