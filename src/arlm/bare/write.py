"""The torch side of `arlm.bare`: a model's bare-decode plan, written beside its layout cache.

After the torch path has loaded a GGUF file (its layout cache mapped, the native layer stack
bound: `kernels.llama.NativeLlama`), `save(llm)` writes what that binding computed - every
tensor the stack, the head and the embedding take, as offsets into the cache's weights.bin, or
into the plan's own blob for the few it made (Gemma's 1 + w norms, the RoPE tables' first rows)
- with the architecture's numbers, the KV cache's format and the tokenizer's ids, as
`bare-<activations>.json` and `.bin` in the cache directory. A later `arlm generate` reads that
(`arlm.bare.model`) and never imports torch.

No plan is written where the bare path would not compute what the torch path computes: a model
the native stack does not take whole, weights outside the packed layouts, a KV cache format
other than float rows, or an embedding table whose rows numpy does not gather bit for bit as
the torch path does (checked here on a sample of the model's own rows).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..files import atomic_write, atomic_write_text
from ..kernels import layout
from ..tokenizer import compact_file
from . import gather, library, pieces
from .model import FORMAT, PLAN_ROPE_ROWS, blob_check, plan_stamp, torch_version

log = logging.getLogger(__name__)

_ALIGN = 64
_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.int8: "int8",
          torch.uint8: "uint8", torch.int64: "int64", torch.int32: "int32"}


class _Blob:
    """The plan's records: a tensor inside the layout cache's map as its offset there, else its
    bytes appended to the plan's blob."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.base, self.size = buffer.data_ptr(), buffer.numel()
        self.parts: list[bytes] = []
        self.length = 0

    def record(self, t: torch.Tensor) -> dict:
        t = t.detach()
        if t.dtype not in _NAMES:
            raise ValueError(f"a {t.dtype} tensor")
        r = {"dtype": _NAMES[t.dtype], "shape": list(t.shape)}
        if t.numel() == 0:
            return r | {"at": "none"}
        p = t.data_ptr()
        if t.is_contiguous() and self.base <= p and p + t.numel() * t.element_size() <= self.base + self.size:
            return r | {"at": "weights", "offset": p - self.base}
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        pad = -self.length % _ALIGN
        self.parts.append(b"\0" * pad + raw)
        self.length += pad
        r |= {"at": "blob", "offset": self.length}
        self.length += len(raw)
        return r


def _embedding(model, blob: _Blob) -> dict:
    """The embedding table as the plan records it (kind, kquant, tensors), or ValueError."""
    emb = model.tok_emb
    table = getattr(emb, "table", None)  # quant.QuantizedEmbedding: rows of a quantized layer
    if table is None:
        return {"kind": "dense", "kquant": None, "tensors": [blob.record(emb.weight)]}
    if not getattr(table, "packed", False):
        raise ValueError("the embedding's table is not in the packed layout")
    return {"kind": type(table).__name__, "kquant": getattr(table, "kind", None),
            "tensors": [blob.record(t) for t in table.tensors()]}


