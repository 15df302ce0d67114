"""Tool calls for chat templates without a tools section (SmolLM2's), as llama.cpp's generic
format does it: the tools are described in the system prompt, and the reply is constrained (a
JSON schema, enforced by the grammar engine) to either a call of one of them or a reply:

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"response": "Hello!"}

`tool_choice` "auto" allows both, "required" only calls, a named function only calls of it,
"none" neither (the tools are not shown). The reply is parsed back into OpenAI's `tool_calls`.
"""

from __future__ import annotations

import json
import uuid


class ToolError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(tools: list, tool_choice) -> tuple[list[dict], str | None]:
    """The tools' functions [{name, description, parameters}] and the choice ("auto", "required",
    "none" or a function's name); ToolError naming the field otherwise."""
    functions = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"tools.{i}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                            f"tools.{i}")
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ToolError(f"tools.{i}.function.parameters: a JSON schema (an object)", f"tools.{i}")
        if params.get("type") == "object" and "additionalProperties" not in params:
            # the arguments the function declares, no others (as OpenAI's strict mode; JSON
            # schema's default would let a small model invent more)
            params = {**params, "additionalProperties": False}
        functions.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("tools: two functions with one name", "tools")
    if tool_choice is None:
        choice = "auto" if functions else None
    elif isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required", "none"):
            raise ToolError(f"tool_choice: {tool_choice!r} is not auto, required, none or a function",
                            "tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise ToolError(f"tool_choice: no tool named {choice!r}", "tool_choice")
    else:
        raise ToolError("tool_choice: expected auto, required, none or {\"type\": \"function\", \"function\": "
                        "{\"name\": ...}}", "tool_choice")
    if choice not in (None, "none") and not functions:
        raise ToolError("tool_choice needs tools", "tool_choice")
    return functions, choice


def reply_schema(functions: list[dict], choice: str) -> dict:
    """The JSON schema a reply must follow under `choice`."""
    allowed = [f for f in functions if choice in ("auto", "required") or f["name"] == choice]
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in allowed]
    call = {"type": "object", "properties": {"tool_call": calls[0] if len(calls) == 1 else {"anyOf": calls}},
            "required": ["tool_call"], "additionalProperties": False}
    if choice != "auto":
        return call
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}
    return {"anyOf": [call, reply]}


def system_prompt(functions: list[dict], choice: str) -> str:
    shown = [f for f in functions if choice in ("auto", "required") or f["name"] == choice]
    text = ("You can call the following tools:\n" + "\n".join(json.dumps(f, ensure_ascii=False) for f in shown)
            + "\n\nAnswer with one JSON object: ")
    if choice == "auto":
        return text + ('{"tool_call": {"name": <a tool\'s name>, "arguments": <its arguments>}} to call a tool, or '
                       '{"response": <your reply>} to answer the user directly.')
    return text + '{"tool_call": {"name": <a tool\'s name>, "arguments": <its arguments>}}.'


def with_tools(messages: list[dict], functions: list[dict], choice: str) -> list[dict]:
    """The conversation with the tools' description in its system message."""
    prompt = system_prompt(functions, choice)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def assistant_text(tool_calls: list) -> str:
    """An earlier assistant turn's tool calls (OpenAI's shape) as the reply format above."""
    calls = []
    for c in tool_calls or []:
        f = c.get("function", {}) if isinstance(c, dict) else {}
        args = f.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        calls.append({"tool_call": {"name": f.get("name"), "arguments": args}})
    return "\n".join(json.dumps(c, ensure_ascii=False) for c in calls)


def parse_reply(text: str) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls in OpenAI's shape) of a constrained reply; unparseable text (a reply
    cut by max_tokens) is content as it is."""
    try:
        obj = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
        call = obj["tool_call"]
        return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": call.get("name"),
                                    "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False)}}]
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return obj["response"], None
    return text, None
