"""Perplexity and KL divergence of a model over a text, through the engine (`arlm perplexity`).

The text is scored in sliding windows, as HF's strided perplexity, exact per token: windows
begin at 0, S, 2S, ... (S the stride); window [b, e), e = min(b + N, len) (N the context), scores
the tokens t in [max(previous e, b + 1), e), each predicted from tokens [b, t), so every token but
the first is scored exactly once (with S = N, non-overlapping windows, a window's first token has
no context in it and goes unscored, as in HF's guide). Each window is a request on an `Engine` over the model's own
runner and KV dtype (`Engine.add_request(..., prompt_logits=True)`), so the numbers are those of
the forward passes generation runs. A window's logits are [N, vocab] float32 (100 MB at N=512,
SmolLM2's 49152 tokens): they are taken window by window, never all at once.

The logits file (`--save-logits`, `LogitsWriter`, `read_logits`), all little-endian:

    offset 0   8 bytes   MAGIC, b"ARLMLGP1"
    offset 8   uint64    H, the header's length in bytes
    offset 16  H bytes   JSON header (UTF-8), padded with spaces so the data starts at a multiple of 64
    16 + H     float16   [n_scored, vocab_size] row-major: log_softmax of the float32 logits

The header: format ("arlm-logprobs"), version (1), model, vocab_size, n_scored, context, stride,
token_ids (the whole text), windows ([begin, first, end] each: window tokens [begin, end), scored
tokens [first, end); the rows follow the windows in order, row k of a window predicting token
first + k), bos (whether the tokenizer put a BOS token first), config (quantization, prefill
dtype, KV dtype, dtype, device). `numpy.memmap(path, "<f2", "r", 16 + H, (n_scored, vocab_size))`
reads the rows.

`kl_stats` compares two runs position by position (KL(P_base || Q), top-1 agreement, the text
token's log-probability), as llama.cpp's `llama-perplexity --kl-divergence`; it takes any
[n, vocab] logits or log-probabilities (numpy or torch), so other engines' outputs go through
the same code.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .engine import Engine, EngineConfig
from .engine.block_pool import DEFAULT_BLOCK_SIZE
from .engine.cache_layout import window_blocks
from .files import create_tmp, replace_durably
from .sampling import SamplingParams
from .settings import KV_SINKS

MAGIC = b"ARLMLGP1"
FORMAT = "arlm-logprobs"
VERSION = 1
_ALIGN = 64  # the rows start at a multiple of this many bytes


# -- windows ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) run as one request; tokens [first, end) scored."""

    begin: int
    first: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def n_scored(self) -> int:
        return self.end - self.first


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The strided windows over a text of `n_tokens` tokens (see the module docstring); the last is
    the first that reaches the end of the text."""
    if context < 2:
        raise ValueError(f"the context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise ValueError(f"the stride must be in 1..context ({context}), got {stride}")
    if n_tokens < 2:
        raise ValueError(f"the text is {n_tokens} token(s); perplexity needs at least 2")
    out, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + context, n_tokens)
        out.append(Window(begin, max(prev_end, begin + 1), end))
        if end == n_tokens:
            return out
        prev_end, begin = end, begin + stride


def batches(wins: list[Window], batch_tokens: int) -> Iterator[list[Window]]:
    """Consecutive windows, as many as fit `batch_tokens` tokens together (at least one): each
    batch goes to the engine at once. A window longer than `batch_tokens` runs in chunks."""
    group: list[Window] = []
    size = 0
    for w in wins:
        if group and size + w.length > batch_tokens:
            yield group
            group, size = [], 0
        group.append(w)
        size += w.length
    if group:
        yield group


def window_logits(llm, token_ids: list[int], wins: list[Window],
                  batch_tokens: int) -> Iterator[tuple[Window, torch.Tensor]]:
    """Each window with its float32 logits [n_scored, vocab] (row k predicts token first + k),
    in order. The windows run as requests on a paged engine over `llm.runner` (prefix caching
    off: every window is computed in full), `batch_tokens` tokens per forward pass at most."""
    groups = list(batches(wins, batch_tokens))
    blocks = max(sum(-(-w.length // DEFAULT_BLOCK_SIZE) for w in g) for g in groups) + 1  # + 1: the pool's reserve
    engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                    EngineConfig(block_size=DEFAULT_BLOCK_SIZE, kv_cache_tokens=blocks * DEFAULT_BLOCK_SIZE,
                                 max_num_seqs=max(len(g) for g in groups), max_num_batched_tokens=batch_tokens,
                                 enable_prefix_caching=False, kv_dtype=llm.kv_dtype))
    greedy = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    for group in groups:
        reqs = [engine.add_request(token_ids[w.begin:w.end], greedy, prompt_logits=True) for w in group]
        engine.run_to_end(reqs)
        for w, r in zip(group, reqs):
            logits, r.prompt_logits = r.prompt_logits, None
            yield w, logits[w.first - 1 - w.begin:w.end - 1 - w.begin]


# -- the logits file -------------------------------------------------------------------------------

class LogitsWriter:
    """Streams float16 log-probability rows into `path`, atomically (arlm.files): a temporary
    file in the same directory, renamed over `path` once every row is in (`commit`); `abort`
    leaves `path` as it was."""

    def __init__(self, path: str | Path, header: dict) -> None:
        self.path = Path(path)
        self.n_rows, self.vocab_size = header["n_scored"], header["vocab_size"]
        self.rows = 0
        self.tmp = Path(create_tmp(self.path))
        self.file = open(self.tmp, "wb")
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-(16 + len(blob)) % _ALIGN)
        self.file.write(MAGIC + struct.pack("<Q", len(blob)) + blob)

    def write(self, logprobs: torch.Tensor) -> None:
        """The next rows: log-probabilities [n, vocab] (stored as float16)."""
        rows = logprobs.detach().to("cpu", torch.float16).contiguous().numpy()
        assert rows.shape[1] == self.vocab_size and self.rows + len(rows) <= self.n_rows, "rows beyond the header's"
        self.file.write(rows.astype("<f2", copy=False).data)
        self.rows += len(rows)

    def commit(self) -> None:
        if self.rows != self.n_rows:
            raise RuntimeError(f"{self.rows} rows written, the header says {self.n_rows}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        replace_durably(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def read_logits(path: str | Path) -> tuple[dict, np.memmap]:
    """A `--save-logits` file: (its header, its rows as a read-only memmap [n_scored, vocab] float16)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ValueError(f"{path}: not an arlm logits file (written by arlm perplexity --save-logits)")
        (length,) = struct.unpack("<Q", head[8:])
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise ValueError(f"{path}: the logits file's header is damaged") from None
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        raise ValueError(f"{path}: logits format {header.get('format')} version {header.get('version')}; "
                         f"this arlm reads {FORMAT} version {VERSION}")
    shape = (header["n_scored"], header["vocab_size"])
    if path.stat().st_size != 16 + length + 2 * shape[0] * shape[1]:
        raise ValueError(f"{path}: the logits file is truncated (expected {shape[0]} rows of {shape[1]})")
    return header, np.memmap(path, dtype="<f2", mode="r", offset=16 + length, shape=shape)


