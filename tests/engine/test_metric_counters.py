"""Each counter of ``/metrics`` counts events, not attempts: one event of its kind, run through the engine
and read back through ``ServerMetrics.render`` (what ``/metrics`` serves), adds exactly its amount."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")  # absent on some hosts (the GPU host has no package index)

from rawpaged import SamplingParams
from rawpaged.entrypoints.server.metrics import ServerMetrics
from tests.conftest import tiny_engine

BLOCK = 16
PROMPT = list(range(10, 10 + 3 * BLOCK + 1))  # 3 full blocks and one token
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return tiny_engine(tiny_dir, block_size=BLOCK)


def scrape(llm) -> dict:
    """The ``/metrics`` counters of ``llm`` now: name -> value."""
    text = ServerMetrics().render(llm.stats()).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rawpaged:") and "_total" in line and "{" not in line
    }


def one_request(llm, prompt, **params):
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params))


# counter -> (what to run before the event, the event, the increment)
CASES = {
    "prompt_tokens": (None, lambda llm: one_request(llm, list(range(100, 137)), max_tokens=2, **GREEDY), 37),
    "generation_tokens": (None, lambda llm: one_request(llm, [5, 6, 7], max_tokens=5, **GREEDY), 5),
    # a repeated prompt: its 3 full blocks looked up and found, once
    "prefix_cache_queries": (
        lambda llm: one_request(llm, PROMPT, max_tokens=1, **GREEDY),
        lambda llm: one_request(llm, PROMPT, max_tokens=1, **GREEDY),
        3,
    ),
    "prefix_cache_hits": (
        lambda llm: one_request(llm, PROMPT, max_tokens=1, **GREEDY),
        lambda llm: one_request(llm, PROMPT, max_tokens=1, **GREEDY),
        3,
    ),
    # n = 2 forks on a partial last block: the first sample that writes it copies it, once
    "cow_copies": (
        None,
        lambda llm: one_request(
            llm, list(range(150, 170)), n=2, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True
        ),
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_event_is_one_increment(llm, name):
    setup, event, amount = CASES[name]
    if setup is not None:
        setup(llm)
    key = f"rawpaged:{name}_total"
    before = scrape(llm)
    event(llm)
    after = scrape(llm)
    assert after[key] - before[key] == amount
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
