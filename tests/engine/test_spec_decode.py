"""Speculative decoding through the engine, on small random models: drafts that are right, wrong or
partly right (an oracle proposer that corrupts one position) leave greedy and seeded outputs exactly as
without speculation, with stops, limits, logprobs and usage applied to the accepted tokens in order; the
token distribution under sampling is the target's; and every block comes back."""

from __future__ import annotations

import numpy as np
import pytest

from rawpaged import LLM, SamplingParams
from rawpaged.testing.random_model import write_random_model
from tests.scripted_model import write_scripted_model
from tests.spec_decode.test_rejection_sampler import chi_square_critical, chi_square_homogeneity

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("spec") / "m",
        num_layers=2,
        hidden_size=128,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        seed=5,
    )


class OracleProposer:
    """Drafts the reference continuation of each prompt (``reference``: prompt tuple -> output ids), with
    the draft cut short or one position corrupted at random, so that every accepted length 0..k occurs.
    Prompts in ``silent`` get no drafts (they decode plainly in the same batches)."""

    def __init__(self, reference: dict, vocab_size: int, seed: int = 0, silent=()):
        self.reference = reference
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.silent = set(silent)
        self.num_calls = 0

    def propose(self, token_ids, k: int) -> list:
        for prompt, out in self.reference.items():
            if tuple(token_ids[: len(prompt)]) == prompt and prompt not in self.silent:
                done = len(token_ids) - len(prompt)
                draft = list(out[done : done + k])
                if draft and self.rng.random() < 0.6:
                    i = int(self.rng.integers(len(draft)))
                    draft[i] = (draft[i] + 1 + int(self.rng.integers(self.vocab_size - 1))) % self.vocab_size
                self.num_calls += 1
                return draft
        return []


def _prompts(n, seed=0, length=(5, 40)):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 250, int(rng.integers(*length)))] for _ in range(n)]


def _run(model, prompts, params, spec=None, oracle=None, **kw):
    llm = LLM(model=str(model), speculative_config=spec, num_kv_blocks=kw.pop("num_kv_blocks", 96), **kw)
    if oracle is not None:
        llm.engine.speculator.proposer = oracle
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    llm.engine.kv_cache_manager.check_invariants()
    return outs, stats, llm


def _ids(outs):
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("block_size", [16, 4])
def test_64_greedy_requests_mixed_with_plain_ones_match_no_speculation(model, block_size):
    prompts = _prompts(64)
    params = [SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True) for n in np.arange(64) % 23 + 1]
    plain, plain_stats, llm = _run(model, prompts, params, block_size=block_size)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    oracle = OracleProposer(reference, llm.engine.model_config.vocab_size, silent=[tuple(p) for p in prompts[::3]])
    spec, stats, _ = _run(model, prompts, params, SPEC, oracle, block_size=block_size)
    assert _ids(spec) == _ids(plain)
    s = stats["spec_decode"]
    assert oracle.num_calls > 100 and s["num_drafts"] > 100
    per_pos = s["num_accepted_tokens_per_pos"]
    assert per_pos[0] > per_pos[3] > 0 and s["num_accepted_tokens"] < s["num_draft_tokens"]  # some of each
    assert stats["generation_tokens_total"] == plain_stats["generation_tokens_total"]
    assert stats["num_steps"] < plain_stats["num_steps"]


def test_seeded_sampling_with_logprobs_gives_the_same_tokens_and_logprobs(model):
    prompts = _prompts(12, seed=1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=20, ignore_eos=True, logprobs=2)
        for i in range(12)
    ]
    plain, _, llm = _run(model, prompts, params)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    spec, stats, _ = _run(model, prompts, params, SPEC, OracleProposer(reference, llm.engine.model_config.vocab_size))
    assert _ids(spec) == _ids(plain)
    assert stats["spec_decode"]["num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            np.testing.assert_allclose([la[t] for t in la], [lb[t] for t in la], atol=2e-4)
        assert b.outputs[0].cumulative_logprob == pytest.approx(a.outputs[0].cumulative_logprob, abs=2e-3)


def test_n_greater_than_one_forks_and_each_sample_speculates(model):
    prompts = _prompts(3, seed=2)
    params = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
    plain, _, llm = _run(model, prompts, params)
    # The oracle knows choice 0's continuation: the other choices see mostly rejected drafts.
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, plain)}
    spec, stats, _ = _run(model, prompts, params, SPEC, OracleProposer(reference, llm.engine.model_config.vocab_size))
    assert _ids(spec) == _ids(plain)
    assert stats["num_cow_copies"] > 0 and stats["spec_decode"]["num_drafts"] > 0


