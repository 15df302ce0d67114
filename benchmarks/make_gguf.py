"""GGUF files with random weights in the shapes users run, written as llama.cpp's converter
(convert_hf_to_gguf.py) writes a real checkpoint and quantized by llama.cpp's own llama-quantize.

    .venv/bin/python benchmarks/make_gguf.py --shapes llama-3.2-1b,llama-3.2-3b --types Q4_K_M,Q8_0,Q4_0
        [--out-dir ~/.cache/arlm-bench/gguf] [--llama-quantize PATH] [--keep-f16] [--seed 0]

Prints one path a line: `<out-dir>/<shape>-<type>.gguf`. A file already there is reused; every
file is written under a temporary name and renamed into place, so a stopped run leaves none
half-written. The F16 file (the converter's output: F16 matrices, F32 norms, biases and RoPE
factors) is the intermediate each type is quantized from; it is deleted afterwards unless
--keep-f16 or `--types F16` asks for it.

What the file holds, as the converter would write it from an HF checkpoint of that shape:
- the converter's metadata keys for the architecture (llama, qwen2, qwen3, gemma3), with the
  real models' hyperparameters (SHAPES); Llama 3.x's scaled RoPE as the `rope_freqs.weight`
  divisors the converter computes;
- its tensor names; Llama's q/k rows permuted for ggml's RoPE (`permute_rope_rows`); Gemma's
  norms stored as 1 + w;
- random weights: N(0, 0.02) for every matrix and bias (the HF initializers' std), norms at
  their HF initial value (1; Gemma's w = 0, stored 1), a fixed seed per tensor name;
- a real tokenizer: SmolLM2's for the Llama and Qwen shapes, padded to the shape's vocabulary
  as the converter pads a vocabulary smaller than the embedding (`[PAD<id>]`, token type
  UNUSED: ordinary vocabulary entries no merge reaches, not special tokens), so the embedding
  and head have the real size; Gemma 3 270M's for gemma-3-1b (the same 262,144-token
  vocabulary Gemma 3 1B has).
Tensors are generated and written one at a time: memory holds the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DEFAULT_OUT = Path.home() / ".cache" / "arlm-bench" / "gguf"
DEFAULT_QUANTIZE = ROOT / "build" / "llama.cpp" / "bin" / "llama-quantize"
STD = 0.02  # the HF initializers' std (initializer_range) for every shape here


@dataclass(frozen=True)
class Shape:
    """One model's hyperparameters, as its HF config.json states them."""

    arch: str  # GGUF architecture: llama, qwen2, qwen3, gemma3
    name: str  # general.name
    d_model: int
    n_layer: int
    n_head: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_theta: float
    norm_eps: float
    tied: bool = True
    # the config's own head_dim (the converter writes key_length/value_length only then)
    head_dim: int | None = None
    # Llama 3's scaled RoPE: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    llama3_rope: dict | None = None
    sliding_window: int | None = None  # Gemma 3 (every 6th layer global: llama.cpp's default)
    rope_theta_swa: float | None = None
    tokenizer: str = "smollm2"  # the arlm model whose GGUF tokenizer is copied

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.n_head


LLAMA32_ROPE = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": Shape("llama", "Llama 3.2 1B", 2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, 1e-5,
                          head_dim=64, llama3_rope=LLAMA32_ROPE),
    "llama-3.2-3b": Shape("llama", "Llama 3.2 3B", 3072, 28, 24, 8, 8192, 128256, 131072, 500000.0, 1e-5,
                          head_dim=128, llama3_rope=LLAMA32_ROPE),
    "llama-3.1-8b": Shape("llama", "Llama 3.1 8B", 4096, 32, 32, 8, 14336, 128256, 131072, 500000.0, 1e-5,
                          tied=False, llama3_rope={**LLAMA32_ROPE, "factor": 8.0}),
    "qwen2.5-1.5b": Shape("qwen2", "Qwen2.5 1.5B", 1536, 28, 12, 2, 8960, 151936, 32768, 1000000.0, 1e-6),
    "qwen3-1.7b": Shape("qwen3", "Qwen3 1.7B", 2048, 28, 16, 8, 6144, 151936, 40960, 1000000.0, 1e-6,
                        head_dim=128),
    "gemma-3-1b": Shape("gemma3", "Gemma 3 1B", 1152, 26, 4, 1, 6912, 262144, 32768, 1000000.0, 1e-6,
                        head_dim=256, sliding_window=512, rope_theta_swa=10000.0, tokenizer="gemma3-270m"),
}


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's q/k row permutation for ggml's RoPE (LlamaModel.permute): each head's
    rows i and i + d/2 become rows 2i and 2i + 1. arlm's `unpermute_rope_rows` undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors [d_head / 2], as the converter computes them
    (LlamaModel.generate_extra_tensors)."""
    r = shape.llama3_rope
    d = shape.d_head
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    old = r["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / r["low_freq_factor"], old / r["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(r["factor"])
        else:
            smooth = (old / wavelen - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


@dataclass
class Tensor:
    """One tensor of the file: its GGUF name, numpy shape (rows first) and a maker of its data."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    dtype: type = field(default=np.float16)


