"""The bodies and answers of ``POST /v1/score`` (vLLM's ``ScoreRequest``: ``text_1`` against ``text_2``)
and ``POST /v1/rerank`` (Jina's and Cohere's shape, as vLLM's ``RerankRequest``: a ``query`` and its
``documents``) as pydantic models. Every refusal is a
:class:`~rawpaged.entrypoints.http.errors.ProtocolError` naming the field.

The answers carry ``score_method``: how the scores were made. A decoder model without a classifier head
(every model this server runs) scores by the cosine similarity of the two texts' embeddings
(``COSINE_SIMILARITY``), not by a cross-encoder; docs/embeddings.md says what that means for ranking.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel

from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel
from rawpaged.entrypoints.http.errors import ProtocolError
from rawpaged.entrypoints.openai.embeddings.protocol import MAX_EMBEDDING_INPUTS, UsageInfo
from rawpaged.entrypoints.server.config import Limits

#: ``score_method`` of the answers: the cosine similarity of the L2-normalized embeddings (the model's
#: pooling), in [-1, 1]
COSINE_SIMILARITY = "cosine_similarity"


def _texts(value, name: str) -> list:
    """``value`` (a string or a list of strings) as a list; ProtocolError naming ``name`` when it is empty
    or holds an empty string."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise ProtocolError(f"{name} must not be empty", param=name)
    if any(not t for t in texts):
        raise ProtocolError(f"{name} must not contain an empty string", param=name)
    return texts


class ScoreRequest(OpenAIBaseModel):
    """A ``POST /v1/score`` body: ``text_1`` (one text, or a list) scored against ``text_2`` (one, or a
    list): one text against each of a list, or two lists of the same length pairwise (vLLM's rules)."""

    expected_types: ClassVar[dict] = {
        "text_1": "a string or a list of strings",
        "text_2": "a string or a list of strings",
    }

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    add_special_tokens: bool = True

    def check(self, limits: Limits) -> None:
        """Raises ProtocolError for an empty side, lists of different lengths (neither of one text), or
        more than ``MAX_EMBEDDING_INPUTS`` pairs."""
        pairs = self.pairs()
        if len(pairs) > MAX_EMBEDDING_INPUTS:
            raise ProtocolError(f"{len(pairs)} pairs; at most {MAX_EMBEDDING_INPUTS}", param="text_2")

    def pairs(self) -> list:
        """``[(text_1, text_2)]`` in order."""
        first, second = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        if len(first) == 1:
            first = first * len(second)
        elif len(second) == 1:
            second = second * len(first)
        if len(first) != len(second):
            raise ProtocolError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text, or lists of the same length",
                param="text_2",
            )
        return list(zip(first, second))


class ScoreResponseData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    """vLLM's ``ScoreResponse`` plus ``score_method``."""

    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo
    score_method: str = COSINE_SIMILARITY


class RerankRequest(OpenAIBaseModel):
    """A ``POST /v1/rerank`` body (Jina's, Cohere's and vLLM's): ``query`` and ``documents`` (strings);
    ``top_n`` the best to return (None or 0: all, as vLLM); ``return_documents`` whether each result
    carries its document's text (default true)."""

    expected_types: ClassVar[dict] = {"documents": "a list of strings"}

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    add_special_tokens: bool = True

    def check(self, limits: Limits) -> None:
        """Raises ProtocolError for an empty query or document, no documents, too many, or a negative
        ``top_n``."""
        _texts(self.query, "query")
        _texts(self.documents, "documents")
        if len(self.documents) > MAX_EMBEDDING_INPUTS:
            raise ProtocolError(f"{len(self.documents)} documents; at most {MAX_EMBEDDING_INPUTS}", param="documents")
        if self.top_n is not None and self.top_n < 0:
            raise ProtocolError(f"top_n must be >= 0, got {self.top_n}", param="top_n")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    """vLLM's ``RerankResponse`` (Jina's shape) plus ``score_method``: ``results`` best first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    score_method: str = COSINE_SIMILARITY
