"""A model whose greedy continuation is a script: for each token id ``t`` of ``script``, the most likely next
token after ``t`` is ``script[t]``, whatever came before. For tests of what the server does with known
outputs (reasoning tags, tool calls) on a real tokenizer and chat template, without trained weights.

How: one decoder layer whose attention output and MLP output projections are zero, so the last hidden
state is the current token's embedding, RMS-normalized; the LM head's row ``script[t]`` is that normalized
embedding times ``scale`` (its logit about ``scale * sqrt(hidden)``, every other about 1 or less)."""

from __future__ import annotations

import numpy as np
from safetensors.numpy import load_file, save_file

from rawpaged.testing.random_model import write_random_model


def write_scripted_model(dst, tokenizer_from, script: dict, architecture: str = "Qwen3ForCausalLM", scale=60.0):
    """Write the model at ``dst`` (``tokenizer_from``'s tokenizer files) and return its directory."""
    d = write_random_model(
        dst,
        num_layers=1,
        hidden_size=64,
        intermediate_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        tokenizer_from=tokenizer_from,
        architecture=architecture,
        tie_word_embeddings=False,
        seed=5,
    )
    path = d / "model.safetensors"
    w = load_file(str(path))
    w["model.layers.0.self_attn.o_proj.weight"][:] = 0.0
    w["model.layers.0.mlp.down_proj.weight"][:] = 0.0
    embed = w["model.embed_tokens.weight"]
    for t, nxt in script.items():
        e = embed[t]
        w["lm_head.weight"][nxt] = scale * e / np.linalg.norm(e)
    save_file(w, str(path), metadata={"format": "pt"})
    return d
