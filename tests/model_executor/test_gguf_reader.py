"""The loader's GGUF reader (``gguf_reader.fast_reader_class``) parses every field and tensor exactly as
the ``gguf`` library's own ``GGUFReader`` does: same keys, types, parts, indices, contents and tensor
bytes, on a file with every metadata type (numbers, strings, arrays of each, an empty array) and on the
shipped SmolLM2 GGUF with its 49,152-piece vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged.model_executor.gguf_loader import open_reader
from rawpaged.model_executor.gguf_reader import fast_reader_class

gguf = pytest.importorskip("gguf")  # absent on some hosts (the GPU host has no package index)


def assert_same(path):
    ours, theirs = fast_reader_class(gguf)(str(path)), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), key
        assert got.contents() == want.contents(), key
        assert len(got.parts) == len(want.parts), key
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.n_bytes, a.data_offset) == (b.tensor_type, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_every_metadata_type_parses_as_the_library_parses_it(tmp_path):
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int64("t.i64", -3)
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", -1e300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ world")
    w.add_array("t.tokens", ["a", "", "▁b", "日本", "<0x0A>"])
    w.add_array("t.scores", [0.5, -1000.0, 3.25])
    w.add_array("t.types", [1, 3, 4, 6])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("x", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("y", rng.standard_normal(17).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same(path)
    reader = open_reader(path)
    assert reader.fields["t.tokens"].contents() == ["a", "", "▁b", "日本", "<0x0A>"]
    assert reader.fields["t.scores"].contents() == [0.5, -1000.0, 3.25]


def test_shipped_gguf_parses_as_the_library_parses_it(model_dir):
    path = model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not prepared")
    assert_same(path)
