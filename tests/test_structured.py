"""Structured outputs (arlm/structured.py): grammars enforced token by token by llguidance.

Every output that ends with EOS parses and validates against its schema (a battery: nested
objects, arrays, enums, bounded numbers, strings with patterns, booleans and nulls), sampled at
temperature 1 with several seeds so that the grammar, not the model's habits, keeps it valid;
a regex and a choice match in full; a row with a grammar leaves the other rows of its batch as
they are alone; a spec the engine cannot enforce is a clear error. Under speculative decoding the
drafts are cut to what the grammar takes and each verified position is masked: greedy output and
its logprobs are plain decoding's, and sampled output still validates.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from arlm.sampling import SamplingParams
from arlm.structured import GrammarError, StructuredOutput

from conftest import run_arlm

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enum_and_numbers": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "count": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["colour", "score", "count"], "additionalProperties": False},
    "pattern_bool_null": {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "active": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["id", "active", "note"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                         "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def llm(smollm2_default):
    """SmolLM2 on its default path: the grammar, not the arithmetic, is under test here, and it
    decodes several times faster than the float32 path (conftest)."""
    return smollm2_default


def _chat(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.apply_chat_template([{"role": "user", "content": text}]))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_against_its_schema(llm, name):
    schema = SCHEMAS[name]
    prompt = _chat(llm, "Answer with JSON.")
    for seed in range(3):
        params = SamplingParams(max_new_tokens=160, temperature=1.0, seed=seed,
                                structured=StructuredOutput("json_schema", schema))
        c = llm.generate([prompt], params)[0]
        assert c.finish_reason == "eos", (name, seed, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_and_choice(llm):
    prompt = _chat(llm, "Tell me something.")
    c = llm.generate([prompt], SamplingParams(max_new_tokens=200, temperature=0.0,
                                              structured=StructuredOutput("json")))[0]
    if c.finish_reason == "eos":
        assert isinstance(json.loads(c.text), dict)
    else:  # cut by max_new_tokens: still a JSON object's prefix
        assert c.text.startswith("{")
    for seed in range(3):
        c = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed,
                                                  structured=StructuredOutput("regex", r"[a-z]{2,6}-[0-9]{2}")))[0]
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", c.text) and c.finish_reason == "eos", c.text
        c = llm.generate([prompt], SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed,
                                                  structured=StructuredOutput("choice", ["alpha", "beta", "gamma"])))[0]
        assert c.text in ("alpha", "beta", "gamma") and c.finish_reason == "eos"


def test_other_rows_of_the_batch_are_untouched(llm):
    plain = SamplingParams(max_new_tokens=12, temperature=0.0)
    guided = SamplingParams(max_new_tokens=30, temperature=0.0, structured=StructuredOutput("json_schema",
                                                                                            SCHEMAS["array"]))
    a, b = _chat(llm, "Name three fruits."), _chat(llm, "Give tags as JSON.")
    alone = llm.engine.generate([a], plain)[0]
    guided_alone = llm.engine.generate([b], guided)[0]
    together = llm.engine.generate([a, b, a], [plain, guided, plain])
    assert together == [alone, guided_alone, alone]


COPY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 60}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                          "maxItems": 6}, "year": {"type": "integer"}},
    "required": ["name", "tags", "year"], "additionalProperties": False}
COPY_JSON = '{"name": "The Old Library of Trinity College", "tags": ["books", "history", "Dublin"], "year": 1592}'


def _run(engine, prompts, params, drafter=None):
    """Each request's (tokens, logprobs) from the engine's outputs, and the engine's stats."""
    reqs = [engine.add_request(p, params, drafter=drafter) for p in prompts]
    got = {r.request_id: ([], []) for r in reqs}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id][0].append(out.token_id)
            got[out.request_id][1].append((out.logprob, out.top_logprobs))
    return [got[r.request_id] for r in reqs]


