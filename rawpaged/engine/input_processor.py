"""Requests in: a prompt (text or token ids) becomes validated token ids, or an ``InvalidRequestError``
naming the field at fault, before anything is queued (after vLLM v1's input processor)."""

from __future__ import annotations

import numpy as np

from rawpaged.errors import InvalidRequestError
from rawpaged.lora.request import LoRARequest
from rawpaged.sampling_params import ALL_LOGPROBS, SamplingParams
from rawpaged.tokenizer import Tokenizer


class InputProcessor:
    """Args:
    tokenizer: the model's tokenizer.
    vocab_size: token ids must lie in ``[0, vocab_size)``.
    max_model_len: prompt + generated tokens per sequence.
    block_size, num_blocks: the KV pool, which must hold a request's whole footprint when empty.
    group_windows: the window of each KV cache group of the pool (None: full attention); None is one group
        of ``sliding_window``. A request needs its blocks in every group: in a sliding group of window W, at
        most the blocks of W - 1 positions plus one step's tokens (at most ``max_num_batched_tokens``), plus
        one.
    max_logprobs: ``logprobs`` and ``prompt_logprobs`` a request may ask for at most (-1: the vocabulary).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        sliding_window: int | None = None,
        max_num_batched_tokens: int | None = None,
        max_logprobs: int = 20,
        group_windows: tuple | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.group_windows = tuple(group_windows) if group_windows is not None else (sliding_window,)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs

    def tokenize(self, prompt) -> tuple:
        """``prompt`` (a string, ``{"prompt_token_ids": [...]}`` optionally with its ``"prompt"`` text, or
        ``{"prompt": str}``) -> ``(text or None, token ids)``, unvalidated."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InvalidRequestError("prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'", "prompt")

    def check_prompt(self, ids: list, pooling: bool = False) -> None:
        """Raises InvalidRequestError (param "prompt") for no tokens, ids outside the vocabulary, or a
        prompt that leaves no room to generate within ``max_model_len`` (``pooling``: a pooling request
        generates nothing, so its prompt may fill ``max_model_len``)."""
        if not ids:
            raise InvalidRequestError("prompt is empty (no tokens)", "prompt")
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids contains ids outside [0, {self.vocab_size}): {bad[:5]}", "prompt"
            )
        if pooling and len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length (max_model_len) is {self.max_model_len} tokens; "
                f"the input has {len(ids)} tokens: shorten it",
                "prompt",
            )
        if not pooling and len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length (max_model_len) is {self.max_model_len} "
                f"tokens; the prompt has {len(ids)} tokens and at least one must remain for "
                f"generation",
                "prompt",
            )

    def check_logprobs(self, params: SamplingParams) -> None:
        """Raises InvalidRequestError (param "logprobs" or "prompt_logprobs", vLLM's words) for a count above
        ``max_logprobs``; -1 counts as the whole vocabulary."""
        for name, what in (("logprobs", "sample logprobs"), ("prompt_logprobs", "prompt logprobs")):
            n = getattr(params, name)
            n = self.vocab_size if n == ALL_LOGPROBS else n
            if n is not None and n > self.max_logprobs:
                raise InvalidRequestError(
                    f"Requested {what} of {n}, which is greater than max allowed: {self.max_logprobs}", name
                )

    def check_lora_request(self, lora_request, lora_manager) -> object:
        """The adapter of ``lora_request`` (None: none), registered and checked by ``lora_manager``
        (``rawpaged.lora.models.LoRAModelManager.register``: its config and weights header; the weights
        are loaded in the background when a step needs them; None: LoRA is off), as a ``LoRAAdapterSpec`` or
        None. Raises InvalidRequestError (param "lora_request") where LoRA is off, for something not a
        ``LoRARequest``, an adapter that cannot be loaded (the message names the adapter and the field), or
        one whose pages leave no block of the pool for KV."""
        if lora_request is None:
            return None
        if lora_manager is None:
            raise InvalidRequestError("lora_request given but LoRA is not enabled (enable_lora=True)", "lora_request")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", "lora_request"
            )
        try:
            spec = lora_manager.register(lora_request)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_request") from None
        pages = lora_manager.num_pages(lora_request.lora_int_id)
        if pages >= self.num_blocks:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r}: its weights take {pages} pages (KV blocks) but the pool "
                f"has only {self.num_blocks} blocks",
                "lora_request",
            )
        return spec

    def process(self, prompt, params: SamplingParams, lora_pages: int = 0) -> tuple:
        """``(text or None, token ids as ints)`` of a request that can run: ``check_prompt``, and its
        footprint (prompt + ``max_tokens``, capped by ``max_model_len``; times ``beam_width`` for beam
        search; with a sliding window, only what the window and one step hold; plus ``lora_pages``, the
        pool blocks its LoRA adapter takes) must fit the empty pool (InvalidRequestError, param
        "max_tokens"); ``check_logprobs``."""
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids)
        self.check_logprobs(params)
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = sum(self._group_blocks(total, w) for w in self.group_windows)
        if params.use_beam_search:  # beams run together; each may end up holding its own blocks
            need *= params.beam_width
        need += lora_pages
        if need > self.num_blocks:
            beams = f" x beam_width {params.beam_width}" if params.use_beam_search else ""
            if len(self.group_windows) > 1:
                beams += f", over {len(self.group_windows)} KV cache groups"
            if lora_pages:
                beams += f", with {lora_pages} pages of its LoRA adapter"
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({total} tokens of block_size {self.block_size}"
                f"{beams}) but the pool has only {self.num_blocks}",
                "max_tokens",
            )
        return text, [int(t) for t in ids]

    def process_pooling(self, prompt) -> tuple:
        """``(text or None, token ids as ints)`` of a pooling request (prefill only) that can run:
        ``check_prompt`` with ``pooling``, and its prompt's blocks must fit the empty pool
        (InvalidRequestError, param "prompt")."""
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids, pooling=True)
        need = sum(self._group_blocks(len(ids), w) for w in self.group_windows)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"the input needs {need} KV blocks ({len(ids)} tokens of block_size {self.block_size}) but the "
                f"pool has only {self.num_blocks}",
                "prompt",
            )
        return text, [int(t) for t in ids]

    def _group_blocks(self, total: int, window: int | None) -> int:
        """Blocks a sequence of ``total`` tokens holds at most in a group of ``window`` (None: full)."""
        need = -(-total // self.block_size)
        if window is None:
            return need
        step = min(total, self.max_num_batched_tokens or total)
        return min(need, -(-(step + window - 1) // self.block_size) + 1)