def check_base(header: dict, token_ids: list[int], context: int, stride: int, vocab_size: int) -> None:
    """Raise ValueError (one line) unless a base logits file scored these tokens in these windows."""
    if header["vocab_size"] != vocab_size:
        raise ValueError(f"the base logits have a vocabulary of {header['vocab_size']} tokens, this model "
                         f"{vocab_size}: KL divergence needs the same tokenizer")
    base_ids = header["token_ids"]
    if base_ids != token_ids:
        where = next((i for i, (a, b) in enumerate(zip(base_ids, token_ids)) if a != b), min(len(base_ids),
                                                                                           len(token_ids)))
        raise ValueError(f"different text: the base scored {len(base_ids)} tokens, this run {len(token_ids)}, "
                         f"first different at token {where} (same files, --max-tokens and tokenizer?)")
    if (header["context"], header["stride"]) != (context, stride):
        raise ValueError(f"different windows: the base ran --context {header['context']} --stride "
                         f"{header['stride']}, this run --context {context} --stride {stride}")


# -- KL divergence ---------------------------------------------------------------------------------

def _float64(a, i: int, j: int) -> torch.Tensor:
    rows = a[i:j]
    if isinstance(rows, torch.Tensor):
        return rows.detach().to("cpu", torch.float64)
    return torch.from_numpy(np.asarray(rows, dtype=np.float64))


