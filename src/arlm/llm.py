"""The text edge of the engine: prompts and chat messages in, text (streamed) out.

`LLM` pairs a model with its tokenizer and chat template. It turns text into ids, drives
`generate.Generation`, detokenizes incrementally (valid UTF-8 pieces), and applies stop strings,
which only make sense on text. `ChatSession` keeps one conversation's KV cache across turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from .generate import STOP, Generation, GenerationStats
from .kv_cache import KVCache
from .loading import LoadedModel
from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


class PromptError(ValueError):
    """A prompt or message list the model cannot take (empty, too long)."""


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                **extra: object) -> str:
    """Render a Jinja2 chat template the way HF transformers does (sandboxed, trimmed blocks)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **extra)
    except TemplateError as e:
        raise PromptError(f"chat template failed: {e}") from None


@dataclass
class TextChunk:
    """One streamed piece: the token ids of this step and the text they completed."""

    row: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats = field(default_factory=GenerationStats)


class _StopWatcher:
    """Finds stop strings in streamed text and holds back a tail that might start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.text = ""  # all text of this row so far (before truncation)
        self.emitted = 0  # chars of self.text already released

    def push(self, piece: str, final: bool) -> tuple[str, bool]:
        """Add text; return (text safe to release now, whether a stop string was hit)."""
        self.text += piece
        if self.stops:
            # Search from just before the unreleased text: a stop string can straddle the edge.
            start = max(0, self.emitted - max(map(len, self.stops)) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
            if hits:
                cut = max(min(hits), self.emitted)
                out, self.emitted = self.text[self.emitted:cut], cut
                self.text = self.text[:cut]
                return out, True
        end = len(self.text)
        if not final:
            for s in self.stops:  # hold back the longest tail that is a prefix of a stop string
                for n in range(min(len(s) - 1, len(self.text) - self.emitted), 0, -1):
                    if self.text.endswith(s[:n]):
                        end = min(end, len(self.text) - n)
                        break
        out, self.emitted = self.text[self.emitted:end], end
        return out, False


class LLM:
    """A loaded model ready to generate text. `LLM.load("smollm2")` is the usual start."""

    def __init__(self, loaded: LoadedModel) -> None:
        if loaded.tokenizer is None:
            raise PromptError(f"model {loaded.name} has no tokenizer; it can only take token ids")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.quantization: str | None = None
        self.prefill_dtype = "float32"  # how a quantized model prefills: "quantized" or a dense copy's dtype (configure)
        self.decode_fn = None  # None: the native step where it applies, else generate.decode_step
        self.static_kv_len = False
        self.kv_dtype: torch.dtype = next(self.model.parameters()).dtype  # the KV caches' dtype (configure)

    @classmethod
    def load(cls, spec: str = "smollm2", device: str = "cpu", dtype: torch.dtype = torch.float32,
             quantize: str | None = "auto", compile: bool = False, prefill_dtype: str = "auto",
             kv_dtype: str = "auto") -> "LLM":
        """Load a model by name or path; `quantize`, `compile`, `prefill_dtype` and `kv_dtype`
        pick the decode and prefill paths (see `configure`)."""
        from .loading import load_model

        llm = cls(load_model(spec, device=device, dtype=dtype))
        llm.configure(quantize=quantize, compile=compile, prefill_dtype=prefill_dtype, kv_dtype=kv_dtype)
        return llm

    def configure(self, quantize: str | None = None, compile: bool = False, prefill_dtype: str = "auto",
                  kv_dtype: str = "auto") -> None:
        """Pick the decode path: weight quantization and (optionally) a compiled decode step.

        quantize: None/"none", "int8", "q4", or "auto": on CPU with the native kernels, 4-bit for
        the matrices it holds exactly (a Q4_1 GGUF's) and int8 for the rest; elsewhere none.
        prefill_dtype (quantized models): "quantized" runs prefill through the same integer-dot
        kernels as decode (no second copy of the weights); "float32" / "bfloat16" keep a dense copy
        of each weight for prefill's GEMMs; "auto": quantized where the packed kernels are built
        (AVX-512 VNNI: faster than bf16 GEMMs there, docs/benchmarks.md), else bfloat16 on CPUs with
        native bf16 matmuls (AVX512-BF16 or AMX), else float32.
        kv_dtype: the KV cache's dtype, "float32", "float16", "bfloat16" or "auto": float16 where a
        quantized model decodes through the native step on CPU (a step streams the cache once: half
        the bytes; its rounding, ~5e-4 relative, is far below the 8-bit activations'), else the
        model's dtype.
        """
        from . import kernels
        from .generate import decode_step

        device = next(self.model.parameters()).device
        if quantize not in (None, "none", "auto", "int8", "q4"):
            raise ValueError(f"unknown quantization {quantize!r} (expected none, auto, int8 or q4)")
        if quantize == "auto" and not (device.type == "cpu" and kernels.native_available()):
            quantize = None
        if kv_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"unknown KV cache dtype {kv_dtype!r} (expected auto, float32, float16 or bfloat16)")
        if prefill_dtype not in ("auto", "quantized", "float32", "bfloat16"):
            raise ValueError(f"unknown prefill dtype {prefill_dtype!r} (expected auto, quantized, float32 or bfloat16)")
        if prefill_dtype == "auto":
            cpu = device.type == "cpu"
            prefill_dtype = ("quantized" if cpu and kernels.packed_available() else
                             "bfloat16" if cpu and kernels.cpu_has_native_bf16() else "float32")
        if quantize in ("auto", "int8", "q4"):
            from .quant import quantize as quantize_model

            quantize_model(self.model, quantize, keep_dense=prefill_dtype != "quantized",
                           prefill_dtype=torch.bfloat16 if prefill_dtype == "bfloat16" else None)
            self.prefill_dtype = prefill_dtype
        self.quantization = quantize if quantize != "none" else None
        self.static_kv_len = compile and device.type == "cuda"
        if compile and device.type == "cuda":  # CUDA graphs: one launch per decode step
            self.decode_fn = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
        elif compile:
            self.decode_fn = torch.compile(decode_step, dynamic=True)
        else:
            self.decode_fn = None  # Generation picks the native step where it applies, else decode_step
        if kv_dtype == "auto":  # float16 where the native step reads it; the module path would widen it every step
            from .generate import native_layers

            native = self.quantization is not None and self.decode_fn is None and native_layers(self.model) is not None
            self.kv_dtype = torch.float16 if native else next(self.model.parameters()).dtype
        else:
            self.kv_dtype = getattr(torch, kv_dtype)

    @property
    def context_length(self) -> int:
        return self.model.config.max_seq_len

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:
            raise PromptError("the prompt is empty")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise PromptError("the prompt encodes to no tokens")
        if len(ids) >= self.context_length:
            raise PromptError(f"the prompt is {len(ids)} tokens; the context window is {self.context_length}")
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise PromptError(f"model {self.loaded.name} has no chat template")
        tok = self.tokenizer
        special = {"bos_token": tok.decode([tok.bos_id]) if tok.bos_id is not None else "",
                   "eos_token": tok.decode([tok.eos_id]) if tok.eos_id is not None else ""}
        return render_chat(self.chat_template, messages, add_generation_prompt, **special)

    def prompt_ids(self, prompts: str | list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids of each prompt: a str (one prompt), or a list of prompts, each a str or a list
        of token ids (ints). Anything else is a TypeError that says what was given."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: expected a str or a list of prompts, got {type(prompts).__name__}")
        if not prompts:
            raise PromptError("no prompts given")
        ids = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids.append(self.encode_prompt(p))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids.append(list(p))
            else:
                raise TypeError(f"prompt {i}: expected a str or a list of token ids (ints), got "
                                f"{type(p).__name__}" + (" of other things" if isinstance(p, (list, tuple)) else ""))
        return ids

    def stream(self, prompts: str | list[str] | list[list[int]], params: SamplingParams,
               cache: KVCache | None = None, context_shift: bool = False) -> Iterator[TextChunk | Generation]:
        """Yield the `Generation` first (for stats and results), then TextChunks as they come.
        prompts: as `prompt_ids` takes them. context_shift: go on past a full context window on
        its last half (see `Generation`)."""
        ids = self.prompt_ids(prompts)
        gen = Generation(self.model, ids, params, self.tokenizer.eos_ids, cache=cache, decode_fn=self.decode_fn,
                         static_kv_len=self.static_kv_len, context_shift=context_shift, kv_dtype=self.kv_dtype)
        detok = [IncrementalDetokenizer(self.tokenizer) for _ in ids]
        watch = [_StopWatcher(params.stop) for _ in ids]
        yield gen
        for step in gen:
            finished = dict(step.finished)
            for row, tok in step.tokens:
                final = row in finished
                piece = detok[row].push(tok) + (detok[row].flush() if final else "")
                text, hit = watch[row].push(piece, final)
                if hit:
                    gen.finish(row, STOP)
                    finished[row] = STOP
                yield TextChunk(row, [tok], text, finished.get(row))

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams,
                 cache: KVCache | None = None, context_shift: bool = False) -> list[Completion]:
        it = self.stream(prompts, params, cache, context_shift)
        gen: Generation = next(it)  # type: ignore[assignment]
        texts = [""] * gen.batch_size
        for chunk in it:
            texts[chunk.row] += chunk.text
        return [Completion(p, c, t, r, gen.stats)
                for p, c, t, r in zip(gen.prompts, gen.completions, texts, gen.finish_reasons)]


class ChatSession:
    """A conversation whose KV cache persists between turns.

    Each turn renders the whole conversation with the chat template, finds how much of it the
    cache already holds (the longest common prefix of token ids), and prefills only the rest.
    """

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 max_context: int | None = None) -> None:
        self.llm, self.params = llm, params
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        cfg = llm.model.config
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be positive (or None for the model's window), got {max_context}")
        device = next(llm.model.parameters()).device
        self.cache = KVCache.for_model(cfg, 1, min(max_context or cfg.max_seq_len, cfg.max_seq_len), llm.kv_dtype,
                                       device)
        self.cached_ids: list[int] = []  # token ids whose K/V are in the cache, in order
        self.last_prefill_tokens = 0

    def send(self, content: str) -> Iterator[TextChunk]:
        """Add a user message and stream the assistant's reply; the reply joins the history. A
        reply abandoned part way (the caller stops iterating) leaves the history as it was."""
        if not isinstance(content, str):
            raise TypeError(f"the message must be a str, got {type(content).__name__}")
        if not content.strip():
            raise PromptError("the message is empty")
        history = self.messages + [{"role": "user", "content": content}]
        ids = self.llm.tokenizer.encode(self.llm.apply_chat_template(history))
        keep = 0
        for a, b in zip(self.cached_ids, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # at least one new token to prefill
        if len(ids) + self.params.max_new_tokens > self.cache.capacity:
            raise PromptError(f"the conversation ({len(ids)} tokens) and a reply of up to {self.params.max_new_tokens} "
                              f"tokens (max_new_tokens) {'no longer fit' if self.cached_ids else 'do not fit'} the "
                              f"context window of {self.cache.capacity} tokens; start a new chat, or allow a "
                              f"shorter reply or a longer context")
        self.cache.seq_lens = [keep]  # forget (and later overwrite) whatever diverged
        self.cached_ids = self.cached_ids[:keep]
        new = ids[keep:]
        self.last_prefill_tokens = len(new)
        it = self.llm.stream([new], self.params, cache=self.cache)
        gen: Generation = next(it)  # type: ignore[assignment]
        if gen.seen is not None:  # a repetition penalty covers the earlier turns too (HF semantics)
            gen.seen[0, torch.tensor(ids[:keep], dtype=torch.long, device=gen.seen.device)] = True
        self.generation = gen
        reply = ""
        for chunk in it:
            reply += chunk.text
            yield chunk
        # Only a finished turn joins the history. The cache now holds the prompt and every reply
        # token but the last (sampled, never fed).
        self.messages = history + [{"role": "assistant", "content": reply}]
        self.cached_ids = ids + gen.completions[0][:-1]
