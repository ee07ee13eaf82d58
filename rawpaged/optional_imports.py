"""Libraries that only some features need, imported where those features run.

``import rawpaged``, the engine and the kernels need NumPy, Numba, safetensors, tokenizers, ml_dtypes, jinja2
and tqdm only. Structured outputs (llguidance), GGUF files (gguf), the HTTP request models (pydantic) and
data-parallel replicas (ray) import their library on first use, so that a host without one (a GPU host
with no package index) runs everything else and a request that needs it is refused with its name.
"""

from __future__ import annotations

import importlib

from rawpaged.errors import MissingDependencyError

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
