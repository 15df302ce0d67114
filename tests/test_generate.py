"""Generation against references: the uncached path, each prompt alone, HF generate, hand-made stops.

Token sequences are compared exactly (greedy, float32); logits within the tolerance each test
states. Real text behaviour (stop strings, EOS, chat) uses SmolLM2; the rest a tiny random
Llama-GQA model (see `conftest.randomize_`) whose logits have clear gaps.
"""

from __future__ import annotations

import pytest
import torch

from arlm.config import ModelConfig
from arlm.engine import Engine, EngineConfig, FinishReason, ModelRunner, prefill
from arlm.kv_cache import KVCache
from arlm.llm import ChatSession, TextChunk
from arlm.loading import build_model
from arlm.model import Transformer
from arlm.sampling import SamplingParams, sample
from arlm.text import StopStrings

from conftest import randomize_

GREEDY = dict(temperature=0.0, ignore_eos=True)
EOS, STOP, LENGTH, CONTEXT = FinishReason.EOS, FinishReason.STOP, FinishReason.LENGTH, FinishReason.CONTEXT
# The engine as `LLM` runs it: static batches on a contiguous cache, every prompt in one prefill.
STATIC = dict(block_size=None, max_num_seqs=1024, max_num_batched_tokens=1 << 20)


def tiny_gqa(max_seq_len: int = 256, seed: int = 3) -> Transformer:
    config = ModelConfig.llama(vocab_size=199, n_layer=3, n_head=6, n_kv_heads=2, d_model=96, d_ff=160,
                               max_seq_len=max_seq_len, rope_theta=10000.0, tie_embeddings=False)
    torch.manual_seed(seed)
    model = Transformer(config)
    return randomize_(model, seed).eval()


@pytest.fixture(scope="module")
def tiny():
    return tiny_gqa()


def random_prompts(lengths, vocab=199, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model, prompts, params, eos_ids=(), context_shift=False, runner=None, **config):
    """Generate on one engine (`STATIC` unless `config` says otherwise); (the output ids of each
    prompt, their finish reasons, tokens produced by decode steps)."""
    engine = Engine(runner or ModelRunner(model), eos_ids, EngineConfig(**{**STATIC, **config}))
    reqs = [engine.add_request(p, params, context_shift=context_shift) for p in prompts]
    decode_tokens = 0
    while engine.has_unfinished():
        outputs = engine.step()
        if not engine.last_step.prompt_tokens:
            decode_tokens += len(outputs)
    return [r.output_ids for r in reqs], [r.finish_reason for r in reqs], decode_tokens


def recompute_greedy(model, prompt, n, params=None, generator=None):
    """The reference: no cache, the whole sequence through the model for every new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[:, -1]
            ids.append(int(logits.argmax(-1)) if params is None else int(sample(logits, params, generator)))
    return ids[len(prompt):]


# -- cached == uncached -----------------------------------------------------------------------------

def test_cached_greedy_equals_recompute_tiny_gqa(tiny):
    prompt = random_prompts([9], seed=1)[0]
    tokens, reasons, _ = run(tiny, [prompt], SamplingParams(max_new_tokens=140, **GREEDY))
    assert reasons == [LENGTH] and len(tokens[0]) == 140
    assert tokens[0] == recompute_greedy(tiny, prompt, 140)
    assert len(set(tokens[0])) > 5, "degenerate output would make this comparison weak"


def test_cached_seeded_sampling_equals_recompute_tiny_gqa(tiny):
    """Same seed, same draws: the cached path and the uncached one sample identical tokens."""
    prompt = random_prompts([5], seed=2)[0]
    params = SamplingParams(max_new_tokens=100, temperature=1.0, top_k=50, top_p=0.95, seed=11, ignore_eos=True)
    tokens, _, _ = run(tiny, [prompt], params)
    ref = recompute_greedy(tiny, prompt, 100, params, torch.Generator().manual_seed(11))
    assert tokens[0] == ref
    assert len(set(tokens[0])) > 20


def teacher_forced_greedy(model, prompt, tokens):
    """The uncached reference in one pass: the argmax after each prefix of prompt + tokens, from
    one forward pass over the whole sequence, no cache. Causal attention gives position
    len(prompt) - 1 + i exactly the prefix that recomputing token i from scratch sees (the
    tiny model's test recomputes step by step, `recompute_greedy`; for SmolLM2 that is 100
    forward passes for the same check)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)]))[0, len(prompt) - 1:-1]
    return logits.argmax(-1).tolist()


