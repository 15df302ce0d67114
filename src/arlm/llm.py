"""The text edge of the engine: prompts and chat messages in, text (streamed) out.

`LLM` pairs a model with its tokenizer and chat template, and drives the one `Engine` (a
contiguous cache sized for each batch): it turns text into ids, submits requests, and streams
each request's tokens back as text (`arlm.text.TextStreamer`: valid UTF-8 pieces, cut at stop
strings, which only make sense on text). `ChatSession` keeps one conversation on an engine of its
own whose prefix cache holds the earlier turns, so each turn prefills only what is new.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch

from . import kernels
from .engine import Engine, EngineConfig, FinishReason, ModelRunner, Request, RequestOutput, decode_step
from .engine.block_pool import DEFAULT_BLOCK_SIZE
from .engine.cache_layout import window_blocks
from .engine.speculative import Drafter, ModelDrafter, NgramDrafter, SpecRates, SpeculativeConfig
from .loading import LoadedModel, load_model
from .kv_cache import KVDtype, check_head_dim, kv_dtype_name, parse_kv_dtype
from .model import Transformer
from .quant import QuantizedLinear, prepare
from .quant import quantize as quantize_model
from .sampling import SamplingParams
from .settings import (ACTIVATIONS, DEFAULT_ACTIVATIONS, KV_SINKS, auto_matmul_path, auto_quantize, legacy_matmul_path,
                       quantized_matmul_path)
from .structured import GrammarError, Grammars
from .text import PromptError, TextStreamer, compile_chat_template, render_chat, template_tokens  # noqa: F401
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class TextChunk:
    """One streamed piece: the token ids of this step and the text they completed."""

    row: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


@dataclass
class GenerationStats(SpecRates):
    prompt_tokens: int = 0  # prompt tokens run through the model (not those a prefix cache held)
    prefill_seconds: float = 0.0  # steps that computed prompt tokens
    decode_tokens: int = 0  # tokens produced by decode steps (excludes each request's first, from prefill)
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0  # bytes allocated for the cache
    kv_dtype: str = ""  # its element type ("float16", "int8", ...)
    kv_bytes_per_token: int = 0  # bytes one cached token takes: K and V, every layer, scales included
    matmul_path: str = ""  # how the prompt's matrices multiply (LLM.configure): vnni, avx2, bf16, float32
    matmul_isa: str = ""  # with which instructions: "AVX512-VNNI", "AMX", "AVX512-BF16", ...
    # the steps' threads (arlm/threads.py): the width at the last step, the narrowest any step
    # had, the widest allowed, whether --threads pinned it, and width changes during the stream
    threads: int = 0
    threads_narrowest: int = 0
    threads_widest: int = 0
    threads_pinned: bool = False
    thread_changes: int = 0
    # speculative decoding (the stream's requests): draft tokens verified, accepted, and target
    # passes that verified a draft (per request)
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_passes: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "prefill_seconds": round(self.prefill_seconds, 4),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
                "decode_tokens": self.decode_tokens, "decode_seconds": round(self.decode_seconds, 4),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "kv_cache_bytes": self.kv_cache_bytes,
                "kv_cache": {"dtype": self.kv_dtype, "bytes_per_token": self.kv_bytes_per_token,
                             "bytes": self.kv_cache_bytes},
                "matmul": {"path": self.matmul_path, "isa": self.matmul_isa},
                "threads": {"width": self.threads, "narrowest": self.threads_narrowest,
                            "widest": self.threads_widest, "pinned": self.threads_pinned,
                            "changes": self.thread_changes},
                "speculative": {"proposed": self.spec_proposed, "accepted": self.spec_accepted,
                                "passes": self.spec_passes,
                                "acceptance_rate": round(self.spec_acceptance_rate, 4),
                                "tokens_per_pass": round(self.spec_tokens_per_pass, 3)}}


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats = field(default_factory=GenerationStats)


class TextStream:
    """Prompts on an engine, streamed as text: iterate for `TextChunk`s (row = the prompt's
    index). The requests are submitted when iteration starts; `requests` and `stats` fill in as
    it runs, and leaving the loop early aborts the requests still running. Outputs of other
    requests on the same engine (another stream iterated alongside) wait in `mailbox` for their
    own stream."""

    def __init__(self, engine: Engine, prompt_ids: list[list[int]], params: SamplingParams, tokenizer: Tokenizer,
                 context_shift: bool = False, mailbox: dict[str, list[RequestOutput]] | None = None,
                 drafter: Drafter | None = None) -> None:
        for p in prompt_ids:  # every prompt is checked before any is queued
            engine.check_request(p, params)
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.context_shift = context_shift
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.requests: list[Request] = []
        self.mailbox = {} if mailbox is None else mailbox
        self.stats = GenerationStats()

    def _outputs(self) -> Iterator[RequestOutput]:
        mine = {r.request_id for r in self.requests}
        while True:
            for rid in mine:
                yield from self.mailbox.pop(rid, [])
            if all(r.finished for r in self.requests):
                return
            gov = self.engine.runtime.threads
            changes = gov.changes
            outputs = self.engine.step()
            st = self.stats
            st.threads, st.threads_widest, st.threads_pinned = gov.width, gov.widest, gov.pinned is not None
            st.threads_narrowest = min(st.threads_narrowest or gov.width, gov.width)
            st.thread_changes += gov.changes - changes
            st.matmul_path, st.matmul_isa = self.engine.runner.matmul_path, self.engine.runner.matmul_isa
            step = self.engine.last_step
            if step.prompt_tokens:
                self.stats.prompt_tokens += step.prompt_tokens
                self.stats.prefill_seconds += step.seconds
            else:
                self.stats.decode_seconds += step.seconds
                self.stats.decode_tokens += sum(1 for o in outputs if o.request_id in mine)
            if self.engine.cache is not None:
                cache = self.engine.cache
                self.stats.kv_cache_bytes, self.stats.kv_bytes_per_token = cache.nbytes, cache.bytes_per_token
                self.stats.kv_dtype = kv_dtype_name(cache.dtype)
            for out in outputs:
                if out.request_id in mine:
                    yield out
                else:
                    self.mailbox.setdefault(out.request_id, []).append(out)

    def __iter__(self) -> Iterator[TextChunk]:
        if self.requests:
            raise RuntimeError("a TextStream runs once")
        self.requests = [self.engine.add_request(p, self.params, context_shift=self.context_shift,
                                                 drafter=self.drafter)
                         for p in self.prompt_ids]
        streamers = [TextStreamer(self.tokenizer, self.params.stop) for _ in self.requests]
        stopped: set[int] = set()
        row_of = {r.request_id: i for i, r in enumerate(self.requests)}
        try:
            for out in self._outputs():
                if out.error is not None:
                    raise (GrammarError if out.client_error else RuntimeError)(f"request {out.request_id}: {out.error}")
                row = row_of[out.request_id]
                req = self.requests[row]
                if row in stopped:  # tokens a speculative step gave past the stop string
                    continue
                text, hit = streamers[row].push(out.token_id, final=out.finish_reason is not None)
                reason = out.finish_reason
                if hit:
                    # A stop string completed by the token that also reached max_new_tokens or
                    # the context limit wins: the text was cut at the string, so that is why it
                    # stopped. The request ends at this token, as plain decoding ends it.
                    stopped.add(row)
                    self.engine.abort(req.request_id, FinishReason.STOP)
                    req.finish_reason = reason = FinishReason.STOP
                    # (a speculative step may have given tokens past this one, or ended later)
                    del req.token_ids[req.num_prompt_tokens + out.num_output_tokens:]
                yield TextChunk(row, [out.token_id], text, reason)
        finally:
            for r in self.requests:
                if not r.finished:
                    self.engine.abort(r.request_id)
                self.mailbox.pop(r.request_id, None)
                if r.spec is not None:
                    self.stats.spec_proposed += r.spec.proposed
                    self.stats.spec_accepted += r.spec.accepted
                    self.stats.spec_passes += r.spec.passes

    def completions(self, texts: list[str]) -> list[Completion]:
        return [Completion(r.prompt_ids, r.output_ids, t, r.finish_reason, self.stats)
                for r, t in zip(self.requests, texts)]


FLOAT_PATHS = {torch.float32: "float32", torch.bfloat16: "bf16", torch.float16: "float16"}  # unquantized models


def _prepare_quantized(model: Transformer, quantize: str | None, matmul_path: str, activations: str,
                       loaded_quantized: bool) -> None:
    """A quantized model's matrices in place, for `matmul_path` (one of kernels.MATMUL_PATHS, not
    "auto") and `activations`: the file's quantized blocks as they are where it was loaded with
    them (`loaded_quantized`), else its float matrices quantized to `quantize`."""
    dense = dict(keep_dense=matmul_path in ("bf16", "float32"), activations=activations,
                 prefill_dtype=torch.bfloat16 if matmul_path == "bf16" else None,
                 packed=matmul_path != "avx2")
    if loaded_quantized:
        prepare(model, **dense)
    else:
        quantize_model(model, quantize, **dense)


class LLM:
    """A loaded model ready to generate text. `LLM.load("smollm2")` is the usual start."""

    WINDOW_SEQS = 8  # sequences a windowed engine (kv_window) holds at once

    def __init__(self, loaded: LoadedModel) -> None:
        if loaded.tokenizer is None:
            raise PromptError(f"model {loaded.name} has no tokenizer; it can only take token ids")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.quantization: str | None = None
        self.matmul_path = "float32"  # the compute-bound passes' matrix path (configure; kernels.MATMUL_PATHS)
        self.matmul_isa = "default"  # the instructions it runs on ("AVX512-VNNI", "AMX", ...)
        self.activations = "float32"  # a quantized model's activation precision (configure)
        self.kv_dtype: KVDtype = next(self.model.parameters()).dtype  # the KV caches' dtype (configure)
        self._mailbox: dict[str, list[RequestOutput]] = {}
        self.speculative: SpeculativeConfig | None = None  # the default of generate/stream (configure)
        self.kv_window, self.kv_sinks = 0, 4  # a sliding window with attention sinks (configure)
        self._drafters: dict[tuple, Drafter] = {}
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size)  # (structured outputs)
        self._start(ModelRunner(self.model))

    def _start(self, runner: ModelRunner) -> None:
        """The runner (the model's weights bound to the kernels) and the engine over it. Static
        batches on a contiguous cache: every prompt of a call prefilled in one pass (as many as
        `max_num_seqs`), then decoded by rows."""
        self.runner = runner
        self._drafters = {}  # bound to the old weights
        if self.kv_window:  # a window runs on a paged pool: room for WINDOW_SEQS sequences at once
            config = EngineConfig(kv_dtype=self.kv_dtype, kv_window=self.kv_window, kv_sinks=self.kv_sinks,
                                  max_num_seqs=self.WINDOW_SEQS)
            live = window_blocks(config.block_size, self.kv_window, self.kv_sinks, config.max_num_batched_tokens)
            config.kv_cache_tokens = (config.max_num_seqs * live + 1) * config.block_size  # (+1: the reserve block)
        else:
            config = EngineConfig(block_size=None, max_num_seqs=1024, max_num_batched_tokens=1 << 20,
                                  kv_dtype=self.kv_dtype)
        self.engine = Engine(runner, self.tokenizer.eos_ids, config)
        self.engine.grammars = self.grammars

    @classmethod
    def load(cls, spec: str = "smollm2", device: str = "cpu", dtype: torch.dtype = torch.float32,
             quantize: str | None = "auto", compile: bool = False, matmul_path: str = "auto",
             kv_dtype: str = "auto", activations: str = DEFAULT_ACTIVATIONS,
             speculative: str | SpeculativeConfig | None = None, kv_window: int = 0, kv_sinks: int = KV_SINKS,
             prefill_dtype: str | None = None) -> "LLM":
        """Load a model by name or path; `quantize`, `compile`, `matmul_path`, `kv_dtype` and
        `activations` pick the decode and prefill paths (see `configure`); `speculative` the
        default speculative decoding of `generate` and `stream` (see `drafter`)."""
        # "auto" on CPU: the file's quantized blocks as they are, straight into the kernels' layout
        direct = quantize == "auto" and device == "cpu" and dtype == torch.float32 and kernels.native_available()
        loaded = load_model(spec, device=device, dtype=dtype, quantized=direct)
        if direct and loaded.requantized:  # the one rounding arlm adds: said, not silent
            names = loaded.requantized
            log.warning("%d of the file's tensors have no kernel here and run re-quantized to int8 per row "
                        "(%s%s); their cost: `arlm perplexity --kl-divergence` against `--quantize none`",
                        len(names), ", ".join(names[:3]), ", ..." if len(names) > 3 else "")
        llm = cls(loaded)
        llm.configure(quantize=quantize, compile=compile, matmul_path=matmul_path, kv_dtype=kv_dtype,
                      activations=activations, kv_window=kv_window, kv_sinks=kv_sinks, prefill_dtype=prefill_dtype)
        if speculative is not None:
            llm.speculative = llm.speculative_config(speculative)
            llm.drafter(llm.speculative)  # load a draft model now, and fail now if it cannot be
        return llm

    @staticmethod
    def speculative_config(spec: str | SpeculativeConfig) -> SpeculativeConfig:
        """A `SpeculativeConfig` from one (as it is) or a method name ("ngram", "self:N", a model)."""
        if isinstance(spec, SpeculativeConfig):
            return spec
        if not isinstance(spec, str) or not spec:
            raise TypeError(f"speculative: expected a method name or a SpeculativeConfig, got {spec!r}")
        return SpeculativeConfig(method=spec)

    def drafter(self, spec: str | SpeculativeConfig | bool | None = None) -> Drafter | None:
        """The drafter for `spec` (built once per configuration, then reused): "ngram" (prompt
        lookup), "self:N" (this model's first N layers and its head), or any model `LLM.load`
        takes with this model's vocabulary, loaded as this one was; a `SpeculativeConfig` for
        the other settings. None: this LLM's default (`speculative`); False or "off": none."""
        if spec is None:
            spec = self.speculative
        if spec is None or spec is False or spec == "off":
            return None
        config = self.speculative_config(spec)
        if self.runner.exact_rows == 1:
            raise ValueError("speculative decoding needs the native CPU kernels (a Llama-family model on CPU), "
                             "whose rows do not depend on their batch; this model runs on the module path")
        key = tuple(sorted(vars(config).items()))
        if key in self._drafters:
            return self._drafters[key]
        method = config.method
        if method == "ngram":
            drafter: Drafter = NgramDrafter(config)
        elif method == "self" or method.startswith("self:"):
            n = method.partition(":")[2]
            if n and not n.isdigit():
                raise ValueError(f"speculative method {method!r}: expected self:N, N the number of layers")
            layers = int(n) if n else self.model.config.n_layer // 2
            drafter = ModelDrafter(self.model.first_layers(layers), config, self.model)
        else:
            drafter = ModelDrafter(self._draft_model(method), config, self.model)
        self._drafters[key] = drafter
        return drafter

    def _draft_model(self, spec: str) -> Transformer:
        """The model `spec` names (`load_model`) as `LLM.load` would ready it beside this one: on
        this model's device, float32; where this model is quantized, quantize="auto" (the file's
        quantized blocks as they are, or int8/q4 now) with this model's activations and the matrix
        path "auto". Its vocabulary (the tokenizer's and the config's) must be this model's."""
        device = next(self.model.parameters()).device
        # ("auto" as configure takes it: none off the CPU kernels)
        quantize = "auto" if self.quantization and device.type == "cpu" and kernels.native_available() else None
        loaded = load_model(spec, device=device, quantized=quantize is not None)
        if loaded.tokenizer is None:
            raise PromptError(f"model {loaded.name} has no tokenizer; it can only take token ids")
        if loaded.tokenizer.vocab_size != self.tokenizer.vocab_size or \
                loaded.model.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(f"draft model {spec} has another vocabulary than {self.loaded.name}")
        if quantize is not None:
            _prepare_quantized(loaded.model, quantize, auto_matmul_path(device.type, self.activations),
                               self.activations, loaded.quantized)
        return loaded.model

    def configure(self, quantize: str | None = None, compile: bool = False, matmul_path: str = "auto",
                  kv_dtype: str = "auto", activations: str = DEFAULT_ACTIVATIONS, kv_window: int = 0,
                  kv_sinks: int = KV_SINKS,
                  prefill_dtype: str | None = None) -> None:
        """Pick the decode path: weight quantization and (optionally) a compiled decode step.

        quantize: None/"none", "int8", "q4", or "auto": on CPU with the native kernels, 4-bit for
        the matrices it holds exactly (a Q4_1 GGUF's) and int8 for the rest; elsewhere none.
        matmul_path (quantized models; kernels.MATMUL_PATHS): how the compute-bound passes - prompt
        tokens - multiply. "vnni": the integer kernels in their packed layout (AVX-512 VNNI or AVX2), the
        same as decode (no second copy of the weights); "avx2": the integer kernels in the row
        layout, prompt and decode (AVX2; forced on an AVX-512 CPU it leaves the weights unpacked);
        "bf16" / "float32": a dense copy of each weight for the prompt's GEMMs through torch
        (oneDNN: AMX tiles where the CPU has them), decode staying on the integer kernels. "auto":
        chosen once here from the CPU's flags (`kernels.auto_matmul_path`): vnni where the packed
        kernels are built (faster than bf16 GEMMs on a Zen 4 and float32's answers, which bf16's
        are not: docs/benchmarks.md), else bf16 where the CPU multiplies bf16 natively, else
        float32. A path this machine cannot run is a ValueError saying why. `llm.matmul_path` and
        `matmul_isa` say what was chosen (and generate's stats). prefill_dtype: the older name
        ("quantized" = vnni or avx2, "bfloat16", "float32").
        activations (quantized models): "int8x2" (8-bit twice, ~16 bits: float32's answers),
        "int8" (one 8-bit pass but the head's: faster, less faithful) or "float32" (slow); see
        `arlm.quant.prepare` and docs/benchmarks.md for what each costs and buys.
        kv_dtype: the KV cache's dtype, "float32", "float16", "bfloat16", "int8", "int4" or
        "auto": float16 where a quantized model decodes through the native step on CPU (a step
        streams the cache once: half the bytes; its rounding, ~5e-4 relative, is far below the
        8-bit activations'), else the model's dtype. int8 and int4 quantize K and V as they are
        written (arlm.kv_cache: 0.53x and 0.34x float16's bytes; docs/benchmarks.md for what they
        cost in perplexity and gain in speed).
        kv_window, kv_sinks: a sliding window with attention sinks (StreamingLLM: each token attends
        to the first kv_sinks tokens and the last kv_window; generation runs past the model's
        context in bounded memory; `EngineConfig.kv_window`); 0: off. generate/stream then run on a
        paged pool of a few sequences.
        """
        device = next(self.model.parameters()).device
        if quantize not in (None, "none", "auto", "int8", "q4"):
            raise ValueError(f"unknown quantization {quantize!r} (expected none, auto, int8 or q4)")
        if quantize == "auto":
            quantize = auto_quantize(device.type)  # (settings.py: the rule the server's differs from)
        if kv_dtype != "auto":
            kv = parse_kv_dtype(kv_dtype)  # (ValueError naming the choices)
            check_head_dim(kv, self.model.config.head_dim)
        if activations not in ACTIVATIONS:
            raise ValueError(f"unknown activation precision {activations!r} (expected {', '.join(ACTIVATIONS)})")
        legacy = prefill_dtype not in (None, "auto")  # (ignored by float models, as it always was)
        if legacy:
            matmul_path = legacy_matmul_path(prefill_dtype, matmul_path)
        loaded_quantized = any(isinstance(m, QuantizedLinear) for m in self.model.modules())  # (LLM.load)
        if loaded_quantized and quantize != "auto":
            raise ValueError(f"{self.loaded.name} was loaded with its file's quantized weights; load it "
                             f"again with quantize={quantize!r} for another precision")
        cpu = device.type == "cpu"
        if loaded_quantized or quantize in ("auto", "int8", "q4"):
            matmul_path = quantized_matmul_path(matmul_path, device.type, activations)
            _prepare_quantized(self.model, quantize, matmul_path, activations, loaded_quantized)
            self.activations = activations
        else:  # a float model multiplies in its own dtype
            own = FLOAT_PATHS.get(next(self.model.parameters()).dtype, "float32")
            if matmul_path not in ("auto", own) and not legacy:
                raise ValueError(f"matmul path {matmul_path} applies to quantized models; this one multiplies "
                                 f"its {own} weights as they are")
            matmul_path = own
        self.matmul_path = matmul_path
        self.matmul_isa = kernels.matmul_isa(matmul_path) if cpu else device.type
        self.quantization = quantize if quantize != "none" else None
        decode_fn = None  # the native step where it applies, else decode_step
        if compile and device.type == "cuda":  # CUDA graphs: one launch per decode step
            decode_fn = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
        elif compile:
            decode_fn = torch.compile(decode_step, dynamic=True)
        dense_prefill = self.quantization is not None and self.matmul_path in ("float32", "bf16")
        runner = ModelRunner(self.model, decode_fn, static_kv_len=compile and device.type == "cuda",
                             dense_prefill=dense_prefill)
        runner.matmul_path, runner.matmul_isa = self.matmul_path, self.matmul_isa
        if kv_dtype == "auto":  # float16 where the native step reads it; the module path would widen it every step
            native = self.quantization is not None and decode_fn is None and runner.native is not None
            self.kv_dtype = torch.float16 if native else next(self.model.parameters()).dtype
        else:
            self.kv_dtype = kv
        self.kv_window, self.kv_sinks = kv_window, kv_sinks
        self._start(runner)

    @property
    def prefill_dtype(self) -> str:
        """The older name of the matrix path: "quantized" (the integer kernels), "bfloat16", "float32"."""
        return {"vnni": "quantized", "avx2": "quantized", "bf16": "bfloat16"}.get(self.matmul_path, self.matmul_path)

    @property
    def decode_fn(self):
        """The rows path's decode step when it is not the native one (e.g. compiled), else None."""
        return self.runner.decode_fn

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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: object) -> str:
        """The conversation as the chat template renders it; `extra`: more template variables
        (e.g. `tools`, HF's convention)."""
        if not self.chat_template:
            raise PromptError(f"model {self.loaded.name} has no chat template: give one with --chat-template "
                              "FILE|TEMPLATE (LLM.chat_template in Python)")
        return render_chat(self.chat_template, messages, add_generation_prompt, **template_tokens(self.tokenizer),
                           **extra)

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
               context_shift: bool = False, speculative: str | SpeculativeConfig | bool | None = None) -> TextStream:
        """The prompts (as `prompt_ids` takes them, each checked now) as a `TextStream`: the
        engine runs them as it is iterated. context_shift: a request that fills the context window
        goes on from its last half instead of stopping. speculative: decode speculatively (see
        `drafter`; None: this LLM's default, False: not): greedy output is token for token the
        same, sampled output has the same distribution."""
        return TextStream(self.engine, self.prompt_ids(prompts), params, self.tokenizer, context_shift,
                          self._mailbox, self.drafter(speculative))

    def generate(self, prompts: str | list[str] | list[list[int]], params: SamplingParams,
                 context_shift: bool = False,
                 speculative: str | SpeculativeConfig | bool | None = None) -> list[Completion]:
        stream = self.stream(prompts, params, context_shift, speculative)
        texts = [""] * len(stream.prompt_ids)
        for chunk in stream:
            texts[chunk.row] += chunk.text
        return stream.completions(texts)


    # The pooling `embed` does, as /v1/models names it
    POOLING = "mean of the final normed hidden states over the input's tokens, L2-normalized"

    def embed(self, texts: str | list[str] | list[list[int]]) -> torch.Tensor:
        """Embeddings of the texts (or token id lists), float32 [n, d_model]: each the mean of its
        tokens' final normed hidden states (after the last norm, before the LM head; the BOS
        token included where the tokenizer prepends one), L2-normalized (`POOLING`). They run as
        prompt-only requests on this LLM's engine, all at once (batched, chunked as any prompt)."""
        ids = self.prompt_ids([texts] if isinstance(texts, str) else texts)
        room = self.engine.max_model_len
        for i, p in enumerate(ids):
            if len(p) >= room:
                raise PromptError(f"input {i} is {len(p)} tokens; the context window takes {room - 1} at most")
        reqs = [self.engine.add_request(p, SamplingParams(max_new_tokens=1), embed=True) for p in ids]
        self.engine.run_to_end(reqs)
        return torch.stack([r.embedding for r in reqs])


