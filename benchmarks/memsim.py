"""KV-memory simulation: replay a request trace through rawpaged's real ``Scheduler`` and
``KVCacheManager`` (no model) under paged and contiguous-reservation KV layouts at one KV budget.

A simulated step is one engine step without the forward pass: ``Scheduler.schedule()`` picks
(sequence, new tokens) pairs exactly as in the engine (FCFS admission, chunked prefill under a token
budget, preemption by recompute when the pool runs dry); a sequence whose KV then covers all of its
tokens samples one token (after its prompt, one per step), and ``Scheduler.update_from_output`` applies
the step as in the engine: ``num_computed_tokens`` advances, full blocks are cached, the token is
appended, and a sequence with its trace's output length finishes, which frees its KV. Requests with
``n > 1`` samples either fork after the prompt (paged with sharing, as ``LLMEngine`` does) or run as
``n`` independent sequences (every other layout).

Layouts (all over the same pool of ``num_slots`` KV token slots):

* ``paged``: ``KVCacheManager(num_slots // block_size, block_size)``; a sequence holds
  ``ceil(tokens / block_size)`` blocks, taken on demand. With ``sharing``: prefix caching on and
  ``n > 1`` samples forked (shared blocks, copy-on-write).
* ``contiguous``: every sequence reserves one contiguous extent of ``reserve(seq)`` slots at admission
  (``max_model_len``; ``prompt + output`` = Orca "oracle"; ``prompt + factor * output`` = over-estimate,
  capped at ``max_model_len``), first-fit over an address-ordered free list that coalesces on free, so
  external fragmentation is real. FCFS: the queue head waits until an extent fits. Token bookkeeping
  still goes through the real scheduler and a ``KVCacheManager`` with ``block_size=1`` sized to the
  pool (never the binding constraint: a sequence's tokens never exceed its extent).

Accounting, measured once per step after its slots are allocated, i.e. as they are once the step's KV
is written and before any frees (all in token slots; C = pool):

* ``reserved`` R: slots held by live sequences (paged: used blocks x block_size; contiguous: sum of
  extents).
* ``used`` U: slots holding the KV of a token (paged with sharing: physical, a shared block counts once).
* ``internal`` = R - U: reserved but holding no token. Split into ``internal_future`` (positions this
  sequence will still write before it finishes) and ``internal_never`` (positions it will never write:
  over-reservation, and a paged sequence's unfilled tail of its last block when it finishes).
  A sequence of P prompt and O output tokens writes KV for P + O - 1 positions (the last sampled
  token's KV is never computed).
* ``external``: free slots C - R that are unusable for the next admission: at a step where the FCFS
  queue head could not be admitted because no free extent is large enough although C - R >= its
  reservation, ``external`` = C - R; otherwise 0. Always 0 for paged (any free block serves).
* utilization = sum U / sum R over steps (time-averaged, every step weighs the same); waste = 1 - it.
* ``logical``: tokens the live sequences can read (sum of their lengths); > U only with sharing, where
  logical / R is the effective tokens served per reserved slot.

This module imports only numpy and rawpaged (no matplotlib).
"""

from __future__ import annotations

import bisect
import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rawpaged.core.kv_cache_manager import KVCacheManager
from rawpaged.core.scheduler import Scheduler
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams

# --------------------------------------------------------------------------------------------- traces


@dataclass
class TraceRequest:
    """One request: ``input_len`` prompt tokens, of which the first ``shared_prefix_len`` are a system
    prompt common to all requests that have one; one output length per sample (``n = len``)."""

    input_len: int
    output_lens: list
    arrival: int = 0  # step at which it arrives
    shared_prefix_len: int = 0

    @property
    def n(self) -> int:
        return len(self.output_lens)


