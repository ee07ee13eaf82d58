"""The second KV tier's bytes: host slots, each one block of every layer's K and V, and the copies between
them and the device caches (``KVTransfers`` from the ``KVTier``, run by the model runner before a step's
kernels: ``run``). A store is made before the runner, from the caches' geometry (``SlotLayout``), and given
to the runner's constructor; the runner hands it its caches at each copy.

* ``HostKVStore``: slots in host memory (on CUDA, page-locked: the driver copies them asynchronously).
* ``FileKVStore``: slots in a memory-mapped file (the CPU's tier: it can hold more than RAM, and a restart
  finds what it holds). Each slot of a cached prefix block has an index record (its hash, token ids, a
  CRC-32 of its bytes); a record is made valid only after its bytes are written, and a slot is invalidated
  before it is rewritten, so a process killed mid-store leaves no valid record over partial bytes. The file's
  header names the model, dtypes and geometry it was written for; a file written for anything else, a
  truncated slot and a slot whose CRC does not match are ignored with a warning, never served.

Layout of a slot: values ``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]`` in the cache's
storage dtype, then for a quantized cache its scales ``[num_layers, 2, block_size, num_kv_heads]`` float32.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rawpaged.dtypes import QuantizedKVType, kv_cache_type
from rawpaged.kernels.kv_cache import QuantizedKVCache

logger = logging.getLogger("rawpaged.kv_offload")


def _layer_arrays(cache) -> tuple:
    """(values, scales or None) of one layer's cache."""
    if isinstance(cache, QuantizedKVCache):
        return cache.data, cache.scales
    return cache, None


@dataclass(frozen=True)
class SlotLayout:
    """What one slot holds: values ``values_shape`` ``[num_layers, 2 (K, V), block_size, num_kv_heads,
    head_dim]`` of ``value_dtype`` (the cache's host storage dtype), then for a quantized cache float32 scales
    ``scales_shape`` ``[num_layers, 2, block_size, num_kv_heads]`` (else None)."""

    values_shape: tuple
    value_dtype: np.dtype
    scales_shape: tuple | None

    @classmethod
    def of(cls, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str):
        """The layout of caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` of ``kv_cache_dtype``, one
        K and one V per layer. Raises ValueError for an unknown ``kv_cache_dtype``."""
        t = kv_cache_type(kv_cache_dtype)
        quantized = isinstance(t, QuantizedKVType)
        values_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        scales_shape = values_shape[:4] if quantized else None
        return cls(values_shape, np.dtype(t.storage if quantized else t.numpy), scales_shape)


class HostKVStore:
    """``num_slots`` host slots of ``layout``, in memory, for the blocks of the runner's caches.

    Args:
        backend: the caches' backend (``to_numpy``/``asarray`` move blocks to and from the host).
        layout: what a slot holds (``SlotLayout``).
        num_slots: slots in the store.
    """

    def __init__(self, backend, layout: SlotLayout, num_slots: int):
        self.backend = backend
        self.num_slots = num_slots
        self.values_shape = layout.values_shape
        self.value_dtype = layout.value_dtype
        self.scales_shape = layout.scales_shape
        self.values, self.scales = self._allocate()

    @staticmethod
    def slot_nbytes(values_shape, value_dtype, scales_shape) -> int:
        """Bytes of one slot: values, then scales (if any)."""
        n = int(np.prod(values_shape)) * np.dtype(value_dtype).itemsize
        return n + (int(np.prod(scales_shape)) * 4 if scales_shape is not None else 0)

    def _allocate(self) -> tuple:
        empty = getattr(self.backend, "host_empty", None) or np.empty
        values = empty((self.num_slots, *self.values_shape), self.value_dtype)
        scales = empty((self.num_slots, *self.scales_shape), np.float32) if self.scales_shape else None
        return values, scales

    # ------------------------------------------------------------------ copies
    def run(self, transfers, key_caches, value_caches) -> None:
        """One step's ``KVTransfers`` between these slots and ``key_caches``/``value_caches`` (the runner's,
        one per layer: arrays or ``QuantizedKVCache``): stores, then loads, then ``after_transfers``."""
        caches = [(_layer_arrays(k), _layer_arrays(v)) for k, v in zip(key_caches, value_caches)]
        self.store(transfers.stores, caches)
        self.load(transfers.loads, caches)
        self.after_transfers()

    def store(self, pairs: list, caches: list) -> None:
        """Device blocks -> host slots, ``pairs`` of ``(block_id, slot)`` (blocks read, nothing changed);
        ``caches``: per layer, ``((values, scales or None), (values, scales or None))`` of K and V."""
        if not pairs:
            return
        blocks, slots = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        self.before_store(slots)
        be = self.backend
        dev_blocks = be.asarray(blocks)
        for layer, pair in enumerate(caches):
            for kv, (values, scales) in enumerate(pair):
                self.values[slots, layer, kv] = be.to_numpy(values[dev_blocks])
                if scales is not None:
                    self.scales[slots, layer, kv] = be.to_numpy(scales[dev_blocks])

    def load(self, pairs: list, caches: list) -> None:
        """Host slots -> device blocks, ``pairs`` of ``(slot, block_id)``; ``caches`` as in ``store``."""
        if not pairs:
            return
        slots, blocks = (np.array(x, dtype=np.int64) for x in zip(*pairs))
        be = self.backend
        dev_blocks = be.asarray(blocks)
        for layer, pair in enumerate(caches):
            for kv, (values, scales) in enumerate(pair):
                values[dev_blocks] = be.asarray(np.ascontiguousarray(self.values[slots, layer, kv]))
                if scales is not None:
                    scales[dev_blocks] = be.asarray(np.ascontiguousarray(self.scales[slots, layer, kv]))

    def before_store(self, slots) -> None:
        """Called with the slots about to be overwritten (a persistent store invalidates them first)."""

    def after_transfers(self) -> None:
        """Called after a step's copies (a persistent store records the prefix slots just stored)."""

    def restore(self, offload) -> None:
        """Register what a persistent store already holds with ``offload`` (nothing here)."""

    def close(self) -> None:
        """Finish pending work (a persistent store flushes its file)."""