def test_speculative_drafts_follow_the_grammar(llm):
    """Prompt lookup drafts inside a JSON schema: drafts the grammar refuses are cut before the
    verify pass, every verified position is masked by the grammar's state after the draft tokens
    before it, and the matcher rolls back to the tokens kept: greedy tokens and their logprobs
    are plain decoding's, and drafts were accepted (the copy task is made for prompt lookup)."""
    spec = StructuredOutput("json_schema", COPY_SCHEMA)
    prompts = [_chat(llm, "Copy this JSON exactly: " + COPY_JSON), _chat(llm, "Give me a book as JSON.")]
    from arlm.engine.speculative import SpeculativeConfig

    # (fixed drafts: the adaptive rule follows the machine's step times, which would make the
    # count of accepted tokens depend on the load)
    drafter = llm.drafter(SpeculativeConfig("ngram", num_speculative_tokens=3, adaptive=False))
    for logprobs in (None, 3):
        params = SamplingParams(max_new_tokens=60, temperature=0.0, logprobs=logprobs, structured=spec)
        accepted = llm.engine.stats.spec_accepted
        plain = _run(llm.engine, prompts, params)
        fast = _run(llm.engine, prompts, params, drafter)
        assert llm.engine.stats.spec_accepted - accepted > 10
        for (tokens, lps), (tokens2, lps2) in zip(plain, fast):
            assert tokens == tokens2
            if logprobs:
                for (lp, top), (lp2, top2) in zip(lps, lps2):
                    assert abs(lp - lp2) < 1e-4 and [t for t, _ in top] == [t for t, _ in top2]
        text = llm.tokenizer.decode(plain[0][0][:-1])
        assert json.loads(text) == json.loads(COPY_JSON), text
    for seed in range(2):  # sampled: drafts accepted or not, the output follows the schema
        params = SamplingParams(max_new_tokens=80, temperature=1.0, seed=seed, structured=spec)
        c = llm.generate([prompts[0]], params, speculative=drafter.config)[0]
        assert c.finish_reason == "eos", c.text
        jsonschema.validate(json.loads(c.text), COPY_SCHEMA)


def test_takes_agrees_with_the_mask(llm):
    """Grammars.takes (the lazy check) allows exactly the tokens the mask allows, along a path
    through a schema, end-of-sequence included."""
    g = llm.grammars
    m = g.matcher(StructuredOutput("json_schema", SCHEMAS["array"]))
    path = llm.tokenizer.encode('{"tags":["red","blue"]}', add_bos=False)
    probe = torch.randint(0, llm.model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    for tok in path + [None]:
        allowed = g.allowed([m])[0]
        for t in probe + path + list(llm.tokenizer.eos_ids):
            assert g.takes(m, t) == bool(allowed[t]), (t, tok)
        if tok is not None:
            assert m.consume_token(tok)


def test_lazy_mask_draws_the_masked_distribution(llm):
    """Rows without top-k/p, min-p draw first and compute the mask only when the grammar refuses
    the token: greedy rows get the masked argmax, sampled rows the masked distribution p / p(A)
    (3000 draws from logits that put most of the mass outside the grammar, frequencies within 4
    standard deviations), and the filtered (eager) path draws the same distribution."""
    from types import SimpleNamespace

    from arlm.engine.request import Request
    from arlm.engine.sampler import sample_plain

    V = llm.model.config.vocab_size
    spec = StructuredOutput("regex", "[a-e]")
    letters = [llm.tokenizer.encode(c, add_bos=False)[0] for c in "abcde"]
    base = torch.randn(V, generator=torch.Generator().manual_seed(2))
    base[letters] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]) + base.max()  # ~1/4 of the mass allowed
    base[torch.topk(base, 20).indices[5:]] += 3.0  # (most of it on 15 tokens the grammar refuses)
    p = base.softmax(-1)
    target = p[letters] / p[letters].sum()
    calls = {"takes": 0, "refused": 0}
    takes = llm.grammars.takes

    def counting(m, t):
        calls["takes"] += 1
        ok = takes(m, t)
        calls["refused"] += not ok
        return ok

    llm.grammars.takes = counting
    fresh = llm.grammars.matcher(spec)
    try:
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=V)):
            counts = torch.zeros(5)
            for rnd in range(15):
                n = 200
                reqs = [Request.create(f"r{i}", [1], dataclasses.replace(params, seed=1000 * rnd + i), V,
                                       llm.tokenizer.eos_ids, "cpu") for i in range(n)]
                for r in reqs:  # (copies of one fresh matcher: its start state, the grammar parsed once)
                    r.matcher = fresh.deep_copy()
                got, failed = sample_plain(base.expand(n, -1).contiguous(), list(range(n)),
                                           SimpleNamespace(seqs=reqs), list(range(n)), llm.grammars)
                assert not failed
                for (t,) in got.values():
                    counts[letters.index(t)] += 1
            n = counts.sum()
            sd = (n * target * (1 - target)).sqrt()
            assert ((counts - n * target).abs() <= 4 * sd + 1).all(), (params, counts / n, target)
        assert calls["refused"] > 1000  # the lazy path drew, was refused and drew again
        greedy = SamplingParams(temperature=0.0)
        r = Request.create("g", [1], greedy, V, llm.tokenizer.eos_ids, "cpu")
        r.matcher = llm.grammars.matcher(spec)
        got, _ = sample_plain(base[None].clone(), [0], SimpleNamespace(seqs=[r]), [0], llm.grammars)
        assert got[0] == [letters[0]]  # the masked argmax
    finally:
        llm.grammars.takes = takes


