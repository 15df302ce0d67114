"""A GGUF model in the kernels' layout, cached once and memory-mapped on every later run.

Opening SmolLM2's GGUF costs ~1.4 s before any weight is read (gguf's reader parses the
tokenizer's 49,152 tokens and merges field by field), and the file's blocks still have to be
split and repacked for the kernels. The first quantized load of a file therefore writes them, in
the kernels' layout, to `~/.cache/arlm/models/<sha256 of the file>-<layout>/` (ARLM_CACHE moves
the root), a weight at a time as it is converted (`Builder`: the model is never held whole in
memory, and the file's pages are handed back as they are read), and then loads that, as every
later run does:

- `manifest.json`: the config, chat template, name, and for every module of the model its kind
  and tensors (dtype, shape, offset);
- `tokenizer.json`: the tokenizer in HF tokenizers' format (BOS/EOS in the manifest);
- `weights.bin`: the tensors' bytes, each at a 64-byte boundary.

Later loads take `weights.bin` as `files.load_weights` holds it (read into memory on transparent
huge pages, or a private copy-on-write map of it, its pages the page cache's and shared with
every process that maps the file: `arlm generate`, ARLM_MMAP=1) and point the model's tensors
into it: no parsing, no conversion, no float32 anywhere. The layout ("packed" on AVX-512 VNNI
and AVX2 CPUs, the same bytes, else "rows") is part of the key, so a build for another ISA
(ARLM_MARCH) never reads the wrong one.
A file is found again by its content hash; `index.json` maps (path, size, mtime, inode) to that
hash so the ~0.1 s of hashing is paid once per file version. Everything is written to a
temporary directory first and renamed into place: a failure or a crash midway leaves no
half-written cache (a killed process leaves its temporary directory, `<name>.tmp*`).

Nothing else would ever remove a directory (a 4.7 GB one for an 8B Q4_K_M file), so every new one
written sweeps the root (`evict_orphans`): the directories no file version is at any more
(neither the one it was built from, gone or rewritten, nor one `index.json` found with its
content since), of an older FORMAT, and temporary directories a killed build left (nothing in
them changed for an hour: a younger one may be another process's build in progress) go, and
`index.json` forgets the file versions no longer there. Only directories named as arlm names
them are looked at (a newer arlm's FORMAT stays); the sweep and `index.json`'s updates hold the
root's lock. A process still mapping a removed directory keeps its pages. ARLM_CACHE_SWEEP=0 turns the sweep off (a
cache shared by machines that see the files at other paths).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from ..config import ModelConfig
from ..files import atomic_write_text, load_weights, locked
from ..model_files import (FORMAT, _current, _stamp, cache_dir, cache_root, file_hash,  # noqa: F401
                           hash_remembered)
from ..model import Transformer
from ..quant import (Int8Linear, KQuantLinear, Q4Linear, Q5Linear, Q8Linear, Q8MinsLinear, QuantizedEmbedding,
                     QuantizedLinear, SplitLinear)
from ..tokenizer import Tokenizer, backend_json
from .loaded import LoadedModel

_ALIGN = 64
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8)}


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
                            "bias": add(module.bias) if module.bias is not None else None})
        elif isinstance(module, QuantizedEmbedding):
            entries.append({"name": name, "kind": "QuantizedEmbedding", "table": f"{name}.table"})
        elif isinstance(module, SplitLinear):  # (its parts are entries of their own, name.parts.i)
            entries.append({"name": name, "kind": "SplitLinear", "parts": len(module.parts),
                            "bias": add(module.bias) if module.bias is not None else None})
        elif isinstance(module, (torch.nn.Embedding, torch.nn.Linear)) or name.endswith("norm"):
            for pname, p in module.named_parameters(recurse=False):
                entries.append({"name": f"{name}.{pname}", "kind": "parameter", "tensors": [add(p)]})
    return entries


class Builder:
    """A cache directory being written: a temporary directory beside its final place, whose
    weights.bin takes each tensor as it comes, at a 64-byte boundary (`add`; `store`: a converted
    weight's, then released), then the manifest and the tokenizer, and the rename into place
    (`finish`). Leaving the `with` block on an exception removes the temporary directory.

    A tensor's record (dtype, shape, offset) is known again by the tensor object: the one `add`
    was given, or the meta tensor `store` left in its place (each kept alive here, so that an id
    is never another tensor's)."""

    def __init__(self, path: Path, layout: str, replace: bool = False) -> None:
        """replace: a directory already there (one `load` could not read) goes. OSError where the
        cache cannot be written."""
        self.final = cache_dir(path, layout)
        if replace and self.final.exists():
            shutil.rmtree(self.final, ignore_errors=True)  # (a process mapping it keeps its pages)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.final.parent, prefix=self.final.name + ".tmp"))
        try:
            self._file = open(self.tmp / "weights.bin", "wb")
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self._offset = 0
        self._records: dict[int, tuple[torch.Tensor, dict]] = {}
        self.source = Path(path).resolve()  # (absolute: the sweep checks it from any directory)

    def __enter__(self) -> "Builder":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        self._file.close()
        if kind is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _write(self, t: torch.Tensor) -> dict:
        t = t.detach().contiguous()
        if t.is_meta:
            raise ValueError("a tensor with no data (meta) that was never written")
        record = {"dtype": str(t.dtype), "shape": list(t.shape), "offset": self._offset}
        if t.numel():
            raw = t.view(-1).view(torch.uint8).numpy()
            self._file.write(memoryview(raw))
            self._offset += raw.size
        pad = -self._offset % _ALIGN
        self._file.write(bytes(pad))
        self._offset += pad
        return record

    def add(self, t: torch.Tensor) -> dict:
        """t's record, its bytes written the first time it is met."""
        if id(t) not in self._records:
            self._records[id(t)] = (t, self._write(t))
        return self._records[id(t)][1]

    def _written(self, t: torch.Tensor, parameter: bool) -> torch.Tensor:
        """t written; a meta tensor of its shape and dtype, which `add` knows as t's record."""
        record = self._write(t)
        stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta")
        if parameter:
            stand_in = torch.nn.Parameter(stand_in, requires_grad=False)
        self._records[id(stand_in)] = (stand_in, record)
        return stand_in

    def store(self, weight):
        """A converted weight (a module, or a tensor: a norm's weight, a bias) in its final layout
        written now; returned holding meta tensors of the same shapes and dtypes in place of its
        own, whose memory goes with them (a tensor comes back as a meta Parameter)."""
        if isinstance(weight, torch.Tensor):
            return self._written(weight, parameter=True)
        for module in weight.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, self._written(p, parameter=True))
            if isinstance(module, QuantizedLinear):
                module._set(*(self._written(t, parameter=False) for t in module.tensors()))
        return weight

    def finish(self, loaded) -> Path:
        """Write the rest (the manifest, the tokenizer) of `loaded` (a LoadedModel whose tensors
        were `store`d, or are written now) and rename the directory into place; the directory.
        Where another process put one there meanwhile, that one stays."""
        manifest = {"format": FORMAT, "source": str(self.source), "stamp": _stamp(self.source), "name": loaded.name,
                    "config": loaded.config.to_dict(), "chat_template": loaded.chat_template,
                    "bos_id": loaded.tokenizer.bos_id, "eos_ids": loaded.tokenizer.eos_ids,
                    "add_bos": loaded.tokenizer.add_bos, "requantized": loaded.requantized,
                    "modules": _describe(loaded.model, self.add)}
        self._file.close()
        (self.tmp / "tokenizer.json").write_text(backend_json(loaded.tokenizer.backend), encoding="utf-8")
        (self.tmp / "manifest.json").write_text(json.dumps(manifest))
        try:
            os.replace(self.tmp, self.final)  # atomic; fails if another process got there first
        except OSError:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if not self.final.exists():
                raise
        if os.environ.get("ARLM_CACHE_SWEEP", "1") != "0":  # (0: a cache shared by machines with other paths)
            evict_orphans(self.final.parent)
        return self.final


STALE_BUILD_S = 3600  # a temporary directory whose files have not changed for this long is a killed build's
_CACHE_NAME = re.compile(r"[0-9a-f]{32}-[a-z0-9_]+-v(\d+)(\.tmp\w+)?")


def _orphan(d: Path, live: set[str]) -> bool:
    """Whether the directory `d` of the cache root is a cache nothing will read again (the module
    doc); anything not named as arlm names its directories is not."""
    m = _CACHE_NAME.fullmatch(d.name)
    if m is None:
        return False
    if m.group(2):  # a build's temporary directory: stale when nothing in it changed for an hour
        newest = max([d.stat().st_mtime] + [f.stat().st_mtime for f in d.iterdir()])
        return time.time() - newest > STALE_BUILD_S
    version = int(m.group(1))
    if version != FORMAT:
        return version < FORMAT and (d / "manifest.json").exists()  # (a newer arlm's stays)
    if d.name[:32] in live:
        return False
    manifest = json.loads((d / "manifest.json").read_text())
    source, stamp = Path(manifest["source"]), manifest.get("stamp")
    if not source.is_absolute():
        return False  # (an early manifest's path as given: from here, unknown)
    return not source.exists() or (stamp is not None and not _current(stamp))


def evict_orphans(root: Path) -> list[Path]:
    """Remove the cache directories under `root` nothing will read again (the module doc): no file
    version it was built from or found by since is where it was (the manifest's source and stamp,
    `index.json`'s current entries with its hash), an older FORMAT, a stale temporary build; and
    `index.json`'s entries of file versions no longer there. Under the root's lock. The
    directories removed."""
    index_path, removed = root / "index.json", []
    with locked(root / ".lock"):
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError):
            index = {}
        kept = {stamp: h for stamp, h in index.items() if _current(stamp)}
        live = {h[:32] for h in kept.values()}
        for d in root.iterdir() if root.is_dir() else ():
            try:
                if d.is_dir() and _orphan(d, live):
                    shutil.rmtree(d, ignore_errors=True)
                    removed.append(d)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # (being written, or unreadable: left as it is)
        if len(kept) < len(index):
            try:
                atomic_write_text(index_path, json.dumps(kept))
            except OSError:
                pass
    return removed


