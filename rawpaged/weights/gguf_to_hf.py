"""GGUF -> HF conversion: a Llama or Qwen2 GGUF file to an HF-style directory with float32 weights; and a
GGUF file with every tensor dequantized to F32 (llama.cpp's float32 peer in the benchmarks).

The steps are the default model's 3-6 (``rawpaged.weights.default_model``): dequantize every tensor with
``gguf.quants.dequantize``, undo llama.cpp's Q/K row permutation, rename to HF names, and write
``model.safetensors``, ``config.json``, ``tokenizer.json`` and ``tokenizer_config.json``. The reading is
``rawpaged.model_executor.gguf_loader``'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from rawpaged.errors import import_optional
from rawpaged.model_executor.gguf_loader import check_tensors, open_reader, read_metadata, read_tensors
from rawpaged.model_executor.model_config import ModelConfig


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
) -> Path:
    """Convert a Llama GGUF file into an HF-style directory with float32 weights.

    Writes ``model.safetensors`` (every tensor dequantized to F32, Q/K rows un-permuted, HF names and
    shapes), ``config.json`` (from the ``llama.*`` metadata), ``tokenizer.json`` and
    ``tokenizer_config.json`` (with ``chat_template`` from ``tokenizer.chat_template``), all through
    ``rawpaged.model_executor.gguf_loader``.

    Args:
        gguf_path: the GGUF file.
        out_dir: the output directory (created if missing; existing files are overwritten).
        progress: show a per-tensor tqdm bar.

    Returns:
        ``out_dir`` as a :class:`Path`.

    Raises:
        ValueError: the GGUF is not a supported model, misses needed metadata, or holds unexpected tensors.
    """
    source = str(gguf_path)
    reader = open_reader(source)
    config, tok, tok_config = read_metadata(reader, source)
    tensors = read_tensors(reader, config, source, native=False, progress=progress)
    tensors = check_tensors(tensors, ModelConfig.from_dict(config, source), source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the others are 0644 too
    del tensors
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return out


def write_f32_gguf(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Write ``dest``: the GGUF ``src`` with every tensor dequantized to F32 (same names, shapes and
    llama.cpp layouts, every metadata key copied), e.g. to run llama.cpp on the very float32 weights
    our float32 model holds. Dequantization is the ``gguf`` package's reference one.

    Raises ValueError if ``src`` is not a readable GGUF file."""
    gguf = import_optional("gguf", "writing a GGUF file")

    reader = open_reader(src)
    dest = Path(dest)
    arch = reader.fields["general.architecture"].contents()
    part = dest.with_name(dest.name + ".part")
    writer = gguf.GGUFWriter(str(part), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, dest)
    return dest