@pytest.mark.slow
def test_cached_greedy_equals_recompute_smollm2(smollm2):
    prompt = smollm2.tokenizer.encode("The history of the printing press")
    tokens, _, _ = run(smollm2.model, [prompt], SamplingParams(max_new_tokens=100, **GREEDY))
    assert len(tokens[0]) == 100 and len(set(tokens[0])) > 20
    assert tokens[0] == teacher_forced_greedy(smollm2.model, prompt, tokens[0])


# -- ragged batches ----------------------------------------------------------------------------------

def first_logits(model, prompts):
    B, P = len(prompts), max(map(len, prompts))
    cache = KVCache.contiguous(model.config, B, P)
    tokens = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        return prefill(model, cache, tokens, torch.arange(P).expand(B, P), torch.tensor([len(p) for p in prompts]) - 1, P)


def test_ragged_batch_equals_each_prompt_alone_smollm2(smollm2):
    """Prompts of 1, 11 and 27 tokens: first-step logits within 1e-4, 24 greedy tokens identical."""
    texts = ["Hi", "The quick brown fox jumps over the lazy dog and then",
             "In the beginning of the twentieth century, the city of Vienna was a centre of art, science and "
             "philosophy, where painters, composers and"]
    prompts = [smollm2.tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    batch_logits = first_logits(smollm2.model, prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(batch_logits[b], first_logits(smollm2.model, [p])[0], atol=1e-4, rtol=0)
    params = SamplingParams(max_new_tokens=24, **GREEDY)
    batch, _, _ = run(smollm2.model, prompts, params)
    for b, p in enumerate(prompts):
        assert batch[b] == run(smollm2.model, [p], params)[0][0]


def test_ragged_batch_rows_finishing_early_tiny_gqa(tiny):
    """Rows that hit EOS early ride along frozen; the others still match running alone."""
    prompts = random_prompts([3, 17, 40, 8], seed=4)
    alone = [run(tiny, [p], SamplingParams(max_new_tokens=30, **GREEDY))[0][0] for p in prompts]
    # Row 0 stops at the first new token it emits after its 3rd; others may stop too, wherever they emit it.
    stop_at = next(i for i in range(3, 30) if alone[0][i] not in alone[0][:i])
    eos = alone[0][stop_at]
    params = SamplingParams(max_new_tokens=30, temperature=0.0)
    ref = [run(tiny, [p], params, eos_ids=[eos]) for p in prompts]
    batch_logits = first_logits(tiny, prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(batch_logits[b], first_logits(tiny, [p])[0], atol=1e-4, rtol=0)
    tokens, reasons, decode_tokens = run(tiny, prompts, params, eos_ids=[eos])
    assert tokens == [r[0][0] for r in ref] and reasons == [r[1][0] for r in ref]
    assert reasons[0] == EOS and len(tokens[0]) == stop_at + 1
    assert LENGTH in reasons, "some row should outlive row 0"
    assert decode_tokens == sum(map(len, tokens)) - len(prompts)  # the first token comes from prefill
    # The same batch through a paged pool (blocks of 8, chunked prefill, continuous batching).
    paged = run(tiny, prompts, params, eos_ids=[eos], block_size=8, kv_cache_tokens=2048, max_num_batched_tokens=16)
    assert paged[:2] == (tokens, reasons)


# -- HF generate with a repetition penalty -------------------------------------------------------------

@pytest.mark.slow
def test_repetition_penalty_greedy_matches_hf_generate(smollm2, hf_smollm2):
    prompt = smollm2.tokenizer.encode("List of fruits: apple, banana, apple, banana,")
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_smollm2.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32,
                                  repetition_penalty=1.3, eos_token_id=2, pad_token_id=2)
    ref = out[0, len(prompt):].tolist()
    params = SamplingParams(max_new_tokens=32, temperature=0.0, repetition_penalty=1.3)
    tokens, _, _ = run(smollm2.model, [prompt], params, eos_ids=[2])
    assert tokens[0] == ref
    plain, _, _ = run(smollm2.model, [prompt], SamplingParams(max_new_tokens=32, temperature=0.0), eos_ids=[2])
    assert plain[0] != ref, "the penalty should change this output, or the test proves nothing"


# -- seeded sampling -------------------------------------------------------------------------------------

def test_seeded_sampling_reproducible_smollm2(smollm2_default):
    prompts = ["Once upon a time", "My favourite food is"]

    def texts(seed):
        out = smollm2_default.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed,
                                                       ignore_eos=True))
        return [c.token_ids for c in out]

    a, b, c = texts(1234), texts(1234), texts(98765)
    assert a == b
    assert a[0] != c[0] and a[1] != c[1]


