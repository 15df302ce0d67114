"""arlm's GGUF reader (loading.gguf._reader) reads metadata arrays in bulk where gguf's reader
takes each element as a field of its own: every field must read as gguf reads it, and a damaged
array must fail as a load error, not read past the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from arlm.loading import LoadError
from arlm.loading.gguf import _reader, open_gguf


def _same_fields(path) -> int:
    want, got = gguf.GGUFReader(str(path)), _reader(path)
    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert got.fields[key].types == field.types, key
        a, b = field.contents(), got.fields[key].contents()
        assert type(b) is type(a) and b == a, key
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in got.tensors] == \
        [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in want.tensors]
    return len(want.fields)


def test_every_kind_of_field_reads_as_gguf_reads_it(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "fields.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("t.string", "héllo")
    w.add_uint32("t.u32", 7)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_array("t.strings", ["", "a", "ß€𝄞", " spaced ", "<0x0A>"] + [f"tok{i}" for i in range(300)])
    w.add_array("t.empty", [])
    w.add_array("t.ints", [int(v) for v in rng.integers(-2**31, 2**31, 257)])
    w.add_array("t.floats", [float(v) for v in rng.standard_normal(100).astype(np.float32)])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("x", rng.standard_normal((4, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _same_fields(path) > 10


def test_a_shipped_files_fields_read_as_gguf_reads_them(smollm2_path):
    assert _same_fields(smollm2_path) > 20  # (its 49,152 tokens and 48,900 merges among them)


def test_an_array_cut_short_is_a_load_error(tmp_path):
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"token number {i}" for i in range(1000)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(LoadError, match="not a valid GGUF file"):
        open_gguf(path)
