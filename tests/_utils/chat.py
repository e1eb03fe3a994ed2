"""Chat checkpoints for tests: a tiny transformers-written DiffusionGemma with a character tokenizer, Gemma's
turn tokens and a chat template, saved by transformers itself (the oracle reads the same files)."""

from __future__ import annotations

import json
import string
from pathlib import Path

# Gemma's chat template (system message folded into the first user turn, "model" for the assistant)
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# a ChatML-style template that uses the rest of transformers' environment: namespace, tojson, loop
# controls, the generation tag, trim_blocks/lstrip_blocks (no "-" in the tags)
CHATML_TEMPLATE = """{{ bos_token }}{% set ns = namespace(system="") %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content %}
        {% continue %}
    {% endif %}
<start_of_turn>{{ message.role }}
{% if message.meta is defined %}{{ message.meta | tojson }}
{% endif %}
{% if ns.system and message.role == 'user' %}[{{ ns.system }}] {% endif %}
{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}<end_of_turn>
{% endfor %}
{% if add_generation_prompt %}<start_of_turn>assistant
{% endif %}"""

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
END_OF_TURN_ID = SPECIALS.index("<end_of_turn>")
VOCAB = [*SPECIALS, *dict.fromkeys(string.printable)]  # 6 + 100 ids, under the tiny model's 128


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


def write_chat_checkpoint(
    out: Path, template: str = GEMMA_TEMPLATE, in_tokenizer_config: bool = False
) -> Path:
    """A transformers-written tiny checkpoint whose tokenizer files (and chat template) transformers saved:
    `chat_template.jinja`, or the template inside tokenizer_config.json with `in_tokenizer_config`. The model
    config ends on <eos> only; generation_config.json adds <end_of_turn>, as Gemma's does."""
    from transformers import PreTrainedTokenizerFast

    from tests._utils.hf_reference import make_hf_checkpoint

    make_hf_checkpoint(out, eos_token_id=1, pad_token_id=0, bos_token_id=2)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        chat_template=template,
    )
    hf.save_pretrained(out)
    if in_tokenizer_config:
        (out / "chat_template.jinja").unlink()
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    gen = json.loads((out / "generation_config.json").read_text())
    gen.update(eos_token_id=[1, END_OF_TURN_ID], max_denoising_steps=4)
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
