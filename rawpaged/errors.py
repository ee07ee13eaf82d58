"""The engine's error types: requests it refuses, and requests it could not finish; and the import of an
optional library, which raises one of them when the library is missing.

Libraries that only some features need, imported where those features run.

``import rawpaged``, the engine and the kernels need NumPy, Numba, safetensors, tokenizers, ml_dtypes, jinja2
and tqdm only. Structured outputs (llguidance), GGUF files (gguf), the HTTP request models (pydantic) and
data-parallel replicas (ray) import their library on first use, so that a host without one (a GPU host
with no package index) runs everything else and a request that needs it is refused with its name.
"""

from __future__ import annotations

import importlib


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameter) the engine refuses.

    A ``ValueError``, so offline callers catch it as one; ``param`` names the offending field (the
    ``param`` of OpenAI's error body), or is None when no single field is at fault.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class LoRAInUseError(RuntimeError):
    """A LoRA adapter that requests in flight run with cannot be unloaded (the server answers 409);
    ``num_requests`` says how many use it."""

    def __init__(self, message: str, num_requests: int):
        super().__init__(message)
        self.num_requests = num_requests


class EngineError(RuntimeError):
    """A request ended by a failure of the engine; the server answers ``status`` (500) with ``type``."""

    status = 500
    type = "internal_server_error"


class EngineDeadError(EngineError):
    """The engine loop failed or was shut down while the request was running."""


class ReplicaUnavailableError(EngineDeadError):
    """The data-parallel replica serving the request died, or none is ready (the server answers 503)."""

    status = 503
    type = "service_unavailable_error"


class ServerShuttingDownError(EngineDeadError):
    """The server stopped before the request finished: its shutdown timeout ran out (503)."""

    status = 503
    type = "service_unavailable_error"


class RequestFailedError(EngineError):
    """Computing this one request failed inside a step; the engine ended it alone and went on."""


class MissingDependencyError(InvalidRequestError):
    """A feature whose library is not installed on this host (the server answers 400; offline callers
    catch a ``ValueError``). The message names the package and how to install it."""


#: extras of pyproject.toml that install a package not in the default install
_EXTRAS = {"ray": "ray"}


def import_optional(module: str, feature: str, *, package: str | None = None, param: str | None = None):
    """``importlib.import_module(module)``, or a ``MissingDependencyError`` (a ``ValueError``; ``param``
    names the request field that asked for ``feature``) saying which package installs it.

    Raises:
        MissingDependencyError when ``module`` cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module
        extra = _EXTRAS.get(package)
        how = f"pip install 'rawpaged[{extra}]'" if extra else f"pip install {package} (in rawpaged's default install)"
        message = f"{feature} needs the package {package!r}, not installed here: {how}"
        raise MissingDependencyError(message, param) from e