# Lognormal parameters: lengths = round(lognormal(mu, sigma)) with mu = ln(mean) - sigma^2 / 2 (so the
# untruncated mean is ``mean``), clipped to [1, max_input] (input) and [1, max_model_len - input] (output).
WORKLOADS = {
    # vLLM paper (Kwon et al. 2023, Fig. 11): ShareGPT mean 161 in / 338 out; Alpaca 19 in / 58 out.
    "sharegpt": {"in_mean": 160.0, "in_sigma": 0.8, "out_mean": 340.0, "out_sigma": 0.8},
    "alpaca": {"in_mean": 20.0, "in_sigma": 0.6, "out_mean": 60.0, "out_sigma": 0.6},
}


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma * sigma / 2
    return np.rint(rng.lognormal(mu, sigma, size)).astype(np.int64)


def synthetic_trace(
    workload: str,
    num_requests: int,
    seed: int = 0,
    max_model_len: int = 2048,
    max_input: int = 1024,
    n: int = 1,
    shared_prefix_len: int = 0,
    shared_fraction: float = 0.0,
    arrival_rate: float | None = None,
) -> list:
    """``num_requests`` requests of ``WORKLOADS[workload]``.

    ``n`` samples per request, each with its own output length from the same distribution. A fraction
    ``shared_fraction`` of requests (chosen at random) get a ``shared_prefix_len``-token system prompt
    prepended to their drawn input. ``arrival_rate``: None = all arrive at step 0; else a Poisson process
    of that many requests per step (arrival step = floor of the cumulative exponential gaps).
    """
    w = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    ins = np.clip(_lognormal(rng, w["in_mean"], w["in_sigma"], num_requests), 1, max_input)
    outs = _lognormal(rng, w["out_mean"], w["out_sigma"], num_requests * n).reshape(num_requests, n)
    has_sys = rng.random(num_requests) < shared_fraction
    if arrival_rate:
        arrivals = np.floor(np.cumsum(rng.exponential(1.0 / arrival_rate, num_requests))).astype(np.int64)
    else:
        arrivals = np.zeros(num_requests, np.int64)
    trace = []
    for i in range(num_requests):
        sys_len = shared_prefix_len if has_sys[i] else 0
        inp = int(min(ins[i] + sys_len, max_model_len - 1))
        o = [int(x) for x in np.clip(outs[i], 1, max_model_len - inp)]
        trace.append(TraceRequest(inp, o, int(arrivals[i]), min(sys_len, inp)))
    return trace