def kl_positions(base_logprobs, logprobs, targets, chunk: int = 128) -> dict[str, np.ndarray]:
    """Per position (arrays [n]): `kl` = KL(P_base || Q) in nats, `top1` (the argmaxes agree),
    `base_logp` and `logp` (each side's log-probability of the text's token `targets[i]`).

    base_logprobs, logprobs: [n, vocab], numpy or torch, logits or log-probabilities alike: each
    row is normalized first (log_softmax in float64). That makes a row stored in float16 a
    distribution again, so its rounding (relative 2^-11 on each log-probability) enters the KL
    only to second order (see tests/test_perplexity.py)."""
    t = torch.as_tensor(np.asarray(targets), dtype=torch.long).cpu()
    n = len(t)
    if len(base_logprobs) != n or len(logprobs) != n:
        raise ValueError(f"{len(base_logprobs)} base rows, {len(logprobs)} rows, {n} targets: they must agree")
    parts: dict[str, list[torch.Tensor]] = {"kl": [], "top1": [], "base_logp": [], "logp": []}
    for i in range(0, n, chunk):
        p_log = torch.log_softmax(_float64(base_logprobs, i, i + chunk), -1)
        q_log = torch.log_softmax(_float64(logprobs, i, i + chunk), -1)
        p = p_log.exp()
        terms = torch.where(p > 0, p * (p_log - q_log), 0.0)  # 0 log 0 = 0
        ti = t[i:i + chunk, None]
        parts["kl"].append(terms.sum(-1))
        parts["top1"].append(p_log.argmax(-1) == q_log.argmax(-1))
        parts["base_logp"].append(p_log.gather(1, ti)[:, 0])
        parts["logp"].append(q_log.gather(1, ti)[:, 0])
    return {k: torch.cat(v).numpy() if v else np.zeros(0) for k, v in parts.items()}


def summarize_kl(per: dict[str, np.ndarray]) -> dict:
    """`kl_positions`'s arrays (concatenated over windows) -> the report: mean, median, 99th
    percentile and max KL, top-1 agreement (%), mean |Δ log p| of the text's token, and both
    perplexities (each from its own log-probabilities of the text's tokens)."""
    kl = per["kl"]
    return {"positions": int(len(kl)), "mean_kl": float(kl.mean()), "median_kl": float(np.median(kl)),
            "p99_kl": float(np.percentile(kl, 99)), "max_kl": float(kl.max()),
            "top1_agreement": float(100.0 * per["top1"].mean()),
            "mean_abs_delta_logp": float(np.abs(per["logp"] - per["base_logp"]).mean()),
            "perplexity": math.exp(-float(per["logp"].mean())),
            "base_perplexity": math.exp(-float(per["base_logp"].mean()))}


def kl_stats(base_logprobs, logprobs, targets) -> dict:
    """KL(P_base || Q) and friends over n positions (`kl_positions`, then `summarize_kl`).
    base_logprobs, logprobs: [n, vocab] (numpy or torch; logits or log-probabilities), targets:
    [n] the text's next tokens."""
    return summarize_kl(kl_positions(base_logprobs, logprobs, targets))


# -- a run -----------------------------------------------------------------------------------------

def token_nll(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 128) -> np.ndarray:
    """-log softmax(logits)[target] of each row (logits [n, vocab], targets [n]) in float64, a
    few rows at a time: float32's log-sum-exp over 49152 logits is off by ~1e-6, enough to move a
    perplexity's sixth digit."""
    out = []
    for i in range(0, len(logits), chunk):
        x = logits[i:i + chunk].double()
        out.append(torch.logsumexp(x, -1) - x.gather(1, targets[i:i + chunk, None])[:, 0])
    return torch.cat(out).cpu().numpy()


def stream_nll(llm, token_ids: list[int], window: int, sinks: int = KV_SINKS, chunk: int = 512) -> np.ndarray:
    """The text as one stream through a windowed cache (`EngineConfig.kv_window`: each token sees
    the first `sinks` tokens and the last `window`), `chunk` tokens per forward pass: the NLL
    [len - 1] (float64) of every token but the first, each predicted from what the window shows
    of the tokens before it. Runs past the model's context in a fixed number of blocks; the
    logits are consumed chunk by chunk (`Request.logits_sink`), never held for the whole text."""
    bs = DEFAULT_BLOCK_SIZE
    blocks = window_blocks(bs, window, sinks, chunk) + 1  # + 1: the pool's reserve
    engine = Engine(llm.runner, llm.tokenizer.eos_ids,
                    EngineConfig(block_size=bs, kv_cache_tokens=blocks * bs, max_num_seqs=1,
                                 max_num_batched_tokens=chunk, enable_prefix_caching=False, kv_dtype=llm.kv_dtype,
                                 kv_window=window, kv_sinks=sinks))
    targets = torch.tensor(token_ids)
    nll = np.zeros(len(token_ids) - 1)

    def sink(start: int, logits: torch.Tensor) -> None:  # row j predicts token start + j + 1
        n = min(logits.shape[0], len(token_ids) - 1 - start)
        if n > 0:
            nll[start:start + n] = token_nll(logits[:n], targets[start + 1:start + 1 + n])

    req = engine.add_request(token_ids, SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
                             prompt_logits=True)
    req.logits_sink = sink
    engine.run_to_end([req])
    return nll


