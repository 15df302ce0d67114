"""Files written atomically: a reader sees the old file or the whole new one, never half of one.

Each write goes to a temp file beside its target, is flushed to disk, renamed over the target,
and the directory flushed so that the rename itself survives a crash. Checkpoints
(loading/checkpoint.py, train/checkpoints.py), prepared data (train/data.py), logits files
(perplexity.py) and exports (arlm.export: a GGUF file, an HF directory) are written this way.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable


@contextmanager
def locked(path: Path):
    """The file `path` (made where missing) held under an exclusive flock while the block runs:
    one process at a time. Where it cannot be opened for writing (a read-only directory), without
    it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def cache_home() -> Path:
    """arlm's cache directory: ~/.cache/arlm, or $ARLM_CACHE (the built kernels under kernels/, the
    models' prepared layouts under models/)."""
    return Path(os.environ.get("ARLM_CACHE", Path.home() / ".cache" / "arlm"))


def huge_pages() -> bool:
    """The kernel gives transparent huge pages to memory that asks (its setting "always" or
    "madvise", not "never")."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def available_memory() -> int | None:
    """Bytes the kernel could give this process without swapping (MemAvailable: free memory and
    the page cache it would drop), or None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# How load_weights holds a model where ARLM_MMAP does not say: on huge pages (a process that
# decodes for long: the server, the Python API), or mapped (`arlm generate`, one command's few
# hundred tokens: the read would cost its start more than its steps gain; cli.cmd_generate).
WEIGHTS_ON_HUGE_PAGES = True


def load_weights(path: str | Path) -> mmap.mmap | None:
    """A model's weights file (a layout cache's weights.bin) as the memory it runs from, or None
    where the file is empty. Read into private anonymous memory on 2 MB pages where the kernel
    has transparent huge pages: a decode step streams every weight once, and on 4 KB pages (what
    a map of a file gets) the hardware prefetchers stop at each page and every 4 KB takes a TLB
    entry: the 1B Q4_K_M step 9.8-10.8 -> 9.6 ms, batch 8 -3% (Zen 5, benchmarks/phases.py).
    The read (on up to 4 threads) costs a fresh process ~0.3 s a GB, the kernel making and
    zeroing its huge pages. Or mapped: a private copy-on-write map of the file, its pages the page
    cache's, shared with every process that maps it (replicas of a model on one machine), read
    as touched. ARLM_MMAP=1 maps, ARLM_MMAP=0 reads; else WEIGHTS_ON_HUGE_PAGES says. A file
    larger than 90% of the memory available maps whatever is asked (a copy would not fit beside
    the rest; a map at least runs, its pages read from the disk as needed). OSError where the
    file cannot be read whole."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return None
        choice = os.environ.get("ARLM_MMAP", "")
        huge = choice == "0" or (choice != "1" and WEIGHTS_ON_HUGE_PAGES)
        room = available_memory()
        fits = room is None or size <= 0.9 * room
        if not (huge and fits and huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")):
            return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        from concurrent.futures import ThreadPoolExecutor

        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        memory.madvise(mmap.MADV_HUGEPAGE)  # (before any page is touched)
        view, chunk = memoryview(memory), 64 << 20

        def read(at: int) -> None:  # (os.preadv lets go of the GIL: the chunks are read side by side)
            end = min(at + chunk, size)
            while at < end:
                got = os.preadv(f.fileno(), [view[at:end]], at)
                if got <= 0:
                    raise OSError(f"{path}: shorter than it was when opened")
                at += got

        with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            list(pool.map(read, range(0, size, chunk)))
        view.release()
        return memory


# create_tmp's temp files, ".<name>.<8 random characters>.tmp" beside <name> (hex digits; the
# wider alphabet also matches mkstemp's names, which a writer killed mid-save may leave behind).
TMP_PATTERN = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")


def create_tmp(path: Path) -> str:
    """A new, empty temp file beside `path`. Unlike mkstemp's (always 0600), it is created 0666
    less the umask, like any other file, so a checkpoint or dataset is readable by whom the user
    meant; the rename keeps the mode."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return str(tmp)
        except FileExistsError:
            continue


def replace_durably(tmp: str | Path, path: Path) -> None:
    """Rename `tmp` over `path` (atomic within a directory), then flush the directory so that the
    rename is on disk. `tmp`'s own contents must be flushed first (os.fsync)."""
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path), fsync it, then rename over `path`: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = create_tmp(path)
    mode = os.stat(tmp).st_mode
    try:
        write(tmp)
        if os.stat(tmp).st_mode != mode:  # a writer that made its own file (safetensors' save_file: 0600)
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        replace_durably(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_directory(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_dir) on a new directory beside `path`, then rename it to `path`: readers see
    no directory there or the whole one. `path` must not exist or be an empty directory (a rename
    replaces nothing more); `write` fsyncs its files (atomic_write does). On failure nothing is
    left."""
    path = Path(path)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            tmp.mkdir()
            break
        except FileExistsError:
            continue
    try:
        write(tmp)
        replace_durably(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def atomic_symlink(link: Path, target: str) -> None:
    """Make `link` a symlink to `target` (a name in the same directory) in one rename: `link`
    points at the old target or the new one, never at nothing."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    replace_durably(tmp, link)


def unwritable_directory(path: str | Path) -> str | None:
    """Why a directory cannot be made (or written) at `path`, in a few words, or None where it
    can: asked before the work whose results go there, not after it. Nothing is created."""
    path = Path(path).absolute()
    for at in (path, *path.parents):
        if at.exists():
            if not at.is_dir():
                return f"{at} is a file" if at == path else f"{at} is a file, not a directory"
            if not os.access(at, os.W_OK | os.X_OK):
                return f"{at} is not writable"
            return None
    return None


def remove_stale_tmp(directory: str | Path, names: Iterable[str]) -> list[Path]:
    """Delete the temp files that a killed atomic_write of any of `names` left in `directory`.

    Only for a directory that no other process is writing: a live writer's temp file looks the same.
    """
    names, removed = set(names), []
    for f in Path(directory).glob(".*.tmp"):
        m = TMP_PATTERN.fullmatch(f.name)
        if m and m["name"] in names and f.is_file():
            f.unlink(missing_ok=True)
            removed.append(f)
    return removed