def test_specs_the_engine_cannot_enforce_are_errors(llm):
    for spec, word in ((StructuredOutput("regex", "(("), "regex"),
                       (StructuredOutput("json_schema", {"type": "frobnicate"}), "json schema"),
                       (StructuredOutput("grammar", "start: undefined_rule"), "grammar")):
        with pytest.raises(GrammarError, match=word):
            llm.grammars.compile(spec)
        with pytest.raises(ValueError):
            llm.engine.add_request([1, 2, 3], SamplingParams(structured=spec))
    for bad in (dict(kind="yaml"), dict(kind="choice", value=[]), dict(kind="json_schema", value="{}")):
        with pytest.raises(GrammarError):
            StructuredOutput(**bad)


def test_cli_flags(capfd):
    def arlm(*args):  # (in this process: five processes, each importing and loading the model, otherwise)
        return run_arlm(capfd, "generate", *args)

    r = arlm("Is the sky blue?", "--chat", "--choice", "yes,no", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] in ("yes", "no")
    for flags, word in ((["--regex", "(("], "regex"), (["--json-schema", '{"type": "frob"}'], "json schema"),
                        (["--json-schema", "/no/such/schema.json"], "cannot read"), (["--choice", ","], "choice")):
        r = arlm("hi", *flags)
        assert r.returncode == 2 and word in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr and not r.stdout


# -- limits: what one request's grammar may cost ----------------------------------------------------

SELF_RECURSIVE = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                  "required": ["next"]}}, "$ref": "#/$defs/n"}
# 3,000 optional properties: compiles (and its first mask is cheap), but the row after "{" holds
# an Earley item per property, past llguidance's per-row limit: it stops while it runs.
WIDE = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40} for i in range(3000)}}


def test_grammars_past_their_limits_are_refused_with_the_reason(llm):
    from arlm.structured import GrammarLimits, Grammars

    g = Grammars(llm.tokenizer, llm.model.config.vocab_size, GrammarLimits(max_size=2000))
    cases = ((StructuredOutput("json_schema", SELF_RECURSIVE), "too_complex"),  # forces itself forever
             (StructuredOutput("json_schema", {**WIDE, "required": list(WIDE["properties"])}), "too_large"),
             (StructuredOutput("regex", "(("), "invalid"))
    for spec, reason in cases:
        with pytest.raises(GrammarError) as e:
            g.compile(spec)
        assert e.value.reason == reason, (spec.kind, e.value)
        assert "\n" not in str(e.value) and "<" not in str(e.value), str(e.value)  # one line, no markup
    assert g.stats.rejected["too_complex"] == 1 and g.stats.rejected["too_large"] == 1
    ok = StructuredOutput("json_schema", SCHEMAS["nested"])
    first = g.compile(ok)
    assert g.compile(ok) is first and g.stats.compiled == 1  # cached
    a, b = first.matcher(), first.matcher()
    assert a is not b and a.consume_token(llm.tokenizer.encode("{")[0]) and b.validate_tokens(
        llm.tokenizer.encode("{")) == 1  # each request's own state