def _check_gather(native, plan: dict, arrays: list[np.ndarray]) -> None:
    """The numpy gather gives the torch path's embedding rows, bit for bit, on a sample of rows."""
    # every lane of a packed block of 16 rows, in the first block, the last (perhaps ragged) and
    # one between: three blocks' pages, not the table's (a row read alone maps its whole folio)
    V = native.model.config.vocab_size
    index = np.unique(np.concatenate([np.arange(min(16, V)), np.arange(max(0, V - 16), V), [V // 2]]))
    want = native.embed(torch.from_numpy(index)).numpy()
    got = gather.rows(plan["embedding"]["kind"], arrays, index, plan["embedding"]["kquant"])
    if plan["arch"]["embed_scale"] is not None:
        got = got * np.float32(plan["arch"]["embed_scale"])
    if got.shape != want.shape or not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        raise ValueError("numpy's embedding rows differ from the torch path's")


def plan_of(llm, activations: str) -> tuple[dict, list[bytes]]:
    """The plan's JSON and blob parts for this loaded LLM; ValueError where it has none."""
    loaded, runner = llm.loaded, llm.runner
    native = runner.native
    buffer = getattr(loaded, "weights", None)
    if loaded.source != "gguf" or buffer is None:
        raise ValueError("not a GGUF model mapped from its layout cache")
    if native is None or native._head is None or runner.matmul_path != "vnni" or runner.decode_fn is not None:
        raise ValueError("the native stack does not run this model whole on the packed kernels")
    model, cfg = native.model, native.model.config
    engine = llm.engine
    if getattr(engine.config, "kv_window", 0):
        raise ValueError("a KV window")
    kv = engine.kv_dtype
    if kv not in (torch.float16, torch.float32, torch.bfloat16):
        raise ValueError(f"KV cache {kv}")
    blob = _Blob(buffer)
    weights = [blob.record(t) for t in native.weights]
    head_w, head_a8 = native._head
    # every matrix in a packed layout (3-dim: the bare build runs only those; a row layout, or a
    # float32 matrix whose prompt rows go through torch's GEMM, is the torch path's)
    L = layout.LayerWeight
    slots = (L.WQKV, L.WO, L.GATE_UP, L.DOWN, L.WK, L.WV, L.UP)
    matrices = [native.weights[i * L.COUNT + s] for i in range(cfg.n_layer) for s in slots] + [head_w[0]]
    if any(w.numel() and w.dim() != 3 for w in matrices):
        raise ValueError("a matrix outside the packed layouts")
    rows = min(cfg.max_seq_len, PLAN_ROPE_ROWS)
    model.ensure_rope(rows)
    rope = {"rows": rows, "cos": blob.record(model.rope_cos[:rows]), "sin": blob.record(model.rope_sin[:rows])}
    local = native._arch()[3:]
    rope |= {"local_cos": blob.record(local[0][:rows] if local[0].numel() else local[0]),
             "local_sin": blob.record(local[1][:rows] if local[1].numel() else local[1])}
    tok = llm.tokenizer
    plan = {
        "format": FORMAT,
        "activations": activations,
        "stamp": plan_stamp(),
        "library": library.key(),
        "name": loaded.name,
        "arch": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "vocab_size": cfg.vocab_size,
                 "n_head": native.n_head, "n_kv_heads": native.n_kv_heads, "head_dim": cfg.head_dim,
                 "eps": native.eps, "a8": native.a8, "residual": native.residual, "geglu": native.geglu,
                 "q_scale": native.q_scale, "windows": native.windows,
                 "embed_scale": float(native.embed_scale) if native.embed_scale is not None else None,
                 "max_model_len": engine.max_model_len},
        "weights": weights,
        "head": {"tensors": [blob.record(t) for t in head_w], "a8": head_a8,
                 "residual": bool(getattr(model.lm_head, "residual_activations", False)),
                 "norm": blob.record(native._norm)},
        "embedding": _embedding(model, blob),
        "rope": rope,
        "kv": {"dtype": _NAMES[kv], "format": int(layout.KVFormat.FLOAT)},
        "tokenizer": {"bos_id": tok.bos_id, "eos_ids": list(tok.eos_ids), "add_bos": tok.add_bos},
        "chat_template": loaded.chat_template,  # (the file's own: --chat-template writes no plan)
        "torch": torch_version(),
    }
    return plan, blob.parts


def save(llm, activations: str) -> Path | None:
    """Write this LLM's plan into its layout cache directory (atomically: the blob first, then
    the JSON that names it, its length and CRC), and start building the bare library where it is
    not built; the plan's path, or None where there is none (said at debug level: the torch path
    is not wrong)."""
    from ..loading import cache

    try:
        directory = cache.cache_dir(llm.loaded.path, "packed")
        target = directory / f"bare-{activations}.json"
        build = bool(os.environ.get("ARLM_BARE_BUILD_WAIT"))
        if not directory.exists() or _current(target):
            library.build(layout.header(), wait=build)  # (a build that failed or was removed: again)
            return None
        plan, parts = plan_of(llm, activations)
        from .model import BarePlan  # (numpy's gather checked against the torch path's rows)

        blob = b"".join(parts)
        blob_path = directory / f"bare-{activations}.bin"
        atomic_write(blob_path, lambda tmp: Path(tmp).write_bytes(blob))
        plan["blob"] = blob_check(blob)
        plan["tokenizer"]["pieces"] = _pieces(directory, llm.tokenizer)
        arrays = BarePlan.arrays_of(directory, plan["embedding"]["tensors"], blob_path)
        _check_gather(llm.runner.native, plan, arrays)
        atomic_write_text(target, json.dumps(plan))
        compact_file(directory / "tokenizer.json")  # (a cache from before: the bare start parses it)
        library.build(layout.header(), wait=build)
        return target
    except (ValueError, OSError) as e:
        log.debug("no bare plan: %s", e)
        return None
    except Exception as e:  # noqa: BLE001 - the command's own work is done: say it, do not fail it
        print(f"arlm: warning: the bare-decode plan was not written ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _pieces(directory: Path, tokenizer) -> list[int] | None:
    """SentencePiece's BPE as arrays (`pieces`: the bare start reads them instead of HF's JSON)
    where the tokenizer is of that shape and gives HF's ids and text on the probes (and on its
    chat turns' markers); the file's length and CRC, or None (then the bare start parses HF's)."""
    backend = tokenizer.backend
    if backend.pre_tokenizer is not None or backend.normalizer is None:  # (Llama 3's, SmolLM2's: at once)
        return None
    try:  # (the cache's tokenizer.json: HF's serialization, already made; not a second to_str())
        arrays = pieces.build((directory / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if arrays is None or not pieces.same_as(pieces.PieceTokenizer(arrays), backend, pieces.PROBES):
        return None
    path = directory / pieces.FILE

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    atomic_write(path, write)
    return blob_check(path.read_bytes())


def _current(target: Path) -> bool:
    """The plan is there, of these sources, this library and torch, and its blob is the one it names."""
    try:
        plan = json.loads(target.read_text())
        blob = (target.with_suffix(".bin")).read_bytes()
    except (OSError, ValueError):
        return False
    return isinstance(plan, dict) and plan.get("format") == FORMAT and plan.get("stamp") == plan_stamp() \
        and plan.get("library") == library.key() and plan.get("torch") == torch_version() \
        and plan.get("blob") == blob_check(blob)
