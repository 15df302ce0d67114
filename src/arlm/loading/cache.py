"""A GGUF model in the kernels' layout, cached once and memory-mapped on every later run.

Opening SmolLM2's GGUF costs ~3.5 s before any weight is read (gguf's reader parses the
tokenizer's 49,152 tokens and merges field by field), and the file's blocks still have to be
split and repacked for the kernels. The first quantized load of a file therefore writes what it
built to `~/.cache/arlm/models/<sha256 of the file>-<layout>/` (ARLM_CACHE moves the root):

- `manifest.json`: the config, chat template, name, and for every module of the model its kind
  and tensors (dtype, shape, offset);
- `tokenizer.json`: the tokenizer in HF tokenizers' format (BOS/EOS in the manifest);
- `weights.bin`: the tensors' bytes, each at a 64-byte boundary.

Later loads map `weights.bin` (a private copy-on-write map: pages come from the OS page cache
and are shared with every other process that maps the file) and point the model's tensors into
it: no parsing, no copy, no float32 anywhere. The layout ("packed" on AVX-512 VNNI CPUs, else
"rows") is part of the key, so a build for another ISA (ARLM_MARCH) never reads the wrong one.
A file is found again by its content hash; `index.json` maps (path, size, mtime, inode) to that
hash so the ~0.1 s of hashing is paid once per file version. Everything is written to a
temporary directory first and renamed into place: a crash leaves no half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from ..config import ModelConfig
from ..files import atomic_write_text
from ..model import Transformer
from ..quant import (Int8Linear, KQuantLinear, Q4Linear, Q5Linear, Q8Linear, Q8MinsLinear, QuantizedEmbedding,
                     QuantizedLinear, SplitLinear)
from ..tokenizer import Tokenizer

FORMAT = 10  # (a layer kind or field the loader adds is a new format: the old directories are rebuilt)
_ALIGN = 64
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)}


def cache_root() -> Path:
    return Path(os.environ.get("ARLM_CACHE", Path.home() / ".cache" / "arlm")) / "models"


def file_hash(path: Path) -> str:
    """The sha256 of the file's bytes, remembered per (path, size, mtime, inode)."""
    st = path.stat()
    stamp = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    index_path = cache_root() / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if stamp in index:
        return index[stamp]
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(index_path, json.dumps({**index, stamp: digest}))
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest


def cache_dir(path: Path, layout: str) -> Path:
    return cache_root() / f"{file_hash(path)[:32]}-{layout}-v{FORMAT}"


# -- saving ----------------------------------------------------------------------------------------

def _describe(model: torch.nn.Module, add) -> list[dict]:
    """The model's modules that hold weights, as manifest entries; add(tensor) -> its record."""
    entries = []
    first: dict[int, str] = {}  # a module met again (a tied head) is an alias of its first name
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in first:
            entries.append({"name": name, "kind": "alias", "of": first[id(module)]})
            continue
        first[id(module)] = name
        if isinstance(module, QuantizedLinear):
            if module.dense_weight is not None:
                raise ValueError(f"{name}: quantized layers with dense copies are not cached")
            entries.append({"name": name, "kind": type(module).__name__, "in": module.in_features,
                            "out": module.out_features, "int8_activations": module.int8_activations,
                            "kquant": getattr(module, "kind", None),
                            "tensors": [add(t) for t in module.tensors()],
                            "bias": add(module.bias.detach()) if module.bias is not None else None})
        elif isinstance(module, QuantizedEmbedding):
            entries.append({"name": name, "kind": "QuantizedEmbedding", "table": f"{name}.table"})
        elif isinstance(module, SplitLinear):  # (its parts are entries of their own, name.parts.i)
            entries.append({"name": name, "kind": "SplitLinear", "parts": len(module.parts),
                            "bias": add(module.bias.detach()) if module.bias is not None else None})
        elif isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) or name.endswith("norm"):
            for pname, p in module.named_parameters(recurse=False):
                entries.append({"name": f"{name}.{pname}", "kind": "parameter", "tensors": [add(p.detach())]})
    return entries


