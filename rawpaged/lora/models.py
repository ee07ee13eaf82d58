"""The adapters an engine knows, where their weights are, and the slots a step computes with (vLLM's
``LoRAModelManager``).

Three places, as in S-LoRA (Sheng et al., 2023): every registered adapter (``register``: checked from its
config and the weights file's header, nothing loaded) may have a host copy (``adapter_cache``: at most
``max_cpu_loras``, read on a worker thread); an adapter a running request uses is resident in pages of the
KV block pool (``rawpaged.core.adapter_pages`` hands out the block ids, ``page_store`` lays the weights out in
them); and a step's adapters (at most ``max_loras``) sit in the slots the kernels read. Per adapted linear of
the base model the slots' weights are stacked, ``lora_a [max_loras, max_lora_rank, in]`` and
``lora_b [max_loras, out, max_lora_rank]`` (an adapter of a lower rank fills its first ``rank`` rows and
columns; ``ranks`` says how many, 0 where it does not adapt that linear), so that one kernel call per linear
serves every adapter of the step (``punica.PunicaWrapper``). A slot is filled from the adapter's pages
(``activate`` with ``pages``) when the adapter enters it, and taken back from the least recently used
adapter the step does not need.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from rawpaged.lora import page_store
from rawpaged.lora.adapter_cache import CPUAdapterCache
from rawpaged.lora.lora_model import LoRAAdapterSpec, LoRAModel, module_shapes
from rawpaged.lora.request import LoRARequest


class LoRAModelManager:
    """Args:
        model_config: the base model's ``ModelConfig``.
        max_loras: adapters one step may use (slots); >= 1.
        max_lora_rank: the highest rank an adapter may have (vLLM's default 16).
        max_cpu_loras: host copies kept at most (None: every registered adapter's); >= ``max_loras``.
        load_in_background: read adapters' files on a worker thread (``ready`` never blocks), else at once.

    Attributes:
        lora_a, lora_b: ``{(layer, module): float32 stack}`` (see the module doc) for every linear an
            adapter may target (mixture-of-experts layers' MLPs excluded).
        ranks: ``{(layer, module): int32 [max_loras]}``, each slot's rank on that linear (0: not adapted).
        scales: float32 ``[max_loras]``, each slot's ``LoRAModel.scaling``.
        specs: ``{lora_int_id: LoRAAdapterSpec}`` of the registered adapters.
        cpu_cache: the host copies (``CPUAdapterCache``).
        pages: the pool's byte views (``page_store.PoolPages``) once ``attach_pages`` gave them, else None.

    Raises ValueError for ``max_loras`` or ``max_lora_rank`` below 1, or ``max_cpu_loras`` below ``max_loras``.
    """

    def __init__(
        self,
        model_config,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        load_in_background: bool = False,
    ):
        for field, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.model_config = model_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self._allocate_slots(module_shapes(model_config))
        self.specs: dict[int, LoRAAdapterSpec] = {}
        self.cpu_cache = CPUAdapterCache(self._load, max_cpu_loras, load_in_background)
        self.pages: page_store.PoolPages | None = None
        self._digests: dict[int, str] = {}  # lora_int_id -> LoRAModel.digest, from its first load
        self._written: dict[int, int] = {}  # lora_int_id -> the page epoch its weights were written in
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._slot_epoch: dict[int, int | None] = {}  # slot -> the page epoch it was filled from
        self.num_loads = 0  # adapters copied into a slot

    def _allocate_slots(self, shapes: dict) -> None:
        n, r = self.max_loras, self.max_lora_rank
        self.lora_a, self.lora_b, self.ranks = {}, {}, {}
        for layer, moe in enumerate(self.model_config.moe_layers):
            for module, (fan_in, fan_out) in shapes.items():
                if moe and module in ("gate_proj", "up_proj", "down_proj"):
                    continue
                key = (layer, module)
                self.lora_a[key] = np.zeros((n, r, fan_in), np.float32)
                self.lora_b[key] = np.zeros((n, fan_out, r), np.float32)
                self.ranks[key] = np.zeros(n, np.int32)
        self.scales = np.zeros(n, np.float32)

    def _load(self, request: LoRARequest) -> LoRAModel:
        return LoRAModel.from_local_checkpoint(request, self.model_config, self.max_lora_rank)

    # ------------------------------------------------------------------ registry
    def register(self, request: LoRARequest) -> LoRAAdapterSpec:
        """Check ``request``'s adapter from its config and weights header (``LoRAAdapterSpec``; no tensor is
        read) and register it, unless its id is registered already; returns its spec. Raises ValueError
        (naming the adapter and the field) for an adapter that cannot be loaded, or an id registered for
        another name or path."""
        known = self.specs.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is already the "
                    f"id of adapter {known.request.lora_name!r} ({known.request.lora_path})"
                )
            return known
        spec = LoRAAdapterSpec.from_local_checkpoint(request, self.model_config, self.max_lora_rank)
        self.specs[request.lora_int_id] = spec
        return spec

    def add_adapter(self, request: LoRARequest) -> LoRAModel:
        """``register`` ``request``'s adapter and load it on this thread (kept as a host copy); returns the
        ``LoRAModel``. Raises ValueError as ``register`` and ``LoRAModel.from_local_checkpoint``."""
        self.register(request)
        return self._host_model(request.lora_int_id)

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter (its host copy and slot); False if it is unknown. Its pool pages are the
        scheduler's: the caller evicts them (``LLMEngine.remove_lora`` does both)."""
        slot = self._resident.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)
        self.cpu_cache.discard(lora_int_id)
        self._written.pop(lora_int_id, None)
        self._digests.pop(lora_int_id, None)
        return self.specs.pop(lora_int_id, None) is not None

    def list_adapters(self) -> dict:
        """``{lora_int_id: LoRARequest}`` of the registered adapters."""
        return {i: s.request for i, s in self.specs.items()}

    @property
    def adapters(self) -> dict:
        """``{lora_int_id: LoRAModel}`` of the host copies now."""
        self.cpu_cache.poll()
        return dict(self.cpu_cache._models)

    # ------------------------------------------------------------------ the scheduler's view
    def ready(self, lora_int_id: int, load: bool = True) -> bool:
        """Whether the registered adapter's weights are on the host (its pages can be written); if not and
        ``load``, its load is asked for (on the worker with ``load_in_background``). Raises KeyError for an
        id that is not registered."""
        spec = self.specs[lora_int_id]
        if lora_int_id in self.cpu_cache:
            return lora_int_id in self._digests or self._note_digest(lora_int_id)
        if not load:
            return False
        self.cpu_cache.request(spec.request)
        return lora_int_id in self.cpu_cache and self._note_digest(lora_int_id)

    def _note_digest(self, lora_int_id: int) -> bool:
        self._digests[lora_int_id] = self.cpu_cache.get(lora_int_id).digest
        return True

    def num_pages(self, lora_int_id: int) -> int:
        """Pool blocks the adapter's weights take: ``ceil(4 * num_floats / block bytes)``. Raises KeyError
        for an id that is not registered, RuntimeError before ``attach_pages``."""
        if self.pages is None:
            raise RuntimeError("LoRA pages: the pool is not attached (attach_pages)")
        return self.pages.num_pages(4 * self.specs[lora_int_id].num_floats)

    def lora_key(self, lora_int_id: int) -> str:
        """The adapter's content digest (``LoRAModel.digest``, known once ``ready``)."""
        return self._digests[lora_int_id]

    def take_failed_loads(self) -> dict:
        """``{lora_int_id: ValueError}`` of the background loads that failed since the last call (the
        adapter's files changed or vanished after ``register``); they may be asked for again."""
        self.cpu_cache.poll()
        failed, self.cpu_cache.failed = self.cpu_cache.failed, {}
        return failed

    def wait_for_loads(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a pending background load (an idle engine's wait)."""
        return self.cpu_cache.wait(timeout)

    @property
    def num_loading(self) -> int:
        return self.cpu_cache.num_pending

    def attach_pages(self, pages: page_store.PoolPages) -> None:
        """The pool's byte views (the model runner's tensors) the adapters' pages live in."""
        self.pages = pages

    # ------------------------------------------------------------------ slots
    @property
    def resident(self) -> dict:
        """``{lora_int_id: slot}`` of the adapters in a slot now."""
        return dict(self._resident)

    def activate(self, lora_ids, pages: dict | None = None) -> dict:
        """Make every adapter of ``lora_ids`` (registered ids) resident in a slot; returns ``{id: slot}``
        for them. ``pages``: ``{id: (epoch, block ids)}`` of each adapter's pool pages (the scheduler's
        ``SchedulerOutput.lora_pages``): an adapter whose pages are new (another epoch) is written into
        them from its host copy (loaded here if the host cache dropped it), and a slot is filled by
        reading the pages back; without ``pages``, slots are filled from the host copies. Raises
        RuntimeError for more distinct ids than ``max_loras`` (the scheduler admits no more), and KeyError
        for an id that is not registered or has no pages."""
        wanted = list(dict.fromkeys(int(i) for i in lora_ids))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters but max_loras is {self.max_loras}")
        for lid in wanted:
            epoch, block_ids = pages[lid] if pages is not None else (None, ())
            if pages is not None and self._written.get(lid) != epoch:
                self.pages.write(block_ids, page_store.pack(self._host_model(lid)))
                self._written[lid] = epoch
            slot = self._resident.get(lid)
            if slot is not None:
                self._resident.move_to_end(lid)
                if self._slot_epoch.get(slot) == epoch:
                    continue
            else:
                slot = self._free_slot(wanted)
            self._fill_slot(slot, lid, epoch, block_ids)
            self._resident[lid] = slot
        return {lid: self._resident[lid] for lid in wanted}

    def _free_slot(self, wanted: list) -> int:
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self._resident if i not in wanted)
        return self._resident.pop(victim)

    def _host_model(self, lora_int_id: int) -> LoRAModel:
        model = self.cpu_cache.get(lora_int_id)
        if model is None:
            model = self.cpu_cache.load_now(self.specs[lora_int_id].request)
        self._digests.setdefault(lora_int_id, model.digest)
        return model

    def token_slots(self, lora_ids: np.ndarray, pages: dict | None = None) -> np.ndarray:
        """int64 ``[num_tokens]`` slots of int ``lora_ids [num_tokens]`` (0: no adapter -> -1), after
        ``activate`` of the ids (with ``pages``, as there)."""
        lora_ids = np.asarray(lora_ids, dtype=np.int64)
        slots = np.full(len(lora_ids), -1, np.int64)
        for lid, slot in self.activate(np.unique(lora_ids[lora_ids > 0]), pages).items():
            slots[lora_ids == lid] = slot
        return slots

    def _clear_slot(self, slot: int) -> None:
        for key in self.lora_a:
            self.lora_a[key][slot] = 0.0
            self.lora_b[key][slot] = 0.0
            self.ranks[key][slot] = 0
        self.scales[slot] = 0.0
        self._slot_epoch.pop(slot, None)

    def _fill_slot(self, slot: int, lid: int, epoch, block_ids) -> None:
        """Slot ``slot`` takes adapter ``lid``: from its pages (``epoch``, ``block_ids``), else its host copy."""
        spec = self.specs[lid]
        self._clear_slot(slot)
        if epoch is None:
            weights = {k: (w.lora_a, w.lora_b) for k, w in self._host_model(lid).layers.items()}
        else:
            raw = self.pages.read(block_ids, 4 * spec.num_floats)
            weights = page_store.unpack(raw.view(np.float32), spec)
        r = spec.rank
        for key, (a, b) in weights.items():
            self.lora_a[key][slot, :r] = a
            self.lora_b[key][slot, :, :r] = b
            self.ranks[key][slot] = r
        self.scales[slot] = spec.scaling
        self._slot_epoch[slot] = epoch
        self.num_loads += 1
