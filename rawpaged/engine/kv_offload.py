"""An engine's second KV tier, put together: its bookkeeping (``core.kv_offload.OffloadingManager``, for the
``core.kv_tier.KVTier`` beside the pool) and its bytes (``model_executor.kv_offload_store``, given to the model
runner's constructor). Both are made before the pool and the runner, so a tier that cannot be made is never
half attached: the engine runs without it.

``--kv-offloading-size GiB`` sizes it in blocks of the pool's size. On CUDA the slots are page-locked host
memory; on the CPU a memory-mapped file, in ``--kv-offload-dir`` (kept: a restart finds the cached prefixes,
every newly cached block is written through) or a temporary file (removed on close).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

from rawpaged.core.kv_offload import OffloadingManager
from rawpaged.model_executor.kv_offload_store import FileKVStore, HostKVStore, SlotLayout

logger = logging.getLogger("rawpaged.engine")


def fingerprint_dir(config) -> Path | None:
    """The directory of a persistent tier (``kv_offload_dir``, made if missing), where the model's content
    fingerprints are remembered too; None without one."""
    if config.kv_offloading_size is None or config.kv_offload_dir is None:
        return None
    directory = Path(config.kv_offload_dir).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class KVOffload:
    """The tier of one engine.

    Attributes:
        manager: the slots' bookkeeping (``OffloadingManager``).
        store: the slots' bytes (``HostKVStore``, or ``FileKVStore`` over ``path``), a persistent store's
            blocks already registered in ``manager``.
        persistent: whether the file outlives the engine (then every newly cached block is written through).
    """

    def __init__(self, manager: OffloadingManager, store: HostKVStore, path: Path | None, persistent: bool):
        self.manager = manager
        self.store = store
        self.path = path
        self.persistent = persistent

    @classmethod
    def from_config(cls, config, backend, key, block_bytes: int, geometry: dict, kv_cache_dtype: str):
        """The tier ``config`` asks for (``kv_offloading_size``), or None. ``key``: the engine's
        ``KVCacheKey`` (a persistent file is named by its digest and keeps it in its header); ``geometry``:
        the KV shapes its blocks have (``num_layers``, ``num_kv_heads``, ``head_dim``), of ``kv_cache_dtype``
        and ``config.block_size`` tokens. Also None, with a warning, when the file cannot be made (e.g. on a
        full disk). Raises ValueError when the size holds no block."""
        if config.kv_offloading_size is None:
            return None
        num_slots = int(config.kv_offloading_size * 2**30) // block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV block of {block_bytes} bytes"
            )
        manager = OffloadingManager(num_slots)
        g = geometry
        layout = SlotLayout.of(g["num_layers"], config.block_size, g["num_kv_heads"], g["head_dim"], kv_cache_dtype)
        path, persistent = None, False  # CUDA: page-locked host memory
        if backend.name == "cpu":
            persistent = config.kv_offload_dir is not None
            path = fingerprint_dir(config) / f"kv-{key.digest[:16]}.bin" if persistent else _temporary_path()
        try:
            if path is None:
                store = HostKVStore(backend, layout, num_slots)
            else:
                fingerprint = dict(geometry, **key.as_dict())
                store = FileKVStore(backend, layout, num_slots, path, fingerprint, manager.slot_info)
        except OSError as e:
            logger.warning("second KV tier disabled: cannot make %s (%s)", path, e)
            return None
        store.restore(manager)
        where = f"file {path}" if path is not None else "page-locked host memory"
        logger.info("second KV tier: %d blocks in %s", num_slots, where)
        return cls(manager, store, path, persistent)

    def stats(self) -> dict:
        """Blocks held and counters (``OffloadStats``)."""
        m = self.manager
        return dict(
            num_slots=m.num_slots,
            num_prefix_blocks=m.num_prefix_blocks,
            num_swap_blocks=m.num_swap_blocks,
            num_free_slots=m.num_free_slots,
            **asdict(m.stats),
        )

    def close(self) -> None:
        """Flush the store (pending records, dirty pages); a temporary file is removed."""
        self.store.close()
        if self.path is not None and not self.persistent:
            self.path.unlink(missing_ok=True)


def _temporary_path() -> Path:
    """A fresh name for a temporary tier file (the store makes the file)."""
    fd, name = tempfile.mkstemp(prefix="rawpaged-kv-", suffix=".bin")
    os.close(fd)
    os.unlink(name)
    return Path(name)
