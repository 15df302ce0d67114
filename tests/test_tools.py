"""Tool-call formats (arlm/serve/tools.py), without a server: which format a chat template gets,
what each grammar lets through (one call, several with parallel_tool_calls, a reply under auto),
how replies parse back into OpenAI's tool_calls, and how earlier calls render. The servers'
tests (test_serve_api.py) run both formats with real clients.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arlm.serve.tools import GenericFormat, HermesFormat, check_tools, tool_format

HERMES = (Path(__file__).parent / "data" / "hermes_chat_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADD = '{"name": "add", "arguments": {"a": 2, "b": 3}}'


@pytest.fixture(scope="module")
def llm(smollm2):
    return smollm2


def accepts(llm, spec, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    m = llm.grammars.matcher(spec)
    ids = llm.tokenizer.encode(text, add_bos=False)
    return m.validate_tokens(ids) == len(ids) and (m.consume_tokens(ids) and m.is_accepting())


def test_the_template_decides_the_format(llm):
    assert isinstance(tool_format(HERMES), HermesFormat)
    assert isinstance(tool_format(llm.chat_template), GenericFormat)  # SmolLM2's: no tools section
    assert isinstance(tool_format(None), GenericFormat)


def test_hermes_grammar_takes_calls_and_under_auto_a_reply(llm):
    functions, _ = check_tools(TOOLS, "auto")
    h = HermesFormat()
    one, two = f"<tool_call>\n{PARIS}\n</tool_call>", f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>"
    required = h.constraint(functions, "required", parallel=False)
    assert accepts(llm, required, one) and not accepts(llm, required, two)
    assert not accepts(llm, required, "Sunny.")
    assert not accepts(llm, required, one.replace('"Paris"', "7"))  # arguments checked against the parameters
    assert accepts(llm, h.constraint(functions, "required", parallel=True), two)
    auto = h.constraint(functions, "auto", parallel=False)
    assert accepts(llm, auto, one) and accepts(llm, auto, "It is sunny in Paris.")
    assert not accepts(llm, auto, "<tool_call>\nnot json\n</tool_call>")
    named = h.constraint(functions, "add", parallel=False)
    assert accepts(llm, named, f"<tool_call>\n{ADD}\n</tool_call>") and not accepts(llm, named, one)


def test_generic_grammar_one_call_or_several(llm):
    functions, _ = check_tools(TOOLS, "required")
    g = GenericFormat()
    one = json.dumps({"tool_call": json.loads(PARIS)}, separators=(",", ":"))
    two = json.dumps({"tool_calls": [json.loads(PARIS), json.loads(ADD)]}, separators=(",", ":"))
    assert accepts(llm, g.constraint(functions, "required", False), one)
    assert not accepts(llm, g.constraint(functions, "required", False), two)
    assert accepts(llm, g.constraint(functions, "required", True), two)
    assert not accepts(llm, g.constraint(functions, "required", True), '{"tool_calls":[]}')
    assert accepts(llm, g.constraint(functions, "auto", False), '{"response":"Hi"}')


def test_replies_parse_into_openai_tool_calls():
    h, g = HermesFormat(), GenericFormat()
    content, calls = h.parse(f"<tool_call>\n{PARIS}\n</tool_call>\n<tool_call>\n{ADD}\n</tool_call>")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert h.parse("Just text.") == ("Just text.", None)
    cut = f"<tool_call>\n{PARIS[:20]}"  # cut by max_tokens: content as it is
    assert h.parse(cut) == (cut, None)
    content, calls = g.parse(json.dumps({"tool_calls": [json.loads(PARIS), json.loads(ADD)]}))
    assert content is None and len(calls) == 2
    assert g.parse('{"response": "Hello"}') == ("Hello", None)
    assert g.parse('{"tool_call": {"name"') == ('{"tool_call": {"name"', None)


def test_earlier_calls_render_in_the_templates_own_format(llm):
    """The Hermes template gets the tools and the earlier calls as objects (arguments parsed from
    OpenAI's string), the results as <tool_response> blocks; the generic one writes them as its
    reply format. tojson is HF's (no HTML escaping of < and >)."""
    functions, choice = check_tools([{**TOOLS[0], "function": {**TOOLS[0]["function"],
                                                                "description": "weather <today>"}}], "auto")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [{"role": "user", "content": "Weather in Paris?"}]
    h = HermesFormat()
    messages = turns + [h.history({"role": "assistant", "content": ""}, [call]),
                        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    messages, extra = h.prompt(messages, functions, choice, parallel=False)
    template, llm.chat_template = llm.chat_template, HERMES
    try:
        text = llm.apply_chat_template(messages, **extra)
    finally:
        llm.chat_template = template
    assert '"description": "weather <today>"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    g = GenericFormat()
    messages = turns + [g.history({"role": "assistant", "content": ""}, [call, call])]
    messages, extra = g.prompt(messages, functions, choice, parallel=True)
    text = llm.apply_chat_template(messages, **extra)
    assert extra == {} and '"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "to call one or more tools" in text
