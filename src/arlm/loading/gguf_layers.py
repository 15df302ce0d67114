"""A GGUF file's weights into arlm's quantized layers as they are stored (`quantized_model`; the
module doc of gguf.py says which type goes where): a matrix's blocks converted a few million
weights at a time on torch's threads (`_by_rows`), each weight's pages of the file's map handed
back once it is converted, and the model assembled on the meta device from the layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from .. import kernels
from ..model import Transformer
from ..quant import (Int8Linear, KQuantLinear, Q4Linear, Q5Linear, Q8Linear, Q8MinsLinear, QuantizedEmbedding,
                     QuantizedLinear, SplitLinear)
from .errors import LoadError
from .gguf import GGUFFile, as_held, converted, dequantize, open_gguf, tensor_blocks
from .gguf_blocks import AS_Q8, BLOCK_BYTES, FLOAT_TYPES, K_BLOCK_BYTES, ROW_K_TYPES, as_q8_0, k_quant_fields

@dataclass
class _Workers:
    """The threads a matrix's chunks are converted on (`_by_rows`): `pool`, of `n` threads."""

    pool: ThreadPoolExecutor
    n: int


class _Stacked:
    """A weight's blocks: its parts' [n, G, bytes] (views of the file's map, but where q/k rows had
    to move) stacked by rows, as a fused weight's rows are, N rows in all; the file whose map
    `release` hands pages back to, and the threads its rows are converted on (`_by_rows`)."""

    def __init__(self, parts: list[np.ndarray], gf: GGUFFile | None = None, workers: _Workers | None = None) -> None:
        self.parts, self.gf, self.workers = parts, gf, workers
        self.N, self.G = sum(b.shape[0] for b in parts), parts[0].shape[1]

    def _pieces(self, start: int, stop: int) -> Iterator[tuple[int, np.ndarray]]:
        offset = 0
        for i, b in enumerate(self.parts):
            lo, hi = max(start - offset, 0), min(stop - offset, b.shape[0])
            if lo < hi:
                yield i, b[lo:hi]
            offset += b.shape[0]

    def rows(self, start: int, stop: int, widen: Callable[[int, np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Rows start:stop [stop - start, G, bytes] (a view where they lie in one part); widen(i,
        rows of part i), where given, applied to each part's rows first."""
        pieces = [b if widen is None else widen(i, b) for i, b in self._pieces(start, stop)]
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def release(self, start: int, stop: int) -> None:
        """Rows start:stop read: the file's pages under them handed back (`GGUFFile.release_view`)."""
        if self.gf is not None:
            for _, b in self._pieces(start, stop):
                self.gf.release_view(b)


# Weights converted at a time (`_by_rows`): the numpy fields and the packing's temporaries are
# several bytes a weight (Q6_K's ~8), a few tens of MB a chunk whatever the matrix's size.
_CHUNK_WEIGHTS = 1 << 22
# Q4_K, Q6_K, Q8_0, Q4_0, Q4_1 and Q5_0 blocks packed by kernels.pack_gguf_blocks (one native pass), where the
# layer is packed (N a multiple of 16) and the kernels are built; False: the fields-then-pack path
# (its result bit for bit: tests/test_gguf_pack.py compares the two through these functions).
NATIVE_PACKING = True


def _by_rows(make: Callable[[int, int], QuantizedLinear], layer: QuantizedLinear, blocks: _Stacked) -> QuantizedLinear:
    """`layer` (N output rows of K weights, on the meta device) given the tensors of make(start,
    stop) (a layer of rows start:stop of `blocks`), made `_CHUNK_WEIGHTS` weights' rows at a time (a
    multiple of 16: whole tiles of the packed layout; at least a chunk a thread) into tensors
    allocated once. Each chunk goes to the packed layout where the layer takes it (8-bit
    activations, as `prepare` leaves it: the layout the cache holds), so the matrix is never held
    twice (rows beside packed), and the file's pages under its rows are handed back as they are
    read. Rows are independent: the chunks' tensors stacked are the whole matrix's, bit for bit,
    whichever of `blocks.workers` made them."""
    N, K = layer.out_features, layer.in_features
    workers = blocks.workers.n if blocks.workers is not None else 1
    rows = max(16, -(-min(_CHUNK_WEIGHTS // K, -(-N // workers)) // 16) * 16)  # (every thread a share)
    a8 = N % 16 == 0 or N <= rows  # (else the last chunk would not pack as the others do)

    def convert(start: int) -> tuple[torch.Tensor, ...]:
        stop = min(N, start + rows)
        chunk = make(start, stop)
        chunk.int8_activations = a8  # (packs where the kernels take it)
        blocks.release(start, stop)
        return chunk.tensors()

    out = convert(0)
    if N > rows:
        first, out = out, tuple(torch.empty((t.shape[0] * N // rows, *t.shape[1:]), dtype=t.dtype) for t in out)

        def put(start: int, tensors: tuple[torch.Tensor, ...]) -> None:
            stop = min(N, start + rows)
            for o, t in zip(out, tensors, strict=True):
                lo, hi = start * o.shape[0] // N, stop * o.shape[0] // N
                if t.shape != (hi - lo, *o.shape[1:]) or t.dtype != o.dtype:
                    raise AssertionError(f"rows {start}:{stop} of {N} gave {tuple(t.shape)} {t.dtype} for "
                                         f"{tuple(o.shape)} {o.dtype}: a layout not stacked by rows")
                o[lo:hi] = t

        put(0, first)
        del first
        starts = range(rows, N, rows)
        for _ in (blocks.workers.pool.map if blocks.workers is not None else map)(lambda s: put(s, convert(s)), starts):
            pass
    layer._set(*out)
    layer.int8_activations = a8  # (packed already: nothing moves)
    return layer


def _k_fields(b: np.ndarray, kind: str) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in k_quant_fields(b, kind).items()}


def _k_quant_layer(blocks: _Stacked, kind: str) -> KQuantLinear:
    """A KQuantLinear from K-quant blocks of one kind (the parts' rows stacked: a fused weight)."""
    K = 256 * blocks.G

    def layer(n: int) -> KQuantLinear:
        with torch.device("meta"):
            return KQuantLinear(kind, K, n)

    def make(start: int, stop: int) -> KQuantLinear:
        chunk = layer(stop - start)
        if NATIVE_PACKING and kind in ("Q4_K", "Q6_K") and blocks.N % 16 == 0 and kernels.native_available():
            # the blocks' bytes moved once, natively (copied where they are the file's read-only map)
            rows = np.require(blocks.rows(start, stop), requirements=["C", "W"])
            chunk._set(*kernels.pack_gguf_blocks(torch.from_numpy(rows), kind))
            return chunk
        f = _k_fields(blocks.rows(start, stop), kind)
        if kind != "Q6_K":
            chunk._set(*kernels.pack_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"], five_bit=kind == "Q5_K"))
        else:
            chunk._set(*kernels.pack_q6_k(f["q"], f["sc"], f["d"]))
        return chunk

    return _by_rows(make, layer(blocks.N), blocks)


def _k_quant_rows(blocks: _Stacked, kind: str):
    """A K-quant weight in the row layout, its values exactly (`Q4Linear.from_q4_k`,
    `Q8MinsLinear.from_q5_k`, `Q8Linear.from_q6_k`): where the packed kernels are not built (AVX2 CPUs)."""
    def make(start: int, stop: int):
        f = _k_fields(blocks.rows(start, stop), kind)
        if kind == "Q4_K":
            return Q4Linear.from_q4_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
        if kind == "Q5_K":
            return Q8MinsLinear.from_q5_k(f["q"], f["sc"], f["m"], f["d"], f["dmin"])
        return Q8Linear.from_q6_k(f["q"], f["sc"], f["d"])

    with torch.device("meta"):
        layer = {"Q4_K": Q4Linear, "Q5_K": Q8MinsLinear, "Q6_K": Q8Linear}[kind](256 * blocks.G, blocks.N)
    return _by_rows(make, layer, blocks)


def q5_0_layer(blocks: np.ndarray | _Stacked) -> Q5Linear:
    """A Q5Linear from Q5_0 blocks [N, K/32, 22] (or parts' blocks, stacked): q = the value + 16,
    scale d (the kernels take the mins as -16 d in float32: exact, no mins stored)."""
    blocks = _Stacked([blocks]) if isinstance(blocks, np.ndarray) else blocks
    N, G = blocks.N, blocks.G
    d = torch.from_numpy(np.concatenate([b[..., 0:2] for b in blocks.parts]).view(np.float16).reshape(N, G))

    def layer(n: int) -> Q5Linear:
        with torch.device("meta"):
            return Q5Linear(32 * G, n)

    def make(start: int, stop: int) -> Q5Linear:
        chunk = layer(stop - start)
        if NATIVE_PACKING and N % 16 == 0 and kernels.native_available():  # (the blocks' bytes moved once)
            chunk._set(*kernels.pack_gguf_blocks(torch.from_numpy(np.require(blocks.rows(start, stop),
                                                                             requirements=["C", "W"])), "Q5_0"))
            return chunk
        b = blocks.rows(start, stop, lambda _, rows: as_q8_0(rows, "Q5_0"))
        q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(stop - start, 32 * G))
        chunk._set(kernels.pack_q5((q.to(torch.int16) + 16).to(torch.uint8)), kernels.pack_scales(d[start:stop]),
                   torch.zeros(0, dtype=torch.float16))
        return chunk

    return _by_rows(make, layer(N), blocks)


def _q4_0_fits(blocks: _Stacked) -> bool:
    """Q4_0's min -8 d is finite in float16 (|d| <= 8188) in every block: it can be a Q4Linear."""
    return all((np.abs(np.ascontiguousarray(b[..., 0:2]).view(np.float16)) <= 8188).all() for b in blocks.parts)


def q4_0_layer(blocks: np.ndarray) -> Q4Linear | None:
    """A Q4Linear from Q4_0 blocks [N, K/32, 18] (`_block_layer`), or None where -8 d overflows
    float16 (then the caller widens to Q8_0)."""
    stacked = _Stacked([blocks])
    return _block_layer(stacked, ["Q4_0"]) if _q4_0_fits(stacked) else None


def _block_layer(blocks: _Stacked, kinds: list[str], as_q8: bool = False) -> Q4Linear | Q8Linear:
    """Q4Linear from Q4_1 blocks (the file's bytes, split) or Q4_0 blocks (d and the nibbles as
    they are, mins -8 d: d q + m = d (q - 8) as gguf dequantizes it, bit for bit, in the file's 4.5
    bits a weight on the packed kernels, which keep no mins for it), or Q8Linear from Q8_0, Q5_0
    and Q4_0 blocks (their values exactly, `as_q8_0`; as_q8: Q4_0 alone too), the parts of `kinds`
    stacked."""
    G = blocks.G
    q4_0 = set(kinds) == {"Q4_0"} and not as_q8
    q4 = q4_0 or set(kinds) == {"Q4_1"}
    cls = Q4Linear if q4 else Q8Linear

    def layer(n: int) -> Q4Linear | Q8Linear:
        with torch.device("meta"):
            return cls(32 * G, n)

    def make(start: int, stop: int) -> Q4Linear | Q8Linear:
        n = stop - start
        chunk = layer(n)
        native = kinds[0] if len(set(kinds)) == 1 and kinds[0] in ("Q8_0", "Q4_1") or q4_0 else None
        if NATIVE_PACKING and native and blocks.N % 16 == 0 and kernels.packed_available():
            # packed natively, as `int8_activations` would pack the rows (copied where they are the file's map)
            rows = np.require(blocks.rows(start, stop), requirements=["C", "W"])
            chunk._set(*kernels.pack_gguf_blocks(torch.from_numpy(rows), "Q4_0" if q4_0 else native))
            chunk.q4_0 = q4_0
            return chunk
        b = blocks.rows(start, stop, None if q4 else lambda i, rows: as_q8_0(rows, kinds[i]))
        scale = torch.from_numpy(np.ascontiguousarray(b[..., 0:2]).view(np.float16).reshape(n, G))
        if q4_0:
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 2:]).reshape(n, 16 * G)), scale,
                       (scale.float() * -8).half())
            chunk.q4_0 = True
        elif q4:
            mins = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16).reshape(n, G))
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 4:]).reshape(n, 16 * G)), scale, mins)
        else:
            chunk._set(torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, 32 * G)), scale)
        return chunk

    whole = layer(blocks.N)
    whole.q4_0 = q4_0
    return _by_rows(make, whole, blocks)


