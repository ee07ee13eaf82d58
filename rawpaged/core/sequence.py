"""One generated sequence: its token ids, KV block table, progress and output state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from rawpaged.core.block_table import BlockTable
from rawpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_LORA = "waiting_for_lora"  # in the waiting queue, its LoRA adapter still being loaded
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """A prompt plus the tokens generated for one choice of a request.

    ``num_computed_tokens`` counts positions whose KV is in the cache; the next step computes
    positions ``num_computed_tokens .. num_tokens-1`` (the whole prompt at first, one token per decode
    step, a chunk under chunked prefill, everything again after preemption by recompute).
    """

    seq_id: int
    request_id: str
    index: int  # choice index within the request
    prompt_token_ids: list
    sampling_params: SamplingParams
    rng: np.random.Generator | None
    arrival_time: float
    output_token_ids: list = field(default_factory=list)
    block_tables: list | None = None  # one BlockTable per KV cache group, while it holds blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)  # per generated token: {token_id: logprob}
    # prompt_logprobs requested: per prompt token so far, None for the first, then {token_id: logprob}
    prompt_logprobs: list = field(default_factory=list)
    # Incremental detokenizer state (``rawpaged.engine.detokenizer``).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    num_text_emitted: int = 0
    pending_logprobs: object = None  # beam search: this step's log_softmax row, until all beams have one
    first_token_time: float | None = None
    grammar: object = None  # structured outputs: the matcher of this sequence's tokens, else None
    reasoning_ended: bool = True  # False while a reasoning model thinks: its grammar waits for </think>
    swapped_table: object = None  # preempted by swapping: its blocks' swap slots (``KVTier.swap_out``)
    # Speculative decoding: the drafts to verify in the next step (never part of ``token_ids``), and the
    # proposer's back-off after rejected drafts (``rawpaged.spec_decode.speculator``).
    spec_token_ids: list = field(default_factory=list)
    spec_misses: int = 0
    spec_backoff: int = 0
    # LoRA: the adapter's id (0: the base model alone) and its content digest, which the prefix cache's
    # hash chain starts from (None: the cache's own root), so two adapters never share a KV block
    lora_int_id: int = 0
    lora_key: str | None = None
    # Pooling (embeddings): the request's resolved ``rawpaged.pooling_params.PoolingParams`` (None: it
    # generates); such a sequence runs its prompt only, never samples, and ends once its last prompt
    # position ran. ``pooling_state``: the float64 sum of the hidden rows pooled so far
    # (``model_executor.layers.pooler``)
    pooling_params: object = None
    pooling_state: object = None

    @property
    def block_table(self) -> BlockTable | None:
        """The first KV cache group's ``BlockTable`` (the only one with one group), or None."""
        return None if self.block_tables is None else self.block_tables[0]

    @block_table.setter
    def block_table(self, table: BlockTable | None) -> None:
        self.block_tables = None if table is None else [table]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while KV of some prompt (or recomputed) tokens before the last one is missing."""
        return self.num_tokens - self.num_computed_tokens > 1

    def fork(self, seq_id: int, index: int, rng: np.random.Generator | None) -> Sequence:
        """A new sequence continuing from this one's state (tokens, text, logprobs); no blocks yet:
        ``Scheduler.fork`` shares them."""
        return Sequence(
            seq_id,
            self.request_id,
            index,
            self.prompt_token_ids,
            self.sampling_params,
            rng,
            self.arrival_time,
            output_token_ids=list(self.output_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=list(self.logprobs),
            output_text=self.output_text,
            prefix_offset=self.prefix_offset,
            read_offset=self.read_offset,
            num_text_emitted=self.num_text_emitted,
            first_token_time=self.first_token_time,
            grammar=self.grammar.fork() if self.grammar is not None else None,
            reasoning_ended=self.reasoning_ended,
            lora_int_id=self.lora_int_id,
            lora_key=self.lora_key,
        )
