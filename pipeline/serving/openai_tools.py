"""OpenAI function tools on a diffusion model (https://platform.openai.com/docs/guides/function-calling).

`tool_choice` decides how a reply becomes tool calls:
  * "required" or a named function {"type": "function", "function": {"name": ...}}: the call is generated
    under a JSON schema by constrained denoising (the llguidance guide path of `response_format`), so every
    call parses and its arguments validate against the function's `parameters`. A named function's output
    is its arguments object; "required" generates {"name": <one of the tools>, "parameters": {...}} (the
    schema is an anyOf over the tools, each name with its own parameters; vLLM's guide is an array of such
    calls, minItems 1, where dgpipe generates one).
    The reply is message.tool_calls with one call and finish_reason "tool_calls".
  * "auto": the model decides, in the tool-call format its chat template declares; dgpipe reads the
    Hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Hermes' and Qwen's
    templates). The Triton model refuses "auto" with a 400 saying why when the checkpoint's template
    declares no format (DiffusionGemma's Gemma template declares none).
  * "none" (or no tools): a plain reply; the tools are not sent (vLLM renders them by default: here a model
    whose prompt format takes no tools would refuse the request).
`parallel_tool_calls: false` keeps the first call of an "auto" reply (vLLM's reading); a forced call is one
call either way.
The tools themselves reach the chat template as transformers' `apply_chat_template(tools=...)` gives them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pipeline.errors import InputError
from pipeline.sampler.constraints import GuideSpec
from pipeline.serving.openai_schema import ChatCompletionRequest, RequestError

HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
ANY_OBJECT = {"type": "object"}  # a function without `parameters` takes any arguments object


@dataclass(frozen=True)
class ToolPlan:
    """How one request's reply becomes tool calls: the checked tools and the choice."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or "function"
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: false keeps an "auto" reply's first call only

    def parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or ANY_OBJECT

    def guide(self) -> tuple[str, str] | None:
        """The guide (Triton's guided_decoding inputs) a forced call is generated under; None for auto."""
        if self.choice == "function":
            assert self.name is not None
            return "json_schema", json.dumps(self.parameters(self.name))
        if self.choice == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        "parameters": self.parameters(t["function"]["name"]),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            return "json_schema", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls})
        return None

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(message content, tool calls) of a reply's text. A forced call that did not complete (the reply
        ended on length or was cut by a stop word) is no call: its text is returned as the content."""
        if self.choice == "auto":
            content, calls = parse_hermes(text)
            return content, calls if self.parallel else calls[:1]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        if self.choice == "function":
            assert self.name is not None
            return None, [tool_call(self.name, value)]
        return None, [tool_call(value["name"], value["parameters"])]


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One call in OpenAI's shape: the arguments as a JSON string."""
    fn = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": fn}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-format calls out of a reply: each well-formed `<tool_call>` block with a name becomes a call;
    the text outside the blocks is the content (None when nothing is left). A block that is not a JSON
    object with a name stays in the content, as text the model wrote."""
    calls, rest, last = [], [], 0
    for m in HERMES_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        rest.append(text[last : m.start()])
        last = m.end()
        calls.append(tool_call(call["name"], call.get("arguments", {})))
    content = "".join([*rest, text[last:]])
    return (content if content.strip() else None) if calls else text, calls


def request_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """A chat request's plan, checked against its other constraint fields."""
    plan = tool_plan(req.tools, req.tool_choice, parallel=req.parallel_tool_calls is not False)
    if plan is not None and plan.guide() is not None:
        if req.guide() is not None:
            raise RequestError(
                "a forced tool call is generated under its function's schema: leave out 'response_format', "
                "'structured_outputs' and the guided_* fields",
                "tool_choice",
            )
        # each schema the call may be generated under, checked as the user wrote it: its pointers are
        # into tools[i].function.parameters, not into the guide built around them
        for i, t in enumerate(plan.tools):
            if plan.choice == "function" and t["function"]["name"] != plan.name:
                continue
            try:
                GuideSpec("json_schema", json.dumps(plan.parameters(t["function"]["name"]))).check()
            except InputError as e:
                raise RequestError(f"'tools[{i}].function.parameters': {e}", "tools") from e
    return plan


def tool_inputs(plan: ToolPlan | None) -> dict[str, Any]:
    """The Triton inputs of a plan: the tools (for the chat template), and the guide of a forced call or
    the "auto" choice the model checks against its template."""
    if plan is None:
        return {}
    out: dict[str, Any] = {"tools": json.dumps(plan.tools)}
    if (guide := plan.guide()) is not None:
        out["guided_decoding_guide_type"], out["guided_decoding_guide"] = guide
    else:
        out["tool_choice"] = plan.choice
    return out


def tool_plan(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool = True
) -> ToolPlan | None:
    """The checked tools and choice; None when the reply is plain text. RequestError naming the field."""
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not tools:
        raise RequestError("'tools' is empty: send at least one function or leave it out", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(
                f'\'tools[{i}]\' must be {{"type": "function", "function": {{"name": ...}}}}', "tools"
            )
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"'tools[{i}].function.parameters' must be a JSON schema object", "tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise RequestError("'tools' names a function twice", "tools")
    choice = "auto" if choice is None else choice  # OpenAI's default when tools are present
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(tools, choice, parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name is None:
            raise RequestError("'tool_choice' names no function: send function.name", "tool_choice")
        if name not in names:
            raise RequestError(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'", "tool_choice"
            )
        return ToolPlan(tools, "function", name, parallel)
    raise RequestError(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )
