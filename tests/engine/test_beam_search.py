"""Beam search against an independent float64 reference of HF transformers' algorithm, on a small random
Markov "model" (no network): the same finished hypotheses, scores and stopping step; plus the pieces
around it (scores, stop ids, forking and pruning sequences, outputs)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from rawpaged.core.sequence import Sequence
from rawpaged.engine import beam_search
from rawpaged.engine.beam_search import BeamState, Hypothesis, beam_outputs, length_normalized, step, step_beams
from rawpaged.sampling_params import SamplingParams

VOCAB = 12


def markov_model(seed: int):
    """float32 log_softmax rows depending on the last token and the length: a small random model."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 2.0, (VOCAB + 1, 8, VOCAB))

    def rows(histories):
        out = []
        for h in histories:
            x = table[h[-1] if h else VOCAB, len(h) % 8].astype(np.float64)
            x = x - x.max()
            out.append((x - np.log(np.exp(x).sum())).astype(np.float32))
        return np.stack(out)

    return rows


def reference_search(rows, width, max_new, stop_ids, length_penalty):
    """HF ``_beam_search`` (early_stopping=False) written out plainly in float64."""
    beams = [(0.0, [])]  # (cumulative logprob, tokens)
    finished = []  # (score, cumulative, tokens, hit_stop), best first
    improvable = True
    for g in range(max_new):
        logp = rows([b[1] for b in beams]).astype(np.float64)
        cands = sorted(
            ((cum + float(logp[i, t]), i * VOCAB + t) for i, (cum, _) in enumerate(beams) for t in range(VOCAB)),
            key=lambda c: (-c[0], c[1]),
        )[: 2 * width]
        running = []
        for rank, (total, flat) in enumerate(cands):
            parent, token = divmod(flat, VOCAB)
            if g + 1 == max_new or token in stop_ids:
                if rank < width and improvable:
                    score = total / float(g + 1) ** length_penalty
                    finished.append((score, total, beams[parent][1] + [token], token in stop_ids))
            elif len(running) < width:
                running.append((total, beams[parent][1] + [token]))
        finished = sorted(finished, key=lambda h: -h[0])[:width]
        if running and len(finished) == width and running[0][0] / float(g + 1) ** length_penalty <= finished[-1][0]:
            improvable = False
        if not running or not improvable:
            return finished, g + 1
        beams = running
    return finished, max_new


def run_step_function(rows, width, max_new, stop_ids, length_penalty):
    state = BeamState(width, length_penalty)
    beams = [(0.0, [])]
    for g in range(max_new):
        chosen = step(state, [c for c, _ in beams], [t for _, t in beams], rows([t for _, t in beams]), stop_ids,
                      max_new)  # fmt: skip
        if state.done:
            return state.finished, g + 1
        beams = [(c.cumulative_logprob, beams[c.parent][1] + [c.token_id]) for c in chosen]
    raise AssertionError("the search never ended")


CASES = [(seed, width, max_new, stop, lp) for seed in range(6) for width in (1, 2, 3, 5) for max_new in (1, 2, 5)
         for stop, lp in (((), 1.0), ((3,), 1.0), ((1, 4, 7), 0.0), ((5,), 2.0), ((2, 9), -1.0))]  # fmt: skip


@pytest.mark.parametrize("seed, width, max_new, stop, lp", CASES)
def test_step_matches_the_reference_search(seed, width, max_new, stop, lp):
    rows = markov_model(seed)
    want, want_steps = reference_search(rows, width, max_new, set(stop), lp)
    got, got_steps = run_step_function(rows, width, max_new, set(stop), lp)
    assert got_steps == want_steps
    assert [(h.token_ids, h.hit_eos) for h in got] == [(tokens, hit) for _, _, tokens, hit in want]
    for h, (score, cum, _, _) in zip(got, want):
        assert h.score == pytest.approx(score, rel=1e-12) and h.cumulative_logprob == pytest.approx(cum, rel=1e-12)


