"""KV cache groups: which layers page their K/V together (after vLLM v1's ``kv_cache_utils``:
``KVCacheSpec``, ``KVCacheGroupSpec``, the grouping of a hybrid model's layers).

A model declares each layer's attention (``ModelConfig.layer_windows()``: a window W or None for full
attention). Layers of one kind are split into groups of ``group_size`` layers each, the same size for every
kind (Gemma 3's 3 global and 15 local layers: 6 groups of 3), so one pool block holds ``group_size``
layers' K and V whichever group takes it, and every group draws its blocks from the one pool. Layer ``i``
keeps its K/V in the pool tensor of its position in its group (``layer_slots``).

One kind of attention (Llama, Mistral's all-layer window) is one group of every layer. With the hybrid
manager off (``disable_hybrid_kv_cache_manager``), a model of several kinds is one group of every layer
attending in full, as far as blocks go: its sliding layers keep every block and only mask.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: the ``layer_ids`` (model layer indices, ascending) whose blocks it pages, and their
    ``sliding_window`` W (each token attends its last W positions) or None (full attention)."""

    layer_ids: tuple
    sliding_window: int | None = None

    @property
    def kind(self) -> str:
        return "full_attention" if self.sliding_window is None else f"sliding_window_{self.sliding_window}"


def group_layers(layer_windows, hybrid: bool = True) -> tuple:
    """The ``KVCacheGroupSpec``s of a model whose layer ``i`` attends with window ``layer_windows[i]``
    (None: full attention), in order of their first layer.

    One kind: one group of every layer. Several kinds, ``hybrid`` off: one full-attention group of every
    layer. Several kinds, ``hybrid`` on: each kind's layers, in order, cut into groups of ``group_size``
    layers, the smallest kind's layer count (vLLM's rule: the largest count where it is under 1.25 times the
    smallest, so few groups are padded); a kind's last group may hold fewer layers.

    Raises:
        ValueError: no layers, or a window below 1.
    """
    windows = tuple(layer_windows)
    if not windows:
        raise ValueError("a model needs at least one layer to page")
    if any(w is not None and w < 1 for w in windows):
        raise ValueError(f"sliding windows must be >= 1 or None, got {windows}")
    kinds = list(dict.fromkeys(windows))
    everything = tuple(range(len(windows)))
    if len(kinds) == 1:
        return (KVCacheGroupSpec(everything, kinds[0]),)
    if not hybrid:
        return (KVCacheGroupSpec(everything, None),)
    layers = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    small, large = min(map(len, layers.values())), max(map(len, layers.values()))
    size = large if large < small * 1.25 else small
    groups = [
        KVCacheGroupSpec(tuple(ids[j : j + size]), w) for w, ids in layers.items() for j in range(0, len(ids), size)
    ]
    return tuple(sorted(groups, key=lambda g: g.layer_ids[0]))


def group_size(groups) -> int:
    """Layers one pool block holds: the largest group's."""
    return max(len(g.layer_ids) for g in groups)


def layer_slots(groups, num_layers: int) -> tuple:
    """``(group index, position in the group)`` of each of ``num_layers`` layers. Raises ValueError when
    the groups do not cover every layer exactly once."""
    slots: dict = {}
    for g, spec in enumerate(groups):
        for pos, layer in enumerate(spec.layer_ids):
            if layer in slots:
                raise ValueError(f"layer {layer} is in two KV cache groups")
            slots[layer] = (g, pos)
    if sorted(slots) != list(range(num_layers)):
        raise ValueError(f"KV cache groups cover layers {sorted(slots)}, not 0..{num_layers - 1}")
    return tuple(slots[i] for i in range(num_layers))
