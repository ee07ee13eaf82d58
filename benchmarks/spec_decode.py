"""Speculative decoding against plain decoding, side by side in one run, on the workloads the repository
ships (``benchmarks/workloads/spec_decode.json``): input-grounded conversations (code edits, quotes,
repeated turns) and open-ended ones (ShareGPT-like questions). Greedy, the default model on the CPU.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/spec_decode.py [--k 3] [--rounds 2] [--server 32]

Two engines, one with ``--speculative-config`` (n-gram, k drafts) and one without, loaded once each. Each
round runs every workload on both, alternating which goes first, so a change in the host's speed falls on
both. Batch 1: each conversation alone, tokens/s = generated tokens / wall time over the group. Batch 32
(open-ended): 32 variants of the open-ended conversations in one ``generate``. A row reports the medians
over rounds, the speed-up, the acceptance rate and mean accepted length (with the bonus token), and how
many outputs equal plain decoding's (greedy; a difference is a near-tie flipped by the verifier's float
order, counted, not hidden). ``--server N``: N open-ended chats at once through ``python server.py``, with and
without ``--speculative-config``, one server at a time. Run it on an otherwise idle host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import conditions, print_table, write_json  # noqa: E402

WORKLOADS = ROOT / "benchmarks" / "workloads" / "spec_decode.json"


def load_workloads(path=WORKLOADS) -> dict:
    """``{"input_grounded": [conversation, ...], "open_ended": [...]}``, each ``{"name", "messages"}``."""
    data = json.loads(Path(path).read_text())
    return {k: v for k, v in data.items() if isinstance(v, list)}


def batch_variants(convs: list, size: int) -> list:
    """``size`` distinct conversations cycling through ``convs`` (a numbered request line added, so that
    the batch does not collapse into shared prefixes and equal answers)."""
    out = []
    for i in range(size):
        conv = convs[i % len(convs)]
        msgs = [dict(m) for m in conv["messages"]]
        msgs[-1]["content"] += f" (request {i})"
        out.append({"name": f"{conv['name']}#{i}", "messages": msgs})
    return out


def run_group(llm, convs: list, params, batch: int) -> dict:
    """Generate ``convs`` ``batch`` at a time; tokens, seconds, outputs and the spec counters' change."""
    before = (llm.stats().get("spec_decode") or {}).copy()
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(convs), batch):
        outs += llm.chat([c["messages"] for c in convs[i : i + batch]], params)
    seconds = time.perf_counter() - t0
    after = llm.stats().get("spec_decode") or {}
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": seconds,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        **delta,
    }


