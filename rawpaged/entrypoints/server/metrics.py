"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (never the global default one, so
several servers can live in one process, e.g. in tests).

Latency histograms are observed by the ``AsyncEngine`` as outputs reach the asyncio side; gauges and
token counters are read from ``LLMEngine.stats()`` at scrape time.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)


_GAUGES = (
    ("rawpaged:num_requests_running", "Requests with a sequence in the running batch.", "num_requests_running"),
    (
        "rawpaged:num_requests_waiting",
        "Requests waiting to be scheduled (none of their sequences running).",
        "num_requests_waiting",
    ),
    (
        "rawpaged:num_seqs_running",
        "Sequences in the running batch (n > 1 and beams: several per request).",
        "num_running",
    ),
    ("rawpaged:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "kv_cache_usage"),
    ("rawpaged:num_free_blocks", "Free KV-cache blocks (including evictable prefix-cache blocks).", "num_free_blocks"),
    ("rawpaged:num_total_blocks", "KV-cache blocks in the pool.", "num_total_blocks"),
    ("rawpaged:num_cached_blocks", "Free blocks still holding a reusable prefix.", "num_cached_blocks"),
    ("rawpaged:num_used_blocks", "KV-cache blocks referenced by some sequence.", "num_used_blocks"),
    ("rawpaged:num_shared_blocks", "KV-cache blocks referenced by more than one sequence.", "num_shared_blocks"),
    ("rawpaged:num_offload_slots", "Blocks the second KV tier can hold (0 without one).", "num_offload_slots"),
    ("rawpaged:num_offloaded_blocks", "Prefix blocks held in the second KV tier.", "num_offloaded_blocks"),
    ("rawpaged:num_swapped_blocks", "Blocks of swapped-out requests held in the second KV tier.", "num_swapped_blocks"),
)
_COUNTERS = (
    ("rawpaged:num_preemptions", "Sequences preempted (swapped out, or recomputed later) so far.", "num_preemptions"),
    ("rawpaged:num_swapped_out", "Sequences preempted by swapping their blocks to the second tier.", "num_swapped_out"),
    ("rawpaged:num_swapped_in", "Sequences swapped back in from the second tier.", "num_swapped_in"),
    ("rawpaged:offload_prefix_hits", "Prefix blocks loaded from the second KV tier.", "offload_prefix_hits"),
    (
        "rawpaged:offload_prefix_stores",
        "Blocks stored in the second KV tier (evicted or written through).",
        "offload_prefix_stores",
    ),
    ("rawpaged:window_frees", "Blocks given back because a sliding window had passed them.", "num_window_frees"),
    ("rawpaged:prompt_tokens", "Prompt tokens computed (prefill) so far.", "prompt_tokens_total"),
    ("rawpaged:generation_tokens", "Tokens generated so far.", "generation_tokens_total"),
    ("rawpaged:prefix_cache_queries", "Prefix-cache lookups (blocks).", "prefix_cache_queries"),
    ("rawpaged:prefix_cache_hits", "Prefix-cache hits (blocks).", "prefix_cache_hits"),
    ("rawpaged:cow_copies", "Copy-on-write block copies.", "num_cow_copies"),
    ("rawpaged:spec_decode_num_drafts", "Speculative drafts verified.", "spec_decode_num_drafts"),
    ("rawpaged:spec_decode_num_draft_tokens", "Speculative draft tokens verified.", "spec_decode_num_draft_tokens"),
    (
        "rawpaged:spec_decode_num_accepted_tokens",
        "Speculative draft tokens accepted.",
        "spec_decode_num_accepted_tokens",
    ),
)


class _EngineStatsCollector:
    """Exposes the last ``stats()`` snapshot handed to ``ServerMetrics.render``. With data-parallel
    replicas (``stats["replicas"]``) every engine series has one sample per live replica, labelled
    ``replica``, and the router's series are added."""

    def __init__(self, owner: ServerMetrics):
        self.owner = owner

    def collect(self):
        s = self.owner.stats
        if not s:
            return
        replicas = s.get("replicas")
        if replicas is None:
            labels, sources = [], [([], s)]
        else:
            labels, sources = ["replica"], [([str(r["replica"])], r) for r in replicas if r.get("ready")]
        for family, specs in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, doc, key in specs:
                metric = family(name, doc, labels=labels)
                for label_values, source in sources:
                    metric.add_metric(label_values, float(source.get(key, 0)))
                yield metric
        per_pos = CounterMetricFamily(
            "rawpaged:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted at each draft position (0: the first draft token).",
            labels=[*labels, "position"],
        )
        for label_values, source in sources:
            for pos, count in enumerate((source.get("spec_decode") or {}).get("num_accepted_tokens_per_pos", ())):
                per_pos.add_metric([*label_values, str(pos)], float(count))
        yield per_pos
        yield from _group_metrics(labels, sources)
        yield from _lora_metrics(labels, sources)
        if replicas is not None:
            yield from _router_metrics(replicas, s.get("router", {}))


def _group_metrics(labels: list, sources: list):
    """Per KV cache group (labels ``group``, its index, and ``kind``): the blocks its tables hold and those
    its sliding window gave back."""
    used = GaugeMetricFamily(
        "rawpaged:kv_cache_group_used_blocks",
        "KV-cache blocks held by a KV cache group's tables.",
        labels=[*labels, "group", "kind"],
    )
    frees = CounterMetricFamily(
        "rawpaged:kv_cache_group_window_frees",
        "Blocks a KV cache group gave back because its sliding window had passed them.",
        labels=[*labels, "group", "kind"],
    )
    for label_values, source in sources:
        for g in source.get("kv_cache_groups") or ():
            group = [*label_values, str(g["group_id"]), g["kind"]]
            used.add_metric(group, float(g["num_used_blocks"]))
            frees.add_metric(group, float(g["num_window_frees"]))
    yield from (used, frees)


def _lora_metrics(labels: list, sources: list):
    """With LoRA on (``stats["lora"]``, ``engine.lora_stats``): vLLM's ``lora_requests_info`` (labels
    ``max_lora``, ``waiting_lora_adapters`` and ``running_lora_adapters``, the adapters' names joined by
    commas; its value the time of the scrape, as vLLM's the time of its update), the adapters registered
    and resident, their loads into a slot, and each adapter's running and waiting requests (label
    ``lora_name``)."""
    lora_sources = [(values, source["lora"]) for values, source in sources if source.get("lora")]
    if not lora_sources:
        return
    info = GaugeMetricFamily(
        "rawpaged:lora_requests_info",
        "Running stats on LoRA requests (vLLM's): the adapters with running and with waiting requests.",
        labels=[*labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    flat = [
        (GaugeMetricFamily, "rawpaged:lora_adapters_registered", "LoRA adapters served.", "num_registered"),
        (GaugeMetricFamily, "rawpaged:lora_adapters_resident", "LoRA adapters in a slot now.", "num_resident"),
        (CounterMetricFamily, "rawpaged:lora_loads", "LoRA adapters copied into a slot so far.", "num_loads"),
    ]
    families = [(family(name, doc, labels=labels), key) for family, name, doc, key in flat]
    per_adapter = [
        (GaugeMetricFamily(f"rawpaged:lora_requests_{kind}", doc, labels=[*labels, "lora_name"]), key)
        for kind, doc, key in (
            ("running", "Requests of a LoRA adapter with a sequence in the running batch.", "num_requests_running"),
            ("waiting", "Requests of a LoRA adapter waiting to be scheduled.", "num_requests_waiting"),
        )
    ]
    now = time.time()
    for values, lora in lora_sources:
        running, waiting = ",".join(lora["running_lora_adapters"]), ",".join(lora["waiting_lora_adapters"])
        info.add_metric([*values, str(lora["max_loras"]), waiting, running], now)
        for metric, key in families:
            metric.add_metric(values, float(lora[key]))
        for metric, key in per_adapter:
            for name, adapter in lora["adapters"].items():
                metric.add_metric([*values, name], float(adapter[key]))
    yield info
    yield from (m for m, _ in families)
    yield from (m for m, _ in per_adapter)


def _router_metrics(replicas: list, router: dict):
    up = GaugeMetricFamily("rawpaged:replica_up", "1 while a replica answers and gets requests.", labels=["replica"])
    load = GaugeMetricFamily(
        "rawpaged:replica_requests_in_flight", "Requests the router has in flight on a replica.", labels=["replica"]
    )
    for r in replicas:
        up.add_metric([str(r["replica"])], 1.0 if r.get("ready") else 0.0)
    for i, n in enumerate(router.get("load", ())):
        load.add_metric([str(i)], float(n))
    failures = CounterMetricFamily(
        "rawpaged:replica_failures", "Times a replica was found dead or unresponsive.", labels=["replica"]
    )
    for i, n in enumerate(router.get("replica_failures", ())):
        failures.add_metric([str(i)], float(n))
    routed = CounterMetricFamily(
        "rawpaged:router_requests",
        "Requests routed: to their prefix's replica (prefix_hit), away from it because it was loaded (spill), "
        "or by load alone (least_loaded).",
        labels=["decision"],
    )
    for decision, key in (("prefix_hit", "prefix_hits"), ("spill", "spills"), ("least_loaded", "least_loaded")):
        routed.add_metric([decision], float(router.get(key, 0)))
    yield from (up, load, failures, routed)


class ServerMetrics:
    """All metrics of one server. ``render(stats)`` returns the Prometheus text exposition."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.stats: dict = {}
        r = self.registry
        self.time_to_first_token = Histogram(
            "rawpaged:time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "rawpaged:inter_token_latency_seconds",
            "Time between consecutive outputs of a request.",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "rawpaged:e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.request_success = Counter(
            "rawpaged:request_success",
            "Choices finished (one per choice of a request with n > 1), by finish reason (stop, length, abort).",
            ["finished_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "rawpaged:http_request_errors", "Requests refused with an HTTP error, by status.", ["status"], registry=r
        )
        r.register(_EngineStatsCollector(self))

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_finished(self, seconds: float, finish_reasons: list) -> None:
        """One ended request: its end-to-end latency once (unless it was aborted), each choice's reason."""
        if any(r != "abort" for r in finish_reasons):
            self.e2e_request_latency.observe(seconds)
        for r in finish_reasons:
            self.request_success.labels(finished_reason=r).inc()

    def count_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def render(self, stats: dict | None = None) -> bytes:
        if stats is not None:
            self.stats = dict(stats)
        return generate_latest(self.registry)
