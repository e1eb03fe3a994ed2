"""Whether a chat template reads a message's content as a string or as a list of parts.

OpenAI messages may carry their content as a list of `{"type": "text", "text": ...}` parts. transformers'
`apply_chat_template` hands the list to the template as it is, which is right for a template that loops over
the parts (Gemma's prints each text part, trimmed, with nothing between them) and wrong for one that prints
`message['content']` as a string (it would print the list's Python repr). vLLM and SGLang resolve this by
reading the template's syntax tree (vLLM's `_detect_content_format`, `vllm/entrypoints/chat_utils.py`): a
template with a `for` loop over a message's `content` takes the list ("openai"), any other the text parts
joined with "\\n" ("string"). This module applies the same rule, so a request renders as it would under
vLLM, and as transformers renders it wherever the template takes the list. No library exposes the rule on
its own (vLLM's is private and would pull in vLLM), hence these few functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

ContentFormat = Literal["string", "openai"]


def content_format(ast) -> ContentFormat:
    """ "openai" where some loop of `ast` (a parsed jinja2 Template) iterates a message's content: a loop
    over an item of `messages` (or of a variable set from it, e.g. `loop_messages = messages[1:]`)."""
    return "openai" if next(_content_loops(ast), None) is not None else "string"


def _reads(node, name: str, key: str | None = None) -> bool:
    """`node` reads variable `name` (or its item / attribute `key`), through filters, tests and slices."""
    import jinja2.nodes as n

    if isinstance(node, n.Filter | n.Test):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, n.Getitem):
        return _reads(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    return isinstance(node, n.Getattr) and _reads(node.node, name) and node.attr == key


def _aliases(ast, name: str) -> list[str]:
    """`name` and every variable `{% set %}` from it, transitively."""
    import jinja2.nodes as n

    found, queue = [name], [name]
    while queue:
        source = queue.pop()
        for assign in ast.find_all(n.Assign):
            target = assign.target
            if isinstance(target, n.Name) and target.name not in found and _reads(assign.node, source):
                found.append(target.name)
                queue.append(target.name)
    return found


def _content_loops(ast) -> Iterator[object]:
    import jinja2.nodes as n

    lists = _aliases(ast, "messages")
    loops = list(ast.find_all(n.For))
    messages = [
        loop.target.name
        for loop in loops
        if isinstance(loop.target, n.Name) and any(_reads(loop.iter, v) for v in lists)
    ]
    for loop in loops:
        if any(_reads(loop.iter, m, "content") for m in messages):
            yield loop