def draw(name: str, dims: tuple[int, ...], seed: int, dtype=np.float16) -> np.ndarray:
    """Tensor `name`'s random values, N(0, STD), as the HF checkpoint would hold them (the same
    for a (seed, name) whatever the other tensors), drawn 64 MB of float32 at a time."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    out = np.empty(dims, dtype)
    flat = out.reshape(-1)
    step = 1 << 24
    for i in range(0, flat.size, step):
        flat[i:i + step] = rng.standard_normal(min(step, flat.size - i), dtype=np.float32) * STD
    return out


def tensors(shape: Shape, seed: int) -> Iterator[Tensor]:
    """The file's tensors in order: matrices F16, norms, biases and RoPE factors F32 (the
    converter's types for `--outtype f16`)."""

    def random(name: str, dims: tuple[int, ...], dtype=np.float16) -> Tensor:
        def make() -> np.ndarray:
            w = draw(name, dims, seed, dtype)
            if shape.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                w = permute_rope_rows(w, shape.n_head if "attn_q" in name else shape.n_kv_heads)
            return w
        return Tensor(name, dims, make, dtype)

    def norm(name: str, dims: int) -> Tensor:
        # HF initializes RMSNorm weights at 1; Gemma's at 0, used as 1 + w and stored so by the converter
        return Tensor(name, (dims,), lambda: np.ones(dims, np.float32), np.float32)

    d, dh = shape.d_model, shape.d_head
    if shape.llama3_rope:
        yield Tensor("rope_freqs.weight", (dh // 2,), lambda: llama3_rope_factors(shape), np.float32)
    yield random("token_embd.weight", (shape.vocab_size, d))
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        yield norm(b + "attn_norm.weight", d)
        for part, heads in (("q", shape.n_head), ("k", shape.n_kv_heads), ("v", shape.n_kv_heads)):
            yield random(b + f"attn_{part}.weight", (heads * dh, d))
            if shape.arch == "qwen2":
                yield random(b + f"attn_{part}.bias", (heads * dh,), np.float32)
        if shape.arch in ("qwen3", "gemma3"):
            yield norm(b + "attn_q_norm.weight", dh)
            yield norm(b + "attn_k_norm.weight", dh)
        yield random(b + "attn_output.weight", (d, shape.n_head * dh))
        if shape.arch == "gemma3":
            yield norm(b + "post_attention_norm.weight", d)
        yield norm(b + "ffn_norm.weight", d)
        yield random(b + "ffn_gate.weight", (shape.d_ff, d))
        yield random(b + "ffn_up.weight", (shape.d_ff, d))
        yield random(b + "ffn_down.weight", (d, shape.d_ff))
        if shape.arch == "gemma3":
            yield norm(b + "post_ffw_norm.weight", d)
    yield norm("output_norm.weight", d)
    if not shape.tied:
        yield random("output.weight", (shape.vocab_size, d))


def tokenizer_fields(source: str, vocab_size: int) -> list[tuple]:
    """(key, value, value type, element type) of every tokenizer.* field of the GGUF that arlm
    resolves `source` to, the token list padded to `vocab_size` as the converter pads it
    (`[PAD<id>]`, UNUSED)."""
    import gguf

    from arlm.loading import resolve_model_path

    reader = gguf.GGUFReader(str(resolve_model_path(source)))
    out = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = f.contents()
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            if len(value) > vocab_size:
                raise ValueError(f"{source}'s tokenizer has {len(value)} tokens, more than the vocabulary {vocab_size}")
            n = vocab_size - len(value)
            pad = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(len(value), vocab_size)],
                   "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * n,
                   "tokenizer.ggml.scores": [0.0] * n}[key]
            value = value + pad
        out.append((key, value, f.types[0], f.types[1] if len(f.types) > 1 else None))
    return out


