"""Structured outputs: constraining generation to a JSON Schema, a regular expression, a choice of
strings or a grammar (vLLM's ``v1/structured_output``).

The grammar engine is llguidance (``backend_guidance``): a matcher per constrained sequence tracks the
tokens it has accepted and writes, for the next token, a bitmask of the vocabulary (one bit per token id,
packed into int32 words: the layout vLLM, xgrammar and llguidance share). The backend's
``apply_token_bitmask`` sets the logits of the tokens a mask forbids to ``-inf`` before sampling.
``StructuredOutputManager`` compiles grammars off the step loop, in a thread, with a cache keyed by the
request's constraint.

llguidance is imported when the first constraint is compiled, not with this package: a host without it
runs everything else, and a constrained request there gets an ``InvalidRequestError`` naming the package.
"""

from rawpaged.structured_output.manager import StructuredOutputManager
from rawpaged.structured_output.params import StructuredOutputsParams

__all__ = ["GuidanceBackend", "GuidanceGrammar", "StructuredOutputManager", "StructuredOutputsParams"]


def __getattr__(name: str):
    if name in ("GuidanceBackend", "GuidanceGrammar"):
        from rawpaged.structured_output import backend_guidance  # deferred: llguidance, an optional library

        return getattr(backend_guidance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
