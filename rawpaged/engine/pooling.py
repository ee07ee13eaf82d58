"""Pooling requests (embeddings) in the engine: what the engine pools with (``Pooling``: the merged
``PoolerConfig`` and the model's Matryoshka sizes), the check of a request's ``PoolingParams``, and the
end of a pooling sequence once its vector is made.

A pooling request is a ``Request`` of one sequence with ``pooling_params`` set: the scheduler runs its
prompt as any prefill (chunked, batched with generation, prefix hits by the usual rules), the runner pools
its hidden states (``model_executor.layers.pooler``) and never samples it, and the step that finishes its
prompt ends it ("stop"): its blocks return at once, the full ones staying findable in the prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rawpaged.engine.outputs import PoolingOutput, PoolingRequestOutput
from rawpaged.errors import InvalidRequestError
from rawpaged.model_executor.pooling_config import get_pooling_config, matryoshka_dimensions
from rawpaged.pooling_params import PoolerConfig, PoolingParams
from rawpaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class Pooling:
    """config: the ``PoolerConfig`` pooling requests run with (pooling type and normalization set).
    matryoshka_dimensions: None when the model takes no ``dimensions``; else the sizes it takes (``()``:
    any up to ``hidden_size``). hidden_size: the vector's full size."""

    config: PoolerConfig
    matryoshka_dimensions: tuple | None
    hidden_size: int

    @classmethod
    def for_model(cls, pooler_config: PoolerConfig | None, model_dir, hidden_size: int) -> Pooling:
        """The engine's pooling: ``pooler_config``'s fields over the model directory's sentence-transformers
        files (``pooling_config.get_pooling_config``), then LAST with normalization."""
        merged = (pooler_config or PoolerConfig()).merged(get_pooling_config(model_dir))
        return cls(merged, matryoshka_dimensions(model_dir), hidden_size)

    def check(self, params: PoolingParams) -> PoolingParams:
        """``params`` resolved (``PoolingParams.resolved``). Raises InvalidRequestError (param "dimensions")
        for ``dimensions`` on a model without Matryoshka embeddings, one it does not list, or one above the
        hidden size; (param "pooling_params") for something not a ``PoolingParams``."""
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(
                f"pooling_params must be a PoolingParams, got {type(params).__name__}", "pooling_params"
            )
        d = params.dimensions
        if d is not None:
            sizes = self.matryoshka_dimensions
            if sizes is None:
                raise InvalidRequestError(
                    "this model does not support matryoshka representation (no is_matryoshka in its "
                    "config.json): dimensions cannot be set",
                    "dimensions",
                )
            if (sizes and d not in sizes) or d > self.hidden_size:
                allowed = list(sizes) if sizes else f"1..{self.hidden_size}"
                raise InvalidRequestError(
                    f"dimensions {d} is not supported by this model (supported: {allowed})", "dimensions"
                )
        return params.resolved(self.config)


#: what a pooling sequence carries as its ``sampling_params`` (it never samples: the fields the scheduler
#: and the KV cache read, one sequence, no prompt logprobs)
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1)


def finish_pooled(engine, pooled: dict) -> list:
    """End the pooling sequences whose vector this step made (``pooled``: ``{sequence: float32 vector}``):
    each finishes ("stop", its blocks back) and its request leaves ``engine.requests``. Returns their
    ``PoolingRequestOutput``s. Call after ``Scheduler.update_from_output``, so that their full blocks are
    cached before they are freed."""
    outputs = []
    for seq, vec in pooled.items():
        req = engine.requests.pop(seq.request_id, None)
        if req is None:  # aborted while the step ran
            continue
        engine.scheduler.finish_seqs([seq], "stop")
        metrics = {"arrival_time": req.arrival_time, "finished_time": time.monotonic()}
        outputs.append(
            PoolingRequestOutput(
                req.request_id,
                req.prompt,
                req.prompt_token_ids,
                PoolingOutput(vec),
                num_cached_tokens=seq.num_cached_tokens,
                metrics=metrics,
            )
        )
    return outputs