def load_trace(path, max_model_len: int | None = None) -> list:
    """A CSV (header with ``input_len,output_len``) or JSONL (objects with those keys) file.

    Optional columns/keys: ``arrival`` (step, default 0), ``n`` (samples, each of ``output_len``),
    ``shared_prefix_len``. Rows with ``input_len + output_len > max_model_len`` raise ValueError.
    """
    path = Path(path)
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    trace = []
    for k, row in enumerate(rows):
        try:
            inp, out = int(row["input_len"]), int(row["output_len"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: row {k + 1} needs integer input_len and output_len ({e})") from None
        if inp < 1 or out < 1:
            raise ValueError(f"{path}: row {k + 1}: lengths must be >= 1")
        if max_model_len is not None and inp + out > max_model_len:
            raise ValueError(
                f"{path}: row {k + 1}: input_len + output_len = {inp + out} > max_model_len {max_model_len}"
            )
        n = int(row.get("n") or 1)
        trace.append(TraceRequest(inp, [out] * n, int(row.get("arrival") or 0), int(row.get("shared_prefix_len") or 0)))
    return trace


def trace_summary(trace: list) -> dict:
    ins = np.array([r.input_len for r in trace])
    outs = np.array([o for r in trace for o in r.output_lens])
    return {
        "requests": len(trace),
        "sequences": int(len(outs)),
        "input_mean": float(ins.mean()),
        "input_p50": float(np.median(ins)),
        "input_max": int(ins.max()),
        "output_mean": float(outs.mean()),
        "output_p50": float(np.median(outs)),
        "output_max": int(outs.max()),
        "with_shared_prefix": int(sum(r.shared_prefix_len > 0 for r in trace)),
        "last_arrival": int(max(r.arrival for r in trace)),
    }


# -------------------------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """``kind``: "paged" or "contiguous". ``reserve`` (contiguous): "max_model_len", "oracle" (prompt +
    true output) or "overestimate" (prompt + ``factor`` x true output). ``sharing`` (paged): prefix
    caching + fork for n > 1."""

    name: str
    kind: str
    block_size: int = 1
    reserve: str = "oracle"
    factor: float = 2.0
    sharing: bool = False


def default_layouts(block_sizes=(8, 16, 32), sharing_block_sizes=()) -> list:
    layouts = [
        Layout("contig-maxlen", "contiguous", reserve="max_model_len"),
        Layout("contig-oracle", "contiguous", reserve="oracle"),
        Layout("contig-2x", "contiguous", reserve="overestimate", factor=2.0),
    ]
    layouts += [Layout(f"paged-{bs}", "paged", block_size=bs) for bs in block_sizes]
    layouts += [Layout(f"paged-{bs}-share", "paged", block_size=bs, sharing=True) for bs in sharing_block_sizes]
    return layouts


class ExtentAdmission:
    """Contiguous reservation: each admitted sequence gets one extent of ``reserve(seq)`` slots out of
    ``[0, num_slots)``, first-fit (lowest address) over an address-ordered free list; freeing coalesces
    with free neighbours. An admission policy for ``Scheduler``."""

    def __init__(self, num_slots: int, reserve):
        self.num_slots = num_slots
        self.reserve = reserve
        self._starts = [0]  # free extents, sorted by start
        self._lens = [num_slots]
        self.extents: dict[int, tuple[int, int]] = {}  # seq_id -> (start, length)
        self.reserved_slots = 0

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.reserved_slots

    @property
    def largest_free_extent(self) -> int:
        return max(self._lens, default=0)

    def free_extents(self) -> list:
        return list(zip(self._starts, self._lens))

    def _first_fit(self, size: int) -> int | None:
        for i, length in enumerate(self._lens):
            if length >= size:
                return i
        return None

    def can_admit(self, seq) -> bool:
        return self._first_fit(self.reserve(seq)) is not None

    def admitted(self, seq) -> None:
        size = self.reserve(seq)
        i = self._first_fit(size)
        if i is None:
            raise RuntimeError("admitted without a fitting extent")
        start = self._starts[i]
        if self._lens[i] == size:
            del self._starts[i], self._lens[i]
        else:
            self._starts[i] += size
            self._lens[i] -= size
        self.extents[seq.seq_id] = (start, size)
        self.reserved_slots += size

    def released(self, seq) -> None:
        ext = self.extents.pop(seq.seq_id, None)
        if ext is None:
            return
        start, size = ext
        self.reserved_slots -= size
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lens.insert(i, size)
        if i + 1 < len(self._starts) and start + size == self._starts[i + 1]:  # merge right
            self._lens[i] += self._lens.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == start:  # merge left
            self._lens[i - 1] += self._lens.pop(i)
            self._starts.pop(i)

    def check(self) -> None:
        """Free extents are disjoint, coalesced, and free + reserved == pool."""
        for k in range(1, len(self._starts)):
            assert self._starts[k - 1] + self._lens[k - 1] < self._starts[k], "free extents overlap/touch"
        assert sum(self._lens) + self.reserved_slots == self.num_slots


# ---------------------------------------------------------------------------------------- simulation


@dataclass
class SimResult:
    layout: str
    num_slots: int
    block_size: int
    steps: int  # makespan: index of the last step + 1 (idle steps included)
    busy_steps: int  # steps with work (the averages are over these)
    num_requests: int
    num_sequences: int
    output_tokens: int
    peak_running_requests: int
    peak_running_seqs: int
    mean_running_seqs: float
    num_preemptions: int
    ext_blocked_steps: int  # steps where the queue head waited only because of external fragmentation
    sum_reserved: int
    sum_used: int
    sum_internal_future: int
    sum_internal_never: int
    sum_external: int
    sum_running_seqs: int
    sum_logical: int
    mean_latency_steps: float
    series: dict = field(default_factory=dict)  # per busy step: step, reserved, used, ... (lists)

    @property
    def utilization(self) -> float:
        return self.sum_used / self.sum_reserved if self.sum_reserved else 1.0

    @property
    def waste(self) -> float:
        return 1.0 - self.utilization

    @property
    def paged_floor(self) -> float | None:
        """Expected waste fraction from last-block slack alone: (block_size-1)/2 slots per running
        sequence, over the reserved slots (None for contiguous layouts)."""
        if self.block_size <= 1 or not self.sum_reserved:
            return None
        return self.sum_running_seqs * (self.block_size - 1) / 2 / self.sum_reserved

    def summary(self) -> dict:
        b = self.busy_steps or 1
        cap = self.num_slots * b
        return {
            "layout": self.layout,
            "num_slots": self.num_slots,
            "block_size": self.block_size,
            "steps": self.steps,
            "busy_steps": self.busy_steps,
            "requests": self.num_requests,
            "sequences": self.num_sequences,
            "output_tokens": self.output_tokens,
            "utilization": self.utilization,
            "waste": self.waste,
            "internal_frac_of_reserved": (self.sum_reserved - self.sum_used) / self.sum_reserved
            if self.sum_reserved
            else 0.0,
            "internal_future_frac_of_reserved": self.sum_internal_future / self.sum_reserved
            if self.sum_reserved
            else 0.0,
            "internal_never_frac_of_reserved": self.sum_internal_never / self.sum_reserved
            if self.sum_reserved
            else 0.0,
            "paged_waste_floor": self.paged_floor,
            "logical_per_reserved": self.sum_logical / self.sum_reserved if self.sum_reserved else 0.0,
            "used_frac_of_pool": self.sum_used / cap,
            "reserved_frac_of_pool": self.sum_reserved / cap,
            "external_frac_of_pool": self.sum_external / cap,
            "ext_blocked_steps": self.ext_blocked_steps,
            "mean_internal_slots": (self.sum_reserved - self.sum_used) / b,
            "mean_external_slots": self.sum_external / b,
            "peak_running_requests": self.peak_running_requests,
            "peak_running_seqs": self.peak_running_seqs,
            "mean_running_seqs": self.mean_running_seqs,
            "preemptions": self.num_preemptions,
            "requests_per_1k_steps": 1000.0 * self.num_requests / self.steps if self.steps else 0.0,
            "output_tokens_per_step": self.output_tokens / self.steps if self.steps else 0.0,
            "mean_latency_steps": self.mean_latency_steps,
        }


def _reserve_fn(layout: Layout, max_model_len: int):
    """Contiguous reservation size of a sequence (its SamplingParams.max_tokens is its true output)."""
    if layout.reserve == "max_model_len":
        return lambda seq: max_model_len
    if layout.reserve == "oracle":
        return lambda seq: min(seq.num_prompt_tokens + seq.sampling_params.max_tokens, max_model_len)
    if layout.reserve == "overestimate":
        f = layout.factor
        return lambda seq: min(seq.num_prompt_tokens + math.ceil(f * seq.sampling_params.max_tokens), max_model_len)
    raise ValueError(f"unknown reserve {layout.reserve!r}")


class _TokenSource:
    """Distinct token ids (so prefix caching matches only the shared system prompt)."""

    def __init__(self, shared_len: int):
        self.system_prompt = list(range(1, shared_len + 1))
        self._next = 1_000_000

    def fresh(self, k: int) -> list:
        start = self._next
        self._next += k
        return list(range(start, start + k))


def simulate(
    trace: list,
    layout: Layout,
    num_slots: int,
    max_model_len: int = 2048,
    max_num_seqs: int = 1024,
    max_num_batched_tokens: int = 2048,
    record_series: bool = True,
    check_invariants: bool = False,
    max_steps: int = 10_000_000,
) -> SimResult:
    """Replay ``trace`` under ``layout`` over ``num_slots`` KV slots; see the module docstring."""
    if layout.kind == "paged":
        bs = layout.block_size
        if num_slots % bs:
            raise ValueError(f"num_slots {num_slots} is not a multiple of block_size {bs}")
        kv = KVCacheManager(num_slots // bs, bs, enable_prefix_caching=layout.sharing)
        policy = None
        capacity = None
    elif layout.kind == "contiguous":
        bs = 1
        kv = KVCacheManager(num_slots, 1, enable_prefix_caching=False)
        policy = ExtentAdmission(num_slots, _reserve_fn(layout, max_model_len))
        capacity = policy.reserve
    else:
        raise ValueError(f"unknown layout kind {layout.kind!r}")
    sched = Scheduler(kv, max_num_seqs, max_num_batched_tokens, max_model_len, admission_policy=policy)
    pool = kv.block_pool
    sharing = layout.kind == "paged" and layout.sharing

    tokens = _TokenSource(max((r.shared_prefix_len for r in trace), default=0))
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    seq_ids = iter(range(1 << 62))
    final_kv: dict[int, int] = {}  # seq_id -> positions it will ever write (P + O - 1)
    req_left: dict[str, int] = {}  # request -> unfinished sequences
    req_arrival: dict[str, int] = {}
    pending_forks: dict[int, list] = {}  # parent seq_id -> children's output lengths
    latencies = []

    def new_seq(rid: str, index: int, req: TraceRequest, out_len: int, width: int) -> Sequence:
        prompt = tokens.system_prompt[: req.shared_prefix_len] + tokens.fresh(req.input_len - req.shared_prefix_len)
        seq = Sequence(
            next(seq_ids), rid, index, prompt, SamplingParams(n=width, max_tokens=out_len), None, float(req.arrival)
        )
        final_kv[seq.seq_id] = req.input_len + out_len - 1
        return seq

    def admit(k: int) -> None:
        req = trace[k]
        rid = f"r{k}"
        req_arrival[rid] = req.arrival
        if sharing and req.n > 1:
            parent = new_seq(rid, 0, req, req.output_lens[0], req.n)
            pending_forks[parent.seq_id] = list(req.output_lens[1:])
            sched.add(parent)
        else:
            for j, out_len in enumerate(req.output_lens):
                sched.add(new_seq(rid, j, req, out_len, 1))
        req_left[rid] = req.n

    def finished(seq: Sequence, step: int) -> None:
        final_kv.pop(seq.seq_id, None)
        req_left[seq.request_id] -= 1
        if req_left[seq.request_id] == 0:
            latencies.append(step + 1 - req_arrival[seq.request_id])

    keys = (
        "step",
        "reserved",
        "used",
        "internal_future",
        "internal_never",
        "external",
        "running_seqs",
        "running_requests",
        "waiting",
    )
    series = {k: [] for k in keys}
    sums = dict.fromkeys(keys[1:], 0)
    peak_req = peak_seq = 0
    ext_blocked = 0
    output_tokens = 0
    sum_logical = 0
    busy = 0
    nxt = 0
    step = 0
    last_step = -1
    while nxt < len(order) or sched.num_unfinished:
        while nxt < len(order) and trace[order[nxt]].arrival <= step:
            admit(order[nxt])
            nxt += 1
        if not sched.num_unfinished:
            step = trace[order[nxt]].arrival  # idle until the next arrival
            continue
        out = sched.schedule()
        if out.is_empty:
            head = sched.waiting[0] if sched.waiting else None
            raise RuntimeError(
                f"{layout.name}: nothing can run at step {step}; a sequence of "
                f"{head.num_tokens if head else '?'} tokens does not fit the pool"
            )
        busy += 1

        # ---- measure: the KV state of this step (its slots are allocated; nothing is freed before
        # update_from_output)
        running = sched.running
        future = never = logical = 0
        if policy is not None:
            reserved = policy.reserved_slots
            used = pool.num_used_blocks  # block_size 1: one block per stored token
            for s in running:
                k = s.block_table.num_tokens
                cap = capacity(s)
                f = final_kv[s.seq_id]
                logical += k
                future += f - k
                never += cap - f
            head = sched.waiting[0] if sched.waiting else None
            external = 0
            if head is not None:
                need = capacity(head)
                if policy.free_slots >= need > policy.largest_free_extent:
                    external = policy.free_slots
                    ext_blocked += 1
        else:
            reserved = pool.num_used_blocks * bs
            external = 0
            if sharing:
                filled: dict[int, int] = {}
                for s in running:
                    t = s.block_table
                    k = t.num_tokens
                    for i, b in enumerate(t.block_ids):
                        c = min(bs, k - i * bs)
                        if c > filled.get(b, 0):
                            filled[b] = c
                used = sum(filled.values())
            else:
                used = 0
            for s in running:
                t = s.block_table
                k = t.num_tokens
                logical += k
                if not sharing:
                    used += k
                cap = len(t.block_ids) * bs
                f = final_kv[s.seq_id]
                if f >= cap:
                    future += cap - k
                else:
                    future += max(0, f - k)
                    never += cap - max(f, k)
        if sharing:  # slack of a still-shared last block is seen by each owner: keep R - U = future + never
            never = min(never, reserved - used)
            future = reserved - used - never
        n_req = len({s.request_id for s in running})
        row = (step, reserved, used, future, never, external, len(running), n_req, len(sched.waiting))
        if record_series:
            for k, v in zip(keys, row):
                series[k].append(v)
        for k, v in zip(keys[1:], row[1:]):
            sums[k] += v
        sum_logical += logical
        peak_req = max(peak_req, n_req)
        peak_seq = max(peak_seq, len(running))
        if check_invariants:
            kv.check_invariants(running)
            if policy is not None:
                policy.check()
            assert reserved - used == future + never, (reserved, used, future, never)

        # ---- sample: sequences whose KV covers all their tokens after this step get one token (a
        # request's first sequence forks its samples first, as in the engine)
        sampled = []
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n != seq.num_tokens:
                continue
            targets = [seq]
            kids = pending_forks.pop(seq.seq_id, None)
            if kids:
                req = trace[int(seq.request_id[1:])]
                for j, out_len in enumerate(kids, start=1):
                    child = Sequence(
                        next(seq_ids),
                        seq.request_id,
                        j,
                        seq.prompt_token_ids,
                        SamplingParams(max_tokens=out_len),
                        None,
                        seq.arrival_time,
                    )
                    sched.fork(seq, child)
                    final_kv[child.seq_id] = req.input_len + out_len - 1
                    targets.append(child)
            sampled += [(t, -(len(t.output_token_ids) + 1) - 10_000 * t.seq_id) for t in targets]
        output_tokens += len(sampled)
        for seq in sched.update_from_output(out, sampled):
            finished(seq, step)
        last_step = step
        step += 1
        if step > max_steps:
            raise RuntimeError(f"{layout.name}: exceeded {max_steps} steps")

    num_seqs = sum(r.n for r in trace)
    return SimResult(
        layout=layout.name,
        num_slots=num_slots,
        block_size=bs,
        steps=last_step + 1,
        busy_steps=busy,
        num_requests=len(trace),
        num_sequences=num_seqs,
        output_tokens=output_tokens,
        peak_running_requests=peak_req,
        peak_running_seqs=peak_seq,
        mean_running_seqs=sums["running_seqs"] / busy if busy else 0.0,
        num_preemptions=sched.stats.num_preemptions,
        ext_blocked_steps=ext_blocked,
        sum_reserved=sums["reserved"],
        sum_used=sums["used"],
        sum_internal_future=sums["internal_future"],
        sum_internal_never=sums["internal_never"],
        sum_external=sums["external"],
        sum_running_seqs=sums["running_seqs"],
        sum_logical=sum_logical,
        mean_latency_steps=float(np.mean(latencies)) if latencies else 0.0,
        series=series if record_series else {},
    )
