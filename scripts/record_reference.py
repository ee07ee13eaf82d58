"""Record reference outputs of the default model from an independent implementation (HF transformers).

Run once by hand, outside the test suite; never a runtime or test dependency of rawpaged:

    python -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 transformers safetensors
    python -m rawpaged.weights prepare
    /tmp/refvenv/bin/python scripts/record_reference.py [--model DIR]

Writes tests/fixtures/reference_greedy.json (greedy continuations + top-5 logprobs of the first generated
position) and tests/fixtures/reference_beam.json (beam search, best sequence and all returned beams).
Prompt token ids come from the model directory's tokenizer.json (the `tokenizers` library), i.e. the
tokenizer rawpaged uses; the model runs in float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import tokenizers
import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
STORY_PROMPT = "Once upon a time, there was a little girl named"
PARAGRAPH_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "several existing technologies into a single system for producing books. Movable metal type, oil-based "
    "ink and a wooden screw press allowed a small workshop to print hundreds of identical pages in a day. "
    "Within fifty years, presses had spread to more than two hundred cities across Europe, and the price of "
    "books fell sharply. The same workshops also printed pamphlets, maps and calendars, which reached "
    "readers who had never owned a book. Historians argue that this change"
)
GREEDY_PROMPTS = [
    ("chat_capital", CHAT_PROMPT),
    ("story_emma", STORY_PROMPT),
    ("code_python", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("list_fruits", "Here is a list of five fruits:\n1."),
    ("paragraph", PARAGRAPH_PROMPT),
    ("digits", "The year 1969 was when humans first landed on the moon. 2024 - 1969 ="),
]
BEAM_PROMPTS = [
    ("chat_capital", CHAT_PROMPT),
    ("story_emma", STORY_PROMPT),
    ("list_fruits", "Here is a list of five fruits:\n1."),
]

KNOWN_CHAT_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
KNOWN_EMMA = " Emma who loved to play in the sun. She would often go to the beach and play with her friends."

GREEDY_MAX_NEW = 32
BEAM_ARGS = dict(
    max_new_tokens=16,
    num_beams=4,
    num_return_sequences=4,
    do_sample=False,
    length_penalty=1.0,
    early_stopping=False,
)


def versions() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "weights" / "SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = tokenizers.Tokenizer.from_file(str(args.model / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
    model.eval()
    eos = model.config.eos_token_id
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else eos

    def encode(text: str) -> list[int]:
        return tok.encode(text).ids

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    # ---------------------------------------------------------------- greedy
    greedy = []
    for name, prompt in GREEDY_PROMPTS:
        ids = encode(prompt)
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0, -1].double()
            lp = torch.log_softmax(logits, dim=-1)
            top = torch.topk(lp, 5)
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=GREEDY_MAX_NEW,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )[0, len(ids) :].tolist()
        # generate() pads finished rows; with batch 1 it stops at eos, so nothing to strip.
        assert out[0] == int(top.indices[0]), (name, out[0], top.indices.tolist())
        greedy.append(
            {
                "name": name,
                "prompt": prompt,
                "prompt_token_ids": ids,
                "output_token_ids": out,
                "output_text": decode(out),
                "first_step_top5": [{"token_id": int(i), "logprob": float(v)} for v, i in zip(top.values, top.indices)],
            }
        )
        print(f"{name}: {len(ids)} prompt tokens -> {decode(out)!r}", file=sys.stderr)

    chat = next(g for g in greedy if g["name"] == "chat_capital")
    emma = next(g for g in greedy if g["name"] == "story_emma")
    assert len(chat["prompt_token_ids"]) == 16 and chat["prompt_token_ids"][:3] == [1, 4093, 198], chat
    assert chat["output_token_ids"] == KNOWN_CHAT_IDS, chat["output_token_ids"]
    assert len(emma["prompt_token_ids"]) == 11, emma["prompt_token_ids"]
    assert emma["output_text"].startswith(KNOWN_EMMA), emma["output_text"]

    common = {
        "model": args.model.name,
        "dtype": "float32",
        "device": "cpu",
        "implementation": "transformers AutoModelForCausalLM",
        "versions": versions(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    greedy_doc = {
        **common,
        "generate_args": {"max_new_tokens": GREEDY_MAX_NEW, "do_sample": False, "eos_token_id": eos},
        "notes": "output_token_ids stop at (and include) eos when produced; first_step_top5 is "
        "log_softmax in float64 of the logits at the last prompt position.",
        "prompts": greedy,
    }
    (args.out / "reference_greedy.json").write_text(json.dumps(greedy_doc, indent=1, ensure_ascii=False) + "\n")

    # ---------------------------------------------------------------- beam search
    beams = []
    for name, prompt in BEAM_PROMPTS:
        ids = encode(prompt)
        x = torch.tensor([ids])
        with torch.no_grad():
            res = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                eos_token_id=eos,
                pad_token_id=pad,
                output_scores=True,
                return_dict_in_generate=True,
                **BEAM_ARGS,
            )
        seqs = []
        for k in range(res.sequences.shape[0]):
            gen = res.sequences[k, len(ids) :].tolist()
            # Rows shorter than the longest are right-padded with pad (== eos here): keep up to first eos.
            if eos in gen:
                gen = gen[: gen.index(eos) + 1]
            seqs.append(
                {
                    "output_token_ids": gen,
                    "output_text": decode(gen),
                    "sequence_score": float(res.sequences_scores[k]),
                }
            )
        beams.append({"name": name, "prompt": prompt, "prompt_token_ids": ids, "best": seqs[0], "beams": seqs})
        print(f"beam {name}: " + " | ".join(repr(s["output_text"]) for s in seqs), file=sys.stderr)

    beam_doc = {
        **common,
        "generate_args": {**BEAM_ARGS, "eos_token_id": eos, "pad_token_id": pad},
        "notes": "HF beam search; sequence_score = (sum of the generated tokens' logprobs) / (number of "
        "generated tokens, eos included) ** length_penalty (checked against a forward pass); beams "
        "are in the order returned (best first); outputs are cut after the first eos (HF right-pads "
        "finished beams with pad == eos).",
        "prompts": beams,
    }
    (args.out / "reference_beam.json").write_text(json.dumps(beam_doc, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out / 'reference_greedy.json'} and {args.out / 'reference_beam.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
