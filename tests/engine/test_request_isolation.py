"""One request never fails another: a failure while computing one request's part of a step (its draw,
its beams, the backend's sampling of its row, its text) ends that request alone, frees its blocks, and
leaves every other request's output exactly as without it. Also the inputs that used to reach such
failures: a huge top_k, extreme length penalties, subnormal temperatures."""

import numpy as np
import pytest

from rawpaged import SamplingParams
from rawpaged.engine import llm_engine, token_selection
from rawpaged.errors import RequestFailedError
from tests.conftest import tiny_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (7, 19, 33)]
POISON_SEED = 666


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.outputs[0].token_ids for o in tiny_engine(tiny_dir).generate(PROMPTS, GREEDY)]


def run_with_poisoned(llm, poisoned: SamplingParams) -> dict:
    """The innocent greedy requests plus one poisoned request, stepped to the end: {request_id: final}."""
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in PROMPTS]
    bad = eng.add_request({"prompt_token_ids": [9, 8, 7, 6, 5]}, poisoned)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"] and s["num_running"] == s["num_waiting"] == 0
    eng.kv_cache_manager.check_invariants()
    return {"good": [final[i] for i in ids], "bad": final[bad]}


def _raise_for_poison(real):
    def wrapped(params, *args):
        if params.seed == POISON_SEED:
            raise RuntimeError("poisoned draw")
        return real(params, *args)

    return wrapped


def test_a_failing_draw_ends_only_its_request(tiny_dir, reference, monkeypatch):
    monkeypatch.setattr(token_selection, "draw_uniform", _raise_for_poison(token_selection.draw_uniform))
    llm = tiny_engine(tiny_dir)
    got = run_with_poisoned(llm, SamplingParams(n=3, temperature=0.9, seed=POISON_SEED, max_tokens=8))
    assert [o.outputs[0].token_ids for o in got["good"]] == reference
    assert all(o.error is None for o in got["good"])
    assert got["bad"].finished and got["bad"].outputs == [] and "poisoned draw" in got["bad"].error
    # Offline, the others complete and then the failure is raised.
    with pytest.raises(RequestFailedError, match="1 of 2 requests failed.*poisoned draw"):
        llm.generate(PROMPTS[:1] * 2, [GREEDY, SamplingParams(temperature=0.5, seed=POISON_SEED)])


def test_a_failing_backend_sample_is_retried_per_request(tiny_dir, reference, monkeypatch):
    llm = tiny_engine(tiny_dir)
    real = llm.engine.runner.sample

    def sample(logits, draws):
        if any(p.top_p == 0.123 for _, p, _ in draws):
            raise FloatingPointError("the kernel rejects this row")
        return real(logits, draws)

    monkeypatch.setattr(llm.engine.runner, "sample", sample)
    got = run_with_poisoned(llm, SamplingParams(temperature=0.7, top_p=0.123, max_tokens=8))
    assert [o.outputs[0].token_ids for o in got["good"]] == reference
    assert "FloatingPointError" in got["bad"].error


def test_a_failing_beam_step_or_detokenizer_ends_only_its_request(tiny_dir, reference, monkeypatch):
    llm = tiny_engine(tiny_dir)

    def broken_step(*args, **kwargs):
        raise ZeroDivisionError("beam scores")

    monkeypatch.setattr(llm_engine.beam_search, "step", broken_step)
    got = run_with_poisoned(llm, SamplingParams(beam_width=3, max_tokens=6))
    assert [o.outputs[0].token_ids for o in got["good"]] == reference and "beam scores" in got["bad"].error
    monkeypatch.undo()

    detok = llm.engine.output_processor.detokenizer
    real_step = detok.step

    def step(seq, end=None):
        if seq.sampling_params.seed == POISON_SEED:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned text")
        return real_step(seq, end)

    monkeypatch.setattr(detok, "step", step)
    got = run_with_poisoned(llm, SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=8))
    assert [o.outputs[0].token_ids for o in got["good"]] == reference and "poisoned text" in got["bad"].error


def test_inputs_that_used_to_fail_the_batch(tiny_dir, reference):
    llm = tiny_engine(tiny_dir)
    for poisoned in (
        SamplingParams(temperature=0.8, top_k=(1 << 63) + 5, seed=1, max_tokens=6),
        SamplingParams(beam_width=2, length_penalty=400.0, max_tokens=6),
        SamplingParams(beam_width=2, length_penalty=-1000.0, max_tokens=6),
        SamplingParams(beam_width=2, length_penalty=1e308, max_tokens=6),
    ):
        got = run_with_poisoned(llm, poisoned)
        assert [o.outputs[0].token_ids for o in got["good"]] == reference
        assert got["bad"].error is None and got["bad"].outputs, poisoned
    # A subnormal temperature is greedy (vLLM: below 1e-5), not an overflow of logits / T.
    for t in (5e-324, 1e-308):
        tiny = SamplingParams(temperature=t, max_tokens=12, ignore_eos=True)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, tiny)] == reference
    wide = SamplingParams(temperature=0.8, top_k=1 << 40, seed=3, max_tokens=6)
    same = SamplingParams(temperature=0.8, top_k=-1, seed=3, max_tokens=6)
    assert (
        llm.generate(PROMPTS[:1], wide)[0].outputs[0].token_ids
        == llm.generate(PROMPTS[:1], same)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("length_penalty", float("inf")),
        ("length_penalty", float("nan")),
        ("seed", -1),
        ("seed", 1 << 64),
        ("top_k", -2),
    ],
)
def test_non_finite_and_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValueError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_the_uniform_stream_is_seeded_per_sample():
    assert np.isclose(
        token_selection.draw_uniform(SamplingParams(temperature=1.0), np.random.default_rng(1)),
        np.random.default_rng(1).random(),
    )
