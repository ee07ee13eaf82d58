"""A model's fingerprint: a SHA-256 over the bytes of the files its weights and configuration come from.
It names what KV blocks of the model depend on, so a persistent KV tier written for one model is never
served to another (``rawpaged.model_executor.kv_offload_store``).

Hashing a model reads all of it (for the default model, 636 MB: about 2 s); the result is remembered in a
small JSON file next to the tier, keyed by each file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

#: the files a model directory's KV depends on (weights, configuration, tokenizer: token ids)
_PATTERNS = ("*.safetensors", "*.gguf", "*.json")
_CHUNK = 1 << 22


def _files(path: Path) -> list:
    if path.is_file():
        return [path]
    found = {p for pattern in _PATTERNS for p in path.glob(pattern)}
    return sorted(p for p in found if p.is_file() and not p.name.startswith("."))


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()


def model_stat_identity(model_path) -> str:
    """A hex SHA-256 over the resolved path, name, size and modification time of each of ``model_path``'s
    files: cheap (no file is read), it tells files apart on one machine but not copies of them."""
    model_path = Path(model_path).resolve()
    total = hashlib.sha256(str(model_path).encode())
    for f in _files(model_path):
        st = f.stat()
        total.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return total.hexdigest()


def model_fingerprint(model_path, cache_file=None) -> str:
    """The hex SHA-256 of ``model_path`` (a model directory or a ``.gguf`` file): over each file's name and
    contents, in name order. ``cache_file``: a JSON file remembering each file's digest by (path, size,
    mtime); written back when it learnt something. Raises OSError if a file cannot be read."""
    model_path = Path(model_path).resolve()
    cache = {}
    if cache_file is not None:
        try:
            cache = json.loads(Path(cache_file).read_text())
        except (OSError, ValueError):
            cache = {}
    total, learnt = hashlib.sha256(), False
    for f in _files(model_path):
        st = f.stat()
        key = f"{f}:{st.st_size}:{st.st_mtime_ns}"
        if key not in cache:
            cache[key] = _digest(f)
            learnt = True
        total.update(f"{f.name}\0{cache[key]}\n".encode())
    if cache_file is not None and learnt:
        tmp = Path(f"{cache_file}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, cache_file)
    return total.hexdigest()
