"""One step's LoRA: each token's adapter slot, tiled by slot once (``kernels.cpu.lora.tiles``), and the
shrink and expand kernels applied beside each of the base model's fused linears (vLLM's
``PunicaWrapper``). The base weights are never touched: ``y = x @ W.T (+ b)`` is computed as loaded
(float32 or quantized) and the adapters' ``scale * (x @ A.T) @ B.T`` added into ``y`` after it."""

from __future__ import annotations

import numpy as np

from rawpaged.kernels.cpu import lora as lora_kernels

#: each fused linear of ``LlamaModel``'s layers: its PEFT modules, in the order of its output columns
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class PunicaWrapper:
    """A step's LoRA state over a ``LoRAModelManager``'s slots.

    Args:
        manager: the ``LoRAModelManager`` (its step's adapters already resident).
        token_slots: int ``[num_tokens]``, each token's slot (-1: the base model alone).
    """

    def __init__(self, manager, token_slots: np.ndarray):
        self.manager = manager
        self.token_slots = np.asarray(token_slots, dtype=np.int64)
        self.order, self.tile_starts, self.tile_slots = lora_kernels.tiles(self.token_slots)
        self.step_slots = np.unique(self.tile_slots)
        self._buf = np.empty((len(self.order), manager.max_lora_rank), np.float32)

    @property
    def num_lora_tokens(self) -> int:
        """Tokens of the step that run with an adapter."""
        return len(self.order)

    def add_lora(self, layer: int, fused: str, x, y) -> None:
        """``y += `` each token's adapter delta, for layer ``layer``'s fused linear ``fused`` (a key of
        ``FUSED_MODULES``): x float32 ``[num_tokens, in]``, y float32 ``[num_tokens, sum of the modules'
        out]`` (the base linear's output), updated in place in the rows of tokens with an adapter."""
        if not len(self.order):
            return
        m = self.manager
        x = np.ascontiguousarray(x, dtype=np.float32)
        offset = 0
        for module in FUSED_MODULES[fused]:
            key = (layer, module)
            lora_b = m.lora_b[key]
            ranks = m.ranks[key]
            if ranks[self.step_slots].any():
                args = (self.order, self.tile_starts, self.tile_slots)
                lora_kernels.shrink(x, m.lora_a[key], m.scales, ranks, *args, self._buf)
                lora_kernels.expand(self._buf, lora_b, ranks, *args, y, offset)
            offset += lora_b.shape[1]
