"""Load an HF-style model directory: ``config.json`` + safetensors (single or sharded), no PyTorch.

safetensors layout (https://github.com/huggingface/safetensors#format): 8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}``,
then the data; offsets are relative to the end of the header. The file is memory-mapped and each
tensor becomes a NumPy view (F32, F16, BF16 via ml_dtypes); the caller converts to the compute dtype
and places it on its backend one tensor at a time.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rawpaged.dtypes import SAFETENSORS_DTYPES
from rawpaged.model_executor.layers.rotary_embedding import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.json`` the decoder forward needs (Llama, Mistral, Qwen2, Qwen3).

    ``rope``: the RoPE variant (``RopeScaling``); ``sliding_window``: tokens a query sees, itself
    included (Mistral), or None; ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple
    torch_dtype: str | None = None  # the checkpoint's dtype name ("bfloat16", ...), if config.json gives one
    rope: RopeScaling = RopeScaling()
    sliding_window: int | None = None
    qk_norm: bool = False

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: architectures {archs} not supported (supported: {SUPPORTED_ARCHITECTURES})")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            if kv_heads < 1 or heads % kv_heads:
                raise ValueError(
                    f"{source}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}"
                )
            if head_dim < 2 or head_dim % 2:
                raise ValueError(f"{source}: head_dim {head_dim} must be even (RoPE rotates pairs)")
            for field, supported in (("hidden_act", "silu"), ("mlp_bias", False)):
                value = cfg.get(field, supported)
                if value != supported:
                    raise ValueError(f"{source}: {field} {value!r} is not supported (only {supported!r})")
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                rope=RopeScaling.from_hf_config(cfg, source),
                sliding_window=_sliding_window(cfg, arch, source),
                qk_norm=arch == "Qwen3ForCausalLM",
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None

    @property
    def context_len(self) -> int:
        """The longest sequence the model serves (``max_position_embeddings``, stretched by RoPE scaling)."""
        return self.rope.context_len(self.max_position_embeddings)

    def expected_shapes(self) -> dict:
        """HF tensor name -> shape, for every tensor the model needs."""
        H, F, D = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * D, self.num_key_value_heads * D
        shapes = {"model.embed_tokens.weight": (self.vocab_size, H), "model.norm.weight": (H,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, H)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,),
                    p + "self_attn.q_proj.weight": (q, H),
                    p + "self_attn.k_proj.weight": (kv, H),
                    p + "self_attn.v_proj.weight": (kv, H),
                    p + "self_attn.o_proj.weight": (H, q),
                    p + "mlp.gate_proj.weight": (F, H),
                    p + "mlp.up_proj.weight": (F, H),
                    p + "mlp.down_proj.weight": (H, F),
                }
            )
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
            if self.attention_bias:
                shapes.update(
                    {
                        p + "self_attn.q_proj.bias": (q,),
                        p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,),
                    }
                )
        return shapes


def _sliding_window(cfg: dict, arch: str, source: str) -> int | None:
    """Mistral's ``sliding_window`` (every layer); Qwen2/Qwen3 window only some layers when
    ``use_sliding_window`` is set, which is refused. Llama has none."""
    if arch.startswith("Qwen"):
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window (a window on some layers only) is not supported")
        return None
    if arch != "MistralForCausalLM" or cfg.get("sliding_window") is None:
        return None
    window = cfg["sliding_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    return window


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


def resolve_model_dir(model: str | None) -> Path:
    """The model directory (or GGUF file) for ``EngineConfig.model``: None or the default model's name ->
    the prepared default model (downloaded and converted on first use); else an existing directory or
    ``.gguf`` file. Raises ValueError for anything else."""
    from rawpaged import weights

    if model is None or model == weights.DEFAULT_MODEL:
        return (
            weights.prepare() if not weights.is_prepared(weights.default_model_dir()) else weights.default_model_dir()
        )
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and not path.exists():
        raise ValueError(f"model file {model!r} does not exist")
    if not path.is_dir() and not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"model {model!r} is neither {weights.DEFAULT_MODEL!r}, a directory nor a .gguf file")
    return path


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


#: generation_config.json fields applied as sampling defaults (as vLLM's ``--generation-config auto``).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class GenerationConfig:
    """What ``generation_config.json`` adds: more end-of-sequence ids and sampling defaults.

    eos_token_ids: its ``eos_token_id`` (an id or a list; Llama 3 and Qwen3 list several).
    sampling_defaults: ``SamplingParams`` keyword -> value for the fields in ``GENERATION_DEFAULTS`` the
        file sets; the server and ``LLM`` apply them where a request leaves the field unset.
    ignored: fields the file sets that this engine does not apply (e.g. ``repetition_penalty``).
    """

    eos_token_ids: tuple = ()
    sampling_defaults: dict = None
    ignored: tuple = ()


def load_generation_config(model_dir: Path) -> GenerationConfig:
    """Read ``model_dir/generation_config.json`` if present (else an empty ``GenerationConfig``).

    Raises:
        ValueError naming the file: not JSON, or a default the sampling parameters refuse.
    """
    from rawpaged.sampling_params import SamplingParams

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
    ignored = tuple(k for k in ("repetition_penalty", "max_new_tokens") if cfg.get(k) not in (None, 1, 1.0))
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


def release_free_heap() -> None:
    """Give the heap pages that loading freed back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    Loading parses metadata into many small objects and fuses weights into new arrays; once those are
    freed, glibc keeps their pages (about 40 MB for a GGUF file) in the process unless asked."""
    import ctypes
    import gc

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
    from rawpaged.kernels.quantization import QuantizedTensor
    from rawpaged.model_executor.gguf_loader import load_gguf
    from rawpaged.tokenizer import Tokenizer

    path = Path(path)
    if path.is_file():
        if quantization == "q8_0":
            raise ValueError(f"quantization 'q8_0' quantizes safetensors checkpoints; {path} is a GGUF file")
        config, tokenizer, weights = load_gguf(path)
        return config, tokenizer, GenerationConfig(sampling_defaults={}), weights
    if quantization == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's formats; {path} is not a GGUF file")
    config = load_config(path)
    weights = load_weights(path, config)
    if quantization == "q8_0":
        weights = {n: QuantizedTensor.quantize(w, "Q8_0") if w.ndim == 2 else w for n, w in weights.items()}
    return config, Tokenizer(path), load_generation_config(path), weights