@dataclass
class PerplexityResult:
    nll: np.ndarray  # [n_scored] float64: -log p of each scored token, nats, in text order
    windows: list[Window]
    seconds: float  # wall time of the windows' forward passes and scoring
    kl: dict | None = None  # summarize_kl's report against a base, if one was given
    config: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    @property
    def tokens_computed(self) -> int:
        """Tokens run through the model (windows overlap: more than the text)."""
        return sum(w.length for w in self.windows)

    def to_dict(self) -> dict:
        return {"perplexity": self.perplexity, "tokens_scored": int(len(self.nll)), "windows": len(self.windows),
                "tokens_computed": self.tokens_computed, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_computed / self.seconds, 2) if self.seconds > 0 else 0.0,
                **self.config, **({"kl_divergence": self.kl} if self.kl is not None else {})}


def run_config(llm) -> dict:
    """What decides the numbers: the model and how it runs."""
    dtype = str(next(llm.model.parameters()).dtype).removeprefix("torch.")
    return {"model": llm.loaded.name, "quantization": llm.quantization or "none",
            "matmul_path": llm.matmul_path, "matmul_isa": llm.matmul_isa,
            "activations": llm.activations if llm.quantization else dtype,
            "requantized": list(getattr(llm.loaded, "requantized", [])),
            "kv_dtype": str(llm.kv_dtype).removeprefix("torch."),
            "dtype": dtype, "device": str(llm.runner.device)}


def evaluate(llm, token_ids: list[int], context: int = 512, stride: int | None = None,
             batch_tokens: int | None = None, save_logits: str | Path | None = None,
             base: tuple[dict, np.ndarray] | None = None) -> PerplexityResult:
    """Score `token_ids` in strided windows (see the module docstring) on `llm` (an arlm.llm.LLM).

    batch_tokens: tokens per forward pass at most (default: context); whole windows share a pass
    as they fit. On CPU a window's numbers do not depend on which others share it, bit for bit:
    the quantized kernels do each row's arithmetic on its own, and MKL's float32 GEMMs do in
    practice from 8 rows up (tests/test_perplexity.py checks the float32 path; a window too long
    for one pass is chunked, which moves its logits by float32 rounding). save_logits: write the
    scored rows' float16 log-probabilities there (`LogitsWriter`). base: `read_logits`'s (header,
    rows) of another run over the same text and windows: the result's `kl` compares this run to it.
    """
    stride = context // 2 if stride is None else stride
    batch_tokens = context if batch_tokens is None else batch_tokens
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    cfg = llm.model.config
    if context > cfg.max_seq_len:
        raise ValueError(f"the context ({context}) exceeds the model's context window ({cfg.max_seq_len})")
    wins = windows(len(token_ids), context, stride)
    vocab = cfg.vocab_size
    config = run_config(llm)
    if base is not None:
        check_base(base[0], token_ids, context, stride, vocab)
    writer = None
    if save_logits is not None:
        tok = llm.tokenizer
        header = {"format": FORMAT, "version": VERSION, "model": llm.loaded.name, "vocab_size": vocab,
                  "n_scored": sum(w.n_scored for w in wins), "context": context, "stride": stride,
                  "token_ids": list(token_ids), "windows": [[w.begin, w.first, w.end] for w in wins],
                  "bos": bool(tok.add_bos and tok.bos_id is not None),
                  "config": config}
        writer = LogitsWriter(save_logits, header)
    nll: list[np.ndarray] = []
    per: list[dict[str, np.ndarray]] = []
    row = 0
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            for w, logits in window_logits(llm, token_ids, wins, batch_tokens):
                targets = torch.tensor(token_ids[w.first:w.end], device=logits.device)
                nll.append(token_nll(logits, targets))
                if writer is not None:
                    writer.write(torch.log_softmax(logits, -1))
                if base is not None:
                    per.append(kl_positions(base[1][row:row + w.n_scored], logits, targets.cpu()))
                row += w.n_scored
                del logits
        if writer is not None:
            writer.commit()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    seconds = time.perf_counter() - t0
    kl = summarize_kl({k: np.concatenate([p[k] for p in per]) for k in per[0]}) if per else None
    return PerplexityResult(np.concatenate(nll), wins, seconds, kl, config)
