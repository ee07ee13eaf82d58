"""Record HF transformers' greedy token ids on Gemma 3 270M's Q4_K_M GGUF (``python -m rawpaged.weights
prepare gemma-3-270m``) into ``tests/data/gemma3_270m_hf_greedy.json``, a second reference beside
``scripts/record_gemma3_float64_reference.py``'s for ``tests/model_executor/test_gemma3_gguf.py``.

    python -m venv /tmp/hf && /tmp/hf/bin/pip install --no-deps "torch==2.13.0+cpu" \\
        && /tmp/hf/bin/pip install typing_extensions sympy networkx jinja2 fsspec filelock \\
           transformers==5.25.0 gguf accelerate
    nice /tmp/hf/bin/python scripts/record_gemma3_hf_reference.py [--gguf FILE] [--out FILE.json]

Run by hand in a separate environment, never by the test suite (rawpaged does not depend on torch or
transformers). ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)``: transformers
reads the file's metadata into a ``Gemma3TextConfig`` (the values the file lacks take HF's defaults:
``sliding_window_pattern`` 6, ``rope_local_base_freq`` 10000, ``query_pre_attn_scalar`` 256),
dequantizes every tensor to float32 with the ``gguf`` package and subtracts 1 from the norm weights
(``modeling_gguf_pytorch_utils.Gemma2TensorProcessor``), which ``Gemma3RMSNorm`` adds back. Eager
attention (``modeling_gemma3.eager_attention_forward``), a ``DynamicCache``; the prompt ids are
llama.cpp's, from ``tests/data/gemma3_270m_llama_cpp_greedy.json``; each step takes the argmax of the
last position's float32 logits (EOS not stopping) and records the gap between the two largest.
"""

from __future__ import annotations

import sys
import time

import torch
import transformers
from gemma3_reference_files import ROOT, llama_cpp_reference, parse_args, write_record
from transformers import AutoModelForCausalLM, DynamicCache

OUT = ROOT / "tests" / "data" / "gemma3_270m_hf_greedy.json"


@torch.no_grad()
def greedy(model, ids: list[int], n_new: int) -> dict:
    cache = DynamicCache(config=model.config)
    x = torch.tensor([ids])
    out, gaps = [], []
    for _ in range(n_new):
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        gaps.append(round(float(top2[0] - top2[1]), 6))
        tok = int(torch.argmax(logits))
        out.append(tok)
        x = torch.tensor([[tok]])
    return {"greedy_ids": out, "top2_gaps": gaps}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], OUT, argv)
    path = args.gguf
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = model.config
    llama = llama_cpp_reference()
    record = {
        "model": path.name,
        "reference": f"HF transformers {transformers.__version__} Gemma3ForCausalLM, gguf_file=, float32, "
        f"eager attention, torch {torch.__version__} (scripts/record_gemma3_hf_reference.py)",
        "config": {
            "layer_types": list(cfg.layer_types),
            "rope_parameters": cfg.rope_parameters,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
            "sliding_window": cfg.sliding_window,
        },
        "n_new": llama["n_new"],
        "cases": [],
    }
    for i, c in enumerate(llama["cases"]):
        g = greedy(model, c["prompt_ids"], llama["n_new"])
        record["cases"].append({"case": i, "prompt_ids": c["prompt_ids"], **g})
        print(f"case {i}: {len(c['prompt_ids'])} tokens, {g['greedy_ids'][:6]} ... ({time.time() - t0:.0f} s)")
    write_record(record, args.out, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
