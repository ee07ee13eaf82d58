"""A request as the engine tracks it: its prompt, parameters and sequences (one per sample; beams come
and go). The scheduler never sees requests, only their sequences."""

from __future__ import annotations

from dataclasses import dataclass, field

from rawpaged.engine.beam_search import BeamState
from rawpaged.lora.request import LoRARequest
from rawpaged.model_executor.logits_processors import LogitsRules
from rawpaged.sampling_params import SamplingParams


@dataclass(eq=False)
class Request:
    """Attributes:
    seqs: every sequence the request made, first one first.
    forked: whether the first sequence forked its ``best_of - 1`` siblings yet.
    beam, beams: beam search only: the search state, and the beams still running.
    logits_rules: the penalties, bias and bans its parameters put on the logits
        (``model_executor.logits_processors.LogitsRules``), or None.
    lora_request: the LoRA adapter it runs with (``rawpaged.lora.request.LoRARequest``), or None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list
    params: SamplingParams
    arrival_time: float
    seqs: list = field(default_factory=list)
    forked: bool = False
    beam: BeamState | None = None
    beams: list = field(default_factory=list)
    logits_rules: LogitsRules | None = None
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs) and (self.forked or self.params.best_of == 1)