async def _chat_all(url: str, convs: list, max_tokens: int) -> tuple:
    """Every conversation of ``convs`` at once to ``/v1/chat/completions`` (greedy); (tokens, seconds, texts)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

        async def one(conv):
            body = {"messages": conv["messages"], "max_tokens": max_tokens, "temperature": 0}
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                out = await r.json()
            return out["usage"]["completion_tokens"], out["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(c) for c in convs))
        return sum(n for n, _ in done), time.perf_counter() - t0, [t for _, t in done]


def server_rows(model: str, convs: list, spec: dict, max_tokens: int, rounds: int) -> list:
    """``python server.py`` with and without ``--speculative-config``, ``len(convs)`` chats at once, one
    server at a time (each warmed by one round first); medians of ``rounds``."""
    from benchmarks.serve import start_server, stop

    runs = {}
    for name, extra in (("off", []), ("ngram", ["--speculative-config", json.dumps(spec)])):
        args = ["--model", model, "--device", "cpu", "--max-num-seqs", str(len(convs)), *extra]
        proc, url, _ = start_server(args, 600)
        try:
            asyncio.run(_chat_all(url, convs[:2], 8))
            runs[name] = [asyncio.run(_chat_all(url, convs, max_tokens)) for _ in range(rounds)]
        finally:
            stop(proc)
    tps = {m: statistics.median(n / s for n, s, _ in r) for m, r in runs.items()}
    same = sum(a == b for a, b in zip(runs["off"][-1][2], runs["ngram"][-1][2]))
    return [
        {
            "workload": "open_ended (server)",
            "batch": len(convs),
            "requests": len(convs),
            "tokens": runs["ngram"][-1][0],
            "off_tok_s": tps["off"],
            "ngram_tok_s": tps["ngram"],
            "speedup": tps["ngram"] / tps["off"],
            "same_outputs": f"{same}/{len(convs)}",
        }
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--disable-by-batch-size", type=int, default=8, help="0: speculate at any batch size")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="the open-ended batch (0: skip)")
    p.add_argument("--server", type=int, default=0, help="also: this many open-ended chats at once through the server")
    p.add_argument("--quick", action="store_true", help="16 tokens, 1 round, batch 4 (a smoke test)")
    p.add_argument("--out", default="benchmarks/out")
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.rounds, args.batch = 16, 1, 4

    from rawpaged import LLM, SamplingParams
    from rawpaged import weights as rp_weights

    model = args.model or str(rp_weights.prepare(progress=True))
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "disable_by_batch_size": args.disable_by_batch_size or None,
    }
    engines = {
        "off": LLM(model=model, device="cpu", max_num_seqs=max(args.batch, 1)),
        "ngram": LLM(model=model, device="cpu", max_num_seqs=max(args.batch, 1), speculative_config=spec),
    }
    for llm in engines.values():
        llm.engine.warmup()
    work = load_workloads()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    cases = [("input_grounded", work["input_grounded"], 1), ("open_ended", work["open_ended"], 1)]
    if args.batch:
        cases.append(("open_ended", batch_variants(work["open_ended"], args.batch), args.batch))
    results = {(name, batch, m): [] for name, _, batch in cases for m in engines}
    for r in range(args.rounds):
        for name, convs, batch in cases:
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for method in order:
                results[(name, batch, method)].append(run_group(engines[method], convs, params, batch))

    rows = []
    for name, _, batch in cases:
        off, on = results[(name, batch, "off")], results[(name, batch, "ngram")]
        tps = {m: statistics.median(x["tokens"] / x["seconds"] for x in results[(name, batch, m)]) for m in engines}
        drafts = sum(x["num_drafts"] for x in on)
        draft_tokens = sum(x["num_draft_tokens"] for x in on)
        accepted = sum(x["num_accepted_tokens"] for x in on)
        same = sum(a == b for a, b in zip(off[-1]["outputs"], on[-1]["outputs"]))
        rows.append(
            {
                "workload": name,
                "batch": batch,
                "requests": len(off[-1]["outputs"]),
                "tokens": on[-1]["tokens"],
                "off_tok_s": tps["off"],
                "ngram_tok_s": tps["ngram"],
                "speedup": tps["ngram"] / tps["off"],
                "acceptance": accepted / draft_tokens if draft_tokens else 0.0,
                "mean_accepted_len": 1 + accepted / drafts if drafts else 1.0,
                "drafts_per_token": drafts / max(1, on[-1]["tokens"] * len(on)),
                "same_outputs": f"{same}/{len(off[-1]['outputs'])}",
            }
        )
    if args.server:
        convs = batch_variants(work["open_ended"], args.server)
        rows += server_rows(model, convs, spec, args.max_tokens, args.rounds)
    print(
        f"\nSpeculative decoding (n-gram, k={args.k}, lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
        f"off from batch {args.disable_by_batch_size or 'never'}), greedy, {args.max_tokens} tokens max, "
        f"median of {args.rounds} rounds"
    )
    print_table(
        rows,
        [
            "workload",
            "batch",
            "requests",
            "tokens",
            "off_tok_s",
            "ngram_tok_s",
            "speedup",
            "acceptance",
            "mean_accepted_len",
            "drafts_per_token",
            "same_outputs",
        ],
    )
    payload = {
        "conditions": conditions(model=model, speculative_config=spec, max_tokens=args.max_tokens, rounds=args.rounds),
        "rows": rows,
    }
    write_json(Path(args.out) / "spec_decode.json", payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
