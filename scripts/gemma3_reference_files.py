"""What the scripts that record Gemma 3 270M references share (``scripts/record_gemma3_*.py``): where the
prepared Q4_K_M GGUF and the recorded llama.cpp reference are, the command line of the scripts that read
the GGUF, and how a record is written. It imports nothing from rawpaged, so a reference recorded with it
(``record_gemma3_float64_reference.py``) stays independent of rawpaged's code."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: llama.cpp's prompt ids, greedy ids and logit gaps (``record_gemma3_reference.py`` writes it)
LLAMA_CPP_REF = ROOT / "tests" / "data" / "gemma3_270m_llama_cpp_greedy.json"
#: where ``python -m rawpaged.weights prepare gemma-3-270m`` leaves the file, below the weights directory
GGUF = Path("gemma-3-270m") / "gemma-3-270m-q4_k_m.gguf"


def parse_args(description: str, out: Path, argv=None) -> argparse.Namespace:
    """``--gguf FILE`` (default: ``prepared_gguf()``) and ``--out FILE.json`` (default ``out``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the prepared one)")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args(argv)
    if args.gguf is None:
        args.gguf = prepared_gguf()
    return args


def prepared_gguf() -> Path:
    """The prepared GGUF below ``$RAWPAGED_WEIGHTS_DIR`` (when set and non-empty) or the repository's
    ``weights/``, as rawpaged's ``weights_root`` finds it in a source tree. Raises FileNotFoundError when
    it is not there."""
    root = Path(os.environ.get("RAWPAGED_WEIGHTS_DIR") or ROOT / "weights").expanduser()
    path = root / GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run python -m rawpaged.weights prepare gemma-3-270m first")
    return path


def llama_cpp_reference() -> dict:
    """``LLAMA_CPP_REF``'s record: ``n_new`` and the ``cases`` (each with ``prompt_ids`` and ``greedy_ids``)."""
    return json.loads(LLAMA_CPP_REF.read_text(encoding="utf-8"))


def write_record(record: dict, out: Path, t0: float) -> None:
    """``record`` as one line of compact JSON into ``out``; prints the path and the seconds since ``t0``."""
    out.write_text(json.dumps(record, indent=None, separators=(",", ":")) + "\n", encoding="utf-8")
    print(out, f"{time.time() - t0:.0f} s")
