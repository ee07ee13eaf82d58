"""Draft-model proposals (``method: "draft_model"``): a smaller model that shares the target's tokenizer
guesses the next k tokens, on the same backend, with a paged KV pool of its own built as the target's is
(``model_executor.model_parts``: the model, its ``KVCacheManager`` and ``ModelRunner``).

Each running sequence that speculates has a mirror sequence in the draft pool. A step brings the mirror
up to the target's tokens (the tokens its last drafts got wrong are rolled back, as the target's are, by
``KVCacheManager.free_rejected_slots``), computes the new tokens as one prefill chunk, then decodes k - 1
more; all mirrors of the step go through each of those k forward passes together. Drafts are the draft
model's greedy tokens: a one-hot draft distribution, so ``rejection_sampler``'s rule keeps the target's
distribution exactly (Leviathan et al. 2023 with q = delta(x)). Mirrors of sequences that left the running
batch are freed at the next step, so the draft pool never holds a finished or aborted sequence's blocks.
"""

from __future__ import annotations

from rawpaged.core.scheduler import SchedulerOutput
from rawpaged.core.sequence import Sequence
from rawpaged.model_executor.model_loader import load_model
from rawpaged.model_executor.model_parts import KVPoolSpec, ModelParts, build_model, build_model_parts
from rawpaged.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0)


def check_vocabularies(draft_config, draft_tokenizer, target_config, target_tokenizer) -> None:
    """Raise ValueError naming ``speculative_config.model`` unless the draft and target models have the same
    vocabulary size and the same tokenizer vocabulary (token string -> id)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocab_size {draft_config.vocab_size} differs from the "
            f"target's {target_config.vocab_size}; a draft model must share the target's tokenizer"
        )
    a, b = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            "speculative_config.model: the draft model's tokenizer differs from the target's "
            f"({len(a)} vs {len(b)} entries; e.g. {diff}); a draft model must share the target's tokenizer"
        )


class DraftModelProposer:
    """Args:
        model_dir: the draft model's directory (or GGUF file).
        target: the target engine's ``ModelParts``, which the draft must agree with (vocabulary, context)
            and runs beside: on its backend and dtypes, with a pool of as many blocks of its own.
    Raises:
        ValueError: the vocabularies differ, or the draft model's context is shorter than the target's
            ``max_model_len``.

    Attributes:
        parts: the draft's own ``ModelParts`` (``model``, ``kv_cache_manager``, ``runner``).
    """

    def __init__(self, model_dir, target: ModelParts):
        try:
            config, tokenizer, _, weights = load_model(model_dir)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        check_vocabularies(config, tokenizer, target.model_config, target.tokenizer)
        if config.context_len < target.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft model's context ({config.context_len} tokens) is shorter "
                f"than max_model_len {target.max_model_len}"
            )
        model = build_model(config, weights, target.backend, target.dtype, target.max_model_len)
        pool = KVPoolSpec(target.num_blocks, target.block_size, target.kv_cache_dtype)
        self.parts = build_model_parts(config, tokenizer, model, target.max_model_len, pool)
        self.backend = target.backend
        self.model, self.kv_cache_manager, self.runner = model, self.parts.kv_cache_manager, self.parts.runner
        self.mirrors: dict = {}  # target seq_id -> the draft pool's Sequence

    def propose_batch(self, items: list) -> list:
        """Drafts for ``items`` = [(target sequence, k)], in order (``[]`` for one whose mirror does not fit
        in the draft pool). The caller passes every running sequence (k = 0 for those not speculating), so
        mirrors of the others are freed here."""
        live = {seq.seq_id for seq, _ in items}
        for seq_id in [i for i in self.mirrors if i not in live]:
            self.kv_cache_manager.free(self.mirrors.pop(seq_id))
        want = [(seq, k) for seq, k in items if k > 0]
        active = []  # (mirror, k)
        scheduled = []
        for seq, k in want:
            mirror = self._sync(seq)
            n = mirror.num_tokens - mirror.num_computed_tokens
            if self.kv_cache_manager.allocate_slots(mirror, n):
                active.append((mirror, k))
                scheduled.append((mirror, n))
            else:  # the draft pool is full: no drafts, and the mirror starts over later
                self.kv_cache_manager.free(self.mirrors.pop(seq.seq_id))
        while scheduled:
            tokens = self._forward(scheduled)
            next_active, scheduled = [], []
            for (mirror, k), token in zip(active, tokens):
                mirror.output_token_ids.append(token)
                if len(mirror.output_token_ids) < k and self.kv_cache_manager.allocate_slots(mirror, 1):
                    next_active.append((mirror, k))
                    scheduled.append((mirror, 1))
            active = next_active
        drafts = []
        for seq, k in items:
            mirror = self.mirrors.get(seq.seq_id)
            drafts.append(list(mirror.output_token_ids) if k and mirror is not None else [])
        return drafts

    def _sync(self, seq) -> Sequence:
        """The mirror of ``seq`` holding exactly ``seq``'s tokens, its computed KV cut back to the longest
        prefix it shares with them (its own drafts after that are rolled back), at least one token to
        compute."""
        tokens = list(seq.token_ids)
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.seq_id, seq.request_id, seq.index, tokens, _GREEDY, None, seq.arrival_time)
            self.mirrors[seq.seq_id] = mirror
            return mirror
        # The mirror holds the target's tokens of the last sync (unchanged since) and then its drafts:
        # only the drafts need comparing.
        same = len(mirror.prompt_token_ids)
        for draft, token in zip(mirror.output_token_ids, tokens[same:]):
            if draft != token:
                break
            same += 1
        same = min(same, mirror.num_computed_tokens)
        mirror.prompt_token_ids = tokens
        mirror.output_token_ids = []
        mirror.num_computed_tokens = min(same, len(tokens) - 1)
        self.kv_cache_manager.free_rejected_slots(mirror)
        return mirror

    def _forward(self, scheduled: list) -> list:
        """One forward pass of the draft model over ``scheduled`` = [(mirror, new tokens)]; each mirror's
        greedy next token. The mirrors' computed counts advance."""
        logits, layout, *_ = self.runner.execute_model(SchedulerOutput(scheduled=list(scheduled)))
        assert len(layout.seqs) == len(scheduled)  # every mirror's new tokens reach its end
        for mirror, n in scheduled:
            mirror.num_computed_tokens += n
        draws = [(row, _GREEDY, 0.0) for row in range(layout.num_rows)]
        return [int(t) for t in self.runner.sample(logits, draws)]

    def check_invariants(self) -> None:
        self.kv_cache_manager.check_invariants(list(self.mirrors.values()))