def save(path: Path, layout: str, loaded, replace: bool = False) -> Path | None:
    """Write `loaded` (a LoadedModel whose weights are in their final layout) to the cache; the
    directory, or None where the cache cannot be written (a read-only home: nothing lost but
    time). replace: a directory already there is one `load` could not read, and goes; without it,
    one already there was written by another process meanwhile, and stays."""
    final = cache_dir(path, layout)
    if final.exists():
        if not replace:  # another process wrote it meanwhile
            return final
        shutil.rmtree(final, ignore_errors=True)  # one `load` could not read (a process mapping it keeps its pages)
    chunks: list[torch.Tensor] = []
    offset = 0

    def add(t: torch.Tensor) -> dict:
        nonlocal offset
        t = t.contiguous()
        record = {"dtype": str(t.dtype), "shape": list(t.shape), "offset": offset}
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        chunks.append(raw)
        pad = -raw.numel() % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8))
        offset += raw.numel() + pad
        return record

    manifest = {"format": FORMAT, "source": str(path), "name": loaded.name, "config": loaded.config.to_dict(),
                "chat_template": loaded.chat_template, "bos_id": loaded.tokenizer.bos_id,
                "eos_ids": loaded.tokenizer.eos_ids, "add_bos": loaded.tokenizer.add_bos,
                "requantized": loaded.requantized, "modules": _describe(loaded.model, add)}
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=final.name + ".tmp"))
        try:
            with open(tmp / "weights.bin", "wb") as f:
                for c in chunks:
                    f.write(c.numpy().tobytes() if c.numel() < 1 << 20 else memoryview(c.numpy()))
            (tmp / "tokenizer.json").write_text(loaded.tokenizer.backend.to_str(), encoding="utf-8")
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            os.replace(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not final.exists():
                raise
    except OSError:
        return None
    return final


# -- loading ---------------------------------------------------------------------------------------

def load(path: Path, layout: str):
    """The cached model for this file and layout as a LoadedModel, or None where there is none
    (or it cannot be read: it is rebuilt)."""
    from . import LoadedModel  # (a cycle: arlm.loading imports this module before it defines LoadedModel)

    directory = cache_dir(path, layout)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("format") != FORMAT:
            return None
        with open(directory / "weights.bin", "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = torch.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=torch.uint8) \
                if size else torch.empty(0, dtype=torch.uint8)
    except (OSError, ValueError):
        return None

    # The tokenizer (~0.13 s of JSON parsing in Rust, outside the GIL) loads beside the model.
    pool = ThreadPoolExecutor(1)
    backend = pool.submit(HFTokenizer.from_file, str(directory / "tokenizer.json"))
    pool.shutdown(wait=False)

    def tensor(r: dict) -> torch.Tensor:
        dtype = _DTYPES[r["dtype"]]
        n = dtype.itemsize * int(torch.Size(r["shape"]).numel())
        return buf[r["offset"]:r["offset"] + n].view(dtype).view(r["shape"])

    config = ModelConfig.from_dict(manifest["config"])
    with torch.device("meta"):
        model = Transformer(config, init=False)
    if config.pos_embedding == "rope":
        model.set_rope_tables()
    kinds = {"Q4Linear": Q4Linear, "Q8Linear": Q8Linear, "Int8Linear": Int8Linear, "Q5Linear": Q5Linear,
             "Q8MinsLinear": Q8MinsLinear}
    modules: dict[str, torch.nn.Module] = {}
    entries = manifest["modules"]
    for e in entries:
        if e["kind"] == "parameter":  # into the module that holds it (a norm, an embedding)
            owner, _, attr = e["name"].rpartition(".")
            setattr(model.get_submodule(owner), attr, torch.nn.Parameter(tensor(e["tensors"][0]), requires_grad=False))
        elif e["kind"] in kinds or e["kind"] == "KQuantLinear":
            with torch.device("meta"):
                bias = e.get("bias") is not None
                layer = KQuantLinear(e["kquant"], e["in"], e["out"], bias=bias) if e["kind"] == "KQuantLinear" \
                    else kinds[e["kind"]](e["in"], e["out"], bias=bias)
            layer._set(*(tensor(r) for r in e["tensors"]))
            if e.get("bias") is not None:  # (Qwen 2's q/k/v)
                layer.bias = torch.nn.Parameter(tensor(e["bias"]), requires_grad=False)
            layer.int8_activations = e["int8_activations"]
            modules[e["name"]] = layer
    for e in entries:  # then what refers to those
        if e["kind"] == "QuantizedEmbedding":
            modules[e["name"]] = QuantizedEmbedding(modules[e["table"]])
        elif e["kind"] == "SplitLinear":
            parts = [modules.pop(f"{e['name']}.parts.{i}") for i in range(e["parts"])]
            modules[e["name"]] = SplitLinear(parts, tensor(e["bias"]) if e.get("bias") is not None else None)
    for e in entries:
        if e["kind"] == "alias":
            modules[e["name"]] = modules[e["of"]]
    for name in sorted(modules, key=lambda n: n.count(".")):  # parents before their children
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, modules[name])
    if config.tie_embeddings and isinstance(model.tok_emb, torch.nn.Embedding) \
            and isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight = model.tok_emb.weight
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return None  # an incomplete manifest: rebuild
    try:
        tokenizer = Tokenizer(backend.result(), manifest["bos_id"], manifest["eos_ids"], manifest["add_bos"])
    except (OSError, ValueError, Exception):  # noqa: BLE001 - HF's parser raises its own kinds: rebuild
        return None
    return LoadedModel(model.eval(), tokenizer, manifest["chat_template"], manifest["name"], "gguf", path,
                       requantized=list(manifest["requantized"]))