# ---------------------------------------------------------------------------------------------- the file
_MAGIC = b"RPKVTIER"
_VERSION = 1
_HEADER_BYTES = 1 << 16
_VALID = 1  # a record's state: state u32, crc32 u32, write sequence u64, block hash u64, token ids i32[block_size]


class FileKVStore(HostKVStore):
    """``HostKVStore`` in a memory-mapped file ``path`` (created, or reopened if it was written for the same
    ``fingerprint``: a JSON-able dict naming the model, dtypes and geometry). The file is allocated in full
    at creation; ``OSError`` (a full disk) propagates, and the caller runs without the tier.

    Args (besides ``HostKVStore``'s):
        path: the file.
        fingerprint: what the slots' bytes depend on besides the tokens.
        slot_info: ``slot_info(slot) -> (kind, block_hash, token_ids)`` of the tier's bookkeeping
            (``OffloadingManager.slot_info``): which stored slots hold prefix blocks, and which.
    """

    def __init__(self, backend, layout: SlotLayout, num_slots: int, path, fingerprint: dict, slot_info):
        self.path = Path(path)
        self.fingerprint = fingerprint
        self.slot_info = slot_info
        self.block_size = block_size = layout.values_shape[2]  # tokens per block: each record keeps them
        self._record = struct.Struct(f"<IIQQ{block_size}i")
        self._lock = threading.Lock()
        self._generation = np.zeros(num_slots, np.int64)
        self._seq = 0
        self._pending: list = []
        self._jobs: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_records, name="kv-offload-writer", daemon=True)
        self.num_ignored = 0  # records dropped at start-up (truncated, corrupted)
        super().__init__(backend, layout, num_slots)
        self._writer.start()

    # ------------------------------------------------------------------ layout
    def _layout(self) -> dict:
        slot = self.slot_nbytes(self.values_shape, self.value_dtype, self.scales_shape)
        return dict(
            version=_VERSION,
            fingerprint=self.fingerprint,
            num_slots=self.num_slots,
            values_shape=list(self.values_shape),
            value_dtype=self.value_dtype.str,
            scales_shape=list(self.scales_shape) if self.scales_shape else None,
            slot_bytes=slot,
            record_bytes=self._record.size,
        )

    def _allocate(self) -> tuple:
        layout = self._layout()
        header = json.dumps(layout, sort_keys=True).encode()
        if len(header) + 12 > _HEADER_BYTES:
            raise ValueError("KV offload header too large")
        index_bytes = self.num_slots * self._record.size
        self._data_offset = _HEADER_BYTES + -(-index_bytes // 4096) * 4096
        total = self._data_offset + self.num_slots * layout["slot_bytes"]
        reuse = self._readable_for(header)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "r+b" if reuse else "w+b") as f:
            self._old_size = os.fstat(f.fileno()).st_size if reuse else 0
            if not reuse:
                f.write(_MAGIC + struct.pack("<I", len(header)) + header)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(f.fileno(), 0, total)  # the space now, not a SIGBUS on a full disk later
            else:  # pragma: no cover
                f.truncate(total)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(total,))
        self._index = self._mm[_HEADER_BYTES : _HEADER_BYTES + index_bytes]
        if not reuse:
            self._index[:] = 0
        slot = layout["slot_bytes"]
        data = self._mm[self._data_offset :].reshape(self.num_slots, slot)
        nv = int(np.prod(self.values_shape)) * self.value_dtype.itemsize
        values = data[:, :nv].view(self.value_dtype).reshape(self.num_slots, *self.values_shape)
        scales = None
        if self.scales_shape:
            scales = data[:, nv:].view(np.float32).reshape(self.num_slots, *self.scales_shape)
        self._slot_bytes = data
        return values, scales

    def _readable_for(self, header: bytes) -> bool:
        """Whether ``path`` is a tier file written for this very header (else it is replaced, with a
        warning when it exists)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(12)
                if len(head) < 12 or head[:8] != _MAGIC:
                    raise ValueError("not a rawpaged KV offload file")
                (n,) = struct.unpack("<I", head[8:12])
                theirs = f.read(n)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as e:
            logger.warning("KV offload file %s ignored and replaced: %s", self.path, e)
            return False
        if theirs != header:
            try:
                what = json.loads(theirs).get("fingerprint")
            except ValueError:
                what = "an unreadable header"
            logger.warning(
                "KV offload file %s was written for %s, not %s: ignored and replaced", self.path, what, self.fingerprint
            )
            return False
        return True

    def _record_at(self, slot: int) -> np.ndarray:
        return self._index[slot * self._record.size : (slot + 1) * self._record.size]

    # ------------------------------------------------------------------ writes
    def before_store(self, slots) -> None:
        with self._lock:
            for slot in slots:
                self._generation[slot] += 1
                self._record_at(int(slot))[:4] = 0  # state: invalid, before the bytes change
        self._pending.extend(int(s) for s in slots)

    def after_transfers(self) -> None:
        for slot in self._pending:
            kind, block_hash, token_ids = self.slot_info(slot)
            if kind == "prefix":
                self._seq += 1
                self._jobs.put((slot, int(self._generation[slot]), self._seq, block_hash, token_ids))
        self._pending = []

    def _write_records(self) -> None:
        """The writer thread: a CRC-32 of each stored slot, then its record (valid last)."""
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            slot, generation, seq, block_hash, token_ids = job
            with self._lock:
                if self._generation[slot] == generation:  # not rewritten since
                    crc = zlib.crc32(self._slot_bytes[slot])
                    rec = self._record_at(slot)
                    body = self._record.pack(0, crc, seq, block_hash, *token_ids)
                    rec[4:] = np.frombuffer(body, np.uint8)[4:]
                    rec[:4] = np.frombuffer(struct.pack("<I", _VALID), np.uint8)
            self._jobs.task_done()

    def flush(self) -> None:
        """Wait for the records in flight and write the file's dirty pages."""
        self._jobs.join()
        self._mm.flush()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._writer.join(timeout=10)

    # ------------------------------------------------------------------ restart
    def restore(self, offload) -> None:
        """Register the slots that hold valid, whole, uncorrupted prefix blocks with ``offload`` (oldest
        first, so LRU order survives); the rest are invalidated, with one warning."""
        found, bad = [], 0
        for slot in range(self.num_slots):
            state, crc, seq, block_hash, *tokens = self._record.unpack(self._record_at(slot).tobytes())
            if state != _VALID:
                continue
            end = self._data_offset + (slot + 1) * self._slot_bytes.shape[1]
            if end > self._old_size or zlib.crc32(self._slot_bytes[slot]) != crc:
                self._record_at(slot)[:4] = 0
                bad += 1
                continue
            found.append((seq, slot, block_hash, tuple(tokens)))
        for seq, slot, block_hash, tokens in sorted(found):
            offload.restore_prefix(slot, block_hash, tokens)
            self._seq = max(self._seq, seq)
        self.num_ignored = bad
        if bad:
            logger.warning("KV offload file %s: %d truncated or corrupted blocks ignored", self.path, bad)
        if found:
            logger.info("KV offload file %s: %d cached blocks found", self.path, len(found))
