"""A checked request's parameters as the engine's ``SamplingParams``: the request's fields, the model's
generation config for those it leaves unset, and vLLM's beam search parameters. Knows the request models'
fields (``protocol``), not HTTP."""

from __future__ import annotations

from rawpaged.errors import InvalidRequestError
from rawpaged.sampling_params import SamplingParams

#: request fields passed on to ``SamplingParams`` as they are, when set
_PLAIN_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
)


def sampling_kwargs(req, defaults: dict | None = None) -> dict:
    """``SamplingParams`` keyword arguments of ``req`` (a ``protocol.GenerationRequest``) except
    ``max_tokens``; ``defaults`` (the model's generation config: temperature, top_p, top_k, min_p,
    repetition_penalty) fill the fields the request leaves unset. Raises ProtocolError for a malformed
    ``response_format`` or ``logit_bias`` key."""
    kw = dict(defaults or {})
    kw.update(n=req.num_choices, temperature=kw.get("temperature", 1.0))
    for name in _PLAIN_FIELDS:
        if getattr(req, name) is not None:
            kw[name] = getattr(req, name)
    if req.seed is not None:
        kw["seed"] = req.seed % (1 << 64)  # negative seeds (valid in OpenAI's API) map to unsigned
    if req.num_logprobs is not None:
        kw["logprobs"] = req.num_logprobs
    if req.num_prompt_logprobs is not None:
        kw["prompt_logprobs"] = req.num_prompt_logprobs
    if req.logit_bias is not None:
        kw["logit_bias"] = req.token_logit_bias()
    best_of = getattr(req, "best_of", None)
    if best_of is not None:
        kw["best_of"] = best_of
    structured = req.structured_outputs_fields()
    if structured is not None:
        kw["structured_outputs"] = structured
    if req.use_beam_search:  # vLLM's extra parameters: width best_of (or n), greedy by nature
        kw["beam_width"] = max(kw.pop("best_of", kw["n"]), kw["n"], 2)
        kw["temperature"] = 0.0
        if req.length_penalty is not None:
            kw["length_penalty"] = req.length_penalty
    return kw


def to_sampling_params(req, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
    """``req``'s ``SamplingParams`` generating at most ``max_tokens`` (``defaults``: see
    ``sampling_kwargs``). Raises ProtocolError: the engine's ``InvalidRequestError`` under the field's name
    as the client sent it (``req.client_error``)."""
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling_kwargs(req, defaults))
    except InvalidRequestError as e:
        raise req.client_error(e) from None
