"""Pure-decode steps on the CPU backend as one compiled call: the decoder layers of ``models.llama`` in
one Numba function (``kernels.cpu.fused_decode.decode_layers``), the CPU's counterpart of replaying a CUDA graph
(``cuda_graph``).

Kernel by kernel, a decode step of the default model makes about 330 calls from Python into Numba (11
per layer: norms, products, RoPE, cache write, attention, SwiGLU), each paying argument checks, an
output allocation and Numba's dispatch (type checks and unboxing of every array): 5-10 us a call, a
few milliseconds of a 20-30 ms batch-1 step. Here the embedding lookup and the LM head stay in Python and
everything between them is one call, on the same kernels in the same order, so the hidden states equal
the op-by-op forward's bit for bit (tests/model_executor/test_cpu_fused_decode.py holds it to that). Each
kernel with a parallel loop still forks and joins the thread pool as it does when called from Python.

One choice differs: attention always takes the thread-parallel kernel (whose tasks compute exactly what
the serial one does). Op by op, attention below ``cpu.PARALLEL_MIN_WORK`` runs serially because the
products before it may be OpenBLAS's, whose spinning threads make waking Numba's pool cost more than
the work; here every product is a Numba kernel, so the pool's threads are already awake.

Weights and caches are handed over once, as ``numba.typed.List``s of the arrays the model already holds
(no copy). Projections may differ in format (float32 or quantized); a projection whose layers differ
(float32 in some, quantized in others) makes the model run op by op (``CPUFusedDecode.supported``).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import typed

from rawpaged.kernels.backend import sliding_window_arg
from rawpaged.kernels.cpu import fused_decode, gemm
from rawpaged.model_executor.forward_paths import sampled_logits


def _typed_list(items):
    """A ``numba.typed.List`` of ``items``, or None when they do not share one Numba type."""
    if len({nb.typeof(item) for item in items}) != 1:
        return None
    return typed.List(items)


class CPUFusedDecode:
    """Runs the decoder layers of a pure-decode step of up to ``max_batch_size`` rows in one compiled
    call (module docstring).

    Args:
        model: a ``LlamaModel`` on the ``CPUBackend``.
        key_caches, value_caches: the runner's per-layer caches ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` (float32, bfloat16 or ``QuantizedKVCache``), read and written in place.
        max_batch_size: decode steps with more rows run op by op (``gemm.SMALL_M``: above it the
            backend's products go to BLAS).
    Raises:
        ValueError: for a model not on the CPU backend.
    """

    def __init__(self, model, key_caches, value_caches, max_batch_size: int = gemm.SMALL_M):
        if model.backend.name != "cpu":
            raise ValueError(f"CPUFusedDecode runs on the cpu backend, not {model.backend.name}")
        self.model = model
        self.max_batch_size = max_batch_size
        #: whether this model's decode steps run here (else op by op): a Llama-family model whose layers
        #: share their formats and their window (a ``GemmaModel`` and a mixture-of-experts ``LlamaModel``
        #: have ``fused_cpu_decode = False``)
        self.supported = getattr(model, "fused_cpu_decode", True)
        if not self.supported:
            return
        cfg = model.config
        layers = model.layers
        keys = [fused_decode.cache_view(c) for c in key_caches]
        values = [fused_decode.cache_view(c) for c in value_caches]
        qmax = getattr(getattr(key_caches[0], "kind", None), "qmax", 0.0)
        self._caches = (
            typed.List([k for k, _ in keys]),
            typed.List([v for v, _ in values]),
            typed.List([s for _, s in keys]),
            typed.List([s for _, s in values]),
            np.float32(qmax),
        )

        def weights(name):
            return _typed_list([fused_decode.linear_weight(layer[name]) for layer in layers])

        def optional(name):  # every layer's, or an empty list for none; None (op by op) for some
            present = [layer[name] for layer in layers if layer[name] is not None]
            if not present:
                return typed.List.empty_list(nb.float32[::1])
            return _typed_list(present) if len(present) == len(layers) else None

        self._weights = (
            typed.List([layer["input_layernorm"] for layer in layers]),
            typed.List([layer["post_attention_layernorm"] for layer in layers]),
            weights("qkv_proj"),
            optional("qkv_bias"),
            optional("q_norm"),
            optional("k_norm"),
            weights("o_proj"),
            weights("gate_up_proj"),
            weights("down_proj"),
        )
        windows = set(model.layer_windows)
        self.supported = all(w is not None for w in self._weights) and len(windows) == 1
        self._eps = np.float32(cfg.rms_norm_eps)
        self._scale = np.float32(model.scale)
        self._window = sliding_window_arg(next(iter(windows)))
        #: attention takes the parallel kernel from this much work (query rows x positions; module docstring)
        self.parallel_attention_min_work = 0

    def can_run(self, step) -> bool:
        """Whether ``step`` (a ``StepInput``) runs here: pure decode (drafts included) of 1 to
        ``max_batch_size`` rows, on a model whose layers share their formats and their window (one KV cache
        group)."""
        return (
            self.supported
            and step.num_groups == 1
            and not step.prefills
            and 0 < step.num_decode_tokens <= self.max_batch_size
        )

    def forward_step(self, step) -> tuple:
        """``(logits of the step's logits rows, hidden states)`` of a ``StepInput`` that :meth:`can_run`."""
        hidden = self.forward(*step.device_inputs(self.model.backend))
        return sampled_logits(self.model, hidden, step.layout), hidden

    def forward(self, input_ids, positions, attn):
        """Final-norm hidden states float32 ``[M, hidden]`` of a pure-decode step, as
        ``LlamaModel.forward(input_ids, positions, attn, key_caches, value_caches)`` returns them.

        input_ids, positions: int64 ``[M]``; attn: ``AttentionMetadata`` with ``num_decode_tokens == M``.
        Raises ValueError for a step that is not pure decode."""
        M = input_ids.shape[0]
        if attn.num_decode_tokens != M:
            raise ValueError(f"a fused decode step takes decode rows only: {attn.num_decode_tokens} of {M}")
        model, cfg = self.model, self.model.config
        residual = np.ascontiguousarray(model.backend.embedding(input_ids, model.embed_tokens))
        out = np.empty_like(residual)
        num_kv_heads = cfg.num_key_value_heads
        context = int(attn.max_context_len) or attn.decode_block_tables.shape[1] * self._caches[0][0].shape[1]
        parallel = M * cfg.num_attention_heads * context >= self.parallel_attention_min_work
        fused_decode.decode_layers(
            residual,
            np.ascontiguousarray(positions, dtype=np.int64),
            attn.slot_mapping,
            attn.decode_block_tables,
            attn.decode_context_lens,
            *self._caches,
            *self._weights,
            model.norm,
            model.cos_sin_cache,
            self._eps,
            self._scale,
            self._window,
            cfg.num_attention_heads,
            cfg.intermediate_size,
            fused_decode.attention_tasks(M, num_kv_heads),
            parallel,
            fused_decode.max_chunks(),
            out,
        )
        return out
