"""A model run from its bare-decode plan: numpy arrays over the layout cache's map, the decode
library's calls (`library`), greedy decoding. No torch.

The calls are the torch path's own for one sequence (`engine.runner`, `kernels.llama`): the prompt
through `forward_llama_paged` with one block holding the whole cache, each later token through
`decode_llama`, the last position through `llama_head`, the next token the logits' argmax
(`argmax_rows`' row function). So the tokens, and the logits they come from, are the torch path's
bit for bit (tests/test_bare.py).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import zlib
from pathlib import Path

import numpy as np

from . import gather
from .library import BFLOAT16, Library, tensor, tensors

FORMAT = 1  # (a field added or changed: plans of another format are not read, and are written again)
PLAN_ROPE_ROWS = 4096  # RoPE rows a plan holds: a longer sequence takes the torch path

_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8, "uint8": np.uint8,
           "int64": np.int64, "int32": np.int32}
_ROOT = Path(__file__).resolve().parent.parent  # the arlm package


def plan_stamp() -> str:
    """The arlm sources a plan was written by (each Python and kernel file's name, size and mtime):
    a plan from other sources is stale (the torch path runs, and writes it again)."""
    parts = []
    for p in sorted(_ROOT.rglob("*")):
        if p.suffix in (".py", ".cpp", ".h") and "__pycache__" not in p.parts:
            st = p.stat()
            parts.append(f"{p.relative_to(_ROOT)}:{st.st_size}:{st.st_mtime_ns}")
    return f"{zlib.crc32(chr(10).join(parts).encode()):08x}"


def torch_version() -> str:
    """The installed torch's version, from its dist-info directory's name (importing torch, or
    importlib.metadata's ~60 ms, is what this path avoids): a plan's RoPE tables and its checked
    embedding rows are that torch's."""
    import sys

    for entry in sys.path:
        try:
            for d in Path(entry or ".").glob("torch-*.dist-info"):
                return d.name[len("torch-"):-len(".dist-info")]
        except OSError:
            continue
    return ""


def blob_check(blob: bytes) -> list[int]:
    """A plan's blob as its JSON pins it: length and CRC."""
    return [len(blob), zlib.crc32(blob)]


def _map(path: Path) -> np.ndarray:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ), dtype=np.uint8)


def _weights(path: Path) -> np.ndarray:
    """weights.bin as the torch path holds it (`files.load_weights`: on huge pages where the kernel
    has them)."""
    from ..files import load_weights

    memory = load_weights(path)
    return np.frombuffer(memory, dtype=np.uint8) if memory is not None else np.zeros(0, dtype=np.uint8)