def save(path: Path, layout: str, loaded, replace: bool = False) -> Path | None:
    """Write `loaded` (a LoadedModel whose weights are in their final layout) to the cache; the
    directory, or None where the cache cannot be written (a read-only home: nothing lost but
    time). replace: a directory already there is one `load` could not read, and goes; without it,
    one already there was written by another process meanwhile, and stays."""
    final = cache_dir(path, layout)
    if final.exists() and not replace:  # another process wrote it meanwhile
        return final
    try:
        with Builder(path, layout, replace=replace) as builder:
            return builder.finish(loaded)
    except OSError:
        return None


# -- loading ---------------------------------------------------------------------------------------

class _Short(ValueError):
    """A manifest's tensor past the end of weights.bin."""


def load(path: Path, layout: str, tokenizer: Tokenizer | None = None) -> LoadedModel | None:
    """The cached model for this file and layout as a LoadedModel, or None where there is none
    (or it cannot be read: it is rebuilt). tokenizer: the one just written to it (a first load's:
    its tokenizer.json not parsed again)."""
    try:
        return _load(path, layout, tokenizer)
    except _Short:
        return None


def _load(path: Path, layout: str, tokenizer: Tokenizer | None = None) -> LoadedModel | None:
    """`load`, raising _Short where weights.bin is shorter than its manifest says."""
    directory = cache_dir(path, layout)
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
        if manifest.get("format") != FORMAT:
            return None
        memory = load_weights(directory / "weights.bin")
        buf = torch.frombuffer(memory, dtype=torch.uint8) if memory is not None else torch.empty(0, dtype=torch.uint8)
    except (OSError, ValueError):
        return None

    # The tokenizer (~0.13 s of JSON parsing in Rust; Gemma 3's 1.45 s) is read on a thread beside the
    # model's set-up, though HF tokenizers holds the GIL while it parses: the two take turns.
    backend = None
    if tokenizer is None:
        pool = ThreadPoolExecutor(1)
        backend = pool.submit(HFTokenizer.from_file, str(directory / "tokenizer.json"))
        pool.shutdown(wait=False)

    def tensor(r: dict) -> torch.Tensor:
        dtype = _DTYPES[r["dtype"]]
        n = dtype.itemsize * int(torch.Size(r["shape"]).numel())
        if r["offset"] + n > buf.numel():  # (weights.bin cut short: a damaged cache, rebuilt)
            raise _Short()
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
        if tokenizer is None:
            tokenizer = Tokenizer(backend.result(), manifest["bos_id"], manifest["eos_ids"], manifest["add_bos"])
    except (OSError, ValueError, Exception):  # noqa: BLE001 - HF's parser raises its own kinds: rebuild
        return None
    return LoadedModel(model.eval(), tokenizer, manifest["chat_template"], manifest["name"], "gguf", path,
                       requantized=list(manifest["requantized"]), weights=buf)
