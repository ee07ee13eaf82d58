"""What the engine returns: ``RequestOutput`` (cumulative, one per request and step) with one
``CompletionOutput`` per choice, ``PoolingRequestOutput`` (one per pooling request, when its prompt ran;
``LLM.embed`` wraps it as ``EmbeddingRequestOutput``), and ``DeltaTracker``, which turns successive outputs
into what each choice gained (the pieces a stream sends)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One choice so far: its whole text and token ids, not a delta."""

    index: int
    text: str
    token_ids: list
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list | None = None  # per token: {token_id: logprob}, the chosen token first
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step. ``metrics``: ``arrival_time``, ``first_token_time`` and, once
    finished, ``finished_time`` (``time.monotonic()`` seconds). ``error``: why the engine ended the request
    (``finished`` then, no outputs), when computing it failed inside a step. ``prompt_logprobs``: with
    ``SamplingParams.prompt_logprobs``, one entry per prompt token once the prompt ran: None for the first,
    then ``{token_id: Logprob}`` (``engine.logprobs.Logprob``: the prompt token first, then the most likely
    ones), as vLLM's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: list | None = None


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM's ``PoolingOutput``): ``data``, float32 ``[dimensions]``."""

    data: object


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output, once its prompt ran (vLLM's ``PoolingRequestOutput``): ``outputs``
    is its ``PoolingOutput`` (None with ``error``, when computing it failed inside a step). ``finished`` is
    always True; ``num_cached_tokens``: prompt tokens taken from the prefix cache. ``metrics`` as
    ``RequestOutput``'s."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: PoolingOutput | None
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """An embedding (vLLM's ``EmbeddingOutput``): ``embedding``, a float32 NumPy array ``[dimensions]``
    (vLLM gives a list of floats; ``.tolist()`` makes one)."""

    embedding: object

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result per prompt (vLLM's ``EmbeddingRequestOutput``): ``outputs.embedding`` is the
    vector."""

    request_id: str
    prompt_token_ids: list
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, out.prompt_token_ids, EmbeddingOutput(out.outputs.data), out.finished)


@dataclass
class ScoringOutput:
    """A pair's score (vLLM's ``ScoringOutput``): here the cosine similarity of the two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result per pair (vLLM's ``ScoringRequestOutput``): ``outputs.score``; ``request_id``
    and ``prompt_token_ids`` are the second text's embedding request's."""

    request_id: str
    prompt_token_ids: list
    outputs: ScoringOutput
    finished: bool = True


@dataclass(slots=True)
class CompletionDelta:
    """What choice ``index`` gained since the previous output: new ``text``, ``token_ids`` and their
    ``logprobs`` (None unless requested), and its ``finish_reason`` once it finished. ``text_offset``:
    characters of the choice sent before this delta (0 with ``first``, the choice's first delta)."""

    index: int
    text: str
    token_ids: list
    logprobs: list | None
    finish_reason: str | None
    text_offset: int
    first: bool


class DeltaTracker:
    """Per-choice deltas of one request's cumulative ``RequestOutput``s (SSE, websocket and the
    command line all stream through it). A choice yields nothing after its finish, nor when it gained
    nothing (text held back while it may begin a stop string, or an incomplete character)."""

    def __init__(self):
        self._sent: dict[int, list] = {}  # index -> [chars sent, tokens sent, finished]

    def deltas(self, output: RequestOutput) -> list:
        out = []
        for c in output.outputs:
            chars, ntok, done = self._sent.setdefault(c.index, [0, 0, False])
            if done:
                continue
            text, ids = c.text[chars:], c.token_ids[ntok:]
            if not text and not ids and c.finish_reason is None:
                continue
            logprobs = c.logprobs[ntok:] if c.logprobs is not None else None
            out.append(CompletionDelta(c.index, text, ids, logprobs, c.finish_reason, chars, chars == 0 and ntok == 0))
            self._sent[c.index] = [len(c.text), len(c.token_ids), c.finish_reason is not None]
        return out

    def num_tokens(self, index: int) -> int:
        """Tokens of choice ``index`` passed on so far."""
        return self._sent.get(index, (0, 0, False))[1]

    def finished(self, index: int) -> bool:
        return self._sent.get(index, (0, 0, False))[2]
