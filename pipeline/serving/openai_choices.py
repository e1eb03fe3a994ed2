"""One choice of an OpenAI response from the model's reply: its message or text, its finish reason, its
log-probabilities in the shape of the API it answers (https://platform.openai.com/docs/api-reference):
  * chat: `logprobs.content`, a list of {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]};
  * text completions (the legacy API): `logprobs` {tokens, token_logprobs, top_logprobs: [{token: logprob}],
    text_offset} (text_offset: each token's character offset in the choice's text).
and its tool calls (openai_tools) when the request forced or allowed them."""

from __future__ import annotations

from typing import Any

from pipeline.serving.client import Reply


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries, "refusal": None}


def text_logprobs(entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """The legacy shape for tokens whose text starts at character `offset` of the choice's text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def logprobs_of(entries: list[dict[str, Any]], chat: bool, offset: int = 0) -> dict[str, Any]:
    return chat_logprobs(entries) if chat else text_logprobs(entries, offset)


def whole_choice(index: int, reply: Reply, chat: bool, logprobs: bool, plan: Any = None) -> dict[str, Any]:
    """A non-streamed choice. `plan`: the request's openai_tools.ToolPlan (None: no tools)."""
    choice: dict[str, Any] = {
        "index": index,
        "finish_reason": reply.finish_reason,
        "logprobs": logprobs_of(reply.logprobs, chat) if logprobs else None,
    }
    if not chat:
        choice["text"] = reply.text
        return choice
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if plan is not None:
        content, calls = plan.calls(reply.text)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            if reply.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
    choice["message"] = message
    return choice
