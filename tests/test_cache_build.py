"""The first quantized load of a GGUF file: built into the kernel-layout cache a weight at a time
(`arlm.loading._build_cache`, `cache.Builder`), then loaded from it as every later run is.

Reference: the model the in-memory path builds (`quantized_model` + `prepare`, each matrix
converted whole, as before the streaming build), compared tensor by tensor, bit for bit, and by
its logits (equal). The streamed build converts in chunks of a few rows here (`_CHUNK_WEIGHTS`
made small) so that every kind's chunks, and chunks across a fused weight's parts, are exercised.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from arlm.loading import LoadError, cache, load_quantized_gguf
from arlm.loading import gguf_layers as gguf_loading
from arlm.quant import (Int8Linear, KQuantLinear, Q4Linear, Q5Linear, Q8Linear, QuantizedEmbedding, QuantizedLinear,
                        SplitLinear, prepare)

from conftest import hf_llama
from cpu_flags import packed_expected

needs_packed = pytest.mark.skipif(not packed_expected(),
                                  reason="this CPU has no AVX-512 VNNI (or ARLM_MARCH built for one without)")

# Two files of a Llama (q/k rows permuted in the file: the un-permuted copies), every kind the
# loader keeps as stored and one it re-quantizes (Q5_1): fused weights of one kind (rows stacked
# across parts, Q8_0 beside widened Q5_0 and Q4_0) and of several (SplitLinear), a float table
# and an untied head, a K-quant table the tied head shares.
FILES = {
    "untied": dict(tie=False, kquant={
        "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q5_0",
        "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q5_1", "output.weight": "Q8_0"},
        layers={KQuantLinear, SplitLinear, Q5Linear, Q4Linear, Int8Linear, Q8Linear, torch.nn.Embedding}),
    "tied": dict(tie=True, kquant={
        "attn_q.weight": "Q8_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q4_0", "attn_output.weight": "Q6_K",
        "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q4_K", "token_embd.weight": "Q6_K"},
        layers={KQuantLinear, SplitLinear, Q8Linear, QuantizedEmbedding}),
    # 200 rows in the table and the head, no whole tiles of 16: a K-quant table in the row layout
    # (float32 scales), a Q8_0 head's chunks left unpacked (the last could not pack)
    "ragged": dict(tie=False, vocab=200, kquant={
        "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q4_K", "attn_output.weight": "Q8_0",
        "ffn_gate.weight": "Q5_K", "ffn_up.weight": "Q5_K", "ffn_down.weight": "Q6_K", "output.weight": "Q8_0",
        "token_embd.weight": "Q4_K"},
        layers={KQuantLinear, Q8Linear, Q4Linear, QuantizedEmbedding}),
}


@pytest.fixture(scope="module", params=list(FILES))
def gguf_file(request, tmp_path_factory):
    from gguf_writer import write_gguf

    spec = FILES[request.param]
    hf = hf_llama(seed=41, n_head=4, n_kv_heads=2, hidden_size=256, intermediate_size=512,
                  vocab_size=spec.get("vocab", 208), tie=spec["tie"])
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", kquant=spec["kquant"])


def _in_memory(path):
    """The in-memory path: every matrix converted whole, then prepared."""
    _, model, requantized = gguf_loading.quantized_model(path)
    return prepare(model), requantized


def _assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Module by module: the same kinds, layouts and tensors (dtype, shape, bytes), the same ties."""
    mods = dict(want.named_modules(remove_duplicate=False))
    got_mods = dict(got.named_modules(remove_duplicate=False))
    assert got_mods.keys() == mods.keys()
    for name, m in got_mods.items():
        w = mods[name]
        assert type(m) is type(w), name
        if isinstance(m, QuantizedLinear):
            assert (m.in_features, m.out_features, m.int8_activations, m.packed, getattr(m, "kind", None)) == \
                (w.in_features, w.out_features, w.int8_activations, w.packed, getattr(w, "kind", None)), name
            for a, b in zip(m.tensors(), w.tensors(), strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
        for pname, p in m.named_parameters(recurse=False):
            q = getattr(w, pname)
            assert p.dtype == q.dtype and torch.equal(p, q), f"{name}.{pname}"
    if isinstance(want.tok_emb, QuantizedEmbedding):
        assert (got.tok_emb.table is got.lm_head) == (want.tok_emb.table is want.lm_head)
    else:
        assert (got.lm_head.weight is got.tok_emb.weight) == (want.lm_head.weight is want.tok_emb.weight)


def _leftovers(root):
    models = root / "models"
    return sorted(p.name for p in models.iterdir() if p.is_dir()) if models.exists() else []


def test_the_streamed_build_is_the_in_memory_model(gguf_file, tmp_path, monkeypatch):
    want, requantized = _in_memory(gguf_file)
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    monkeypatch.setattr(gguf_loading, "_CHUNK_WEIGHTS", 48 * 256)  # 48 rows of 256 (16 of 512) a chunk
    loaded = load_quantized_gguf(gguf_file)
    _assert_same_model(loaded.model, want)
    assert loaded.requantized == requantized
    assert (requantized != []) == (gguf_file.stem == "untied")  # (Q5_1 has no kernel: int8 rows)
    if packed_expected():  # (what the file is there to cover; elsewhere every K-quant is in the row layout)
        assert FILES[gguf_file.stem]["layers"] <= {type(m) for m in loaded.model.modules()}
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        assert torch.equal(loaded.model(ids), want(ids))
    # the cache holds it: one directory, the three files, no temporary left; loaded again from it
    (directory,) = _leftovers(tmp_path)
    assert not directory.count(".tmp")
    assert {p.name for p in (tmp_path / "models" / directory).iterdir()} == {"manifest.json", "weights.bin",
                                                                              "tokenizer.json"}
    again = load_quantized_gguf(gguf_file)
    _assert_same_model(again.model, want)


def test_a_first_load_parses_the_file_once(gguf_file, tmp_path, monkeypatch):
    """A file never loaded is parsed while its bytes are hashed, and that parse builds the cache
    (once); a copy at a new path is found in the cache by its hash; a path remembered is not parsed."""
    import shutil

    import arlm.loading as loading

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    opened, real = [], loading.open_gguf
    monkeypatch.setattr(loading, "open_gguf", lambda p: opened.append(p) or real(p))
    first = load_quantized_gguf(gguf_file)
    assert opened == [gguf_file]
    copy = tmp_path / "copy.gguf"
    shutil.copy(gguf_file, copy)
    again = load_quantized_gguf(copy)  # (its tokenizer from the cache's tokenizer.json; the first load's is the built one)
    _assert_same_model(again.model, first.model)
    text = "Hello, wörld! 12345 <s>\n\tend"
    assert again.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert (again.tokenizer.bos_id, again.tokenizer.eos_ids) == (first.tokenizer.bos_id, first.tokenizer.eos_ids)
    assert len(_leftovers(tmp_path)) == 1
    parsed = len(opened)
    load_quantized_gguf(copy)
    assert len(opened) == parsed


def test_a_new_build_sweeps_what_nothing_will_read(gguf_file, tmp_path, monkeypatch):
    """Caches of file versions no longer anywhere (deleted, or rewritten in place), of an older
    format, and stale temporary builds go when a new cache is written; a cache whose content
    another path still has (found by hash), a build in progress (a temporary directory with a
    fresh file), a newer arlm's format and what arlm did not name stay."""
    import json
    import os
    import shutil
    import time

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "models"
    a, b, e = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "e.gguf"

    def copy(path, tail: int = 0) -> None:  # (other bytes at the end: another hash, another build)
        shutil.copy(gguf_file, path)
        with open(path, "ab") as f:
            f.write(b"\0" * tail)

    def built_dirs() -> set:
        return {d for d in root.iterdir() if d.name.endswith(f"-v{cache.FORMAT}")}

    copy(a)
    load_quantized_gguf(a)
    (built,) = built_dirs()
    copy(b)
    load_quantized_gguf(b)  # the same content: found by hash, loaded from the directory a built
    a.unlink()
    copy(e, 16)
    load_quantized_gguf(e)
    (rewritten,) = built_dirs() - {built}
    copy(e, 48)  # e rewritten in place: its old version's directory is read by nothing now

    def fake(name: str, source: str | None = None, age_s: float = 0.0, fresh_file: bool = False):
        d = root / name
        d.mkdir()
        if source is not None:
            (d / "manifest.json").write_text(json.dumps({"source": source}))
        if fresh_file:
            (d / "weights.bin").write_bytes(b"being written")
        os.utime(d, (time.time() - age_s, time.time() - age_s))
        return d

    h = "0123456789abcdef" * 2
    gone = [rewritten, fake(f"{'1' * 32}-packed-v{cache.FORMAT}", source=str(tmp_path / "deleted.gguf")),
            fake(f"{'2' * 32}-packed-v{cache.FORMAT - 1}", source=str(tmp_path / "old.gguf")),
            fake(f"{'3' * 32}-packed-v{cache.FORMAT}.tmpold", age_s=2 * cache.STALE_BUILD_S)]
    stay = [built, fake(f"{'4' * 32}-packed-v{cache.FORMAT}.tmpnew"),
            fake(f"{'6' * 32}-packed-v{cache.FORMAT}.tmpslow", age_s=2 * cache.STALE_BUILD_S, fresh_file=True),
            fake(f"{h}-packed-v{cache.FORMAT + 1}", source=str(tmp_path / "deleted.gguf")),
            fake("llava-v1.5-7b", age_s=2 * cache.STALE_BUILD_S), fake("data.tmp", age_s=2 * cache.STALE_BUILD_S),
            fake(f"{'5' * 32}-packed-v{cache.FORMAT}"),  # (no manifest yet: unreadable, left)
            fake(f"{'7' * 32}-packed-v{cache.FORMAT}", source="relative/old.gguf")]  # (a path as given: unknown)
    assert sorted(cache.evict_orphans(root)) == sorted(gone)
    assert all(d.exists() for d in stay) and not any(d.exists() for d in gone)
    assert not any(str(a) in stamp for stamp in json.loads((root / "index.json").read_text()))

    b.unlink()  # now nothing has the built directory's content: the next build sweeps it
    c, d = tmp_path / "c.gguf", tmp_path / "d.gguf"
    copy(c, 32)
    copy(d, 64)
    monkeypatch.setenv("ARLM_CACHE_SWEEP", "0")  # (off: the build leaves the orphan)
    load_quantized_gguf(c)
    assert built.exists()
    monkeypatch.delenv("ARLM_CACHE_SWEEP")
    load_quantized_gguf(d)
    assert not built.exists() and len(built_dirs()) == 4  # c's, d's, and the two fakes without a readable source


@needs_packed
def test_store_leaves_meta_tensors_and_writes_each_once(gguf_file, tmp_path, monkeypatch):
    # Each weight is written as it comes and let go: what the model keeps is meta tensors (no
    # memory), and weights.bin is the weights' bytes, each once, at 64-byte boundaries.
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    stored = []
    real_store = cache.Builder.store

    def store(self, weight):
        out = real_store(self, weight)
        tensors = [out] if isinstance(out, torch.Tensor) else list(out.parameters()) + list(out.buffers())
        assert tensors and all(t.is_meta for t in tensors)
        stored.extend(tensors)
        return out

    monkeypatch.setattr(cache.Builder, "store", store)
    load_quantized_gguf(gguf_file)
    size = sum(-(-t.numel() * t.element_size() // 64) * 64 for t in {id(t): t for t in stored}.values())
    (directory,) = _leftovers(tmp_path)
    assert (tmp_path / "models" / directory / "weights.bin").stat().st_size == size


def test_a_failure_midway_leaves_nothing(gguf_file, tmp_path, monkeypatch):
    # An error after some weights were written: raised as it is, no directory (temporary or
    # final) left in the cache; a truncated file: the LoadError, nothing left either.
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path))
    real = gguf_loading._quantized_layer
    calls = []

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("a failure midway")
        return real(*args)

    monkeypatch.setattr(gguf_loading, "_quantized_layer", failing)
    with pytest.raises(RuntimeError, match="a failure midway"):
        load_quantized_gguf(gguf_file)
    assert _leftovers(tmp_path) == []
    monkeypatch.setattr(gguf_loading, "_quantized_layer", real)

    data = gguf_file.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:len(data) * 2 // 3])
    with pytest.raises(LoadError, match="truncated"):
        load_quantized_gguf(truncated)
    assert _leftovers(tmp_path) == []


def test_an_unwritable_cache_builds_in_memory(gguf_file, tmp_path, monkeypatch):
    # ARLM_CACHE under a file: no cache directory can be made; the model is built in memory, the
    # same. A write failing midway (a full disk): the attempt removed, the model built in memory.
    want, requantized = _in_memory(gguf_file)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "file" / "cache"))
    loaded = load_quantized_gguf(gguf_file)
    _assert_same_model(loaded.model, want)
    assert loaded.requantized == requantized and loaded.tokenizer is not None

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "full"))
    real_write, writes = cache.Builder._write, []

    def write(self, t):
        writes.append(1)
        if len(writes) == 7:
            raise OSError(28, "No space left on device")
        return real_write(self, t)

    monkeypatch.setattr(cache.Builder, "_write", write)
    loaded = load_quantized_gguf(gguf_file)
    _assert_same_model(loaded.model, want)
    assert len(writes) == 7 and _leftovers(tmp_path / "full") == []


def test_the_progress_bar_shows_on_a_terminal_only(gguf_file, tmp_path, monkeypatch, capfd):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "quiet"))
    load_quantized_gguf(gguf_file)
    assert capfd.readouterr().err == ""  # (stderr is not a terminal under pytest)

    monkeypatch.setenv("ARLM_CACHE", str(tmp_path / "terminal"))
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    load_quantized_gguf(gguf_file)
    shown = terminal.getvalue()
    assert f"building the kernel layout of {gguf_file.name} (first load)" in shown
    load_quantized_gguf(gguf_file)  # (from the cache: no bar)
    assert terminal.getvalue() == shown