def test_stops_and_limits_apply_to_accepted_tokens_in_order(model):
    prompts = _prompts(8, seed=3)
    probe, _, llm = _run(model, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    tok = llm.tokenizer
    cases = []
    for o in probe:
        ids = list(o.outputs[0].token_ids)
        cases.append(SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ids[9]], ignore_eos=True))
        text = tok.decode(ids[:12])
        cases.append(SamplingParams(temperature=0.0, max_tokens=30, stop=[text[-3:]], ignore_eos=True))
        cases.append(SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    prompts3 = [p for p in prompts for _ in range(3)]
    plain, plain_stats, _ = _run(model, prompts3, cases)
    reference = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, probe)}
    oracle = OracleProposer(reference, llm.engine.model_config.vocab_size, seed=4)
    spec, stats, spec_llm = _run(model, prompts3, cases, SPEC, oracle, max_model_len=60)
    for a, b in zip(plain, spec):
        assert (list(b.outputs[0].token_ids), b.outputs[0].text, b.outputs[0].finish_reason) == (
            list(a.outputs[0].token_ids),
            a.outputs[0].text,
            a.outputs[0].finish_reason,
        )
    assert stats["generation_tokens_total"] == plain_stats["generation_tokens_total"]
    assert spec_llm.engine.output_processor.num_dropped_tokens > 0  # a stop string inside accepted drafts


def test_the_context_limit_caps_drafts(model):
    prompts = _prompts(4, seed=6, length=(40, 45))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    plain, _, llm = _run(model, prompts, params, max_model_len=64)
    reference = {tuple(p): list(o.outputs[0].token_ids) + [7] * 8 for p, o in zip(prompts, plain)}
    spec, _, _ = _run(model, prompts, params, SPEC, OracleProposer(reference, 256, seed=1), max_model_len=64)
    assert _ids(spec) == _ids(plain)
    assert all(len(p) + len(o.outputs[0].token_ids) == 64 for p, o in zip(prompts, spec))


def test_under_sampling_the_token_distribution_is_the_targets(tmp_path):
    """Small vocabulary (16), temperature 0.3 (a random model is near uniform at 1): the joint distribution
    of the first 3 tokens over 1200 seeds, with the greedy tokens as drafts, against 1200 other seeds
    without speculation (chi-square, p=1e-4). A rule that always accepts the first draft fails it."""
    small = write_random_model(
        tmp_path / "v16",
        num_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=16,
        seed=9,
    )
    prompt = [3, 7, 1, 9, 4]
    greedy, _, _ = _run(small, [prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    draft = list(greedy[0].outputs[0].token_ids)

    class Fixed:
        def propose(self, token_ids, k):
            done = len(token_ids) - len(prompt)
            return draft[done : done + k]

    def joint(spec, seeds):
        params = [SamplingParams(temperature=0.3, seed=int(s), max_tokens=3, ignore_eos=True) for s in seeds]
        outs, stats, _ = _run(small, [prompt] * len(seeds), params, spec, Fixed() if spec else None, max_num_seqs=256)
        codes = [a * 256 + b * 16 + c for a, b, c in (o.outputs[0].token_ids for o in outs)]
        return np.bincount(codes, minlength=16**3), stats

    a, stats = joint({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}, range(1200))
    b, _ = joint(None, range(5000, 6200))
    assert stats["spec_decode"]["num_accepted_tokens"] > 200
    # pool rare cells so every expected count is >= 5
    order = np.argsort(-(a + b))
    common = order[: int(np.sum((a + b)[order] >= 20))]
    rest = np.setdiff1d(np.arange(a.size), common)
    a2 = np.append(a[common], a[rest].sum())
    b2 = np.append(b[common], b[rest].sum())
    stat, df = chi_square_homogeneity(a2, b2)
    assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_the_real_proposers_keep_greedy_outputs(model, method):
    """No oracle: each method's own drafts on prompts with repeats. The suffix method also searches
    finished outputs, so the same request again is drafted from the first answer."""
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, 250, 6)] * 4 for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _, _ = _run(model, prompts, params)
    llm = LLM(model=str(model), speculative_config={"method": method, "num_speculative_tokens": 5}, num_kv_blocks=96)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert _ids(first) == _ids(plain)
    before = llm.stats()["spec_decode"]["num_accepted_tokens"]
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params)
    assert _ids(again) == _ids(plain[:1])
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    gained = stats["spec_decode"]["num_accepted_tokens"] - before
    if method == "suffix":
        assert gained >= 30, stats["spec_decode"]  # the first answer, found again


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """Another random model with the target's tokenizer: a draft that agrees now and then."""
    return write_random_model(
        tmp_path_factory.mktemp("draft") / "d",
        num_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        seed=6,
    )


