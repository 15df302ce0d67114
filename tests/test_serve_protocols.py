"""The protocols agents and retrieval pipelines speak, through their official clients against the
app in process (the SDKs' HTTP goes through a TestClient, a real httpx client on the ASGI app):
OpenAI's Embeddings and Responses APIs, Anthropic's Messages."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import torch

MODEL = "smollm2"


@pytest.fixture(scope="module")
def smollm2(smollm2_default):
    """SmolLM2 on its default path (what `arlm serve` runs; several times faster to decode than the
    float32 model): the app's model, and the reference for its embeddings."""
    return smollm2_default


@pytest.fixture(scope="module")
def app(smollm2):
    """The app over a real engine of its own on SmolLM2's runner, served in process."""
    from fastapi.testclient import TestClient

    from arlm.engine import AsyncEngine, Engine, EngineConfig
    from arlm.serve import api
    from arlm.structured import Grammars

    # (the cache's element type as `arlm serve` resolves it: float16 beside the native step)
    config = EngineConfig(kv_cache_tokens=4096, max_num_batched_tokens=64, kv_dtype=smollm2.kv_dtype)
    engine = Engine(smollm2.runner, smollm2.tokenizer.eos_ids, config)
    engine.grammars = Grammars(smollm2.tokenizer, smollm2.model.config.vocab_size)
    with TestClient(api.create_app(api.Server(smollm2, AsyncEngine(engine), MODEL, api_key="k"))) as http:
        yield http, engine


@pytest.fixture(scope="module")
def oai(app):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=app[0])


# -- embeddings -------------------------------------------------------------------------------------

def test_embeddings_through_the_openai_client(app, oai, smollm2):
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue rose by 4%."]
    r = oai.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    got = torch.tensor([d.embedding for d in r.data])
    assert torch.allclose(got, smollm2.embed(texts), atol=1e-5)  # (the same vectors as LLM.embed)
    ids = [smollm2.tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    # base64: the little-endian float32 bytes of the float answer (the same request alone both times)
    raw = oai.embeddings.create(model=MODEL, input=ids[0], encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    floats = oai.embeddings.create(model=MODEL, input=ids[0], encoding_format="float").data[0].embedding
    assert np.array_equal(vec, np.array(floats, dtype=np.float32))
    assert np.allclose(vec, got[0].numpy(), atol=1e-6)  # (float32 GEMMs: a batch's rows round apart)
    d = smollm2.model.config.d_model
    assert len(oai.embeddings.create(model=MODEL, input=[ids[1]], dimensions=d).data[0].embedding) == d
    card = app[0].get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]
    assert card["embeddings"] == {"dimensions": d, "pooling": smollm2.POOLING}
    s = app[1].scheduler
    assert s.pool.num_free == s.pool.n_blocks  # (no blocks held once answered)


BAD_EMBEDDINGS = [  # (body past "model", the field named)
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [[1, 2], [-1]]}, "input.1"),
    ({"input": "hi", "dimensions": 7}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x " * 5000}, "input"),
]


@pytest.mark.parametrize("body,param", BAD_EMBEDDINGS)
def test_bad_embedding_requests_are_400_naming_the_field(app, body, param):
    http = app[0]
    r = http.post("/v1/embeddings", json={"model": MODEL, **body}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert http.get("/health").status_code == 200


# -- OpenAI Responses -----------------------------------------------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QUESTION = "What is the capital of France?"


def test_responses_text_is_chat_completions_text(oai):
    # The same conversation through both APIs: one chat template, the same greedy reply.
    r = oai.responses.create(model=MODEL, input=QUESTION, instructions="Answer briefly.", max_output_tokens=12,
                             temperature=0)
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                                                              {"role": "user", "content": QUESTION}],
                                       max_tokens=12, temperature=0)
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.output[0].type == "message" and r.output[0].role == "assistant"


def test_responses_stream_events_and_the_store(oai):
    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.incomplete_details.reason == "max_output_tokens"
    # stored: fetched, continued, deleted
    assert oai.responses.retrieve(final.id).output_text == text
    again = oai.responses.create(model=MODEL, input="And of Italy?", previous_response_id=final.id,
                                 max_output_tokens=8, temperature=0)
    assert again.previous_response_id == final.id and again.usage.input_tokens > final.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > 0  # (the earlier turns from the prefix cache)
    oai.responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(final.id)


def test_responses_function_tools_round_trip(oai):
    r = oai.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                             tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    # (tool_choice none: a 135M model asked again would call again)
    follow = oai.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                                  temperature=0, max_output_tokens=24, input=[{"type": "function_call_output",
                                                                "call_id": calls[0].call_id,
                                                                "output": "Sunny, 24 C"}])
    assert follow.output[0].type == "message" and follow.output_text
    # streamed, a call comes as its arguments' events
    events = list(oai.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                       max_output_tokens=64, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["city"]


BAD_RESPONSES = [  # (body past "model", status, the field named)
    ({}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input.0.type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]}, 400, "input.0.call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input.0.content.0"),
    ({"input": "hi", "max_output_tokens": "8"}, 400, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
    ({"input": "x " * 9000}, 400, "input"),
]