# -- stop conditions ---------------------------------------------------------------------------------------
# (SmolLM2 on its default path: real text, several times faster to decode than the float32 model;
# each test compares the engine with itself, never with a float32 reference)

def stream_chunks(llm, prompt, params):
    """(the prompt's request, after the stream ran; the chunks)"""
    stream = llm.stream([prompt], params)
    chunks = list(stream)
    assert all(isinstance(c, TextChunk) for c in chunks)
    return stream.requests[0], chunks


@pytest.fixture(scope="module")
def story(smollm2_default):
    """A greedy continuation without stop strings, and its stream chunk boundaries in the text."""
    prompt = "Once upon a time, in a small village by the sea, there lived"
    params = SamplingParams(max_new_tokens=48, **GREEDY)
    req, chunks = stream_chunks(smollm2_default, prompt, params)
    text = "".join(c.text for c in chunks)
    bounds, pos = [], 0
    for c in chunks[:-1]:
        pos += len(c.text)
        bounds.append(pos)
    return prompt, text, bounds, req.output_ids


def check_stop(llm, prompt, stop, full_text, max_new_tokens=48):
    """Streamed and non-streamed text both equal the reference cut before the stop string."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=[stop], **GREEDY)
    req, chunks = stream_chunks(llm, prompt, params)
    streamed = "".join(c.text for c in chunks)
    done = llm.generate(prompt, params)[0]
    expect = full_text[:full_text.index(stop)]
    assert stop not in streamed
    assert streamed == expect == done.text
    assert chunks[-1].finish_reason == STOP == done.finish_reason == req.finish_reason
    return req, chunks


def test_stop_string_spanning_several_tokens(smollm2_default, story):
    prompt, text, bounds, _ = story
    # Five tokens' worth of text starting at a token boundary well into the reply.
    start, end = bounds[8], bounds[13]
    stop = text[start:end]
    assert text.index(stop) == start and len(stop) >= 5
    assert bounds[13] > bounds[12]  # the 14th token ends the stop string
    req, _ = check_stop(smollm2_default, prompt, stop, text)
    assert len(req.output_ids) == 14  # it stopped on the token that completed the stop string


def test_stop_string_straddling_stream_chunks(smollm2_default, story):
    prompt, text, bounds, _ = story
    for b in bounds[5:]:
        stop = text[b - 2:b + 2]  # starts inside one chunk, ends inside the next
        if text.index(stop) == b - 2 and stop.strip():
            break
    else:
        pytest.fail("no chunk boundary to straddle")
    check_stop(smollm2_default, prompt, stop, text)


def test_stop_string_completed_by_the_last_allowed_token(smollm2_default, story):
    """max_new_tokens and the stop string end on the same token: the text is cut, so 'stop'."""
    prompt, text, bounds, completion = story
    n = 12
    stop = text[bounds[n - 3]:bounds[n - 1]]  # the text of tokens n-1 and n: the n-th completes it
    assert text.index(stop) == bounds[n - 3] and bounds[n - 1] > bounds[n - 2]
    req, _ = check_stop(smollm2_default, prompt, stop, text, max_new_tokens=n)
    assert len(req.output_ids) == n


def test_stop_prefixes_that_never_complete_are_released(smollm2_default, story):
    prompt, text, _, _ = story
    word = text.split()[3]
    stop = word + "\u2603"  # the word then a snowman: its prefix keeps appearing, never the whole
    params = SamplingParams(max_new_tokens=48, stop=[stop, " the@@"], **GREEDY)
    req, chunks = stream_chunks(smollm2_default, prompt, params)
    assert "".join(c.text for c in chunks) == text
    assert req.finish_reason == LENGTH


def test_stop_strings_hand_made_pieces():
    w = StopStrings(["o w"])
    assert w.push("Hel", False) == ("Hel", False)
    assert w.push("lo", False) == ("l", False)  # "o" might start "o w": held back
    assert w.push(" wo", False) == ("", True)
    # Several stop strings with overlapping prefixes: each held tail is kept until resolved.
    w = StopStrings(["abcdZ", "XabcdY"])
    out = [w.push(p, False) for p in ["..", "Xab", "cd", "Y"]]
    assert "".join(o[0] for o in out) == ".." and out[-1][1]
    w = StopStrings(["abcdZ", "XabcdY"])
    out = [w.push(p, i == 4) for i, p in enumerate(["..", "Xab", "cd", "Q", "!"])]
    assert "".join(o[0] for o in out) == "..XabcdQ!" and not any(o[1] for o in out)


def test_eos_finishes_with_eos(smollm2_default):
    llm = smollm2_default
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}])
    req, chunks = stream_chunks(llm, prompt, SamplingParams(max_new_tokens=48, temperature=0.0))
    assert req.finish_reason == EOS
    assert req.output_ids[-1] in llm.tokenizer.eos_ids
    assert chunks[-1].finish_reason == EOS
    text = "".join(c.text for c in chunks)
    assert "4" in text and "<|im_end|>" not in text


def test_max_new_tokens_finishes_with_length(tiny):
    for n in (1, 2, 17):
        tokens, reasons, _ = run(tiny, random_prompts([6, 2]), SamplingParams(max_new_tokens=n, **GREEDY))
        assert [len(t) for t in tokens] == [n, n] and reasons == [LENGTH, LENGTH]


def test_context_limit_finishes_with_context():
    """max_seq_len 32: a row stops once its last sampled token has no position left to go to."""
    model = tiny_gqa(max_seq_len=32, seed=5)
    prompts = random_prompts([20, 5, 32], seed=6)
    params = SamplingParams(max_new_tokens=100, **GREEDY)
    tokens, reasons, _ = run(model, prompts, params)
    assert reasons == [CONTEXT] * 3
    # The whole window is used: the prompt plus every fed token fill 32 positions, + 1 sampled.
    assert [len(t) for t in tokens] == [32 - 20 + 1, 32 - 5 + 1, 1]
    for p, t in zip(prompts, tokens):
        assert t == recompute_greedy(model, p, len(t))
        assert run(model, [p], params)[0][0] == t
    with pytest.raises(ValueError, match="context window"):
        run(model, random_prompts([33]), params)
    # Through a paged pool too: the same tokens, and the same stop.
    assert run(model, prompts, params, block_size=4, kv_cache_tokens=256)[:2] == (tokens, reasons)


# -- the KV cache --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_bytes_per_token(dtype):
    for cfg in (ModelConfig.llama(), ModelConfig.gpt2(), ModelConfig.llama(n_head=6, n_kv_heads=1, d_model=96)):
        cache = KVCache.contiguous(cfg, batch_size=3, capacity=16, dtype=dtype)
        element = torch.tensor([], dtype=dtype).element_size()
        assert cache.bytes_per_token == 2 * cfg.n_layer * cfg.n_kv_heads * cfg.head_dim * element
        assert cache.nbytes == 3 * 16 * cache.bytes_per_token
    assert KVCache.contiguous(ModelConfig.llama(), 1, 1).bytes_per_token == 2 * 30 * 3 * 64 * 4  # SmolLM2: 46080


def test_kv_cache_in_place_and_matches_a_fresh_prefill(tiny):
    """The engine's contiguous cache is allocated once for the batch and written in place; each
    request's row holds the K/V of a fresh prefill of the tokens it fed (<= 1e-4)."""
    prompts = random_prompts([4, 15, 9], seed=7)
    engine = Engine(tiny, (), EngineConfig(**STATIC))
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=12, **GREEDY)) for p in prompts]
    engine.step()
    cache = engine.cache
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
    assert cache.n_blocks == 3 and cache.block_size == 15 + 12
    while engine.has_unfinished():
        engine.step()
        assert engine.cache is cache and (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
        for r in reqs:
            assert r.num_computed == len(r.token_ids) - 1 or r.finished  # the newest is not fed yet
    for r in reqs:
        fed = r.token_ids[:-1]
        ref = KVCache.contiguous(tiny.config, 1, len(fed))
        with torch.inference_mode():
            prefill(tiny, ref, torch.tensor([fed]), torch.arange(len(fed))[None], torch.tensor([len(fed) - 1]),
                    len(fed))
        n, row = len(fed), r.blocks[0] if r.blocks else reqs.index(r)
        torch.testing.assert_close(cache.k[:, row, :, :n], ref.k[:, 0], atol=1e-4, rtol=0)
        torch.testing.assert_close(cache.v[:, row, :, :n], ref.v[:, 0], atol=1e-4, rtol=0)


# -- chat ------------------------------------------------------------------------------------------------

def test_chat_second_turn_equals_whole_conversation_from_scratch(smollm2):
    params = SamplingParams(max_new_tokens=40, temperature=0.0)
    session = ChatSession(smollm2, params, max_context=1024)
    first = "".join(c.text for c in session.send("What is the capital of France?"))
    first_prefill = session.last_prefill_tokens
    second = "".join(c.text for c in session.send("And of Germany?"))
    second_tokens = session.last_request.output_ids

    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": first}, {"role": "user", "content": "And of Germany?"}]
    full = smollm2.tokenizer.encode(smollm2.apply_chat_template(history))
    assert session.messages[:3] == history and session.messages[3] == {"role": "assistant", "content": second}
    scratch = smollm2.generate([full], params)[0]
    assert second_tokens == scratch.token_ids and second == scratch.text
    assert first_prefill == len(smollm2.tokenizer.encode(smollm2.apply_chat_template(history[:1])))
    # Only the new turn is prefilled ("<|im_end|>\n<|im_start|>user\nAnd of Germany?<|im_end|>\n..."),
    # from the last full block of the first turn on: the prefix cache holds whole blocks.
    first_turn = len(smollm2.tokenizer.encode(smollm2.apply_chat_template(history[:2], add_generation_prompt=False)))
    new = len(full) - first_turn
    assert session.cached_tokens > 0 and session.cached_tokens % ChatSession.BLOCK_SIZE == 0
    assert session.last_prefill_tokens == len(full) - session.cached_tokens
    assert session.last_prefill_tokens < new + ChatSession.BLOCK_SIZE


def test_chat_repetition_penalty_counts_earlier_turns(smollm2):
    """HF semantics: the penalty covers every token of the input, earlier turns included, so the
    cached second turn must still equal the whole conversation run from scratch."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, repetition_penalty=1.3)
    session = ChatSession(smollm2, params, max_context=1024)
    turns = ["Name three colours of the rainbow.", "Name three more colours of the rainbow."]
    first = "".join(c.text for c in session.send(turns[0]))
    "".join(c.text for c in session.send(turns[1]))
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first},
               {"role": "user", "content": turns[1]}]
    full = smollm2.tokenizer.encode(smollm2.apply_chat_template(history))
    assert session.last_request.output_ids == smollm2.generate([full], params)[0].token_ids


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_context_shift_equals_recomputing_the_cropped_window(family):
    # With context_shift, a row that fills the window goes on from its last half, recomputed at
    # positions 0..: each token must be what an uncached forward over that window predicts
    # (the reference below), and generation runs past the window to max_new_tokens.
    from conftest import arlm_from_hf, hf_gpt2, hf_llama

    hf = hf_llama(seed=7, max_position_embeddings=16) if family == "llama" else hf_gpt2(seed=7, n_positions=16)
    model = arlm_from_hf(hf)
    limit, keep = 16, 8
    prompt = [5, 9, 2, 7, 3]
    params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    tokens, reasons, _ = run(model, [prompt], params, context_shift=True)
    assert reasons == ["length"] and len(tokens[0]) == 40
    seq, w = list(prompt), 0
    with torch.inference_mode():
        while len(seq) < len(prompt) + 40:
            if len(seq) - w > limit:
                w = len(seq) - 1 - keep
            window = seq[w:]
            seq.append(int(model(torch.tensor([window]))[0, -1].argmax()))
    assert tokens[0] == seq[len(prompt):]
    # the same through a paged pool, and beside another request that does not shift
    both, reasons, _ = run(model, [prompt, [4, 4]], params, context_shift=True, block_size=4, kv_cache_tokens=64)
    assert both[0] == tokens[0] and reasons == ["length", "length"]
    # without it the row stops at the window
    stopped, reasons, _ = run(model, [prompt], params)
    assert reasons == ["context"] and len(stopped[0]) == limit - len(prompt) + 1


# -- the default (quantized) path: a batch equals each prompt alone, token for token ---------------

@pytest.fixture(scope="module")
def default_llm(smollm2_default):
    """SmolLM2 as `LLM.load("smollm2")` configures it: 4-bit/int8 layers, 8-bit activations,
    quantized prefill on AVX-512 VNNI CPUs, float16 KV cache, the native decode step (the
    session's, loaded from its blocks: no second quantization of the float model)."""
    return smollm2_default


def test_default_path_ragged_batch_equals_each_prompt_alone(default_llm):
    """8-bit activations turn float32 noise into whole-token differences, so the batch must do the
    same arithmetic per row as the prompt alone: greedy tokens identical (no tolerance), also
    beside a long prompt and with a repetition penalty."""
    texts = ["In 1492,", "The capital of France is", "Once upon a time", "def fibonacci(n):"]
    long = " ".join(["The history of the city is long and full of wars, plagues and great buildings."] * 20)
    for params in (SamplingParams(max_new_tokens=24, temperature=0.0),
                   SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1.3)):
        batch = default_llm.generate(texts + [long], params)
        for b, t in enumerate(texts):
            assert batch[b].token_ids == default_llm.generate(t, params)[0].token_ids, t


def test_seeded_sampling_does_not_depend_on_the_row(default_llm):
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=42)
    alone = default_llm.generate("Hello", params)[0].token_ids
    batch = default_llm.generate(["Other words", "Hello", "Hello"], params)
    assert batch[1].token_ids == alone and batch[2].token_ids == alone