def _quantized_layer(gf: GGUFFile, parts, requantized: list[str], workers: _Workers | None = None):
    """A fused or single linear weight from its file tensors. On the packed kernels: parts of
    different kinds (not all widenable to Q8_0) each as their own layer (SplitLinear); a K-quant
    kind as KQuantLinear; Q5_0 as Q5Linear. Everywhere: Q4Linear where every part is Q4_1 (the
    file's bytes, split) or Q4_0 (mins -8 d), Q8Linear where every part is Q8_0, Q5_0 or a mix
    with Q4_0 (their values exactly, `as_q8_0`), else int8 per row from the dequantized values
    (listed in `requantized`). workers:
    the threads a matrix's chunks are converted on (`_by_rows`), where given."""
    kinds = {t.tensor_type.name for _, t in parts}
    N = sum(int(t.shape[1]) for _, t in parts)
    packed = N % 16 == 0 and kernels.packed_available()
    if len(kinds) > 1 and not kinds <= set(AS_Q8) and not kinds & set(FLOAT_TYPES) and (
            kernels.packed_available() or kinds & set(ROW_K_TYPES)):
        # parts of different kinds (Q4_K_M's Q6_K v beside Q4_K q and k): each as it is stored
        return SplitLinear([_quantized_layer(gf, [part], requantized, workers) for part in parts])

    def blocks() -> _Stacked:
        return _Stacked([tensor_blocks(gf, rest, t) for rest, t in parts], gf, workers)

    if len(kinds) == 1 and kinds <= set(K_BLOCK_BYTES) and packed:
        return _k_quant_layer(blocks(), kinds.pop())
    if len(kinds) == 1 and kinds <= set(ROW_K_TYPES):  # the row layout's exact forms
        return _k_quant_rows(blocks(), kinds.pop())
    if kinds == {"Q5_0"} and packed:
        return q5_0_layer(blocks())
    if kinds == {"Q4_1"} or kinds <= set(AS_Q8):
        stacked = blocks()
        # (Q4_0 as 4 bits unless its min -8 d overflows float16: then widened to Q8_0 as a mix is)
        as_q8 = kinds == {"Q4_0"} and not _q4_0_fits(stacked)
        return _block_layer(stacked, [t.tensor_type.name for _, t in parts], as_q8)
    ws = [as_held(rest, dequantize(gf, t), gf) for rest, t in parts]
    w = torch.from_numpy(np.concatenate(ws) if len(ws) > 1 else np.array(ws[0]))
    if kinds <= set(FLOAT_TYPES):  # float matrices: their values exactly, in float32 (the native stack's GEMMs)
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        return layer
    requantized += [t.name for _, t in parts]
    return Int8Linear.from_float(w)