def write_f16(shape: Shape, path: Path, seed: int = 0) -> Path:
    """`shape` with random weights as the converter's F16 file, at `path` (atomically)."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), shape.arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"{shape.name} (random weights)")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.d_model)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    if shape.rope_theta_swa is not None:
        w.add_rope_freq_base_swa(shape.rope_theta_swa)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    if shape.head_dim is not None:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    if shape.sliding_window is not None:
        w.add_sliding_window(shape.sliding_window)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if shape.arch == "llama":  # (LlamaModel's own keys)
        w.add_vocab_size(shape.vocab_size)
        w.add_rope_dimension_count(shape.d_head)
    for key, value, vtype, sub in tokenizer_fields(shape.tokenizer, shape.vocab_size):
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    return write_tensors(w, tmp, path, list(tensors(shape, seed)))


def write_tensors(w, tmp: Path, path: Path, plan: list[Tensor]) -> Path:
    """The tensors of `plan` after the metadata gguf.GGUFWriter `w` (writing to `tmp`) holds, one
    in memory at a time; then `tmp` renamed to `path`, or removed on any error."""
    for t in plan:
        w.add_tensor_info(t.name, t.shape, np.dtype(t.dtype), math.prod(t.shape) * np.dtype(t.dtype).itemsize)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            w.write_tensor_data(t.make())
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def file_types() -> set[str]:
    """The types this script makes: F16 and llama-quantize's (gguf's LlamaFileType names less MOSTLY_)."""
    import gguf

    return {n.removeprefix("MOSTLY_") for n in gguf.LlamaFileType.__members__} - {"ALL_F32", "GUESSED"}


def quantize(binary: Path, f16: Path, out: Path, kind: str, threads: int) -> Path:
    """llama-quantize `f16` to `kind` at `out` (atomically)."""
    tmp = out.with_name(out.name + ".tmp")
    r = subprocess.run([str(binary), str(f16), str(tmp), kind, str(threads)], capture_output=True, text=True)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {kind} failed: {r.stderr.strip()[-800:]}")
    os.replace(tmp, out)
    return out


def make(name: str, kinds: list[str], out_dir: Path, binary: Path, keep_f16: bool = False, seed: int = 0,
         threads: int = os.cpu_count() or 1) -> list[Path]:
    """The files of shape `name` in each of `kinds` (F16 or a llama-quantize type), made where missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {k: out_dir / f"{name}-{k}.gguf" for k in kinds}
    f16 = out_dir / f"{name}-F16.gguf"
    missing = [k for k, p in paths.items() if not p.exists() and k != "F16"]
    made_f16 = False
    if (missing or "F16" in kinds) and not f16.exists():
        print(f"writing {f16}", file=sys.stderr, flush=True)
        write_f16(SHAPES[name], f16, seed)
        made_f16 = True
    for k in missing:
        print(f"quantizing {paths[k]}", file=sys.stderr, flush=True)
        quantize(binary, f16, paths[k], k, threads)
    if made_f16 and not keep_f16 and "F16" not in kinds:
        f16.unlink()
    return list(paths.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="llama-3.2-1b", help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--types", default="Q4_K_M",
                   help="comma-separated: F16, or llama-quantize types (Q4_K_M, Q8_0, ...)")
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    p.add_argument("--llama-quantize", type=Path, default=DEFAULT_QUANTIZE)
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 intermediate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    shapes, kinds = args.shapes.split(","), args.types.split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        p.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if unknown := set(kinds) - file_types():
        p.error(f"--types: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(file_types()))})")
    if any(k != "F16" for k in kinds) and not args.llama_quantize.exists():
        p.error(f"{args.llama_quantize} is missing: benchmarks/build_peers.sh builds it")
    for name in shapes:
        for path in make(name, kinds, args.out_dir.expanduser(), args.llama_quantize, args.keep_f16, args.seed):
            print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
