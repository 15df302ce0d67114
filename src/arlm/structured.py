"""Structured outputs: a grammar enforced at every decode step, by llguidance.

A request's `SamplingParams.structured` (a `StructuredOutput`: any JSON object, a JSON schema, a
regular expression, a choice among strings, or a Lark grammar) becomes an llguidance matcher when
the request is added to the engine (`Grammars.matcher`). Each step the engine asks the matchers
of the rows that have one for the tokens allowed next, as a bitmask, and sets the other logits to
-inf before sampling (rows without a grammar pay nothing); the token drawn is then fed to the
matcher. End-of-sequence is allowed exactly where the grammar may end, so an output that stops
with EOS always parses; one cut by max_tokens may not (as everywhere: the client sees
finish_reason "length").

Why llguidance (over xgrammar, the other CPU-native engine made for this): it computes each mask
on the fly with an Earley parser over a token trie (~50 us a token for a 128k vocabulary, no
per-schema precompilation), takes JSON schema, regex and Lark from one API, and is what OpenAI,
llama.cpp, vLLM and SGLang use for JSON schema; docs/benchmarks.md has its cost per step here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot take; the message says why, in one line."""


def _one_line(message: str) -> str:
    """llguidance's multi-line diagnostics (a caret under the source, the grammar's lines) as one line."""
    keep = [ln.strip() for ln in message.splitlines()
            if ln.strip() and set(ln.strip()) != {"^"} and not re.match(r"^\d+ \|", ln.strip())]
    return " ".join(keep)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must be. kind: "json" (any JSON object), "json_schema" (value: the schema,
    a dict), "regex" (value: a pattern the whole output matches), "choice" (value: a list of
    strings: exactly one of them), "grammar" (value: a Lark grammar, llguidance's dialect)."""

    kind: str
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown structured output kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind == "json_schema" and not isinstance(self.value, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        if self.kind in ("regex", "grammar") and (not isinstance(self.value, str) or not self.value):
            raise GrammarError(f"a {self.kind} must be a non-empty string")
        if self.kind == "choice" and (not isinstance(self.value, (list, tuple)) or not self.value
                                      or not all(isinstance(c, str) and c for c in self.value)):
            raise GrammarError("choice must be a non-empty list of non-empty strings")

    def __hash__(self) -> int:  # (value may be a dict)
        return hash((self.kind, json.dumps(self.value, sort_keys=True)))

    def grammar(self) -> str:
        """llguidance's grammar text for this spec."""
        from llguidance import LLMatcher  # (llguidance, a native library: loaded with the first grammar)

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
        if self.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(self.value, defaults={"whitespace_flexible": False})
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid: {e}") from None
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return LLMatcher.grammar_from_regex("(" + "|".join(re.escape(c) for c in self.value) + ")")
        return LLMatcher.grammar_from_lark(self.value)


class Grammars:
    """llguidance's view of one tokenizer (built once: every token's bytes), and the matchers
    of the requests that have a structured output."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None  # built on first use (~0.2 s)
        self._checked: dict[StructuredOutput, str] = {}

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance  # (llguidance, a native library: loaded with the first grammar)

            eos = list(self.tokenizer.eos_ids) or None
            self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                        eos_token=eos[0] if eos and len(eos) == 1 else eos)
        return self._ll_tokenizer

    @property
    def words(self) -> int:
        """The mask's size in 32-bit words."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def check(self, spec: StructuredOutput) -> str:
        """The grammar for `spec`, checked (GrammarError with llguidance's reason otherwise)."""
        from llguidance import LLMatcher  # (llguidance, a native library: loaded with the first grammar)

        if spec not in self._checked:
            grammar = spec.grammar()
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
            if is_error:
                raise GrammarError(f"unsupported {spec.kind.replace('_', ' ')}: {_one_line(messages[0])}")
            self._checked[spec] = grammar
        return self._checked[spec]

    def matcher(self, spec: StructuredOutput):
        from llguidance import LLMatcher  # (llguidance, a native library: loaded with the first grammar)

        m = LLMatcher(self.ll_tokenizer, self.check(spec), log_level=0)
        if m.is_error():
            raise GrammarError(f"unsupported {spec.kind.replace('_', ' ')}: {_one_line(m.get_error())}")
        return m

    def bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), words] int32: the tokens each matcher allows next, one bit a token
        (bit t % 32 of word t / 32), for `kernels.mask_rows`."""
        bits = torch.empty((len(matchers), self.words), dtype=torch.int32)
        for i, m in enumerate(matchers):  # (llguidance's LLExecutor in parallel is slower here: docs/benchmarks.md)
            m.unsafe_compute_mask_ptr(bits[i].data_ptr(), self.words * 4)
        return bits

    def bitmask_along(self, matcher, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, words] int32: the tokens the matcher allows next, then after each
        token of `draft` in turn (speculative decoding: the masks of a verify pass's positions).
        The draft must be valid (`valid_prefix`); the matcher is left where it was."""
        bits = torch.empty((len(draft) + 1, self.words), dtype=torch.int32)
        for j in range(len(draft) + 1):
            matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self.words * 4)
            if j < len(draft) and not matcher.consume_token(draft[j]):
                raise RuntimeError(f"draft token {draft[j]} breaks the grammar: {matcher.get_error()}")
        matcher.rollback(len(draft))
        return bits

    def allowed(self, matchers: list) -> torch.Tensor:
        """[len(matchers), vocab] bool: the tokens each matcher allows next."""
        bits = self.bitmask(matchers).numpy()
        mask = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(mask.astype(bool))

    def takes(self, matcher, token: int) -> bool:
        """Whether the matcher's mask allows `token` next, without computing the mask (a few
        microseconds against ~0.05-0.15 ms): end-of-sequence where the grammar may end, any
        other token where the grammar can go on with it."""
        if token in self.tokenizer.eos_ids:
            return matcher.is_accepting()
        return matcher.validate_tokens([token]) == 1

    @staticmethod
    def valid_prefix(matcher, draft: list[int], eos_ids) -> int:
        """How many of the draft's first tokens the grammar takes from the matcher's state (the
        rest are dropped before the verify pass: it would reject them); a draft stops at EOS."""
        cut = next((j for j, t in enumerate(draft) if t in eos_ids), len(draft))
        return matcher.validate_tokens(draft[:cut]) if cut else 0
