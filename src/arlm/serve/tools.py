"""Tool calls: the tools shown to the model, its reply constrained by the grammar engine to a
call or a reply, and the reply parsed back into OpenAI's `tool_calls`.

Two formats, chosen by the chat template (`tool_format`), as llama.cpp chooses its handlers:

- A template with a tools section in Hermes's format (Qwen2.5/3, Hermes, SmolLM3: the template
  renders `tools` and asks for `<tool_call>` blocks) gets its own format: the tools go to the
  template as `tools` (HF's convention), earlier calls as structured `tool_calls` (arguments as
  objects), and the reply is constrained to

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  (one block, or several with `parallel_tool_calls`), or under "auto" to text that does not
  start a call.
- Any other template (SmolLM2's has no tools section) gets llama.cpp's generic format: the tools
  are described in the system prompt and the reply is one JSON object,

      {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
      {"tool_calls": [{"name": ..., "arguments": ...}, ...]}      (parallel_tool_calls)
      {"response": "Hello!"}                                       ("auto" only)

`tool_choice` "auto" allows a call or a reply, "required" only calls, a named function only calls
of it, "none" neither (the tools are not shown). `parallel_tool_calls` (default false, as
llama.cpp's server: a small model asked for one call makes one) allows one or more calls a reply.
"""

from __future__ import annotations

import json
import re
import uuid

from ..structured import StructuredOutput


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


def _shown(functions: list[dict], choice: str) -> list[dict]:
    return [f for f in functions if choice in ("auto", "required") or f["name"] == choice]


def _call_schema(functions: list[dict]) -> dict:
    """{"name": <one of them>, "arguments": <its parameters>}."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _arguments(args) -> object:
    """An earlier call's arguments as an object where they parse (OpenAI sends a JSON string)."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _earlier_calls(tool_calls: list) -> list[tuple[object, object, object]]:
    """An earlier assistant turn's calls (OpenAI's shape) as (id, name, arguments as an object)."""
    return [(c.get("id"), (c.get("function") or {}).get("name"),
             _arguments((c.get("function") or {}).get("arguments", "{}")))
            for c in tool_calls if isinstance(c, dict)]


def _openai_call(name, arguments) -> dict:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class GenericFormat:
    """llama.cpp's generic format (templates without a tools section)."""

    name = "generic"

    def history(self, message: dict, tool_calls: list | None) -> dict:
        """An earlier turn for the template: an assistant's calls written as the reply format."""
        if not tool_calls:
            return message
        calls = [{"name": name, "arguments": args} for _, name, args in _earlier_calls(tool_calls)]
        text = json.dumps({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}, ensure_ascii=False)
        return {**message, "content": (message["content"] + "\n" if message["content"] else "") + text}

    def prompt(self, messages: list[dict], functions: list[dict], choice: str,
               parallel: bool) -> tuple[list[dict], dict]:
        """The conversation with the tools' description in its system message, and the extra
        template variables (none)."""
        text = ("You can call the following tools:\n"
                + "\n".join(json.dumps(f, ensure_ascii=False) for f in _shown(functions, choice))
                + "\n\nAnswer with one JSON object: ")
        call = ('{"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments>}, ...]} to call one or '
                'more tools' if parallel else
                '{"tool_call": {"name": <a tool\'s name>, "arguments": <its arguments>}} to call a tool')
        text += call + (', or {"response": <your reply>} to answer the user directly.' if choice == "auto" else ".")
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}] + messages[1:], {}
        return [{"role": "system", "content": text}] + messages, {}

    def constraint(self, functions: list[dict], choice: str, parallel: bool) -> StructuredOutput:
        call = _call_schema(_shown(functions, choice))
        if parallel:
            calls = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                     "required": ["tool_calls"], "additionalProperties": False}
        else:
            calls = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                     "additionalProperties": False}
        if choice != "auto":
            return StructuredOutput("json_schema", calls)
        reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                 "additionalProperties": False}
        return StructuredOutput("json_schema", {"anyOf": [calls, reply]})

    def parse(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, tool_calls in OpenAI's shape) of a constrained reply; unparseable text (a
        reply cut by max_tokens) is content as it is."""
        try:
            obj = json.loads(text)
        except ValueError:
            return text, None
        if isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
            obj = {"tool_calls": [obj["tool_call"]]}
        if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list) and obj["tool_calls"] \
                and all(isinstance(c, dict) for c in obj["tool_calls"]):
            return None, [_openai_call(c.get("name"), c.get("arguments", {})) for c in obj["tool_calls"]]
        if isinstance(obj, dict) and isinstance(obj.get("response"), str):
            return obj["response"], None
        return text, None


class HermesFormat:
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, the tools rendered by the
    template itself (Qwen2.5/3, Hermes 2/3, SmolLM3)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def history(self, message: dict, tool_calls: list | None) -> dict:
        if not tool_calls:
            return message
        calls = [{"type": "function", "id": cid, "function": {"name": name, "arguments": args}}
                 for cid, name, args in _earlier_calls(tool_calls)]
        return {**message, "tool_calls": calls}

    def prompt(self, messages: list[dict], functions: list[dict], choice: str,
               parallel: bool) -> tuple[list[dict], dict]:
        tools = [{"type": "function", "function": f} for f in _shown(functions, choice)]
        return messages, {"tools": tools}

    def constraint(self, functions: list[dict], choice: str, parallel: bool) -> StructuredOutput:
        schema = json.dumps(_call_schema(_shown(functions, choice)), ensure_ascii=False)
        start = "calls | TEXT" if choice == "auto" else "calls"
        more = ' ("\\n" call)*' if parallel else ""
        grammar = (f"start: {start}\ncalls: call{more}\n"
                   f"call: {json.dumps(self.OPEN + chr(10))} body {json.dumps(chr(10) + self.CLOSE)}\n"
                   f"body: %json {schema}\n")
        if choice == "auto":  # a reply: any text but one that starts a call
            grammar += "TEXT: /[^<\\s][\\s\\S]*|<[^t][\\s\\S]*|<t[^o][\\s\\S]*/\n"
        return StructuredOutput("grammar", grammar)

    def parse(self, text: str) -> tuple[str | None, list[dict] | None]:
        blocks = re.findall(re.escape(self.OPEN) + r"\s*(.*?)\s*" + re.escape(self.CLOSE), text, re.S)
        calls = []
        for b in blocks:
            try:
                obj = json.loads(b)
            except ValueError:
                return text, None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return text, None
            calls.append(_openai_call(obj["name"], obj.get("arguments", {})))
        if not calls:
            return text, None
        rest = re.sub(re.escape(self.OPEN) + r".*?" + re.escape(self.CLOSE), "", text, flags=re.S).strip()
        return rest or None, calls


def tool_format(chat_template: str | None) -> GenericFormat | HermesFormat:
    """The format a chat template asks for: its own where it renders `tools` as Hermes's
    `<tool_call>` blocks, else llama.cpp's generic format."""
    t = chat_template or ""
    if "tools" in t and HermesFormat.OPEN in t:
        return HermesFormat()
    return GenericFormat()
