"""The one interface a step's forward pass meets, whichever of the three ways runs it: replayed on static
buffers (``cuda_graph.CUDAGraphRunner``, pure-decode steps), in one compiled call on the CPU
(``cpu_fused_decode.CPUFusedDecode``, pure-decode steps) or op by op (:class:`EagerForward`, any step).

A path has ``can_run(step) -> bool`` and ``forward_step(step) -> (logits, hidden)`` for a
``step_input.StepInput``: float32 logits ``[step.layout.num_rows, vocab]`` on the backend (one row per
``LogitsLayout`` row) and the step's final-norm hidden states ``[num_tokens, hidden]``, or None from a path
that keeps none (no row of its steps scores a prompt). The runner takes the first path that can run.
"""

from __future__ import annotations

import numpy as np


def sampled_logits(model, hidden, layout):
    """The LM head on the hidden rows the logits rows come from (``layout.logits_indices``): float32
    ``[layout.num_rows, vocab]`` on the backend, or a host ``[0, vocab]`` when no sequence samples."""
    if not layout.num_rows:
        return np.zeros((0, model.config.vocab_size), np.float32)
    return model.compute_logits(hidden[model.backend.asarray(layout.logits_indices)])


class EagerForward:
    """Any step, kernel by kernel: ``LlamaModel.forward`` over the runner's per-layer KV caches
    (``layer_groups``: each layer's KV cache group index, empty with one group; ``lora``: the step's
    adapters, ``rawpaged.lora.punica.PunicaWrapper``, or None)."""

    def __init__(self, model, key_caches: list, value_caches: list, layer_groups: tuple = (), lora=None):
        self.model = model
        self.key_caches, self.value_caches = key_caches, value_caches
        self.layer_groups = layer_groups
        self.lora = lora

    def can_run(self, step) -> bool:
        return True

    def forward_step(self, step) -> tuple:
        ids, positions, attn = step.device_inputs(self.model.backend, self.layer_groups)
        if self.lora is None:
            hidden = self.model.forward(ids, positions, attn, self.key_caches, self.value_caches)
        else:
            hidden = self.model.forward(ids, positions, attn, self.key_caches, self.value_caches, lora=self.lora)
        return sampled_logits(self.model, hidden, step.layout), hidden
