"""Offline inference: ``LLM(model=None).generate(prompts, SamplingParams(...))``, ``LLM.embed(prompts)`` and
``LLM.score(text_1, texts_2)``, named after vLLM's."""

from __future__ import annotations

import numpy as np

from rawpaged.config import EngineConfig
from rawpaged.engine.llm_engine import LLMEngine
from rawpaged.engine.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from rawpaged.errors import RequestFailedError
from rawpaged.pooling_params import PoolingParams
from rawpaged.sampling_params import SamplingParams


class LLM:
    """An ``LLMEngine`` run to completion for each call.

    Args: those of ``EngineConfig`` (model, device, dtype, block_size, num_kv_blocks, max_num_seqs,
    max_model_len, ...), with the same defaults. Raises ValueError for bad configuration or model files,
    RuntimeError for ``device="cuda"`` without a usable GPU.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, lora_request=None) -> list:
        """Generate for one prompt or a list; returns ``RequestOutput``s in input order.

        ``sampling_params`` is one ``SamplingParams`` for all or a list (one per prompt); None means
        ``get_default_sampling_params()`` (the model's generation config, as in vLLM). ``lora_request``
        (with ``enable_lora``): one ``LoRARequest`` for all, a list (one per prompt, None for the base model),
        or None. If any prompt or adapter is invalid, a ValueError is raised and nothing is left queued. If
        computing a request failed in the engine, RequestFailedError is raised once the others are done.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        return self._run(prompts, sampling_params, lora_request)

    def embed(self, prompts, pooling_params=None, lora_request=None) -> list:
        """Embed one prompt or a list (strings, ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``);
        returns an ``EmbeddingRequestOutput`` per prompt, in input order, as vLLM's ``LLM.embed``: its
        ``outputs.embedding`` is a float32 NumPy array ``[hidden_size]`` (or ``[dimensions]``); stack them
        with ``np.stack([o.outputs.embedding for o in outs])``.

        Each prompt runs once, prefill only, batched with whatever else runs, and is pooled as the
        engine's ``pooler_config`` says (default: the last position's final-norm hidden state,
        L2-normalized; docs/embeddings.md). ``pooling_params``: one ``PoolingParams`` for all, a list, or
        None. ``lora_request`` as ``generate``'s. Raises ValueError (nothing left queued) for an invalid
        prompt or parameter, RequestFailedError as ``generate``.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling_params for {len(prompts)} prompts")
        return [EmbeddingRequestOutput.from_base(o) for o in self._run(prompts, pooling_params, lora_request)]

    def score(self, data_1, data_2) -> list:
        """Score ``data_1`` (one prompt, or a list) against ``data_2`` (one, or a list: one against each, or
        two lists of the same length pairwise, as vLLM's ``LLM.score``); a ``ScoringRequestOutput`` per pair
        whose ``outputs.score`` is the cosine similarity of the two L2-normalized embeddings (this engine's
        models have no classifier head: docs/embeddings.md). Raises ValueError for lists of other lengths
        and as ``embed``."""
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        elif len(second) == 1:
            second = second * len(first)
        if len(first) != len(second) or not first:
            raise ValueError(f"data_1 has {len(first)} prompts and data_2 {len(second)}: give one, or as many")
        outs = self.embed(first + second, PoolingParams(normalize=True))
        n = len(first)
        return [
            ScoringRequestOutput(
                b.request_id,
                b.prompt_token_ids,
                ScoringOutput(float(np.dot(a.outputs.embedding.astype(np.float64), b.outputs.embedding))),
            )
            for a, b in zip(outs[:n], outs[n:])
        ]

    def _run(self, prompts: list, params_list: list, lora_request) -> list:
        """Queue every prompt with its parameters and step the engine until all finished; the final outputs
        in input order (see ``generate``)."""
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(prompt, params, lora_request=lora))
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        errors = [f"{rid}: {final[rid].error}" for rid in ids if final[rid].error is not None]
        if errors:
            raise RequestFailedError(f"{len(errors)} of {len(ids)} requests failed ({'; '.join(errors)})")
        return [final[rid] for rid in ids]

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` defaults (temperature, top_p,
        top_k, min_p where it sets them)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def chat(self, messages, sampling_params=None, chat_template_kwargs: dict | None = None) -> list:
        """Like ``generate`` for one conversation (list of {"role", "content"}) or a list of them,
        rendered with the model's chat template and ``add_generation_prompt=True`` (plus
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3); message contents are
        literal text (``Tokenizer.encode_chat``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in convs:
            text, ids = self.tokenizer.encode_chat(conv, True, chat_template_kwargs)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params)

    def beam_search(
        self,
        prompts,
        beam_width: int = 4,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        n: int | None = None,
        ignore_eos: bool = False,
    ) -> list:
        """Beam search for each prompt; ``outputs`` holds the ``n`` (default ``beam_width``) best
        hypotheses, best first (HF transformers' semantics, see ``rawpaged.engine.beam_search``)."""
        params = SamplingParams(
            n=n or beam_width,
            beam_width=beam_width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            temperature=0.0,
            ignore_eos=ignore_eos,
        )
        return self.generate(prompts, params)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Flush what outlives the engine (a persistent second KV tier's file); the engine stays usable
        without its tier. Idempotent."""
        self.engine.close()
