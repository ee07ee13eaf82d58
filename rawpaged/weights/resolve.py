"""A model name as ``EngineConfig.model`` gives it -> the directory or GGUF file the loader reads."""

from __future__ import annotations

from pathlib import Path

from rawpaged.weights.default_model import DEFAULT_MODEL, default_model_dir, is_prepared, prepare


def resolve_model_dir(model: str | None) -> Path:
    """The model directory (or GGUF file) for ``EngineConfig.model``: None or the default model's name ->
    the prepared default model (downloaded and converted on first use); else an existing directory or
    ``.gguf`` file.

    Raises:
        ValueError naming the model for anything else.
    """
    if model is None or model == DEFAULT_MODEL:
        return prepare() if not is_prepared(default_model_dir()) else default_model_dir()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.exists():
        raise ValueError(f"model file {model!r} does not exist")
    if not path.is_dir() and not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"model {model!r} is neither {DEFAULT_MODEL!r}, a directory nor a .gguf file")
    return path
