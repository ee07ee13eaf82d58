"""Load an HF-style model directory: ``config.json`` + safetensors (single or sharded), no PyTorch.

safetensors layout (https://github.com/huggingface/safetensors#format): 8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``,
then the data; offsets are relative to the end of the header. The file is memory-mapped and each
tensor becomes a NumPy view (F32, F16, BF16 via ml_dtypes); the caller converts to the compute dtype
and places it on its backend one tensor at a time.
"""

from __future__ import annotations

import ctypes
import gc
import json
import struct
from pathlib import Path

import numpy as np

from rawpaged.dtypes import SAFETENSORS_DTYPES
from rawpaged.kernels.quantization import QuantizedTensor
from rawpaged.model_executor.gguf_loader import gguf_generation_config, load_gguf
from rawpaged.model_executor.model_config import GENERATION_DEFAULTS, GenerationConfig, ModelConfig
from rawpaged.sampling_params import SamplingParams
from rawpaged.tokenizer import Tokenizer


def read_safetensors(path: Path) -> dict:
    """Memory-map one safetensors file: name -> read-only NumPy view.

    Raises:
        ValueError naming the file (and tensor) for a truncated file, a header length beyond the file,
        bad JSON, an unknown dtype, a size that disagrees with shape x dtype, out-of-range or
        overlapping data offsets.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: truncated file ({size} bytes, no header length)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise ValueError(f"{path}: header length {header_len} beyond the file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_len = size - data_start
    spans = []
    for name, info in header.items():
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except KeyError as e:
            raise ValueError(f"{path}: tensor {name!r}: unknown dtype or missing field {e}") from None
        except (TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from None
        if not 0 <= begin <= end <= data_len:
            raise ValueError(
                f"{path}: tensor {name!r}: data offsets [{begin}, {end}) outside the data "
                f"section ({data_len} bytes; truncated file?)"
            )
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name!r}: {end - begin} bytes for shape {shape} {info['dtype']}")
        spans.append((begin, end, name, dtype, shape))
    spans.sort()
    for (b0, e0, n0, *_), (b1, e1, n1, *_) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"{path}: tensors {n0!r} and {n1!r} overlap ([{b0}, {e0}) and [{b1}, {e1}))")
    if not spans:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start, shape=(data_len,)) if data_len else None
    return {name: mm[b:e].view(dtype).reshape(shape) for b, e, name, dtype, shape in spans}


def safetensors_files(model_dir: Path) -> list:
    """The safetensors files of a model directory (single file or sharded with an index)."""
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.exists():
        return [single]
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ValueError(f"{index}: shard files missing: {missing}")
        return files
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.exists():
        ggufs = sorted(p.name for p in Path(model_dir).glob("*.gguf"))
        hint = f" (it holds {ggufs[0]}: pass that file as the model)" if ggufs else ""
        raise ValueError(f"{model_dir}: no config.json{hint}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return ModelConfig.from_dict(cfg, str(path))


def load_generation_config(model_dir: Path) -> GenerationConfig:
    """Read ``model_dir/generation_config.json`` if present (else an empty ``GenerationConfig``).

    Raises:
        ValueError naming the file: not JSON, or a default the sampling parameters refuse.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return GenerationConfig(sampling_defaults={})
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    defaults = {k: cfg[k] for k in GENERATION_DEFAULTS if cfg.get(k) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    ignored = tuple(k for k in ("max_new_tokens",) if cfg.get(k) is not None)
    return GenerationConfig(eos_ids, defaults, ignored)


def load_weights(model_dir: Path, config: ModelConfig) -> dict:
    """All tensors of the model as memory-mapped NumPy views, validated against ``config``.

    Raises:
        ValueError naming the file and tensor for missing or unexpected tensors and wrong shapes.
    """
    model_dir = Path(model_dir)
    tensors, origin = {}, {}
    for f in safetensors_files(model_dir):
        for name, arr in read_safetensors(f).items():
            if name in tensors:
                raise ValueError(f"{f}: tensor {name!r} also in {origin[name]}")
            tensors[name] = arr
            origin[name] = f
    expected = config.expected_shapes()
    # Tied checkpoints sometimes also store lm_head; rotary caches are recomputed.
    ignorable = {"lm_head.weight"} | {n for n in tensors if n.endswith("rotary_emb.inv_freq")}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{model_dir}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(set(tensors) - set(expected) - ignorable)
    if unexpected:
        raise ValueError(f"{origin[unexpected[0]]}: unexpected tensors {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"{origin[name]}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config.json implies {shape}"
            )
    return {n: tensors[n] for n in expected}


def stack_hf_experts(weights: dict, config: ModelConfig) -> dict:
    """``weights`` (HF checkpoint names) with each sparse layer's per-expert tensors stacked into the names
    ``LlamaModel`` reads (``docs/moe.md``): ``model.layers.{L}.mlp.experts.{gate,up,down}_proj.weight``
    ``[E, rows, cols]`` (Mixtral's ``w1``, ``w3``, ``w2``) and the router as ``mlp.gate.weight`` (Mixtral's
    ``block_sparse_moe.gate``); other tensors unchanged. The stacks are float32 copies (the checkpoint's
    views are left unread once stacked)."""
    if not config.moe:
        return weights
    out = dict(weights)
    mixtral = config.architecture == "MixtralForCausalLM"
    for i, sparse in enumerate(config.moe_layers):
        if not sparse:
            continue
        p = f"model.layers.{i}."
        src = p + ("block_sparse_moe." if mixtral else "mlp.")
        out[p + "mlp.gate.weight"] = out.pop(src + "gate.weight")
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            parts = [out.pop(src + f"experts.{e}.{names.get(proj, proj)}.weight") for e in range(config.num_experts)]
            out[p + f"mlp.experts.{proj}.weight"] = np.stack([np.asarray(w, dtype=np.float32) for w in parts])
    return out


#: router weights stay in float when the checkpoint is quantized on load (as vLLM keeps the gate unquantized)
_ROUTER_SUFFIXES = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def release_free_heap() -> None:
    """Give the heap pages that loading freed back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    Loading parses metadata into many small objects and fuses weights into new arrays; once those are
    freed, glibc keeps their pages (about 40 MB for a GGUF file) in the process unless asked."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model(path: Path, quantization: str | None = None) -> tuple:
    """(``ModelConfig``, ``Tokenizer``, ``GenerationConfig``, weights) of a model directory or GGUF file.

    Weights map HF names to host arrays or ``QuantizedTensor``s:
    - a GGUF file keeps its Q8_0/Q4_0/Q4_1 tensors in their blocks (``quantization`` None or "gguf") and
      dequantizes every other type to float32;
    - a safetensors checkpoint with ``quantization="q8_0"`` has its 2-D weights (linears, embeddings)
      quantized to Q8_0 on load with the ``gguf`` package's reference quantizer.

    Raises:
        ValueError naming the option or file: "gguf" for a safetensors checkpoint, "q8_0" for a GGUF
        file, or any loading error (``EngineConfig`` checks ``quantization``'s value).
    """
    path = Path(path)
    if path.is_file():
        if quantization == "q8_0":
            raise ValueError(f"quantization 'q8_0' quantizes safetensors checkpoints; {path} is a GGUF file")
        config, tokenizer, weights = load_gguf(path)
        return config, tokenizer, gguf_generation_config(config, tokenizer), weights
    if quantization == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's formats; {path} is not a GGUF file")
    config = load_config(path)
    weights = stack_hf_experts(load_weights(path, config), config)
    if quantization == "q8_0":
        weights = {
            n: QuantizedTensor.quantize(w, "Q8_0") if w.ndim == 2 and not n.endswith(_ROUTER_SUFFIXES) else w
            for n, w in weights.items()
        }
    return config, Tokenizer(path), load_generation_config(path), weights
