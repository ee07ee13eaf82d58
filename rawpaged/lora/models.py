"""The adapters an engine knows, and the slots a step computes with (vLLM's ``LoRAModelManager``).

Registered adapters (``add_adapter``) are kept loaded on the host. A step's adapters are made resident in
one of ``max_loras`` slots first (``activate``): per adapted linear of the base model, the slots' weights
are stacked, ``lora_a [max_loras, max_lora_rank, in]`` and ``lora_b [max_loras, out, max_lora_rank]``
(an adapter of a lower rank fills its first ``rank`` rows and columns; ``ranks`` says how many, 0 where it
does not adapt that linear), so that one kernel call per linear serves every adapter of the step
(``punica.PunicaWrapper``). A slot is taken back from the least recently used adapter the step does not
need. The slots are the unit a later pool would page: a slot's arrays are what would live in KV pool pages.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from rawpaged.lora.lora_model import LoRAModel, module_shapes
from rawpaged.lora.request import LoRARequest


class LoRAModelManager:
    """Args:
        model_config: the base model's ``ModelConfig``.
        max_loras: adapters one step may use (slots); >= 1.
        max_lora_rank: the highest rank an adapter may have (vLLM's default 16).

    Attributes:
        lora_a, lora_b: ``{(layer, module): float32 stack}`` (see the module doc) for every linear an
            adapter may target (mixture-of-experts layers' MLPs excluded).
        ranks: ``{(layer, module): int32 [max_loras]}``, each slot's rank on that linear (0: not adapted).
        scales: float32 ``[max_loras]``, each slot's ``LoRAModel.scaling``.

    Raises ValueError for ``max_loras`` or ``max_lora_rank`` below 1.
    """

    def __init__(self, model_config, max_loras: int = 1, max_lora_rank: int = 16):
        for field, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        self.model_config = model_config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        shapes = module_shapes(model_config)
        self.lora_a, self.lora_b, self.ranks = {}, {}, {}
        for layer, moe in enumerate(model_config.moe_layers):
            for module, (fan_in, fan_out) in shapes.items():
                if moe and module in ("gate_proj", "up_proj", "down_proj"):
                    continue
                key = (layer, module)
                self.lora_a[key] = np.zeros((max_loras, max_lora_rank, fan_in), np.float32)
                self.lora_b[key] = np.zeros((max_loras, fan_out, max_lora_rank), np.float32)
                self.ranks[key] = np.zeros(max_loras, np.int32)
        self.scales = np.zeros(max_loras, np.float32)
        self.adapters: dict[int, LoRAModel] = {}
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.num_loads = 0  # adapters copied into a slot

    # ------------------------------------------------------------------ registry
    def add_adapter(self, request: LoRARequest) -> LoRAModel:
        """Load and check ``request``'s adapter (``LoRAModel.from_local_checkpoint``) unless its id is
        registered already; returns it. Raises ValueError (naming the adapter and the field) for an
        adapter that cannot be loaded, or an id registered for another name or path."""
        known = self.adapters.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} is already the "
                    f"id of adapter {known.request.lora_name!r} ({known.request.lora_path})"
                )
            return known
        model = LoRAModel.from_local_checkpoint(request, self.model_config, self.max_lora_rank)
        self.adapters[request.lora_int_id] = model
        return model

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter and free its slot; False if it is unknown."""
        slot = self._resident.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)
        return self.adapters.pop(lora_int_id, None) is not None

    def list_adapters(self) -> dict:
        """``{lora_int_id: LoRARequest}`` of the registered adapters."""
        return {i: m.request for i, m in self.adapters.items()}

    # ------------------------------------------------------------------ slots
    @property
    def resident(self) -> dict:
        """``{lora_int_id: slot}`` of the adapters in a slot now."""
        return dict(self._resident)

    def activate(self, lora_ids) -> dict:
        """Make every adapter of ``lora_ids`` (registered ids) resident; returns ``{id: slot}`` for them.
        Raises RuntimeError for more distinct ids than ``max_loras`` (the scheduler admits no more), and
        KeyError for an id that is not registered."""
        wanted = list(dict.fromkeys(int(i) for i in lora_ids))
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} LoRA adapters but max_loras is {self.max_loras}")
        for lid in wanted:
            if lid in self._resident:
                self._resident.move_to_end(lid)
                continue
            model = self.adapters[lid]
            used = set(self._resident.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._resident if i not in wanted)
                slot = self._resident.pop(victim)
            self._load_slot(slot, model)
            self._resident[lid] = slot
        return {lid: self._resident[lid] for lid in wanted}

    def token_slots(self, lora_ids: np.ndarray) -> np.ndarray:
        """int64 ``[num_tokens]`` slots of int ``lora_ids [num_tokens]`` (0: no adapter -> -1), after
        ``activate`` of the ids."""
        lora_ids = np.asarray(lora_ids, dtype=np.int64)
        slots = np.full(len(lora_ids), -1, np.int64)
        for lid, slot in self.activate(np.unique(lora_ids[lora_ids > 0])).items():
            slots[lora_ids == lid] = slot
        return slots

    def _clear_slot(self, slot: int) -> None:
        for key in self.lora_a:
            self.lora_a[key][slot] = 0.0
            self.lora_b[key][slot] = 0.0
            self.ranks[key][slot] = 0
        self.scales[slot] = 0.0

    def _load_slot(self, slot: int, model: LoRAModel) -> None:
        self._clear_slot(slot)
        r = model.rank
        for key, w in model.layers.items():
            self.lora_a[key][slot, :r] = w.lora_a
            self.lora_b[key][slot, :, :r] = w.lora_b
            self.ranks[key][slot] = r
        self.scales[slot] = model.scaling
        self.num_loads += 1