def test_ties_go_to_the_lower_token_id_as_in_torch_topk():
    state = BeamState(1, 1.0)
    rows = np.log(np.array([[0.1, 0.3, 0.3, 0.3]], np.float32))
    chosen = step(state, [0.0], [[]], rows, stop_ids=set(), max_new_tokens=5)
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 1)]
    two = BeamState(2, 1.0)
    chosen = step(two, [0.0, 0.0], [[5], [6]], np.log(np.full((2, 3), 1 / 3, np.float32)), set(), 5)
    assert [(c.parent, c.token_id) for c in chosen] == [(0, 0), (0, 1)]


def test_a_stop_token_outside_the_top_width_is_not_a_hypothesis():
    state = BeamState(1, 1.0)
    rows = np.log(np.array([[0.6, 0.3, 0.1]], np.float32))  # top-2: 0 then 1 (stop, rank 1 >= width)
    chosen = step(state, [0.0], [[]], rows, stop_ids={1}, max_new_tokens=5)
    assert state.finished == [] and [c.token_id for c in chosen] == [0] and not state.done
    chosen = step(BeamState(2, 1.0), [0.0], [[]], rows, {0}, 5)
    assert [c.token_id for c in chosen] == [1, 2]


def test_the_search_stops_when_no_running_beam_can_beat_the_worst_hypothesis():
    state = BeamState(1, 1.0)
    rows = np.log(np.array([[0.7, 0.2, 0.1]], np.float32))  # token 0 stops
    chosen = step(state, [0.0], [[]], rows, {0}, 10)
    assert state.done and not state.improvement_possible and [c.token_id for c in chosen] == [1]
    assert state.finished[0].token_ids == [0] and state.finished[0].hit_eos


def test_length_normalized_never_raises():
    assert length_normalized(-3.0, 2, 1.0) == -1.5 and length_normalized(-3.0, 4, 0.5) == -1.5
    assert length_normalized(-3.0, 7, 400.0) == 0.0 and length_normalized(-3.0, 7, -1000.0) == -math.inf
    assert length_normalized(-3.0, 1, 1e308) == -3.0


def test_stop_token_ids_add_eos_unless_ignored():
    assert beam_search.stop_token_ids(SamplingParams(stop_token_ids=[5]), {2}) == {2, 5}
    assert beam_search.stop_token_ids(SamplingParams(stop_token_ids=[5], ignore_eos=True), {2}) == {5}


def _beam_request(width, rows, prompt=(1, 2, 3), logprobs=None, max_tokens=8):
    params = SamplingParams(beam_width=width, n=width, max_tokens=max_tokens, logprobs=logprobs)
    head = Sequence(0, "r", 0, list(prompt), params, None, 0.0)
    head.pending_logprobs = rows[0]
    return SimpleNamespace(params=params, prompt_token_ids=list(prompt), beam=BeamState(width, 1.0), beams=[head],
                           seqs=[head])  # fmt: skip


def test_step_beams_forks_branching_parents_and_prunes_the_rest():
    rows = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    req = _beam_request(2, rows, logprobs=1)
    forks = []

    def fork(r, parent):
        child = parent.fork(len(r.seqs), len(r.seqs), None)
        r.seqs.append(child)
        forks.append((parent, child))
        return child

    sampled, pruned = step_beams(req, fork, eos_token_ids={3}, max_model_len=100, now=5.0)
    head = req.seqs[0]
    assert [(s is head, t) for s, t in sampled] == [(True, 0), (False, 1)] and pruned == []
    assert forks == [(head, sampled[1][0])] and req.beams == [s for s, _ in sampled]
    assert head.pending_logprobs is None and all(s.first_token_time == 5.0 for s, _ in sampled)
    assert [s.cumulative_logprob for s, _ in sampled] == pytest.approx([math.log(0.5), math.log(0.3)], rel=1e-6)
    assert [list(s.logprobs[0]) for s, _ in sampled] == [[0], [1, 0]]  # the chosen token, then the top one
    # Next step: both beams continue from the first only: the second is pruned.
    for s, _ in sampled:
        s.output_token_ids.append(_)
    req.beams[0].pending_logprobs = np.log(np.array([0.6, 0.4, 1e-9, 1e-9], np.float32))
    req.beams[1].pending_logprobs = np.log(np.array([0.25, 0.25, 0.25, 0.25], np.float32))
    sampled, pruned = step_beams(req, fork, {3}, 100, 6.0)
    assert [s.index for s, _ in sampled] == [0, 2] and [t for _, t in sampled] == [0, 1]
    assert pruned == [req.seqs[1]]


