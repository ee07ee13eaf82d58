"""Pure-decode steps on the CPU backend as one compiled call: the decoder layers of ``models.llama`` or
``models.gemma`` in one Numba function (``kernels.cpu.fused_decode.decode_layers``), the CPU's counterpart of
replaying a CUDA graph (``cuda_graph``).

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

Gemma's layer is the Llama layer with two more norms (of the attention's and the MLP's outputs), the
tanh-GeLU gate, the attention's soft cap and per-layer windows and RoPE tables; a model with several KV cache
groups (Gemma 3's sliding and full layers) gives each layer its group's slots and block tables. The
embedding (scaled by ``sqrt(hidden)`` for Gemma) and the LM head stay the model's own.

Weights and caches are handed over once, as ``numba.typed.List``s of the arrays the model already holds
(no copy). Projections may differ in format (float32 or quantized); a projection whose layers differ
(float32 in some, quantized in others) makes the model run op by op (``CPUFusedDecode.supported``).
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import typed

from rawpaged.kernels.backend import sliding_window_arg, soft_cap_arg
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
        model: a ``LlamaModel`` or ``GemmaModel`` on the ``CPUBackend``.
        key_caches, value_caches: the runner's per-layer caches ``[num_blocks, block_size,
            num_kv_heads, head_dim]`` (float32, bfloat16 or ``QuantizedKVCache``), read and written in place.
        max_batch_size: decode steps with more rows run op by op (``gemm.SMALL_M``: above it the
            backend's products go to BLAS).
        layer_groups: each layer's KV cache group index (empty: one group), as the runner's.
    Raises:
        ValueError: for a model not on the CPU backend.
    """

    def __init__(self, model, key_caches, value_caches, max_batch_size: int = gemm.SMALL_M, layer_groups=()):
        if model.backend.name != "cpu":
            raise ValueError(f"CPUFusedDecode runs on the cpu backend, not {model.backend.name}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.layer_groups = tuple(layer_groups)
        #: whether this model's decode steps run here (else op by op): a Llama or Gemma model whose layers
        #: share their formats (a mixture-of-experts ``LlamaModel`` has ``fused_cpu_decode = False``)
        self.supported = getattr(model, "fused_cpu_decode", True)
        if not self.supported:
            return
        cfg = model.config
        gemma = bool(getattr(cfg, "gemma", False))
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

        def norms(name):
            return typed.List([layer[name] for layer in layers])

        no_norms = typed.List.empty_list(nb.float32[::1])
        self._weights = (
            norms("input_layernorm"),
            norms("post_attention_layernorm") if gemma else no_norms,
            norms("pre_feedforward_layernorm" if gemma else "post_attention_layernorm"),
            norms("post_feedforward_layernorm") if gemma else no_norms,
            weights("qkv_proj"),
            no_norms if gemma else optional("qkv_bias"),
            optional("q_norm"),
            optional("k_norm"),
            weights("o_proj"),
            weights("gate_up_proj"),
            weights("down_proj"),
        )
        self.supported = all(w is not None for w in self._weights)
        self._eps = np.float32(cfg.rms_norm_eps)
        self._scale = np.float32(model.scale)
        self._cos_sin = typed.List(getattr(model, "layer_cos_sin", None) or [model.cos_sin_cache] * len(layers))
        self._windows = np.array([sliding_window_arg(w) for w in model.layer_windows], np.int64)
        self._soft_cap = soft_cap_arg(getattr(model, "soft_cap", None))
        self._gelu = gemma
        self._embed_scale = getattr(model, "embed_scale", None)
        self._layer_groups = np.array(self.layer_groups or [0] * len(layers), np.int64)
        #: attention takes the parallel kernel from this much work (query rows x positions; module docstring)
        self.parallel_attention_min_work = 0

    def can_run(self, step) -> bool:
        """Whether ``step`` (a ``StepInput``) runs here: pure decode (drafts included) of 1 to
        ``max_batch_size`` rows, on a model whose layers share their formats."""
        return self.supported and not step.prefills and 0 < step.num_decode_tokens <= self.max_batch_size

    def forward_step(self, step) -> tuple:
        """``(logits of the step's logits rows, hidden states)`` of a ``StepInput`` that :meth:`can_run`."""
        hidden = self.forward(*step.device_inputs(self.model.backend, self.layer_groups))
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
        residual = np.ascontiguousarray(model.backend.embedding(input_ids, model.embed_tokens, self._embed_scale))
        out = np.empty_like(residual)
        groups = attn.groups or (attn,)
        num_kv_heads = cfg.num_key_value_heads
        context = int(attn.max_context_len) or attn.decode_block_tables.shape[1] * self._caches[0][0].shape[1]
        parallel = M * cfg.num_attention_heads * context >= self.parallel_attention_min_work
        fused_decode.decode_layers(
            residual,
            np.ascontiguousarray(positions, dtype=np.int64),
            typed.List([g.slot_mapping for g in groups]),
            typed.List([g.decode_block_tables for g in groups]),
            typed.List([g.decode_context_lens for g in groups]),
            self._layer_groups,
            *self._caches,
            *self._weights,
            model.norm,
            self._cos_sin,
            self._eps,
            self._scale,
            self._windows,
            self._soft_cap,
            self._gelu,
            cfg.num_attention_heads,
            cfg.intermediate_size,
            *fused_decode.attention_tasks(M, num_kv_heads),
            parallel,
            fused_decode.max_chunks(),
            out,
        )
        return out