def _converted_weight(gf: GGUFFile, requantized: list[str], workers: _Workers, parts):
    """A weight from its parts [(GGUF short name, tensor)] as `quantized_model` holds it."""
    rest, t = parts[0]
    if len(t.shape) == 1:  # norms, and biases (q, k and v's concatenated)
        return torch.from_numpy(np.concatenate([as_held(r, dequantize(gf, x), gf) for r, x in parts]))
    kind = t.tensor_type.name
    as_stored = kind in BLOCK_BYTES or kind in ROW_K_TYPES or (
        kind in K_BLOCK_BYTES and int(t.shape[1]) % 16 == 0 and kernels.packed_available())
    if len(parts) == 1 and rest == "token_embd.weight" and not as_stored:
        return torch.from_numpy(dequantize(gf, t).copy())  # a float table, gathered as it is
    return _quantized_layer(gf, parts, requantized, workers)


def _parameter(t: torch.Tensor) -> torch.nn.Parameter:
    # (one `keep` made stays the same object: the cache's builder knows its record by it)
    return t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)


def quantized_model(source: str | Path | GGUFFile, keep: Callable[[object], object] | None = None,
                    progress: Callable[[int], object] | None = None) -> tuple[GGUFFile, "torch.nn.Module", list[str]]:
    """The file's model with its quantized weights kept as they are stored (see the module doc):
    (the open file, the model, names of the tensors that had to be re-quantized).

    source: a path, or a file `open_gguf` opened. keep(weight) -> what the model holds of each
    weight (a layer, or a tensor: a norm's weight, a bias) as soon as it is converted, before the
    next is read; by default the weight itself. progress(n): after each weight, n the file's
    bytes it took."""
    gf = source if isinstance(source, GGUFFile) else open_gguf(source)
    requantized: list[str] = []

    # A matrix's chunks on as many threads as torch's width, each op on one thread: ops
    # parallelized within are slower here than on one thread as soon as a neighbour is busy (a
    # barrier per op waits out its time slice: arlm.threads), and numpy's never were.
    width = torch.get_num_threads()
    tensors = {}
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(width) as pool:
            convert = partial(_converted_weight, gf, requantized, _Workers(pool, width))
            for name, value, parts in converted(gf, convert):
                tensors[name] = value if keep is None else keep(value)
                if progress is not None:
                    progress(sum(int(t.n_bytes) for _, t in parts))
    finally:
        torch.set_num_threads(width)
    return gf, _assembled(gf, tensors), requantized


