"""What paging buys: KV memory waste, capacity and throughput, paged vs contiguous reservation.

Replays request traces through rawpaged's real Scheduler and BlockAllocator (no model; see
benchmarks/memsim.py for the step model and the exact definitions) under these KV layouts, all over
the same pool of --num-slots token slots:

  contig-maxlen   contiguous extent of max_model_len per sequence (naive servers)
  contig-oracle   contiguous extent of prompt + true output length (Orca, oracle max_tokens)
  contig-2x       contiguous extent of prompt + 2 x true output (over-estimated max_tokens; --overestimate)
  paged-B         rawpaged blocks of B tokens (--block-sizes), no sharing
  paged-16-share  blocks of 16 with prefix caching and fork for n > 1 (sharing workloads only)

Default workloads (seed --seed, all requests arrive at step 0 unless --arrival-rate):
  sharegpt     --sharegpt-requests requests, lognormal input mean 160 (sigma 0.8), output mean 340 (sigma 0.8)
  alpaca       --alpaca-requests requests, lognormal input mean 20 (sigma 0.6), output mean 60 (sigma 0.6)
  alpaca+sys   alpaca, 50% of requests prefixed by one shared 128-token system prompt
  alpaca-n4    alpaca, n = 4 samples per request (each sample draws its own output length)
  sharegpt-n4  sharegpt, n = 4
--trace FILE replaces them with one workload read from a CSV/JSONL of input_len,output_len
(optional arrival, n, shared_prefix_len).

Writes <out>/memory_study.json, <out>/memory_<workload>.png (memory use over time per layout), prints a
table. Usage: python benchmarks/memory_study.py [--out benchmarks/out] [--trace FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.memsim import Layout, default_layouts, load_trace, simulate, synthetic_trace, trace_summary  # noqa: E402

SERIES_POINTS = 400  # per layout in the JSON (bin means)


def _bin_means(x: np.ndarray, y: np.ndarray, bins: int):
    if len(x) <= bins:
        return x, y
    edges = np.linspace(0, len(x), bins + 1).astype(int)
    xs = np.array([x[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    ys = np.array([y[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
    return xs, ys


def downsample(series: dict, bins: int = SERIES_POINTS) -> dict:
    if not series or not series.get("step"):
        return {}
    x = np.asarray(series["step"], dtype=float)
    out = {}
    for k, v in series.items():
        if k == "step":
            continue
        xs, ys = _bin_means(x, np.asarray(v, dtype=float), bins)
        out[k] = [round(float(a), 2) for a in ys]
    out["step"] = [round(float(a), 1) for a in xs]
    return out


def workloads(args) -> dict:
    """name -> (trace, description, layouts)."""
    base = default_layouts(block_sizes=args.block_sizes)
    if args.overestimate != 2.0:
        base = [
            Layout(f"contig-{args.overestimate:g}x", "contiguous", reserve="overestimate", factor=args.overestimate)
            if lay.reserve == "overestimate"
            else lay
            for lay in base
        ]
    share = [lay for lay in base if lay.name in ("contig-maxlen", "contig-oracle", "paged-16")]
    share.append(Layout("paged-16-share", "paged", block_size=16, sharing=True))
    kw = dict(max_model_len=args.max_model_len, arrival_rate=args.arrival_rate)
    arr = (
        f"Poisson arrivals, {args.arrival_rate} requests/step" if args.arrival_rate else "all requests arrive at step 0"
    )
    if args.trace:
        trace = load_trace(args.trace, args.max_model_len)
        if args.arrival_rate:  # Poisson arrivals overriding the file's (if any)
            rng = np.random.default_rng(args.seed)
            gaps = np.floor(np.cumsum(rng.exponential(1.0 / args.arrival_rate, len(trace)))).astype(int)
            for r, a in zip(trace, gaps):
                r.arrival = int(a)
        sharing = any(r.n > 1 or r.shared_prefix_len for r in trace)
        layouts = base + ([Layout("paged-16-share", "paged", block_size=16, sharing=True)] if sharing else [])
        return {Path(args.trace).stem: (trace, f"user trace {args.trace}", layouts)}
    s, a = args.sharegpt_requests, args.alpaca_requests
    w = {
        "sharegpt": (
            synthetic_trace("sharegpt", s, args.seed, **kw),
            f"ShareGPT-like: {s} requests, input lognormal mean 160 sigma 0.8 (clip [1,1024]), "
            f"output lognormal mean 340 sigma 0.8 (clip to max_model_len), {arr}",
            base,
        ),
        "alpaca": (
            synthetic_trace("alpaca", a, args.seed, **kw),
            f"Alpaca-like: {a} requests, input lognormal mean 20 sigma 0.6, output lognormal mean 60 sigma 0.6, {arr}",
            base,
        ),
    }
    if not args.no_sharing:
        w["alpaca+sys"] = (
            synthetic_trace("alpaca", a, args.seed, shared_prefix_len=128, shared_fraction=0.5, **kw),
            f"Alpaca-like ({a} requests) with one shared 128-token system prompt prepended to a "
            f"random 50% of requests, {arr}",
            share,
        )
        w["alpaca-n4"] = (
            synthetic_trace("alpaca", max(1, a // 4), args.seed, n=4, **kw),
            f"Alpaca-like, {max(1, a // 4)} requests x n=4 samples (parallel sampling; each sample "
            f"its own output length), {arr}",
            share,
        )
        w["sharegpt-n4"] = (
            synthetic_trace("sharegpt", max(1, s // 4), args.seed, n=4, **kw),
            f"ShareGPT-like, {max(1, s // 4)} requests x n=4 samples, {arr}",
            share,
        )
    return w


def plot(path: Path, workload: str, results: list, num_slots: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(n, 1, figsize=(10, 1.6 * n + 1), sharex=True, squeeze=False)
    xmax = max(r.steps for r in results)
    colors = {
        "used (token KV)": "#2b7bba",
        "reserved, written later": "#9ecae1",
        "reserved, never written": "#fdae6b",
        "free, unusable (external frag.)": "#e6550d",
        "free": "#f0f0f0",
    }
    for ax, r in zip(axes[:, 0], results):
        s = r.series
        x = np.asarray(s["step"], float)
        parts = [np.asarray(s[k], float) / num_slots for k in ("used", "internal_future", "internal_never", "external")]
        free = 1.0 - (np.asarray(s["reserved"], float) / num_slots) - parts[3]
        ys = [_bin_means(x, p, 2000)[1] for p in parts + [free]]
        xs = _bin_means(x, parts[0], 2000)[0]
        ax.stackplot(xs, *ys, colors=list(colors.values()), labels=list(colors.keys()), linewidth=0)
        ax.set_xlim(0, xmax)
        ax.set_ylim(0, 1)
        ax.set_ylabel("pool", fontsize=8)
        ax.set_title(
            f"{r.layout}: utilization {100 * r.utilization:.1f}% of reserved, "
            f"peak {r.peak_running_requests} requests, makespan {r.steps} steps",
            fontsize=9,
            loc="left",
        )
        ax.tick_params(labelsize=8)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("simulated step")
    fig.suptitle(f"KV pool ({num_slots} token slots) over time: {workload}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLS = [
    ("layout", "layout", "{}"),
    ("util%", "utilization", "{:.1f}"),
    ("waste%", "waste", "{:.1f}"),
    ("floor%", "paged_waste_floor", "{:.1f}"),
    ("int-later%", "internal_future_frac_of_reserved", "{:.1f}"),
    ("int-never%", "internal_never_frac_of_reserved", "{:.1f}"),
    ("ext%pool", "external_frac_of_pool", "{:.1f}"),
    ("tok/slot", "logical_per_reserved", "{:.3f}"),
    ("peak req", "peak_running_requests", "{}"),
    ("mean seqs", "mean_running_seqs", "{:.1f}"),
    ("preempt", "preemptions", "{}"),
    ("req/1k steps", "requests_per_1k_steps", "{:.1f}"),
    ("out tok/step", "output_tokens_per_step", "{:.1f}"),
    ("latency", "mean_latency_steps", "{:.0f}"),
    ("steps", "steps", "{}"),
]
PCT = {
    "utilization",
    "waste",
    "paged_waste_floor",
    "internal_future_frac_of_reserved",
    "internal_never_frac_of_reserved",
    "external_frac_of_pool",
}


def format_table(rows: list, markdown: bool = False) -> str:
    def cell(row, key, fmt):
        v = row[key]
        if v is None:
            return "-"
        return fmt.format(100 * v if key in PCT else v)

    head = [c[0] for c in COLS]
    body = [[cell(r, k, f) for _, k, f in COLS] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def check_goals(all_rows: dict) -> list:
    goals = []
    for wl in ("sharegpt", "alpaca"):
        rows = {r["layout"]: r for r in all_rows.get(wl, [])}
        p, m = rows.get("paged-16"), rows.get("contig-maxlen")
        if not p or not m:
            continue
        goals.append(
            {
                "goal": f"{wl}: paged-16 waste < 4% of reserved slots",
                "value": p["waste"],
                "floor": p["paged_waste_floor"],
                "met": p["waste"] < 0.04,
            }
        )
        ratio = p["peak_running_requests"] / max(1, m["peak_running_requests"])
        goals.append(
            {
                "goal": f"{wl}: paged-16 peak concurrent requests >= 2x contig-maxlen",
                "value": ratio,
                "mean_ratio": p["mean_running_seqs"] / max(1e-9, m["mean_running_seqs"]),
                "met": ratio >= 2,
            }
        )
    return goals


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--trace", help="CSV/JSONL with input_len,output_len[,arrival,n,shared_prefix_len]")
    ap.add_argument("--num-slots", type=int, default=16384, help="KV pool in token slots (all layouts)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    ap.add_argument("--overestimate", type=float, default=2.0, help="max_tokens factor of contig-<f>x")
    ap.add_argument("--sharegpt-requests", type=int, default=1000)
    ap.add_argument("--alpaca-requests", type=int, default=2000)
    ap.add_argument("--arrival-rate", type=float, default=None, help="Poisson requests/step (default: all at 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sharing", action="store_true", help="skip the prefix-sharing workloads")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quick", action="store_true", help="1/5 of the requests (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.sharegpt_requests //= 5
        args.alpaca_requests //= 5
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    conditions = {
        "num_slots": args.num_slots,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "arrivals": f"Poisson {args.arrival_rate}/step" if args.arrival_rate else "all at step 0",
        "step_model": "one engine step per simulated step; every step has the same duration",
    }
    report = {"conditions": conditions, "workloads": {}, "goals": []}
    all_rows = {}
    for name, (trace, desc, layouts) in workloads(args).items():
        results = []
        for lay in layouts:
            r = simulate(
                trace,
                lay,
                args.num_slots,
                args.max_model_len,
                args.max_num_seqs,
                args.max_num_batched_tokens,
                record_series=True,
            )
            results.append(r)
        rows = [r.summary() for r in results]
        all_rows[name] = rows
        report["workloads"][name] = {
            "description": desc,
            "trace": trace_summary(trace),
            "layouts": [dict(row, series=downsample(r.series)) for row, r in zip(rows, results)],
        }
        ts = trace_summary(trace)
        print(
            f"\n== {name}: {desc}\n   realized: input mean {ts['input_mean']:.1f} (p50 {ts['input_p50']:.0f}, "
            f"max {ts['input_max']}), output mean {ts['output_mean']:.1f} (p50 {ts['output_p50']:.0f}, "
            f"max {ts['output_max']}), {ts['sequences']} sequences"
        )
        print(format_table(rows))
        if not args.no_plot:
            plot(out / f"memory_{name.replace('+', '_')}.png", name, results, args.num_slots)
    report["goals"] = check_goals(all_rows)
    report["elapsed_s"] = round(time.time() - t0, 1)
    (out / "memory_study.json").write_text(json.dumps(report, indent=1))
    print()
    for g in report["goals"]:
        extra = (
            f" (floor {100 * g['floor']:.1f}%)" if "floor" in g else f" (mean-concurrency ratio {g['mean_ratio']:.1f}x)"
        )
        val = f"{100 * g['value']:.1f}%" if "waste" in g["goal"] else f"{g['value']:.1f}x"
        print(f"[{'MET' if g['met'] else 'NOT MET'}] {g['goal']}: {val}{extra}")
    print(f"\nwrote {out / 'memory_study.json'} and plots in {report['elapsed_s']} s")
    return report


if __name__ == "__main__":
    main()