class BarePlan:
    """A plan (`bare-<activations>.json`, written by `arlm.bare.write`) and the arrays it names."""

    def __init__(self, directory: Path, activations: str) -> None:
        """ValueError or OSError where there is no current plan for these activations."""
        from .library import key

        self.directory = directory
        self.plan = json.loads((directory / f"bare-{activations}.json").read_text())
        if not isinstance(self.plan, dict) or self.plan.get("format") != FORMAT or \
                self.plan.get("stamp") != plan_stamp() or self.plan.get("library") != key() or \
                self.plan.get("torch") != torch_version():
            raise ValueError("the plan is stale")
        self.weights = _weights(directory / "weights.bin")
        self.blob = _map(directory / f"bare-{activations}.bin")
        if [len(self.blob)] != self.plan["blob"][:1]:  # (its CRC is checked where it is written)
            raise ValueError("the plan's blob is not the one it names")

    @staticmethod
    def arrays_of(directory: Path, records: list[dict], blob_path: Path) -> list[np.ndarray]:
        weights, blob = _map(directory / "weights.bin"), _map(blob_path)  # (a plan's check: a map is enough)
        return [BarePlan._array(r, weights, blob) for r in records]

    @staticmethod
    def _array(r: dict, weights: np.ndarray, blob: np.ndarray) -> np.ndarray:
        dtype = np.dtype(_DTYPES[r["dtype"]])
        shape = tuple(r["shape"])
        if r["at"] == "none":
            return np.zeros(shape, dtype=dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        src = weights if r["at"] == "weights" else blob
        return src[r["offset"]:r["offset"] + n].view(dtype).reshape(shape)

    def array(self, r: dict) -> np.ndarray:
        return self._array(r, self.weights, self.blob)

    def view(self, r: dict):
        """The record as the library takes it (bfloat16 held as uint16: its scalar type said)."""
        return self.array(r), BFLOAT16 if r["dtype"] == "bfloat16" else None


class BareModel:
    """The plan's model on the library: `prefill`, `decode`, `next_token`."""

    def __init__(self, plan: BarePlan, lib: Library) -> None:
        self.lib, self.p = lib, plan.plan
        a = self.arch = self.p["arch"]
        self._keep = []  # every array a ctypes view points into
        self._out: dict[int, np.ndarray] = {}  # rows -> the head's logits buffer
        self.weights = self._views(plan, self.p["weights"])
        self.head = self._views(plan, self.p["head"]["tensors"])
        self.norm = self._views(plan, [self.p["head"]["norm"]])
        rope = self.p["rope"]
        self.rope_rows = rope["rows"]
        self.cos, self.sin, self.local_cos, self.local_sin = (
            self._views(plan, [rope[k]]) for k in ("cos", "sin", "local_cos", "local_sin"))
        emb = self.p["embedding"]
        self.emb_kind, self.emb_kquant = emb["kind"], emb["kquant"]
        self.emb_tensors = [plan.array(r) for r in emb["tensors"]]
        self.embed_scale = None if a["embed_scale"] is None else np.float32(a["embed_scale"])
        self.windows = (ctypes.c_int64 * max(1, len(a["windows"])))(*a["windows"])
        self.kv_dtype = np.dtype(_DTYPES[self.p["kv"]["dtype"]])
        self.kv_scalar = BFLOAT16 if self.p["kv"]["dtype"] == "bfloat16" else None
        no_rows = np.zeros(0, dtype=np.int64)
        self.empty, self.empty_long = tensor(None), tensor(no_rows)
        self._keep.append(no_rows)

    def _views(self, plan: BarePlan, records: list[dict]):
        arrays = [plan.view(r) for r in records]
        self._keep.append(arrays)
        return tensors(arrays)

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt and output) the plan runs."""
        return min(self.rope_rows, self.arch["max_model_len"])

    def new_cache(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        """A contiguous KV cache for one sequence of up to `length` tokens: k, v [L, 1, H_kv, T, d]."""
        a = self.arch
        shape = (a["n_layer"], 1, a["n_kv_heads"], length, a["head_dim"])
        return np.zeros(shape, dtype=self.kv_dtype), np.zeros(shape, dtype=self.kv_dtype)

    def embed(self, ids: list[int]) -> np.ndarray:
        x = gather.rows(self.emb_kind, self.emb_tensors, np.asarray(ids, dtype=np.int64), self.emb_kquant)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.embed_scale is not None:
            x *= self.embed_scale
        return x

    def _head(self, x: np.ndarray) -> np.ndarray:
        """Logits [N, vocab] of x's rows, in a buffer kept for the next call (a decode step's
        row is ~0.5-1 MB: a fresh one each step is a fresh mapping to fault in)."""
        a, h = self.arch, self.p["head"]
        out = self._out.get(x.shape[0])
        if out is None:
            out = self._out[x.shape[0]] = np.empty((x.shape[0], a["vocab_size"]), dtype=np.float32)
        xt, ot = tensor(x), tensor(out)
        self.lib.check(self.lib.lib.arlm_bare_head(xt, self.norm, self.head, a["eps"], int(h["a8"]),
                                                   int(h["residual"]), ot))
        return out

    def prefill(self, ids: list[int], k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The prompt's tokens into the cache; the last position's logits [vocab] (valid until
        the next call, as `decode`'s)."""
        a = self.arch
        x = self.embed(ids)
        n = len(ids)
        table, seq = np.zeros((1, 1), dtype=np.int64), np.zeros(n, dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)
        keep = [tensor(t) for t in (x, table, seq, pos)]
        kt, vt = tensor(k, self.kv_scalar), tensor(v, self.kv_scalar)
        self.lib.check(self.lib.lib.arlm_bare_forward(
            keep[0], self.weights, len(self.p["weights"]), kt, vt, keep[1], keep[2], keep[3], self.cos, self.sin,
            a["n_head"], a["n_kv_heads"], a["eps"], int(a["a8"]), a["residual"], self.p["kv"]["format"], 0, 0,
            int(a["geglu"]), a["q_scale"], self.windows, len(a["windows"]), self.local_cos, self.local_sin,
            self.empty, self.empty, self.empty_long))
        return self._head(np.ascontiguousarray(x[n - 1:n]))[0]

    def decode(self, token: int, position: int, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One token at `position` over the cache's first positions; its logits [vocab]."""
        a = self.arch
        x = self.embed([token])
        pos = np.array([position], dtype=np.int64)
        xt, pt = tensor(x), tensor(pos)
        kt, vt = tensor(k, self.kv_scalar), tensor(v, self.kv_scalar)
        self.lib.check(self.lib.lib.arlm_bare_decode(
            xt, self.weights, len(self.p["weights"]), kt, vt, pt, self.cos, self.sin, position + 1,
            a["n_head"], a["n_kv_heads"], a["eps"], int(a["a8"]), a["residual"], self.p["kv"]["format"],
            int(a["geglu"]), a["q_scale"], self.windows, len(a["windows"]), self.local_cos, self.local_sin))
        return self._head(x)[0]

    def next_token(self, logits: np.ndarray) -> int:
        return self.lib.argmax(logits)

