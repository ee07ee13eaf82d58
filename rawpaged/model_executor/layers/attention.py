"""One layer's paged attention over a step's mixed batch: the decode tokens, then the prefill chunks."""

from __future__ import annotations


def paged_attention_layer(backend, out, q, key_cache, value_cache, attn, scale, sliding_window=None, soft_cap=None):
    """Write ``out [T, num_heads, head_dim]`` for the step's queries ``q`` (same shape) over the layer's caches.

    ``attn`` is the layer's ``AttentionMetadata`` (decode tokens first: ``attn.num_decode_tokens`` of them
    go to ``backend.paged_attention``, the rest to ``backend.prefill_attention``); ``sliding_window`` and
    ``soft_cap`` as those ops take them (None: full attention, no cap).
    """
    nd, T = attn.num_decode_tokens, q.shape[0]
    if nd:
        backend.paged_attention(
            out[:nd],
            q[:nd],
            key_cache,
            value_cache,
            attn.decode_block_tables,
            attn.decode_context_lens,
            scale,
            max_context_len=attn.max_context_len,
            sliding_window=sliding_window,
            logits_soft_cap=soft_cap,
        )
    if nd < T:
        backend.prefill_attention(
            out[nd:],
            q[nd:],
            key_cache,
            value_cache,
            attn.prefill_block_tables,
            attn.query_start_loc,
            attn.prefill_seq_lens,
            scale,
            max_query_len=attn.max_query_len,
            sliding_window=sliding_window,
            logits_soft_cap=soft_cap,
        )
