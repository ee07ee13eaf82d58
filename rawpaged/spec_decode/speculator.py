"""Which sequences speculate, and how far: after each step, every running sequence that decodes next gets
its drafts for the next step (``Sequence.spec_token_ids``), from the configured proposer.

No sequence gets drafts while the running batch holds ``disable_by_batch_size`` sequences or more. A
sequence gets none when it uses beam search or structured outputs (their per-token state is not rolled
back yet), when fewer than two tokens are left before ``max_tokens`` or ``max_model_len``, or while it backs
off: a draft of which nothing was accepted makes the sequence skip the next 1, 2, 4, ... (at most
``MAX_BACKOFF_STEPS``) decode steps before it proposes again, and any acceptance resets that. So text the
proposer cannot predict costs a verification step now and then, not every step.
"""

from __future__ import annotations

from rawpaged.config import SpeculativeConfig
from rawpaged.spec_decode.draft_model import DraftModelProposer
from rawpaged.spec_decode.metrics import SpecDecodingStats
from rawpaged.spec_decode.ngram_proposer import NgramProposer
from rawpaged.spec_decode.suffix_proposer import SuffixProposer

#: the longest run of decode steps a sequence sits out after drafts that were all rejected
MAX_BACKOFF_STEPS = 16


class Speculator:
    """Args:
    config: the ``SpeculativeConfig``.
    max_model_len: tokens per sequence at most (no draft position reaches it).
    target: the target engine's ``ModelParts`` (needed by a draft model only).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int, target=None):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config, target)
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    def num_draft_tokens(self, seq) -> int:
        """How many drafts ``seq`` may take now (0: none; a pooling sequence never samples, so never drafts)."""
        params = seq.sampling_params
        if params.use_beam_search or seq.grammar is not None or seq.pooling_params is not None:
            return 0
        if seq.num_tokens - seq.num_computed_tokens != 1:  # not decoding next
            return 0
        if seq.spec_backoff > 0:
            seq.spec_backoff -= 1
            return 0
        # Draft i sits at position num_tokens + i, and the step emits at most k + 1 tokens.
        room = min(self.max_model_len - seq.num_tokens, params.max_tokens - len(seq.output_token_ids) - 1)
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, seqs) -> None:
        """Set ``spec_token_ids`` of each of ``seqs`` (the running batch) for the next step (none for any
        when the batch has ``disable_by_batch_size`` sequences or more)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(seqs) >= limit
        items = [(seq, 0 if off else self.num_draft_tokens(seq)) for seq in seqs]
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is not None:
            for (seq, _), drafts in zip(items, batch(items)):
                seq.spec_token_ids = drafts
            return
        for seq, k in items:
            seq.spec_token_ids = self.proposer.propose(seq.token_ids, k) if k else []

    def finished(self, seq) -> None:
        """A sequence finished: a proposer that learns from past outputs (suffix) keeps its output."""
        add = getattr(self.proposer, "add_finished", None)
        if add is not None and seq.output_token_ids:
            add(seq.output_token_ids)

    def reset_stats(self) -> None:
        self.stats = SpecDecodingStats(self.config.num_speculative_tokens)

    def observe(self, seq, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Record a verified draft of ``seq`` and update its back-off."""
        self.stats.observe_draft(num_draft_tokens, num_accepted_tokens)
        if num_accepted_tokens:
            seq.spec_misses = 0
        else:
            seq.spec_misses += 1
            seq.spec_backoff = min(MAX_BACKOFF_STEPS, 1 << (seq.spec_misses - 1))


def make_proposer(config: SpeculativeConfig, target=None):
    """The proposer of ``config.method``: one with ``propose(token_ids, k) -> list`` of draft ids, or
    ``propose_batch([(sequence, k)]) -> [drafts]`` (the draft model, which needs ``target``, the target
    engine's ``ModelParts``: see ``DraftModelProposer``; ``config.model`` is then a resolved path)."""
    if config.method == "draft_model":
        if target is None:
            raise ValueError("speculative_config: method 'draft_model' needs the target engine's geometry")
        return DraftModelProposer(config.model, target)
    if config.method == "suffix":
        return SuffixProposer(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
            config.suffix_decoding_max_cached_requests,
        )
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
