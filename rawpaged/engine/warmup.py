"""The warm-up an engine runs before it serves: requests that reach every CPU kernel variant the
configuration can call, so that no request compiles one later (a first compile costs seconds, while the
first request waits).

A Numba kernel compiles once per argument-type signature and then loads from its on-disk cache at the next
start, so what matters is to call each kernel with each signature serving can give it. Those come from
the configuration (weights dtype and quantization, KV dtype, speculative decoding: the engine warms up as
it is configured) and from what a request asks for, which the warm-up requests cover:

- a long greedy prompt (tiled prefill, BLAS products), then a middling one (tiled, Numba's products) and
  short ones (the Numba prefill kernel) joining one per step,
  so that steps mix prefills with decodes (the model's own decode attention), and pure-decode steps of
  several rows (the fused decode) and of one;
- the middling prompt repeats itself, so the n-gram proposer drafts and the target verifies;
- sampled rows with penalties, ``logit_bias`` (the logits edits), top-k/top-p/min-p, a seed, ``logprobs``
  and ``prompt_logprobs``, and ``n=2`` (the copy-on-write of a shared block);
- ``allowed_token_ids`` (the token bitmask a grammar also uses), and a grammar when llguidance is
  installed (it also builds the structured-output manager);
- beam search;
- then a prompt that extends the long one (a prefill on a prefix-cache hit).

Where a kernel has a serial and a parallel twin chosen by the size of the work, the twin the warm-up did
not reach is compiled for the same signatures (``jit.compile_twins``).
"""

from __future__ import annotations

import importlib.util
import logging
import time

from rawpaged.kernels.cpu.jit import compile_twins
from rawpaged.kernels.cpu.prefill_tiled import TILED_PREFILL_MIN_TOKENS
from rawpaged.kernels.cpu.quant import ROWS_MAX_BATCH
from rawpaged.sampling_params import SamplingParams
from rawpaged.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: the grammar of the warm-up's constrained request
CHOICE = ("yes", "no")

#: the long prompt's length when the context, the batch and the pool allow it (tokens): past the rows a
#: quantized linear multiplies in registers, so its dequantize-then-SGEMM path runs too
LONG_PROMPT = ROWS_MAX_BATCH + 32


def _tokens(n: int, vocab: int, salt: int) -> list:
    return [(7 * i + 3 + 131 * salt) % vocab for i in range(n)]


def warmup_rounds(
    max_model_len: int, max_num_batched_tokens: int, num_blocks: int, block_size: int, vocab_size: int, grammar: bool
) -> list:
    """The warm-up requests, as rounds of ``(prompt_token_ids, SamplingParams)``: a round's requests join
    one per step (so steps mix prefills with decodes of several rows), and the next round starts when they
    are done.

    Every prompt plus its ``max_tokens`` fits ``max_model_len``, the long prompt is prefilled in one step
    of ``max_num_batched_tokens`` and a round's tokens fit the pool of ``num_blocks`` blocks of
    ``block_size``: the long prompt shrinks to fit (a context of 32 tokens still
    warms up; the scheduler queues what does not fit at once). ``grammar``: add a request with a
    ``choice`` grammar."""
    room = max(2, max_model_len - 8)
    long_len = max(2, min(LONG_PROMPT, room - 16, max_num_batched_tokens, (num_blocks * block_size) // 4))
    short = min(5, room)
    repeat = min(TILED_PREFILL_MIN_TOKENS + 16, room)  # tiled, in a step small enough for Numba's GEMM
    pattern = _tokens(6, vocab_size, 2)
    edited = SamplingParams(
        n=2,
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=0,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.1,
        logit_bias={1: 1.0},
        logprobs=2,
        prompt_logprobs=2,
        max_tokens=4,
        ignore_eos=True,
    )
    first = [
        (_tokens(long_len, vocab_size, 0), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
        ((pattern * repeat)[:repeat], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
        (_tokens(short, vocab_size, 1), edited),
        (
            _tokens(short, vocab_size, 3),
            SamplingParams(temperature=0.8, allowed_token_ids=list(range(min(8, vocab_size))), max_tokens=3),
        ),
        (_tokens(short, vocab_size, 4), SamplingParams(n=2, use_beam_search=True, max_tokens=3, ignore_eos=True)),
    ]
    if grammar:
        choice = StructuredOutputsParams(choice=list(CHOICE))
        first.append(
            (_tokens(short, vocab_size, 5), SamplingParams(temperature=0.8, structured_outputs=choice, max_tokens=2))
        )
    long_prompt = first[0][0]
    extended = (long_prompt + _tokens(16, vocab_size, 6))[: max(2, room - 2)]
    second = [(extended, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))]
    return [[_fit(prompt, params, max_model_len) for prompt, params in r] for r in (first, second)]


def _fit(prompt: list, params: SamplingParams, max_model_len: int) -> tuple:
    """``prompt`` cut, and ``params.max_tokens`` lowered, so that both fit ``max_model_len``."""
    params.max_tokens = max(1, min(params.max_tokens, max_model_len - 1))
    return prompt[: max(1, max_model_len - params.max_tokens)], params


def _grammars_work(engine) -> bool:
    """Whether ``engine`` compiles grammars: llguidance is installed and takes the model's tokenizer (a
    request with a grammar on an engine where it does not gets its error then, not the warm-up)."""
    if importlib.util.find_spec("llguidance") is None:
        return False
    try:
        engine.structured_output_manager.compile(StructuredOutputsParams(choice=list(CHOICE)))
    except Exception:  # noqa: BLE001
        logger.debug("warm-up without a grammar request", exc_info=True)
        return False
    return True


def run_warmup(engine) -> float:
    """Run ``warmup_rounds`` for ``engine`` (an idle ``LLMEngine``) to the end, then ``compile_twins``.
    Returns the seconds taken. Raises RuntimeError if the engine has requests."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warmup() needs an idle engine")
    t0 = time.monotonic()
    rounds = warmup_rounds(
        engine.max_model_len,
        engine.config.max_num_batched_tokens,
        engine.kv_cache_manager.num_blocks,
        engine.config.block_size,
        engine.model_config.vocab_size,
        grammar=_grammars_work(engine),
    )
    for requests in rounds:
        for prompt, params in requests:  # one per step: later prompts prefill while earlier ones decode
            engine.add_request({"prompt_token_ids": prompt}, params)
            engine.step()
        while engine.has_unfinished_requests():
            engine.step()
    compile_twins()
    return time.monotonic() - t0
