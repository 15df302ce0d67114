"""A real model's function in a larger model's widths: a Llama-architecture GGUF (SmolLM2-135M-
Instruct's, by default) zero-padded to a named shape's d_model, heads and FFN width, written as
llama.cpp's converter writes F16 and quantized by llama.cpp's own llama-quantize.

    .venv/bin/python benchmarks/widen_gguf.py [--source smollm2] [--widths llama-3.2-1b]
        [--types Q4_K_M,Q8_0] [--out-dir ~/.cache/arlm-bench/gguf] [--llama-quantize PATH]

Prints one path a line: `<out-dir>/<source>-in-<widths>-<type>.gguf` (reused where present;
written under a temporary name and renamed into place).

Why: make_gguf.py's files have the shapes users run but random weights, and random weights never
repeat their context, so what depends on the model's outputs (speculative decoding's acceptance:
a prompt-lookup draft is accepted only where the model copies) cannot be measured on them, and
no 1B model ships on PyPI. The widened file computes the source model's logits exactly (up to
float rounding, and the quantizer's rounding of its own type) while every decode step streams and
multiplies matrices of the target's widths: a 1B-wide step's cost with a real model's choices.
It keeps the source's layers (SmolLM2: 30, where Llama 3.2 1B has 16: 1.8B weights, a step
~1.9x the 1B file's matrices at Q4_K_M less the smaller head), vocabulary and RoPE.

How the padding keeps the function (each exact in real arithmetic):
- the residual stream's new dimensions start at 0 (the embedding's new columns) and every matrix
  that writes the stream (attn_output, ffn_down) has zero rows there, so they stay 0;
- an RMSNorm over d_t dimensions of which d_s are nonzero sees mean(x^2) scaled by d_s / d_t:
  its weight is multiplied by sqrt(d_s / d_t) and the file's epsilon by d_s / d_t, which gives
  x / sqrt(mean_s(x^2) + eps) * w again (the new dimensions' weights 0);
- query head h of KV group j (the source's g_s heads a group) becomes head j * g_t + h % g_s of
  the target's groups of g_t (KV head j stays j): every source head reads its own keys. The
  target's other heads have zero queries and attn_output columns: they add nothing;
- the FFN's new units have zero gate, up and down weights: SiLU(0) * 0 = 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import make_gguf  # noqa: E402

# The source's metadata keys the widening rewrites (the rest are copied as they are)
WIDTH_KEYS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
              "attention.layer_norm_rms_epsilon")


def tensor_kind(name: str) -> str:
    """A GGUF tensor name's kind: blk.3.attn_q.weight -> attn_q, token_embd.weight -> token_embd."""
    return name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name.split(".")[0]