def test_step_beams_limits_by_the_context_left():
    rows = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    req = _beam_request(2, rows, prompt=(1, 2, 3), max_tokens=50)
    sampled, _ = step_beams(req, lambda r, p: p.fork(9, 9, None), set(), max_model_len=4, now=0.0)
    assert sampled == [] and req.beam.done and len(req.beam.finished) == 2  # one token fits: all hit the limit


def test_beam_outputs_take_the_n_best_hypotheses():
    tok = SimpleNamespace(decode=lambda ids: "".join(chr(97 + i) for i in ids))
    req = SimpleNamespace(params=SamplingParams(n=2, beam_width=3), beam=BeamState(3, 1.0))
    req.beam.finished = [Hypothesis(-1.0, -2.0, [0, 1], True, [{0: -1.0}, {1: -1.0}]),
                         Hypothesis(-1.5, -3.0, [2, 2], False), Hypothesis(-2.0, -4.0, [3], False)]  # fmt: skip
    outs = beam_outputs(req, tok)
    # a stop token's text is left out, as sampling leaves it out (vLLM)
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.cumulative_logprob) for o in outs] == [
        (0, "a", [0, 1], "stop", -2.0), (1, "cc", [2, 2], "length", -3.0)]  # fmt: skip
    assert outs[0].logprobs == [{0: -1.0}, {1: -1.0}] and outs[1].logprobs is None
    req.params = SamplingParams(n=2, beam_width=3, include_stop_str_in_output=True)
    assert [o.text for o in beam_outputs(req, tok)] == ["ab", "cc"]


def test_length_normalized_hides_every_floating_point_warning():
    with np.errstate(all="raise"):  # a caller that raises on every floating-point event
        assert length_normalized(-3.0, 7, 400.0) == 0.0  # overflow
        assert length_normalized(-3.0, 7, -1000.0) == -math.inf  # division by zero
        assert math.isnan(length_normalized(-math.inf, 7, 400.0))  # inf / inf: invalid


def test_when_the_top_two_width_all_stop_the_search_ends():
    state = BeamState(1, 1.0)
    rows = np.log(np.array([[0.5, 0.4, 0.1]], np.float32))  # top-2 both stop tokens
    chosen = step(state, [0.0], [[]], rows, stop_ids={0, 1}, max_new_tokens=9)
    assert chosen == [] and state.done and [h.token_ids for h in state.finished] == [[0]]


def test_the_last_candidate_of_the_top_two_width_is_the_true_one():
    rng = np.random.default_rng(7)
    for _ in range(20):
        p = rng.dirichlet(np.ones(64)).astype(np.float32)
        rows = np.log(p)[None, :]
        order = np.argsort(-p, kind="stable")
        stop = {int(order[0]), int(order[1])}  # the two best stop: running beams are the 3rd and 4th best
        chosen = step(BeamState(2, 1.0), [0.0], [[]], rows, stop, 9)
        assert [c.token_id for c in chosen] == [int(order[2]), int(order[3])]


def test_a_tie_between_the_best_running_beam_and_the_worst_hypothesis_ends_the_search():
    state = BeamState(1, 1.0)
    rows = np.log(np.array([[0.5, 0.5]], np.float32))
    chosen = step(state, [0.0], [[]], rows, stop_ids={0}, max_new_tokens=9)
    assert [c.token_id for c in chosen] == [1] and state.done and state.improvement_possible is False


