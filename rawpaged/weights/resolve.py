"""A model name as ``EngineConfig.model`` gives it -> the directory or GGUF file the loader reads."""

from __future__ import annotations

from pathlib import Path

from rawpaged.weights.default_model import DEFAULT_MODEL, default_model_dir, is_prepared, prepare
from rawpaged.weights.gemma3 import GEMMA3_MODEL, gemma3_gguf_path
from rawpaged.weights.hub import is_repo_id, resolve_repo

#: the names of the models ``python -m rawpaged.weights prepare`` knows, as ``--model`` takes them
MODEL_NAMES = (DEFAULT_MODEL, GEMMA3_MODEL)


def resolve_model_dir(model: str | None, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """The model directory (or GGUF file) for ``EngineConfig.model``: None or the default model's name ->
    the prepared default model (downloaded and converted on first use); ``gemma-3-270m`` -> its prepared
    GGUF file (``rawpaged.weights.gemma3``, downloaded on first use); an existing directory or ``.gguf``
    file; else a Hugging Face Hub id (``org/name``, ``org/name:QUANT``) -> its snapshot in the Hub cache,
    at ``revision``, or the GGUF file ``gguf_file`` of it (``rawpaged.weights.hub``).

    Raises:
        ValueError naming the model for anything else, and for a Hub id that is neither cached nor
        downloadable (naming the cache path and the variables).
    """
    if model is None or model == DEFAULT_MODEL:
        return prepare() if not is_prepared(default_model_dir()) else default_model_dir()
    if model == GEMMA3_MODEL:
        return gemma3_gguf_path()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.exists():
        raise ValueError(f"model file {model!r} does not exist")
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if is_repo_id(model):
        return resolve_repo(model, revision, gguf_file)
    raise ValueError(
        f"model {model!r} is neither one of {list(MODEL_NAMES)}, a directory, a .gguf file nor a Hugging Face "
        "Hub id (org/name)"
    )