class Widening:
    """How one source's tensors map into the target's widths."""

    def __init__(self, fields: dict, widths: make_gguf.Shape) -> None:
        get = lambda key: int(fields[f"llama.{key}"])  # noqa: E731
        self.d_s, self.ff_s, self.h_s, self.kv_s = (get("embedding_length"), get("feed_forward_length"),
                                                    get("attention.head_count"), get("attention.head_count_kv"))
        self.dh = self.d_s // self.h_s
        self.d_t, self.ff_t, self.h_t, self.kv_t = widths.d_model, widths.d_ff, widths.n_head, widths.n_kv_heads
        self.eps = float(fields["llama.attention.layer_norm_rms_epsilon"]) * self.d_s / self.d_t
        g_s, g_t = self.h_s // self.kv_s, self.h_t // self.kv_t
        sizes = (("d_model", self.d_s, self.d_t), ("d_ff", self.ff_s, self.ff_t), ("KV heads", self.kv_s, self.kv_t),
                 ("query heads per KV head", g_s, g_t))
        problems = [f"{name} {s} > {t}" for name, s, t in sizes if s > t]
        if widths.d_head != self.dh:
            problems.append(f"head width {self.dh} != {widths.d_head}")
        if problems:
            raise SystemExit(f"widen_gguf: the source does not fit the widths: {', '.join(problems)}")
        # source query head -> target query head
        self.q_heads = [h // g_s * g_t + h % g_s for h in range(self.h_s)]

    def heads(self, w: np.ndarray, n_target: int, mapping: list[int], axis: int) -> np.ndarray:
        """w's head blocks (dh rows or columns each) moved to their target heads along `axis`."""
        shape = list(w.shape)
        shape[axis] = n_target * self.dh
        out = np.zeros(shape, w.dtype)
        for s, t in enumerate(mapping):
            src = [slice(None)] * w.ndim
            dst = [slice(None)] * w.ndim
            src[axis], dst[axis] = slice(s * self.dh, (s + 1) * self.dh), slice(t * self.dh, (t + 1) * self.dh)
            out[tuple(dst)] = w[tuple(src)]
        return out

    def shape(self, name: str, dims: tuple[int, ...]) -> tuple[int, ...]:
        """Source tensor `name`'s shape (rows first) in the target's widths."""
        if name.endswith("norm.weight"):
            return (self.d_t,)
        kind = tensor_kind(name)
        rows = {"token_embd": dims[0], "output": dims[0], "attn_q": self.h_t * self.dh,
                "attn_k": self.kv_t * self.dh, "attn_v": self.kv_t * self.dh, "attn_output": self.d_t,
                "ffn_gate": self.ff_t, "ffn_up": self.ff_t, "ffn_down": self.d_t}.get(kind)
        if rows is None:
            raise SystemExit(f"widen_gguf: no widening for tensor {name}")
        return rows, {"attn_output": self.h_t * self.dh, "ffn_down": self.ff_t}.get(kind, self.d_t)

    def tensor(self, name: str, w: np.ndarray) -> np.ndarray:
        """Source tensor `name` (rows first, float32) in the target's widths: its heads moved to
        their target heads, a norm's weight rescaled, then zero-padded to `shape`."""
        kind = tensor_kind(name)
        if name.endswith("norm.weight"):
            w = w * np.float32(math.sqrt(self.d_s / self.d_t))
        elif kind == "attn_q":
            w = self.heads(w, self.h_t, self.q_heads, 0)
        elif kind in ("attn_k", "attn_v"):
            w = self.heads(w, self.kv_t, list(range(self.kv_s)), 0)
        elif kind == "attn_output":
            w = self.heads(w, self.h_t, self.q_heads, 1)
        out = np.zeros(self.shape(name, w.shape), w.dtype)
        out[tuple(slice(0, n) for n in w.shape)] = w
        return out


def write_widened(source: Path, widths: make_gguf.Shape, path: Path) -> Path:
    """The F16 file of `source` widened to `widths` (its d_model, heads and d_ff), at `path`
    (atomically)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    if fields.get("general.architecture") != "llama":
        raise SystemExit(f"widen_gguf: {source} is {fields.get('general.architecture')!r}, not a llama GGUF")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise SystemExit("widen_gguf: sources with RoPE factors (rope_freqs) are not handled")
    widen = Widening(fields, widths)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    rewritten = {f"llama.{k}" for k in WIDTH_KEYS} | {"general.name", "general.file_type", "general.architecture"}
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in rewritten:
            continue
        w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[1] if len(f.types) > 1 else None)
    w.add_name(f"{fields.get('general.name', source.stem)} in {widths.name}'s widths")
    w.add_embedding_length(widen.d_t)
    w.add_feed_forward_length(widen.ff_t)
    w.add_head_count(widen.h_t)
    w.add_head_count_kv(widen.kv_t)
    w.add_layer_norm_rms_eps(widen.eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    def planned(t) -> make_gguf.Tensor:
        """Source tensor t as the widened file holds it (F32 norms, F16 matrices)."""
        dims = tuple(int(n) for n in reversed(t.shape))  # (rows first)
        dtype = np.float32 if t.name.endswith("norm.weight") else np.float16

        def make() -> np.ndarray:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(dims)
            return widen.tensor(t.name, values).astype(dtype)

        return make_gguf.Tensor(t.name, widen.shape(t.name, dims), make, dtype)

    plan = [planned(t) for t in reader.tensors]  # (checked before anything is written)
    return make_gguf.write_tensors(w, tmp, path, plan)


def make(source: str, widths_name: str, kinds: list[str], out_dir: Path, binary: Path,
         threads: int = os.cpu_count() or 1) -> list[Path]:
    """The widened files in each of `kinds` (F16 or a llama-quantize type), made where missing."""
    from arlm.loading import resolve_model_path

    source_path = Path(resolve_model_path(source))  # (a bad source fails here, before anything is written)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{source if '/' not in source else Path(source).stem}-in-{widths_name}"
    paths = {k: out_dir / f"{stem}-{k}.gguf" for k in kinds}
    f16 = out_dir / f"{stem}-F16.gguf"
    missing = [k for k, p in paths.items() if not p.exists() and k != "F16"]
    made_f16 = False
    if (missing or "F16" in kinds) and not f16.exists():
        print(f"writing {f16}", file=sys.stderr, flush=True)
        write_widened(source_path, make_gguf.SHAPES[widths_name], f16)
        made_f16 = True
    for k in missing:
        print(f"quantizing {paths[k]}", file=sys.stderr, flush=True)
        make_gguf.quantize(binary, f16, paths[k], k, threads)
    if made_f16 and "F16" not in kinds:
        f16.unlink()
    return list(paths.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", default="smollm2", help="an arlm model name or a llama GGUF file (default: smollm2)")
    p.add_argument("--widths", default="llama-3.2-1b",
                   help=f"the shape whose widths to take, of: {', '.join(make_gguf.SHAPES)} (default: llama-3.2-1b)")
    p.add_argument("--types", default="Q4_K_M", help="comma-separated: F16, or llama-quantize types")
    p.add_argument("--out-dir", type=Path, default=make_gguf.DEFAULT_OUT)
    p.add_argument("--llama-quantize", type=Path, default=make_gguf.DEFAULT_QUANTIZE)
    args = p.parse_args()
    kinds = args.types.split(",")
    llamas = [n for n, s in make_gguf.SHAPES.items() if s.arch == "llama"]
    if args.widths not in llamas:
        p.error(f"--widths: one of the llama shapes ({', '.join(llamas)})")
    if unknown := set(kinds) - make_gguf.file_types():
        p.error(f"--types: unknown {', '.join(sorted(unknown))}")
    if any(k != "F16" for k in kinds) and not args.llama_quantize.exists():
        p.error(f"{args.llama_quantize} is missing: benchmarks/build_peers.sh builds it")
    from arlm.loading.errors import LoadError

    try:
        for path in make(args.source, args.widths, kinds, args.out_dir.expanduser(), args.llama_quantize):
            print(path, flush=True)
    except LoadError as e:
        raise SystemExit(f"widen_gguf: --source: {e}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
