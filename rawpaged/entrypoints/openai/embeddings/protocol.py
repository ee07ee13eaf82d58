"""The body and answer of ``POST /v1/embeddings`` as pydantic models: OpenAI's ``EmbeddingCreateParams``
(``input``, ``model``, ``encoding_format``, ``dimensions``, ``user``) plus vLLM's extras ``normalize`` and
``add_special_tokens`` (vLLM's ``EmbeddingCompletionRequest``); the answer is OpenAI's
``CreateEmbeddingResponse`` (vLLM's ``EmbeddingResponse``). Every refusal is a
:class:`~rawpaged.entrypoints.http.errors.ProtocolError` naming the field.
"""

from __future__ import annotations

import base64
from typing import ClassVar, Literal

import numpy as np
from pydantic import BaseModel

from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.server.config import Limits
from rawpaged.pooling_params import PoolingParams

#: inputs one request may embed at most (OpenAI's limit)
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(OpenAIBaseModel):
    """A ``POST /v1/embeddings`` body. ``input``: a string, a list of strings, a list of token ids (one
    input) or a list of token-id lists; none may be empty, and each must fit ``max_model_len`` (the route
    checks that). ``encoding_format``: "float" (lists of numbers) or "base64" (each vector's little-endian
    float32 bytes, as OpenAI's). ``dimensions``: only for a model with Matryoshka embeddings (else a 400).
    ``normalize``: L2-normalize (default: the server's ``--pooler-config``). ``add_special_tokens``: add
    what the tokenizer adds to a text (BOS), default true as vLLM's."""

    expected_types: ClassVar[dict] = {
        "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
        "encoding_format": "'float' or 'base64'",
        "dimensions": "an integer",
    }

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True

    def check(self, limits: Limits) -> None:
        """Raises ProtocolError (param "input") for no input, an empty string or token list, or more than
        ``MAX_EMBEDDING_INPUTS`` inputs; (param "dimensions") for ``dimensions`` below 1."""
        items = self.items()
        if not items:
            raise ProtocolError("input must not be empty", param="input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ProtocolError(f"input has {len(items)} items; at most {MAX_EMBEDDING_INPUTS}", param="input")
        if any(len(item) == 0 for item in items):
            raise ProtocolError("input must not contain an empty string or an empty token list", param="input")
        if self.dimensions is not None and self.dimensions < 1:
            raise ProtocolError(f"dimensions must be >= 1, got {self.dimensions}", param="dimensions")

    def items(self) -> list:
        """The inputs, each a string or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [list(self.input)]
        return list(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class EmbeddingResponseData(BaseModel):
    """One vector: a list of floats, or with ``encoding_format`` "base64" a string."""

    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class UsageInfo(BaseModel):
    """Tokens read (vLLM's ``UsageInfo``: ``completion_tokens`` is 0 for pooling)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(BaseModel):
    """The answer: ``data`` in input order."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


def encode_embedding(vec: np.ndarray, encoding_format: str) -> list | str:
    """``vec`` (float32) as a list of floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(vec, dtype=np.float32).tolist()