def test_tiny_temperature_is_greedy(default_llm):
    greedy = default_llm.generate("The capital of France is", SamplingParams(max_new_tokens=6, temperature=0))
    tiny_t = default_llm.generate("The capital of France is", SamplingParams(max_new_tokens=6, temperature=1e-40))
    assert tiny_t[0].token_ids == greedy[0].token_ids and tiny_t[0].text.strip()


def test_prompt_types(default_llm):
    params = SamplingParams(max_new_tokens=2, temperature=0)
    assert len(default_llm.stream("Hi", params).prompt_ids) == 1  # one str is one prompt, as for generate
    ids = default_llm.tokenizer.encode("Hi")
    assert default_llm.generate([ids], params)[0].token_ids == default_llm.generate("Hi", params)[0].token_ids
    for bad in (None, 123, [1, 2, 3], [(1.5, 2)], [b"hi"], [[5.7, 10.2]]):
        with pytest.raises(TypeError, match="prompt"):
            default_llm.generate(bad, params)
    with pytest.raises(ValueError, match="no prompts"):
        default_llm.generate([], params)


def test_abandoned_chat_turn_leaves_the_history_as_it_was(default_llm):
    params = SamplingParams(max_new_tokens=12, temperature=0)
    fresh = ChatSession(default_llm, params)
    expected = "".join(c.text for c in fresh.send("Hello!"))
    session = ChatSession(default_llm, params)
    for _ in session.send("Tell me a long story about a dragon."):
        break  # the caller walks away after the first chunk
    assert "".join(c.text for c in session.send("Hello!")) == expected
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    with pytest.raises(TypeError):
        next(session.send(None))
