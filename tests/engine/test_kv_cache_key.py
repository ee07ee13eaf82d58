"""The KV cache key names every setting that changes KV values: changing any one field alone changes its
digest (so the prefix hashes' root and the tier file's name), and equal settings give equal digests."""

from __future__ import annotations

import dataclasses

import pytest

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.engine.kv_cache_key import KVCacheKey, kv_cache_key

BASE = dict(dtype="float32", quantization=None, kv_cache_dtype="float32", block_size=16, backend="cpu")
CHANGES = {
    "model": "another model's files",
    "dtype": "bfloat16",
    "quantization": "q8_0",
    "kv_cache_dtype": "int8",
    "block_size": 8,
    "backend": "cuda",
}


def test_every_field_has_a_change_case():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(KVCacheKey)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_one_field_alone_changes_the_digest_and_the_prefix_root(field):
    a = KVCacheKey(model="m", **BASE)
    b = dataclasses.replace(a, **{field: CHANGES[field]})
    assert a.digest != b.digest
    roots = [KVCacheManager(8, 4, enable_prefix_caching=True, cache_keys=(k.digest,)).root_hash for k in (a, b)]
    assert roots[0] != roots[1]


def test_equal_settings_give_equal_digests_and_the_model_is_named_by_its_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text('{"x": 1}')
    ka, ka2 = (kv_cache_key(tmp_path / "a", **BASE) for _ in range(2))
    assert ka == ka2 and ka.digest == ka2.digest
    assert kv_cache_key(tmp_path / "b", **BASE).digest != ka.digest
    # by contents where blocks outlive the engine: a copy of the same files is the same model
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{}")
    cache = tmp_path / "fingerprints.json"
    by_content = [kv_cache_key(tmp_path / d, **BASE, fingerprint_cache=cache).model for d in "acb"]
    assert by_content[0] == by_content[1] != by_content[2]