@pytest.mark.parametrize("body,status,param", BAD_RESPONSES)
def test_bad_responses_requests_name_the_field(app, body, status, param):
    http = app[0]
    r = http.post("/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": "Bearer k"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert http.get("/health").status_code == 200


# -- Anthropic Messages -----------------------------------------------------------------------------

GREEDY = {"temperature": 0}  # (the SDK's newer versions take sampling fields through extra_body)
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(app):
    import anthropic

    return anthropic.Anthropic(base_url="http://testserver", api_key="k", http_client=app[0])


def test_messages_text_is_chat_completions_text(claude, oai):
    m = claude.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Answer briefly.",
                               messages=[{"role": "user", "content": QUESTION}])
    chat = oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Answer briefly."},
                                                              {"role": "user", "content": QUESTION}],
                                       max_tokens=12, temperature=0)
    assert m.content[0].type == "text" and m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    count = claude.messages.count_tokens(model=MODEL, system="Answer briefly.",
                                         messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == m.usage.input_tokens


def test_messages_stream_and_stop_sequences(claude):
    with claude.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    # a stop sequence the greedy reply reaches: cut there, named
    word = text.split()[1]
    m = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, stop_sequences=[word],
                               messages=[{"role": "user", "content": QUESTION}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word and word not in m.content[0].text
    assert text.startswith(m.content[0].text)


def test_messages_tools_forced_then_answered(claude):
    m = claude.messages.create(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER_TOOL],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and use.input.get("city")
    follow = claude.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"}, messages=[
                                        {"role": "user", "content": "What is the weather in Paris?"},
                                        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                      "content": "Sunny, 24 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens") and follow.content[0].text
    # streamed: the call's input as input_json_delta
    with claude.messages.stream(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER_TOOL],
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use" and final.content[-1].input


def test_messages_structured_output(claude):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"],
              "additionalProperties": False}
    m = claude.messages.create(model=MODEL, max_tokens=48, extra_body=GREEDY,
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               messages=[{"role": "user", "content": QUESTION}])
    assert set(json.loads(m.content[0].text)) == {"capital"}


OK_MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
BAD_MESSAGES = [  # (body, the field its message names)
    ({"model": MODEL, "messages": OK_MESSAGE["messages"]}, "max_tokens"),
    ({**OK_MESSAGE, "messages": []}, "messages"),
    ({**OK_MESSAGE, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({**OK_MESSAGE, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0.type"),
    ({**OK_MESSAGE, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                                "content": "x"}]}]}, "messages.0.content.0.tool_use_id"),
    ({**OK_MESSAGE, "temperature": 1.5}, "temperature"),
    ({**OK_MESSAGE, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({**OK_MESSAGE, "messages": [{"role": "user", "content": "x " * 9000}]}, "messages")]


def test_messages_key_and_errors_in_anthropics_shape(app):
    http = app[0]
    ok = OK_MESSAGE
    r = http.post("/v1/messages", json=ok, headers={"x-api-key": "k", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = http.post("/v1/messages", json=ok, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    for body, field in BAD_MESSAGES:
        r = http.post("/v1/messages", json=body, headers={"x-api-key": "k"})
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert field in err["error"]["message"], (field, err)
    assert http.get("/health").status_code == 200


def test_messages_stream_pings_while_a_long_prompt_prefills(app, monkeypatch):
    from arlm.serve import anthropic as messages_api

    monkeypatch.setattr(messages_api, "PING_SECONDS", 0.01)
    long = "The history of the Roman Empire spans many centuries. " * 120
    with app[0].stream("POST", "/v1/messages", headers={"x-api-key": "k"}, json={
            "model": MODEL, "max_tokens": 2, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": long}]}) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and "ping" in kinds and kinds[-1] == "message_stop"
    assert kinds.index("ping") < kinds.index("content_block_start")


def test_earlier_tool_calls_reach_the_chat_template(smollm2):
    # A conversation's earlier calls, from either protocol, are written the tool format's way (the
    # generic format's JSON reply for SmolLM2's template), as Chat Completions' are; a stored
    # conversation is never changed by the turns that continue it.
    from types import SimpleNamespace

    from arlm.serve import anthropic as messages_api
    from arlm.serve import responses
    from arlm.serve.common import Server

    server = Server(smollm2, SimpleNamespace(engine=SimpleNamespace(max_model_len=100, stats=SimpleNamespace(),
                                                                    grammars=None)), MODEL)
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    req = responses.ResponsesRequest.model_validate({"model": MODEL, "input": [
        {"role": "user", "content": "Weather in Paris?"}, call,
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"}]})
    msgs, calls = responses.conversation(req, [], set())
    text = smollm2.apply_chat_template(server.template_messages(msgs))
    assert calls == {"c1"} and '"get_weather"' in text and '"Paris"' in text and "Sunny" in text
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    frozen = [dict(m) for m in history]
    more = responses.ResponsesRequest.model_validate({"model": MODEL, "input": [call]})
    msgs, _ = responses.conversation(more, history, set())
    assert history == frozen and msgs[-1]["content"] == "Hello" and msgs[-1]["tool_calls"][0]["id"] == "c1"
    m = messages_api.MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}]})
    text = smollm2.apply_chat_template(server.template_messages(messages_api.conversation(m)))
    assert '"get_weather"' in text and '"Paris"' in text and "Sunny" in text