class ChatSession:
    """A conversation whose earlier turns stay in the KV cache.

    Each turn renders the whole conversation with the chat template and submits it to an engine
    of the session's own: a paged pool of `max_context` tokens whose prefix cache still holds
    the earlier turns' blocks, so only the tokens past the last full block they share are
    prefilled again.
    """

    BLOCK_SIZE = DEFAULT_BLOCK_SIZE

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None = None,
                 max_context: int | None = None) -> None:
        self.llm, self.params = llm, params
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        cfg = llm.model.config
        if max_context is not None and max_context < 1:
            raise ValueError(f"max_context must be positive (or None for the model's window), got {max_context}")
        self.max_context = min(max_context or cfg.max_seq_len, cfg.max_seq_len)
        bs = self.BLOCK_SIZE
        # One block beyond the window: a turn's first write into a cached block copies it first.
        tokens = (-(-self.max_context // bs) + 1) * bs
        self.engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                             EngineConfig(block_size=bs, kv_cache_tokens=tokens, max_num_seqs=1,
                                          max_num_batched_tokens=self.max_context, kv_dtype=llm.kv_dtype))
        self.engine.grammars = llm.grammars
        self.last_prefill_tokens = 0  # prompt tokens the last turn computed (the rest came from the cache)
        self.cached_tokens = 0  # prompt tokens the last turn took from the cache
        self.stats = GenerationStats()
        self.last_request: Request | None = None  # the last turn's request (its reply's token ids)

    def send(self, content: str) -> Iterator[TextChunk]:
        """Add a user message and stream the assistant's reply; the reply joins the history. A
        reply abandoned part way (the caller stops iterating) leaves the history as it was."""
        if not isinstance(content, str):
            raise TypeError(f"the message must be a str, got {type(content).__name__}")
        if not content.strip():
            raise PromptError("the message is empty")
        history = self.messages + [{"role": "user", "content": content}]
        ids = self.llm.tokenizer.encode(self.llm.apply_chat_template(history))
        if len(ids) + self.params.max_new_tokens > self.max_context:
            raise PromptError(f"the conversation ({len(ids)} tokens) and a reply of up to {self.params.max_new_tokens} "
                              f"tokens (max_new_tokens) {'no longer fit' if len(self.messages) > 1 else 'do not fit'} "
                              f"the context window of {self.max_context} tokens; start a new chat, or allow a "
                              f"shorter reply or a longer context")
        stream = TextStream(self.engine, [ids], self.params, self.llm.tokenizer, drafter=self.llm.drafter())
        self.stats = stream.stats
        reply = ""
        for chunk in stream:
            req = self.last_request = stream.requests[0]
            if req.num_output_tokens == 1:  # admitted: the prefix cache was consulted
                self.cached_tokens = req.num_cached_tokens
                self.last_prefill_tokens = len(ids) - req.num_cached_tokens
            reply += chunk.text
            yield chunk
        # Only a finished turn joins the history.
        self.messages = history + [{"role": "assistant", "content": reply}]
