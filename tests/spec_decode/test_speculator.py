"""Who speculates and how far: the config's parsing and errors, the limits a draft respects (max_tokens,
max_model_len, beam search, structured outputs, the batch-size switch) and the back-off after misses."""

from __future__ import annotations

import pytest

from rawpaged.config import EngineConfig, SpeculativeConfig
from rawpaged.core.sequence import Sequence
from rawpaged.sampling_params import SamplingParams
from rawpaged.spec_decode.ngram_proposer import NgramProposer
from rawpaged.spec_decode.speculator import MAX_BACKOFF_STEPS, Speculator
from rawpaged.spec_decode.suffix_proposer import SuffixProposer


def decoding(prompt, output, **params) -> Sequence:
    s = Sequence(0, "r", 0, list(prompt), SamplingParams(**params), None, 0.0, output_token_ids=list(output))
    s.num_computed_tokens = s.num_tokens - 1
    return s


def test_parsed_from_json_dict_or_none_and_errors_name_the_key():
    assert SpeculativeConfig.parse(None) is None
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c == SpeculativeConfig(num_speculative_tokens=3) and SpeculativeConfig.parse(c) is c
    assert EngineConfig(speculative_config={"prompt_lookup_max": 7}).speculative_config.prompt_lookup_max == 7
    assert SpeculativeConfig.parse('{"model": "small"}').method == "draft_model"  # inferred, as vLLM does
    for bad, match in [
        ('{"method": "medusa"}', "speculative_config.method"),
        ('{"num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"disable_by_batch_size": 0}', "disable_by_batch_size"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "suffix_decoding_min_token_prob"),
        ('{"suffix_decoding_max_spec_factor": 0}', "suffix_decoding_max_spec_factor"),
        ('{"suffix_decoding_max_tree_depth": 0}', "suffix_decoding_max_tree_depth"),
        ('{"suffix_decoding_max_cached_requests": -1}', "suffix_decoding_max_cached_requests"),
        ('{"num_spec_tokens": 2}', "unknown key"),
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "suffix", "model": "m"}', 'used only with "method": "draft_model"'),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(speculative_config=bad)


def test_drafts_respect_max_tokens_and_the_context():
    sp = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1), max_model_len=12)
    repeat = [1, 2, 3, 1, 2, 3]
    s = decoding(repeat, [1], max_tokens=100)
    sp.propose([s])
    assert s.spec_token_ids == [2, 3, 1, 2]
    s = decoding(repeat, [1], max_tokens=3)  # 2 more tokens: one draft and the bonus
    sp.propose([s])
    assert s.spec_token_ids == [2]
    s = decoding(repeat, [1, 2, 3, 1], max_tokens=100)  # 10 tokens of 12: drafts at positions 10, 11
    sp.propose([s])
    assert s.spec_token_ids == [2, 3]


def test_no_drafts_for_beams_grammars_prefills_or_a_large_batch():
    sp = Speculator(SpeculativeConfig(prompt_lookup_min=1), max_model_len=100)
    beam = decoding([1, 2, 1, 2], [1], beam_width=2, max_tokens=9)
    constrained = decoding([1, 2, 1, 2], [1], max_tokens=9)
    constrained.grammar = object()
    prefill = decoding([1, 2, 1, 2], [1], max_tokens=9)
    prefill.num_computed_tokens = 0
    sp.propose([beam, constrained, prefill])
    assert beam.spec_token_ids == constrained.spec_token_ids == prefill.spec_token_ids == []
    limited = Speculator(SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=2), max_model_len=100)
    a, b = decoding([1, 2, 1, 2], [1], max_tokens=9), decoding([1, 2, 1, 2], [1], max_tokens=9)
    limited.propose([a])
    assert a.spec_token_ids
    limited.propose([a, b])
    assert a.spec_token_ids == b.spec_token_ids == []


def test_misses_back_off_exponentially_and_an_acceptance_resets():
    sp = Speculator(SpeculativeConfig(prompt_lookup_min=1), max_model_len=1000)
    s = decoding([1, 2] * 4, [1], max_tokens=500)
    skipped = []
    for _ in range(7):
        sp.observe(s, 3, 0)
        n = 0
        while sp.num_draft_tokens(s) == 0:
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, MAX_BACKOFF_STEPS, MAX_BACKOFF_STEPS]
    sp.observe(s, 3, 1)
    assert s.spec_misses == 0 and sp.num_draft_tokens(s) == 3
    assert sp.stats.num_drafts == 8 and sp.stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_the_method_picks_the_proposer_and_suffix_learns_finished_outputs():
    assert isinstance(Speculator(SpeculativeConfig(), 100).proposer, NgramProposer)
    sp = Speculator(SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=2.0), 100)
    assert isinstance(sp.proposer, SuffixProposer)
    done = decoding([9], [4, 5, 6, 7], max_tokens=4)
    sp.finished(done)
    s = decoding([1, 2], [4, 5], max_tokens=50)
    sp.propose([s])
    assert s.spec_token_ids == [6, 7]