def _assembled(gf: GGUFFile, tensors: dict[str, object]) -> Transformer:
    """The model of `tensors` (our name -> a layer, or a norm's weight or a bias); LoadError where
    the file left one of its tensors missing."""
    cfg = gf.config
    with torch.device("meta"):
        model = Transformer(cfg, init=False)
    model.set_rope_tables()
    # the model's own (meta) tensors, to tell those the file left missing (kept alive: ids stay theirs)
    unset = [t for t in list(model.parameters()) + list(model.buffers()) if t.is_meta]
    emb = tensors.pop("tok_emb.weight")
    # the quantized layers in place of the nn.Linears first, then the norms' weights and biases
    for name, value in sorted(tensors.items(), key=lambda kv: isinstance(kv[1], torch.Tensor)):
        owner_name, _, attr = name.rpartition(".")
        if isinstance(value, torch.Tensor):  # a norm's weight, a bias
            setattr(model.get_submodule(owner_name), attr, _parameter(value))
        else:  # a quantized layer in place of an nn.Linear
            parent, _, child = owner_name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, value)
    if isinstance(emb, torch.Tensor):
        model.tok_emb = torch.nn.Embedding(*emb.shape, device="meta")
        model.tok_emb.weight = _parameter(emb)  # (frozen: Embedding.from_pretrained's)
        if cfg.tie_embeddings:  # one float32 matrix for both (the file's values: nothing rounded again)
            model.lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta")
            model.lm_head.weight = model.tok_emb.weight
    else:
        model.tok_emb = QuantizedEmbedding(emb)
        if cfg.tie_embeddings:  # one matrix for both: the head's rows are the table
            model.lm_head = emb
    unset_ids = {id(t) for t in unset}
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if id(t) in unset_ids]
    if missing:
        raise LoadError(f"{gf.path}: tensors missing from the file: {missing[:4]}")
    return model.eval()