def test_the_compiler_runs_off_the_caller_shares_a_spec_and_refuses_when_full(llm):
    from concurrent.futures import wait

    from arlm.structured import GrammarLimits, Grammars

    g = Grammars(llm.tokenizer, llm.model.config.vocab_size, GrammarLimits(max_pending=2))
    specs = [StructuredOutput("json_schema", {"type": "object", "properties": {f"k{i}_{j}": {"type": "integer"}
                                                                                 for j in range(400)}})
             for i in range(3)]
    f0 = g.submit(specs[0])
    assert g.submit(specs[0]) is f0  # one compilation for every request of a spec
    f1 = g.submit(specs[1])
    with pytest.raises(GrammarError) as e:
        g.submit(specs[2])
    assert e.value.reason == "busy" and g.stats.rejected["busy"] == 1
    wait([f0, f1])
    assert g.pending == 0 and f0.result().spec == specs[0]
    assert g.submit(specs[0]).result() is f0.result()  # from the cache, at once
    g.submit(specs[2]).result()


def test_a_grammar_stopped_by_its_limits_fails_its_request_alone(llm):
    """A request whose grammar hits llguidance's limits while it runs ends with a client error
    (the HTTP edge's 400 or error event); the other rows of the step get their tokens."""
    plain = SamplingParams(max_new_tokens=10, temperature=0.0)
    a = _chat(llm, "Name three fruits.")
    alone = llm.engine.generate([a], plain)[0]
    for params in (SamplingParams(max_new_tokens=20, temperature=0.0, structured=StructuredOutput("json_schema", WIDE)),
                   SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=1,
                                  structured=StructuredOutput("json_schema", WIDE))):
        reqs = [llm.engine.add_request(a, plain), llm.engine.add_request(_chat(llm, "JSON please."), params),
                llm.engine.add_request(a, plain)]
        errors = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.error is not None:
                    errors[out.request_id] = out
        assert list(errors) == [reqs[1].request_id], errors
        out = errors[reqs[1].request_id]
        assert out.client_error and "more work per token than its limits allow" in out.error, out.error
        assert reqs[0].output_ids == alone and reqs[2].output_ids == alone


def test_eager_masks_prefetched_beside_the_forward_pass_change_nothing(llm, monkeypatch):
    """top-p rows are masked before their draw; their masks come from the mask thread, computed
    during the forward pass. The tokens are those of masks computed after it."""
    from arlm.engine import sampler

    prompts = [_chat(llm, "Answer with JSON."), _chat(llm, "Describe a city as JSON.")]
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, top_p=0.9, seed=s,
                             structured=StructuredOutput("json_schema", SCHEMAS[name]))
              for s, name in enumerate(("nested", "array_of_objects"))]
    started = []
    start = sampler.PrefetchedMasks.start
    monkeypatch.setattr(sampler.PrefetchedMasks, "start",
                        classmethod(lambda cls, b, g: started.append(1) or start.__func__(cls, b, g)))
    with_prefetch = llm.engine.generate(prompts, params)
    assert started
    monkeypatch.setattr(sampler.PrefetchedMasks, "start", classmethod(lambda cls, b, g: None))
    assert llm.engine.generate(prompts, params) == with_prefetch
    for ids, p in zip(with_prefetch, params):
        text = llm.tokenizer.decode(ids)
        if ids and ids[-1] in llm.tokenizer.eos_ids or text.endswith("}") or text.endswith("]"):
            jsonschema.validate(json.loads(text.removesuffix("<|im_end|>")), p.structured.value)
