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
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


# Why a grammar was refused, for the client's message and /metrics (arlm_grammar_rejected_total).
REASONS = ("invalid", "too_large", "too_complex", "timeout", "busy")


class GrammarError(ValueError):
    """A structured-output spec the grammar engine cannot take; the message says why, in one
    line, and `reason` (one of REASONS) says which limit or rule refused it."""

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


def _one_line(message: str) -> str:
    """llguidance's multi-line diagnostics (a caret under the source, the grammar's lines) as one line."""
    keep = [ln.strip() for ln in message.replace("<non-verbose/>", "").splitlines()
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


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost. A compilation runs on the compiler's thread, not
    the engine's, and is refused past `timeout` seconds or `max_size` grammar symbols; every
    mask (one token's step) is bounded by llguidance's fuel: `step_items` Earley items (~20k a
    millisecond) and `step_lexer_fuel` (~14k a millisecond), so that no request's grammar can
    stretch a step of the batch it runs in. `max_pending`: compilations queued at most (more
    are refused as "busy" rather than queued behind a slow one)."""

    timeout: float = 10.0
    max_size: int = 100_000
    step_items: int = 50_000
    step_lexer_fuel: int = 200_000
    max_pending: int = 32

    def parser_limits(self):
        from llguidance import LLParserLimits  # (llguidance, a native library: loaded with the first grammar)

        return LLParserLimits(max_grammar_size=self.max_size, step_max_items=self.step_items,
                              step_lexer_fuel=self.step_lexer_fuel, verbose_errors=False)


def _reason(message: str) -> str:
    """REASONS' name for one of llguidance's errors."""
    text = message.lower()
    if "too big" in text or "too large" in text:
        return "too_large"
    if any(w in text for w in ("too complex", "too many", "items; max is", "fuel", "limit")):
        return "too_complex"
    return "invalid"


def matcher_error(matcher) -> "GrammarError":
    """The error of a matcher that stopped in one (a limit hit while it ran: the request's grammar
    is more than the server allows, a client's error)."""
    message = _one_line(matcher.get_error())
    reason = _reason(message)
    what = "the grammar needs more work per token than its limits allow" if reason == "too_complex" \
        else "the grammar failed"
    return GrammarError(f"{what}: {message}", reason)


def refused(matcher, token: int) -> Exception:
    """Why the matcher refused a token: the grammar's limits (a GrammarError) or a token the mask
    did not allow (a RuntimeError: the caller skipped the mask)."""
    if matcher.is_error() and _reason(matcher.get_error()) == "too_complex":
        return matcher_error(matcher)
    return RuntimeError(f"token {token} breaks the grammar: {_one_line(matcher.get_error())}")


class CompiledGrammar:
    """A spec compiled once: each request gets its own matcher, a copy of this one's state."""

    def __init__(self, spec: StructuredOutput, matcher, seconds: float) -> None:
        self.spec, self._template, self.seconds = spec, matcher, seconds

    def matcher(self):
        return self._template.deep_copy()


@dataclass
class GrammarStats:
    """What the compiler did, for /metrics: compilations, refusals by reason, and each
    compilation's seconds to `on_compile` (arlm serve's histogram)."""

    compiled: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    on_compile: Callable[[float], None] | None = None

    def reject(self, e: GrammarError) -> GrammarError:
        self.rejected[e.reason] = self.rejected.get(e.reason, 0) + 1
        return e


def _mask_buffer(*shape: int) -> torch.Tensor:
    """An int32 tensor of `shape`, uninitialised: llguidance writes masks into it, one bit a token."""
    import torch  # (not at the top: `arlm serve --help` reads GrammarLimits' defaults, and imports no torch)

    return torch.empty(shape, dtype=torch.int32)


class Grammars:
    """llguidance's view of one tokenizer (built once: every token's bytes), the compiler of the
    requests' structured outputs, and the masks of their matchers at each step.

    `compile` builds a spec's matcher (blocking; llguidance drops the GIL meanwhile) and keeps
    the last `CACHE` specs; `submit` runs it on the compiler's own thread, for servers, so that
    neither the event loop nor the engine's step ever waits for a grammar."""

    CACHE = 64  # compiled specs kept
    FORCED_PROBE = 256  # forced tokens a compilation's probe takes at most

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.limits = limits or GrammarLimits()
        self.stats = GrammarStats()
        self._ll_tokenizer = None  # built on first use (~0.2 s)
        self._lock = threading.Lock()  # (the cache, the tokenizer and the stats: several threads compile)
        self._compiled: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future] = {}
        self._executor: ThreadPoolExecutor | None = None  # the compiler's thread
        self._mask_executor: ThreadPoolExecutor | None = None  # masks computed beside a forward pass
        self._pending = 0

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance  # (llguidance, a native library: loaded with the first grammar)

                eos = list(self.tokenizer.eos_ids) or None
                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=eos[0] if eos and len(eos) == 1 else eos)
            return self._ll_tokenizer

    def prepare(self) -> None:
        """llguidance loaded and its view of the tokenizer built now, not by the first grammar
        (whose time-out would pay for them)."""
        self.ll_tokenizer.vocab_size

    @property
    def words(self) -> int:
        """The mask's size in 32-bit words."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's grammar, compiled and probed, or GrammarError with llguidance's reason (a
        grammar over the size limit, one it cannot follow, one whose forced start already breaks
        a step's budget: a schema that requires itself forever). Cached by spec."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        from llguidance import LLMatcher  # (llguidance, a native library: loaded with the first grammar)

        start = time.perf_counter()
        kind = spec.kind.replace("_", " ")
        try:
            m = LLMatcher(self.ll_tokenizer, spec.grammar(), log_level=0, limits=self.limits.parser_limits())
            if m.is_error():
                message = _one_line(m.get_error())
                raise GrammarError(f"unsupported {kind}: {message}", _reason(message))
            # The probe, on a copy: the first mask, then the tokens the grammar forces from its
            # start taken as the first steps would take them (at most FORCED_PROBE) and the mask
            # after them. A grammar that breaks a step's budget there (a schema that requires
            # itself forever, a regex whose lexer explodes) is refused before it runs.
            probe = m.deep_copy()
            bits = _mask_buffer(self.words)
            probe.unsafe_compute_mask_ptr(bits.data_ptr(), self.words * 4)
            forced = [] if probe.is_error() else probe.compute_ff_tokens()[:self.FORCED_PROBE]
            if forced and not probe.is_error() and probe.consume_tokens(forced) and not probe.is_error():
                probe.unsafe_compute_mask_ptr(bits.data_ptr(), self.words * 4)
            if probe.is_error():
                raise matcher_error(probe)
        except GrammarError as e:
            with self._lock:
                raise self.stats.reject(e) from None
        compiled = CompiledGrammar(spec, m, time.perf_counter() - start)
        with self._lock:
            self.stats.compiled += 1
            if self.stats.on_compile is not None:
                self.stats.on_compile(compiled.seconds)
            self._compiled[spec] = compiled
            while len(self._compiled) > self.CACHE:
                self._compiled.popitem(last=False)
        return compiled

    def submit(self, spec: StructuredOutput) -> Future:
        """`compile` on the compiler's thread: a Future of the CompiledGrammar (GrammarError
        "busy" at once when `limits.max_pending` compilations are queued)."""
        with self._lock:
            if spec in self._compiled:
                done: Future = Future()
                done.set_result(self._compiled[spec])
                return done
            if spec in self._compiling:  # (n choices, or many clients with one schema: compiled once)
                return self._compiling[spec]
            if self._pending >= self.limits.max_pending:
                raise self.stats.reject(GrammarError(
                    f"{self._pending} grammars are being compiled; try again later", "busy"))
            if self._executor is None:
                # One thread: compilations take a core of their own, never the engine's both.
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="arlm-grammar")
            self._pending += 1
            future = self._executor.submit(self.compile, spec)
            self._compiling[spec] = future
        future.add_done_callback(lambda _: self._done(spec))
        return future

    def _done(self, spec: StructuredOutput) -> None:
        with self._lock:
            self._pending -= 1
            self._compiling.pop(spec, None)

    @property
    def pending(self) -> int:
        """Compilations queued or running."""
        return self._pending

    def timed_out(self, spec: StructuredOutput) -> GrammarError:
        """The refusal of a compilation that took over `limits.timeout` seconds. (It finishes on
        the compiler's thread, for the cache: llguidance cannot be stopped, and its size limit
        and fuel bound it.)"""
        with self._lock:
            return self.stats.reject(GrammarError(
                f"compiling the {spec.kind.replace('_', ' ')} took over {self.limits.timeout:g} s "
                "(arlm serve --grammar-timeout)", "timeout"))

    def matcher(self, spec: StructuredOutput):
        """A new matcher for `spec` at its start."""
        return self.compile(spec).matcher()

    def prefetch(self, matchers: list) -> Future:
        """`bitmask(matchers)` on the mask thread, from now: a step computes its eager grammar
        rows' masks while its forward pass runs (llguidance drops the GIL as it computes them).
        The matchers must not move until the future is done."""
        with self._lock:
            if self._mask_executor is None:
                self._mask_executor = ThreadPoolExecutor(1, thread_name_prefix="arlm-masks")
        return self._mask_executor.submit(self.bitmask, matchers)

    def bitmask(self, matchers: list) -> torch.Tensor:
        """[len(matchers), words] int32: the tokens each matcher allows next, one bit a token
        (bit t % 32 of word t / 32), for `kernels.mask_rows`."""
        bits = _mask_buffer(len(matchers), self.words)
        for i, m in enumerate(matchers):  # (llguidance's LLExecutor in parallel is slower here: docs/benchmarks.md)
            m.unsafe_compute_mask_ptr(bits[i].data_ptr(), self.words * 4)
        return bits

    def bitmask_along(self, matcher, draft: list[int]) -> torch.Tensor:
        """[len(draft) + 1, words] int32: the tokens the matcher allows next, then after each
        token of `draft` in turn (speculative decoding: the masks of a verify pass's positions).
        The draft must be valid (`valid_prefix`); the matcher is left where it was."""
        bits = _mask_buffer(len(draft) + 1, self.words)
        for j in range(len(draft) + 1):
            matcher.unsafe_compute_mask_ptr(bits[j].data_ptr(), self.words * 4)
            if matcher.is_error():
                raise matcher_error(matcher)
            if j < len(draft) and not matcher.consume_token(draft[j]):
                raise refused(matcher, draft[j])
        matcher.rollback(len(draft))
        return bits

    def allowed(self, matchers: list) -> torch.Tensor:
        """[len(matchers), vocab] bool: the tokens each matcher allows next."""
        import numpy as np
        import torch

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