def test_a_draft_model_leaves_the_targets_outputs_unchanged(model, draft):
    prompts = _prompts(10, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 5 + [
        SamplingParams(temperature=0.7, seed=i, max_tokens=20, ignore_eos=True) for i in range(5)
    ]
    plain, _, _ = _run(model, prompts, params)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": None}
    got, stats, llm = _run(model, prompts, params, spec)
    assert _ids(got) == _ids(plain)
    assert stats["spec_decode"]["num_draft_tokens"] > 100
    proposer = llm.engine.speculator.proposer
    proposer.check_invariants()
    assert not proposer.mirrors  # every mirror went with its sequence
    pool = proposer.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_a_model_drafting_for_itself_is_accepted_almost_always(model):
    prompts = _prompts(6, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _, _ = _run(model, prompts, params)
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4}
    got, stats, _ = _run(model, prompts, params, spec)
    assert _ids(got) == _ids(plain)
    s = stats["spec_decode"]
    assert s["acceptance_rate"] >= 0.95, s  # below 1 only where float order flips a near-tie


def test_a_draft_model_with_another_vocabulary_is_refused(model, tmp_path):
    other = write_random_model(
        tmp_path / "v",
        num_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        vocab_size=300,
        seed=1,
    )
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's vocab_size 300"):
        LLM(model=str(model), speculative_config={"method": "draft_model", "model": str(other)})


def test_a_draft_model_that_cannot_be_loaded_is_named_in_the_error(model, tmp_path):
    for path, match in [(tmp_path / "missing", "neither"), (tmp_path, "no config.json")]:
        with pytest.raises(ValueError, match=f"speculative_config.model: .*{match}"):
            LLM(model=str(model), speculative_config={"model": str(path)})


# A scripted model (SmolLM2's tokenizer, EOS 2) that answers 101 102 103 104 EOS after 100, then 105 106: a
# prompt holding that answer once makes the n-gram proposer draft it again, past EOS.
ANSWER = [100, 101, 102, 103, 104, 2, 105, 106]
REPEAT = [*ANSWER, 7, 100]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, model_dir):
    script = dict(zip(ANSWER, ANSWER[1:]))
    path = write_scripted_model(tmp_path_factory.mktemp("rep") / "m", model_dir, script, "LlamaForCausalLM", scale=1.5)
    return LLM(model=str(path), speculative_config=SPEC, num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "params, want",
    [
        (dict(), [101, 102, 103, 104, 2]),  # drafts 102 103 104 2 and the bonus 105: EOS cuts 105
        (dict(stop_token_ids=[103]), [101, 102, 103]),  # the same step, cut at 103
        (dict(max_tokens=3, ignore_eos=True), [101, 102, 103]),
        (dict(ignore_eos=True, max_tokens=7), [101, 102, 103, 104, 2, 105, 106]),
    ],
)
def test_drafts_accepted_past_a_stop_leave_no_logprobs_behind(scripted, params, want):
    """Token ids, logprobs and the cumulative logprob are cut at the same place."""
    assert 2 in scripted.engine.eos_token_ids
    before = scripted.stats()["spec_decode"]["num_accepted_tokens"]
    params = {"max_tokens": 20, **params}
    out = scripted.generate([{"prompt_token_ids": REPEAT}], SamplingParams(temperature=0.0, logprobs=1, **params))
    c = out[0].outputs[0]
    assert list(c.token_ids) == want
    assert scripted.stats()["spec_decode"]["num_accepted_tokens"] > before  # the drafts were taken
    assert len(c.logprobs) == len(c.token_ids), c.logprobs
    chosen = [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]
    assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-4)
    stats = scripted.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_one_verified_draft_counts_once(scripted):
    """The repeat prompt: one draft of 4 tokens (102 103 104 EOS), all accepted, then EOS ends it."""
    before = scripted.stats()["spec_decode"]
    scripted.generate([{"prompt_token_ids": REPEAT}], SamplingParams(temperature=0.0, max_tokens=20))
    after = scripted.stats()["spec_decode"]
    got = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert got == {"num_drafts": 1, "num_draft_tokens": 4, "num_accepted_tokens": 4}
    per_pos = [a - b for a, b in zip(after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])]
    assert per_pos == [1, 1, 1, 1]
