"""Files on disk: a prepared-data directory that an interrupted `arlm prepare` left half old, half
new is refused with a clear error (not an IndexError mid-run), stale temp files are cleaned up, and
atomic_write's files get the mode the umask asks for (not mkstemp's 0600).

No real SIGKILL: the half-written states are made by hand, file by file, as a kill would leave them.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from arlm.cli import main
from arlm.files import atomic_write, atomic_write_text, unwritable_directory
from arlm.train import data as data_module
from arlm.train import prepare
from arlm.train.data import DataError, TokenData, fingerprint

SMALL = "abc ab ba cab\n" * 40                                      # 4 characters
BIG = "the quick brown fox jumps over the lazy dog\n" * 80          # 28 characters, more tokens
SAME_LENGTH = "cab ba ab abc\n" * 40                                # SMALL's characters and length, reordered
INTERRUPTED = "incomplete or inconsistent"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def two_prepares(tmp_path) -> tuple[Path, Path]:
    """data_a from SMALL, data_b from BIG: a kill mid-prepare of BIG into data_a mixes the two."""
    prepare([write(tmp_path / "a.txt", SMALL)], tmp_path / "data_a", tokenizer="char")
    prepare([write(tmp_path / "b_big.txt", BIG)], tmp_path / "data_b", tokenizer="char")
    return tmp_path / "data_a", tmp_path / "data_b"


def test_new_train_bin_beside_old_files_is_refused(two_prepares, tmp_path, capsys):
    """A kill mid-prepare: the new train.bin renamed into place, the old val.bin, meta.json and
    tokenizer.json, and the val.bin temp file that was being written. The new tokens index past
    the old vocabulary, so a run that took the directory would die mid-step on an IndexError;
    `arlm train` refuses it up front with a one-line error."""
    a, b = two_prepares
    assert int(np.fromfile(b / "train.bin", dtype=np.uint16).max()) >= TokenData.open(a).vocab_size
    shutil.copy(b / "train.bin", a / "train.bin")
    shutil.copy(b / "val.bin", a / ".val.bin.k2x_9q0z.tmp")
    with pytest.raises(DataError, match=INTERRUPTED):
        TokenData.open(a)

    rc = main(["train", "--data-dir", str(a), "--out-dir", str(tmp_path / "run"), "--max-steps", "1",
               "--device", "cpu", "--progress", "false", "--plot", "false"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("arlm: error: data in") and INTERRUPTED in err, err


def test_same_size_train_bin_from_another_prepare_is_refused(tmp_path):
    """Same token counts, so only the fingerprints in meta.json tell the files apart."""
    prepare([write(tmp_path / "a.txt", SMALL)], tmp_path / "a", tokenizer="char")
    prepare([write(tmp_path / "c.txt", SAME_LENGTH)], tmp_path / "c", tokenizer="char")
    assert (tmp_path / "a" / "train.bin").stat().st_size == (tmp_path / "c" / "train.bin").stat().st_size
    shutil.copy(tmp_path / "c" / "train.bin", tmp_path / "a" / "train.bin")
    with pytest.raises(DataError, match=f"{INTERRUPTED}.*train.bin is not the file meta.json describes"):
        TokenData.open(tmp_path / "a")


def test_prepare_killed_before_meta_json_leaves_a_refused_directory(tmp_path, monkeypatch):
    """meta.json is removed before the new files go in: a prepare that dies after writing the
    splits leaves no old meta.json to vouch for them."""
    out = tmp_path / "data"
    prepare([write(tmp_path / "a.txt", SMALL)], out, tokenizer="char")

    def killed(path, text):
        raise KeyboardInterrupt  # stands in for the SIGKILL, after train.bin and val.bin are in place

    monkeypatch.setattr(data_module, "atomic_write_text", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare([write(tmp_path / "c.txt", SAME_LENGTH)], out, tokenizer="char")
    with pytest.raises(DataError, match=f"{INTERRUPTED}.*meta.json is missing"):
        TokenData.open(out)


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    """Even when sizes and fingerprints agree (rewritten here to agree), an id the embedding has no
    row for is caught at open, not as an IndexError in the middle of a run."""
    out = tmp_path / "data"
    meta = prepare([write(tmp_path / "a.txt", SMALL)], out, tokenizer="char")
    ids = np.fromfile(out / "train.bin", dtype=np.uint16)
    ids[len(ids) // 2] = meta["vocab_size"]
    ids.tofile(out / "train.bin")
    meta.setdefault("files", {})["train.bin"] = fingerprint(out / "train.bin")
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"{INTERRUPTED}.*token id {meta['vocab_size']}, outside the vocabulary"):
        TokenData.open(out)


def test_prepare_removes_the_temp_files_a_killed_prepare_left(tmp_path):
    out = tmp_path / "data"
    prepare([write(tmp_path / "a.txt", SMALL)], out, tokenizer="char")
    stale = [out / ".train.bin.k2x_9q0z.tmp", out / ".val.bin.0a1b2c3d.tmp", out / ".meta.json.zzzzzzzz.tmp",
             out / ".tokenizer.json.abcdefgh.tmp"]
    kept = [out / ".notes.txt.abcdefgh.tmp", out / ".train.bin.tmp", out / "train.bin.abcdefgh.tmp", out / "mine.tmp"]
    for f in stale + kept:
        f.write_bytes(b"x")
    prepare([write(tmp_path / "b_big.txt", BIG)], out, tokenizer="char")
    assert [f.name for f in stale if f.exists()] == []
    assert [f.name for f in kept if f.exists()] == [f.name for f in kept]  # not atomic_write's, or not prepare's
    assert TokenData.open(out).vocab_size == len(set(BIG))


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_write_respects_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        atomic_write(tmp_path / "b.bin", lambda tmp: np.arange(4, dtype=np.uint16).tofile(tmp))
        # (a writer that makes its own file: safetensors' is 0600 whatever the umask)
        atomic_write(tmp_path / "c.safetensors", lambda tmp: save_file({"w": torch.zeros(2)}, tmp))
        prepare([write(tmp_path / "a.txt", SMALL)], tmp_path / "data", tokenizer="char")
    finally:
        os.umask(old)
    written = [tmp_path / "a.json", tmp_path / "b.bin", tmp_path / "c.safetensors", *(tmp_path / "data").iterdir()]
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in written} == {f.name: oct(mode) for f in written}


def test_unwritable_directory_says_why_and_makes_nothing(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    assert unwritable_directory(tmp_path / "new" / "deeper") is None
    assert not (tmp_path / "new").exists()
    assert unwritable_directory(tmp_path / "f") == f"{tmp_path / 'f'} is a file"
    assert unwritable_directory(tmp_path / "f" / "d") == f"{tmp_path / 'f'} is a file, not a directory"
    monkeypatch.setattr("os.access", lambda path, mode: False)  # (root may write anywhere: the check as others see it)
    assert unwritable_directory(tmp_path / "new") == f"{tmp_path} is not writable"


@pytest.mark.parametrize("mapped", ["0", "1"])
def test_load_weights_holds_the_files_bytes(tmp_path, monkeypatch, mapped):
    # A layout cache's weights.bin as a model runs from it: read into private memory (on huge
    # pages where the kernel gives them) or, with ARLM_MMAP=1, a private map of the file; either
    # way its bytes, in chunks read side by side (a size no whole number of them), writable
    # without touching the file; an empty file is None.
    from arlm.files import huge_pages, load_weights

    monkeypatch.setenv("ARLM_MMAP", mapped)
    data = np.random.default_rng(5).integers(0, 256, (64 << 20) + 4096 + 7, dtype=np.uint8).tobytes()
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    memory = load_weights(path)
    assert len(memory) == len(data) and memory[:] == data
    memory[0] = (data[0] + 1) % 256
    assert path.read_bytes()[:1] == data[:1]
    if mapped == "0" and huge_pages():  # (anonymous: no file behind it)
        assert not any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())
    (tmp_path / "empty.bin").write_bytes(b"")
    assert load_weights(tmp_path / "empty.bin") is None


def test_load_weights_maps_a_file_the_memory_could_not_hold(tmp_path, monkeypatch):
    # ARLM_MMAP=0 asks for a copy, but the copy would not fit in the memory available: the file is
    # mapped (its bytes the same), not read into memory it would not have.
    from arlm import files

    monkeypatch.setenv("ARLM_MMAP", "0")
    monkeypatch.setattr(files, "available_memory", lambda: 1 << 20)
    path = tmp_path / "weights.bin"
    data = bytes(range(256)) * (16 << 10)  # 4 MB
    path.write_bytes(data)
    memory = files.load_weights(path)
    assert memory[:] == data
    assert any(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())