def test_finished_hypotheses_carry_their_logprobs():
    rows = np.log(np.array([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]], np.float32))
    state = BeamState(2, 1.0)
    parents = [[{5: -0.1}], [{6: -0.2}]]
    step(state, [-0.1, -0.2], [[5], [6]], rows, stop_ids={0, 2}, max_new_tokens=9, logprobs=parents, num_logprobs=1)
    assert [h.token_ids for h in state.finished] == [[5, 0], [6, 2]]
    assert state.finished[0].logprobs == [{5: -0.1}, {0: float(rows[0, 0])}]
    assert state.finished[1].logprobs == [{6: -0.2}, {2: float(rows[1, 2])}]
    plain = BeamState(2, 1.0)
    step(plain, [-0.1, -0.2], [[5], [6]], rows, stop_ids={0, 2}, max_new_tokens=9)
    assert all(h.logprobs is None for h in plain.finished)


@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_step_beams_reports_logprobs_for_every_token(num_logprobs):
    rows = markov_model(3)
    req = _beam_request(2, rows([[]]), logprobs=num_logprobs, max_tokens=4)
    n_seqs = [1]

    def fork(r, parent):
        child = parent.fork(n_seqs[0], n_seqs[0], None)
        n_seqs[0] += 1
        r.seqs.append(child)
        return child

    while not req.beam.done:
        sampled, _ = step_beams(req, fork, set(), 100, 0.0)
        for s, token in sampled:
            s.output_token_ids.append(token)
        for b in req.beams:
            b.pending_logprobs = rows([b.output_token_ids])[0]
    for h in req.beam.finished:
        assert len(h.logprobs) == len(h.token_ids) == 4
        assert sum(e[t] for e, t in zip(h.logprobs, h.token_ids)) == pytest.approx(h.cumulative_logprob, abs=1e-4)
        for e, t in zip(h.logprobs, h.token_ids):
            assert list(e)[0] == t and len(e) in ((1,) if num_logprobs == 0 else (num_logprobs, num_logprobs + 1))


def test_step_beams_without_logprobs_keeps_none():
    rows = markov_model(3)
    req = _beam_request(2, rows([[]]), max_tokens=3)

    def fork(r, parent):
        r.seqs.append(parent.fork(len(r.seqs), len(r.seqs), None))
        return r.seqs[-1]

    while not req.beam.done:
        sampled, _ = step_beams(req, fork, set(), 100, 0.0)
        for s, token in sampled:
            s.output_token_ids.append(token)
        for b in req.beams:
            b.pending_logprobs = rows([b.output_token_ids])[0]
    assert all(h.logprobs is None for h in req.beam.finished) and all(s.logprobs == [] for s in req.seqs)


def test_a_stopped_hypothesis_with_logprobs_0_reports_its_token_only():
    rows = np.log(np.array([[0.5, 0.3, 0.2]], np.float32))
    req = _beam_request(2, rows, logprobs=0)

    def fork(r, parent):
        r.seqs.append(parent.fork(len(r.seqs), len(r.seqs), None))
        return r.seqs[-1]

    step_beams(req, fork, eos_token_ids={1}, max_model_len=100, now=0.0)  # token 1 stops at rank 1 < width
    assert [h.token_ids for h in req.beam.finished] == [[1]]
    assert req.beam.finished[0].logprobs == [{1: float(rows[0, 1])}]  # not the top token 0 as well


@pytest.mark.parametrize("seed", range(10))
def test_candidates_come_best_first_ties_by_lower_flat_index_at_a_wide_beam(seed):
    rng = np.random.default_rng(seed)
    width, vocab = 8, 40
    rows = np.round(np.log(rng.dirichlet(np.ones(vocab), size=4)), 1).astype(np.float32)  # many ties
    cum = [0.0, 0.0, -0.5, -1.0]
    running = step(BeamState(width, 1.0), cum, [[7]] * 4, rows, stop_ids=set(), max_new_tokens=100)
    flat = (rows.astype(np.float64) + np.array(cum)[:, None]).reshape(-1)
    want = sorted(range(flat.size), key=lambda i: (-flat[i], i))[:width]
    assert [(c.parent, c.token_id) for c in running] == [(i // vocab, i % vocab) for i in want]
    assert [c.cumulative_logprob for c in running] == [flat[i] for i in want]
