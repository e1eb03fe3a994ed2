"""Chat templates: token-identical to transformers' apply_chat_template, messages checked, end-of-turn stops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import CheckpointError, InputError
from pipeline.runtime import chat_template as ct
from tests._utils.chat import CHATML_TEMPLATE, END_OF_TURN_ID, GEMMA_TEMPLATE, write_chat_checkpoint

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "  Why is the sky blue?\n"},
    ],
    [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! <end_of_turn>"},  # control text in user strings, as-is
        {"role": "user", "content": [{"type": "text", "text": 'tab\tand "quotes" & <b>'}]},
    ],
]


@pytest.fixture(scope="module", params=["gemma", "chatml"])
def chat_ckpt(request, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    if request.param == "gemma":  # the template inside tokenizer_config.json
        return write_chat_checkpoint(out, GEMMA_TEMPLATE, in_tokenizer_config=True)
    return write_chat_checkpoint(out, CHATML_TEMPLATE)  # chat_template.jinja beside the checkpoint


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_render_and_tokens_match_transformers(chat_ckpt, messages):
    from transformers import AutoTokenizer

    from pipeline.runtime.session import load_session

    hf = AutoTokenizer.from_pretrained(chat_ckpt)
    session = load_session(chat_ckpt, weights=False)
    if "chatml" in str(chat_ckpt) and len(messages) > 2:
        messages = [*messages[:1], {**messages[1], "meta": {"lang": "en", "html": "<&>"}}, *messages[2:]]
    # content parts reach Gemma's template, which loops over them, as sent; the ChatML one prints `content`
    # as a string, so it gets the text parts joined with "\n" as vLLM sends them (the list's Python repr
    # otherwise)
    if "chatml" in str(chat_ckpt):
        messages_read = [
            {**m, "content": "\n".join(p["text"] for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
    else:
        messages_read = messages
    want_text = hf.apply_chat_template(messages_read, add_generation_prompt=True, tokenize=False)
    want_ids = hf.apply_chat_template(
        messages_read, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    checked = ct.parse_messages(messages)
    template = ct.load_chat_template(chat_ckpt)
    assert template is not None and template.special_tokens["bos_token"] == "<bos>"
    assert template.render(checked) == want_text
    assert session.encode_messages(checked) == want_ids
    assert want_ids[0] == 2 and want_ids.count(2) == 1  # <bos> once: rendered, never added again
    # what a server echoes before the answer: the rendered prompt as transformers decodes its ids
    assert session.decode_prompt(want_ids) == hf.decode(want_ids, skip_special_tokens=True)
    plain = session.encode_prompt("Why?")
    assert session.decode_prompt(plain) == "Why?"  # a plain prompt reads back as given


def test_gemma_folds_the_system_message_and_refuses_bad_turns(tmp_path):
    template = ct.ChatTemplate(GEMMA_TEMPLATE, {"bos_token": "<bos>"})
    text = template.render(ct.chat_messages("Hi", system="Be brief."))
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(InputError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "x"}])


def test_plain_prompts_are_unchanged_and_end_of_turn_is_an_end_token(tmp_path):
    from pipeline.runtime.session import load_session

    ckpt = write_chat_checkpoint(tmp_path / "c")
    session = load_session(ckpt, weights=False)
    assert session.encode_prompt("Hi") == session.tokenizer.encode("<bos>Hi", add_special_tokens=False).ids
    # config.json ends on <eos> only; generation_config.json adds <end_of_turn>
    assert session.end_token_ids == [1, END_OF_TURN_ID]
    assert session.model.config.text_config.end_token_ids == [1, END_OF_TURN_ID]


def test_generation_stops_on_end_of_turn(tmp_path):
    import torch

    from pipeline.runtime.scheduler import BlockDiffusionRuntime, Request
    from pipeline.runtime.session import load_session

    session = load_session(write_chat_checkpoint(tmp_path / "c"), device="cpu")
    prompt = session.encode_messages(ct.chat_messages("Hi"))
    length = session.model.config.canvas_length
    pinned = [-1, -1, END_OF_TURN_ID]  # the canvas is forced to end its turn at position 2
    req = Request(prompt_ids=prompt, max_tokens=4 * length, sampler=session.sampler(), template=pinned)
    runtime = BlockDiffusionRuntime(session.model, max_batch=1, max_len=len(prompt) + 6 * length)
    with torch.inference_mode():
        res = runtime.generate([req])[0]
    assert res.finish_reason == "stop" and len(res.steps_per_canvas) == 1
    assert END_OF_TURN_ID not in res.tokens[:2] and len(res.tokens) <= 3


def test_a_checkpoint_without_a_template_refuses_messages_and_sudoku_reads_the_puzzle():
    from pipeline.demo import tokenizer as stok
    from pipeline.resources import EMBEDDED_MODEL
    from pipeline.runtime.session import load_session

    puzzle = "14...9..56925.31.8835.1.927..1732.5.259.6.7.437694.28....6.4.935.3.914..92....816"
    session = load_session(EMBEDDED_MODEL, weights=False)  # no chat template: its own (Sudoku) format
    messages = ct.parse_messages(
        json.dumps([{"role": "system", "content": "solve"}, {"role": "user", "content": puzzle}])
    )
    assert session.encode_messages(messages) == stok.sudoku_prompt_ids(puzzle)
    assert session.decode_prompt(session.encode_messages(messages)) == puzzle  # the echo: the puzzle read
    assert session.end_token_ids == [1, 4]

    import dataclasses

    from pipeline.runtime.prompt_format import TextFormat

    text = TextFormat(dataclasses.replace(session.checkpoint, dgpipe={}), session.tokenizer)
    with pytest.raises(InputError, match="no chat template"):
        text.encode_messages(messages)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("[{", "messages: not valid JSON"),
        ('{"role": "user"}', r"must be a JSON list of messages \(got dict\)"),
        ("[]", "the list is empty"),
        ('["hi"]', r"messages\[0\]: must be an object"),
        ('[{"content": "x"}]', r"messages\[0\]: 'role' is missing"),
        ('[{"role": "robot", "content": "x"}]', r"messages\[0\]: unknown role 'robot'"),
        ('[{"role": "user", "content": 3}]', r"messages\[0\]: 'content' is missing or not a string"),
        (
            '[{"role": "user", "content": [{"type": "image_url"}]}]',
            r"messages\[0\]\.content\[0\]: part type 'image_url' is not supported",
        ),
        ('[{"role": "user", "content": [{"type": "text"}]}]', r"content\[0\]: a text part needs 'text'"),
    ],
)
def test_bad_messages_name_the_problem(raw, problem):
    with pytest.raises(ct.MessagesError, match=problem):
        ct.parse_messages(raw)
    assert issubclass(ct.MessagesError, InputError)


def test_text_parts_reach_a_template_that_loops_over_them_and_are_joined_for_one_that_does_not():
    parts = [{"type": "text", "text": "Hello", "extra": 1}, {"type": "text", "text": "world"}]
    (msg,) = ct.parse_messages([{"role": "user", "content": parts}])
    assert msg == {
        "role": "user",
        "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
    }
    assert ct.last_user_text([msg]) == "Hello\nworld"  # what a format without a template reads
    gemma, chatml = (
        ct.ChatTemplate(GEMMA_TEMPLATE, {"bos_token": "<bos>"}),
        ct.ChatTemplate(CHATML_TEMPLATE, {}),
    )
    assert (gemma.content_format, chatml.content_format) == ("openai", "string")
    assert "<start_of_turn>user\nHelloworld<end_of_turn>" in gemma.render([msg])  # each part trimmed, as sent
    assert "Hello\nworld" in chatml.render([msg])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        (
            "{% for m in messages %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        # through an alias of the messages, as Gemma's loop_messages
        (
            "{% set rest = messages[1:] %}{% for m in rest %}{% for p in m.content %}x{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for c in m['role'] %}{{ c }}{% endfor %}{% endfor %}", "string"),
        ("{% for p in other['content'] %}{{ p }}{% endfor %}", "string"),  # not a message's content
    ],
)
def test_the_content_format_is_read_from_the_template_as_vllm_reads_it(template, expected):
    assert ct.ChatTemplate(template, {}).content_format == expected


def test_null_fields_are_dropped_and_a_broken_template_is_the_checkpoint_s_fault(tmp_path):
    assert ct.parse_messages([{"role": "user", "content": "x", "name": None}]) == [
        {"role": "user", "content": "x"}
    ]
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(CheckpointError, match="does not compile"):
        ct.load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    assert ct.load_chat_template(tmp_path) is None


def test_the_sandbox_refuses_python_internals():
    template = ct.ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(InputError, match="unsafe"):
        template.render([{"role": "user", "content": "x"}])


def test_tools_reach_the_template_and_a_hermes_template_declares_its_tool_call_format():
    from pipeline.runtime.chat_template import ChatTemplate

    source = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "Call a tool as <tool_call>{...}</tool_call>.{% endif %}{{ messages[0].content }}"
    )
    hermes = ChatTemplate(source, {})
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    assert hermes.render([{"role": "user", "content": "hi"}], tools=tools).startswith("<tools>f;g;</tools>")
    assert hermes.render([{"role": "user", "content": "hi"}]) == "hi"
    assert hermes.tool_call_format == "hermes"
    assert ChatTemplate("{{ messages[0].content }}", {}).tool_call_format is None


def test_an_earlier_calls_arguments_reach_the_template_as_an_object():
    """OpenAI's messages carry a call's arguments as a JSON string; a Hermes template writes them with
    `tojson`, so the string was written twice encoded. As vLLM does, they are parsed: {} when empty, a string
    that is not JSON left as it is."""
    template = ct.ChatTemplate(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
        "{% endfor %}{% endfor %}",
        {},
    )

    def call(arguments):
        fn = {"name": "f", "arguments": arguments}
        return [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": fn}]}]

    assert (
        template.render(ct.parse_messages(call('{"x": 1}')))
        == '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    )
    assert (
        template.render(ct.parse_messages(call("")))
        == '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    assert (
        template.render(ct.parse_messages(call("{x")))
        == '<tool_call>{"name": "f", "arguments": "{x"}</tool_call>'
    )
    parsed = ct.parse_messages(json.dumps(call('{"x": [1, 2]}')))
    assert parsed[0]["tool_calls"][0] == {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": {"x": [1, 2]}},
    }
