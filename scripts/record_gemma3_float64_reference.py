"""Record a float64 NumPy reference of Gemma 3 270M's Q4_K_M GGUF (``python -m rawpaged.weights prepare
gemma-3-270m``), dequantized, into ``tests/data/gemma3_270m_float64_reference.json``, which
``tests/model_executor/test_gemma3_gguf.py`` compares our engine to.

    nice python scripts/record_gemma3_float64_reference.py [--gguf FILE] [--out FILE.json]

Run by hand, outside the test suite (it takes a few minutes on two cores). Independent of rawpaged's loader,
kernels and tokenizer: the file is read with the ``gguf`` package's ``GGUFReader``, every tensor is
dequantized by ``gguf.quants.dequantize`` (the package's NumPy port of ggml-quants.c) and computed on in
float64; the prompt ids are llama.cpp's, from ``tests/data/gemma3_270m_llama_cpp_greedy.json``. Nothing of
rawpaged is imported (``gemma3_reference_files`` finds the prepared file itself).

The architecture is HF transformers' ``models/gemma3/modeling_gemma3.py`` (5.25.0), text-only:

- ``Gemma3TextScaledWordEmbedding``: embedding rows times ``hidden_size ** 0.5``.
- ``Gemma3RMSNorm``: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``. llama.cpp's converter
  (``conversion/gemma.py``, ``Gemma3Model.norm_shift``: "Gemma3RMSNorm adds 1.0 to the norm value") stores
  ``1 + weight`` for every tensor named ``*norm.weight`` (the four per layer, q/k norms, the final norm),
  so the file's value is the factor itself and is used as it is.
- ``Gemma3DecoderLayer``: ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then ``x +
  post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``. GGUF names (llama.cpp
  ``src/models/gemma3.cpp``): ``attn_norm`` = input_layernorm, ``post_attention_norm`` =
  post_attention_layernorm, ``ffn_norm`` = pre_feedforward_layernorm, ``post_ffw_norm`` =
  post_feedforward_layernorm.
- ``Gemma3MLP``: ``down(gelu_pytorch_tanh(gate(x)) * up(x))``.
- ``Gemma3Attention``: q, k, v projections; ``q_norm``/``k_norm`` per head before RoPE; RoPE with
  ``rotate_half`` (the halves of each head: llama.cpp's ``LLAMA_ROPE_TYPE_NEOX`` for ``gemma3``, and the
  converter does not permute q/k for it); scores ``q k^T * query_pre_attn_scalar ** -0.5``; no soft-cap;
  causal, and on sliding layers a query at position i sees keys ``i - W < j <= i``
  (``create_sliding_window_causal_mask``; llama.cpp's ``LLAMA_SWA_TYPE_STANDARD`` masks ``i - j >= W``).
- ``Gemma3ForCausalLM``: logits = final norm times the tied embedding (the file has no ``output.weight``);
  ``final_logit_softcapping`` is None (the file stores no ``final_logit_softcapping``).

The values the GGUF does not store, and where each one comes from:

- layer pattern: layer i is full attention when ``(i + 1) % 6 == 0``, else sliding. HF
  ``configuration_gemma3.py`` (``sliding_window_pattern`` default 6) and llama.cpp
  ``llama_model_gemma3::load_arch_hparams`` (``load_swa_pattern(ml, 6)``: sliding where ``il % 6 < 5``);
  the file has no ``attention.sliding_window_pattern`` key (checked below).
- local RoPE base: 10000. HF ``configuration_gemma3.py`` (``default_theta["local"]``, and google/
  gemma-3-270m's config ``rope_local_base_freq``) and llama.cpp ``llama-hparams.h``
  (``rope_freq_base_train_swa = 10000.0f``, kept where the file has no ``rope.freq_base_swa``: checked).
  The global base is the file's ``rope.freq_base`` (1e6).
- ``query_pre_attn_scalar``: 256 = head_dim. google/gemma-3-270m's config.json and HF's default; llama.cpp
  ``f_attention_scale = 1 / sqrt(n_embd_head_k)`` for every size but the 27B model.

Recorded:

- ``teacher_forced``: for a few prompts (one 2,242 tokens long, so the 512-token window matters), the
  logits at a few prompt positions, compactly: the top 20 ids and logits, the logits of 32 fixed ids, the
  logit of the next prompt token, and max, mean, std and logsumexp over the whole vocabulary.
- ``greedy``: for the 8 prompts of the llama.cpp reference, 64 greedy ids (argmax, EOS not stopping),
  with the gap between the two largest float64 logits at each step. The prompt is run in one pass, then
  one token at a time over a KV cache (the window applied to the sliding layers' cached keys).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gemma3_reference_files import ROOT, llama_cpp_reference, parse_args, write_record

OUT = ROOT / "tests" / "data" / "gemma3_270m_float64_reference.json"
ARCH = "gemma3"
PATTERN = 6  # every 6th layer full (see the module docstring)
LOCAL_ROPE_BASE = 10000.0
QUERY_PRE_ATTN_SCALAR = 256
TOP_K = 20
#: (case index in the llama.cpp reference, prompt positions): the logits there are recorded
TEACHER_FORCED = {
    0: [2, 3, 4, 5],
    2: [5, 15, 16, 17, 18],
    6: [100, 511, 512, 1500, 2238, 2239, 2240, 2241],
}
PROBE_IDS = [int(i) for i in np.random.default_rng(55).choice(262144, 32, replace=False)]


def read_model(path: Path) -> tuple[dict, dict]:
    """(hyperparameters, GGUF tensor name -> float64 array in NumPy order ``[rows, cols]``)."""
    reader = gguf.GGUFReader(path)

    def field(key):
        f = reader.fields[f"{ARCH}.{key}"]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]][0]

    assert reader.fields["general.architecture"].contents() == ARCH
    for absent in ("attention.sliding_window_pattern", "rope.freq_base_swa", "final_logit_softcapping"):
        assert f"{ARCH}.{absent}" not in reader.fields, f"{absent} is stored: use it instead of the fixed value"
    hp = {
        "layers": int(field("block_count")),
        "hidden": int(field("embedding_length")),
        "heads": int(field("attention.head_count")),
        "kv_heads": int(field("attention.head_count_kv")),
        "head_dim": int(field("attention.key_length")),
        "eps": float(field("attention.layer_norm_rms_epsilon")),
        "rope_global": float(field("rope.freq_base")),
        "rope_local": LOCAL_ROPE_BASE,
        "window": int(field("attention.sliding_window")),
        "scale": QUERY_PRE_ATTN_SCALAR**-0.5,
    }
    hp["sliding"] = [(i + 1) % PATTERN != 0 for i in range(hp["layers"])]
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(w, np.float64).reshape([int(n) for n in reversed(t.shape)])
    assert "output.weight" not in tensors  # tied head
    return hp, tensors


def rms_norm(x, factor, eps):
    """``Gemma3RMSNorm`` with the file's factor (``1 + weight``)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * factor


def gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3)))


def rope(x, positions, base):
    """``apply_rotary_pos_emb`` with ``rotate_half``: x ``[T, heads, D]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    freqs = positions[:, None].astype(np.float64) * inv_freq[None]
    emb = np.concatenate([freqs, freqs], -1)[:, None, :]
    half = d // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


class Reference:
    """The model, run over one sequence with a float64 KV cache per layer."""

    def __init__(self, hp: dict, w: dict):
        self.hp, self.w = hp, w
        self.embed = w["token_embd.weight"]

    def start(self):
        self.k = [np.zeros((0, self.hp["kv_heads"], self.hp["head_dim"])) for _ in range(self.hp["layers"])]
        self.v = [k.copy() for k in self.k]

    def step(self, ids: list[int]) -> np.ndarray:
        """Run ``ids`` after what is cached; return the final-normed hidden states ``[len(ids), hidden]``."""
        hp, w = self.hp, self.w
        H, Hkv, D, eps = hp["heads"], hp["kv_heads"], hp["head_dim"], hp["eps"]
        start = self.k[0].shape[0]
        T = len(ids)
        pos = np.arange(start, start + T)
        x = self.embed[ids] * math.sqrt(hp["hidden"])
        for layer in range(hp["layers"]):
            p = f"blk.{layer}."
            sliding = hp["sliding"][layer]
            h = rms_norm(x, w[p + "attn_norm.weight"], eps)
            q = (h @ w[p + "attn_q.weight"].T).reshape(T, H, D)
            k = (h @ w[p + "attn_k.weight"].T).reshape(T, Hkv, D)
            v = (h @ w[p + "attn_v.weight"].T).reshape(T, Hkv, D)
            q = rms_norm(q, w[p + "attn_q_norm.weight"], eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], eps)
            base = hp["rope_local"] if sliding else hp["rope_global"]
            q, k = rope(q, pos, base), rope(k, pos, base)
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
            keys = np.repeat(self.k[layer], H // Hkv, axis=1)
            vals = np.repeat(self.v[layer], H // Hkv, axis=1)
            kpos = np.arange(keys.shape[0])
            visible = kpos[None, :] <= pos[:, None]
            if sliding:
                visible &= kpos[None, :] > pos[:, None] - hp["window"]
            scores = (q.transpose(1, 0, 2) @ keys.transpose(1, 2, 0)) * hp["scale"]  # [H, T, keys]
            scores = np.where(visible[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = (probs @ vals.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(T, H * D) @ w[
                p + "attn_output.weight"
            ].T
            x = x + rms_norm(attn, w[p + "post_attention_norm.weight"], eps)
            h = rms_norm(x, w[p + "ffn_norm.weight"], eps)
            mlp = gelu_tanh(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)
            x = x + rms_norm(mlp @ w[p + "ffn_down.weight"].T, w[p + "post_ffw_norm.weight"], eps)
        return rms_norm(x, w["output_norm.weight"], eps)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """float64 ``[rows, vocab]`` from final-normed hidden states ``[rows, hidden]``."""
        return hidden @ self.embed.T


def summary(row: np.ndarray, next_id: int | None) -> dict:
    top = np.argsort(-row, kind="stable")[:TOP_K]
    m = float(row.max())
    return {
        "top_ids": [int(i) for i in top],
        "top_logits": [round(float(row[i]), 6) for i in top],
        "probe_logits": [round(float(row[i]), 6) for i in PROBE_IDS],
        "next_id": next_id,
        "next_logit": None if next_id is None else round(float(row[next_id]), 6),
        "max": round(m, 6),
        "mean": round(float(row.mean()), 6),
        "std": round(float(row.std()), 6),
        "logsumexp": round(m + math.log(float(np.exp(row - m).sum())), 6),
    }


def teacher_forced(ref: Reference, cases: list) -> list:
    out = []
    for index, positions in TEACHER_FORCED.items():
        ids = cases[index]["prompt_ids"]
        ref.start()
        hidden = ref.step(ids)
        rows = ref.logits(hidden[positions])
        records = [
            {"position": p, **summary(r, ids[p + 1] if p + 1 < len(ids) else None)} for p, r in zip(positions, rows)
        ]
        out.append({"case": index, "prompt_len": len(ids), "positions": records})
        print(f"teacher-forced case {index}: {len(ids)} tokens, {len(positions)} positions", flush=True)
    return out


def greedy(ref: Reference, ids: list[int], n_new: int) -> dict:
    ref.start()
    hidden = ref.step(ids)[-1:]
    out, gaps = [], []
    for _ in range(n_new):
        row = ref.logits(hidden)[0]
        top2 = np.partition(row, -2)[-2:]
        gaps.append(round(float(abs(top2[1] - top2[0])), 6))
        tok = int(np.argmax(row))
        out.append(tok)
        hidden = ref.step([tok])
    return {"greedy_ids": out, "top2_gaps": gaps}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], OUT, argv)
    path = args.gguf
    t0 = time.time()
    hp, tensors = read_model(path)
    ref = Reference(hp, tensors)
    llama = llama_cpp_reference()
    cases = llama["cases"]
    record = {
        "model": path.name,
        "reference": "float64 NumPy, gguf.quants.dequantize of every tensor, HF transformers modeling_gemma3.py "
        "(scripts/record_gemma3_float64_reference.py)",
        "gguf_package": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "numpy": np.__version__,
        "fixed_values": {
            "layer_pattern": PATTERN,
            "rope_local_base": LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR,
        },
        "probe_ids": PROBE_IDS,
        "n_new": llama["n_new"],
        "teacher_forced": teacher_forced(ref, cases),
        "greedy": [],
    }
    for i, c in enumerate(cases):
        g = greedy(ref, c["prompt_ids"], llama["n_new"])
        record["greedy"].append({"case": i, "prompt_ids": c["prompt_ids"], **g})
        same = next((k for k, (a, b) in enumerate(zip(g["greedy_ids"], c["greedy_ids"])) if a != b), None)
        print(f"greedy case {i}: {len(c['prompt_ids'])} tokens; llama.cpp parts at {same} ({time.time() - t0:.0f} s)")
    write_record(record, args.out, t0)
    return 0


def _dist_version(name: str) -> str:
    from importlib.metadata import version  # noqa: PLC0415

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
