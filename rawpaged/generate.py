"""Command line: ``python -m rawpaged.generate --prompt "..." [--chat] [--max-tokens N] [--temperature T]``.

Prints the generated text. The default model is prepared on first use.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rawpaged.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    ap.add_argument("--chat", action="store_true", help="wrap the prompt with the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--model", default=None, help="HF-style model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="auto: float32 on the CPU; on CUDA the checkpoint's float16/bfloat16, else bfloat16")
    args = ap.parse_args(argv)

    from rawpaged import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            out = llm.generate([args.prompt], params)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
