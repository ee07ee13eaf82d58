"""Load a GGUF file (llama.cpp's format) directly: config, tokenizer and chat template from its metadata,
tensors read with the ``gguf`` package (memory-mapped).

Tensors in a native format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K:
``rawpaged.kernels.quantization.NATIVE``) stay in their blocks as ``QuantizedTensor``s unless
``native=False``; every other type the ``gguf`` package can dequantize becomes float32, and the load log
says which tensors and how many bytes that costs. llama.cpp's converter permutes the rows of Llama's Q and
K projections (it interleaves the two rotary halves of each head); the permutation is undone, on whole
rows, so it is exact on blocks too. Qwen2 and Gemma 3 files are not permuted. GGUF lists dimensions fastest
first, so the reader's arrays are already HF-shaped ``[out_features, in_features]``. Gemma 3
(``gguf_gemma3``): the values llama.cpp fixes rather than stores, its names, its norms written as ``1 + w``;
its SentencePiece tokenizer: ``gguf_spm``; the byte-level BPE tokenizers of the others: ``gguf_tokenizer``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from rawpaged.errors import import_optional
from rawpaged.kernels.quantization import NATIVE, QuantizedExperts, QuantizedTensor
from rawpaged.model_executor import gguf_gemma3, gguf_moe
from rawpaged.model_executor.gguf_reader import fast_reader_class
from rawpaged.model_executor.gguf_spm import build_spm_tokenizer
from rawpaged.model_executor.gguf_tokenizer import PRE_TOKENIZERS, build_tokenizer
from rawpaged.model_executor.model_config import GenerationConfig, ModelConfig
from rawpaged.tokenizer import Tokenizer

logger = logging.getLogger("rawpaged.engine")

# GGUF tensor name (without "blk.N." and the ".weight"/".bias" suffix) -> HF name.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Mixtral where llama.expert_count is set (gguf_moe)
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    **{arch: hf for arch, (hf, _) in gguf_moe.MOE_ARCHITECTURES.items()},
}
#: the chat template read beside a GGUF that has none (HF's file name for one; ``rawpaged.weights.gemma3``
#: writes it)
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a ``gguf.GGUFReader``, or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation.

    llama.cpp's converter writes ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``; this
    applies the inverse, ``reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2)``.

    Args:
        w: the permuted weight, ``[n_head * head_dim, ...]`` (float rows, or rows of quantized blocks).
        n_head: the number of heads stacked in ``w`` (query heads for Q, KV heads for K).

    Returns:
        A new array of the same shape in HF's "rotate_half" row order.

    Raises:
        ValueError: the first dimension is not a multiple of ``2 * n_head``.
    """
    rows = w.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {w.shape} with {n_head} heads")
    return np.ascontiguousarray(w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)
    in architecture ``arch`` (``gemma3``: ``ffn_norm`` is ``pre_feedforward_layernorm``, and the norms
    after attention and the MLP, ``q_norm`` and ``k_norm``; a mixture of experts' HF model_type
    (``gguf_moe.GGUF_ARCH``): the router, expert stacks, shared expert and q/k norms of
    ``gguf_moe.LAYER_NAMES``).

    Raises ValueError for a name outside the architecture's set."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if base.startswith("blk."):
        _, idx, kind = base.split(".", 2)
        names = LAYER_NAMES
        if arch == "gemma3":
            names = {**LAYER_NAMES, **gguf_gemma3.LAYER_NAMES}
        elif arch in gguf_moe.GGUF_ARCH:
            names = {**LAYER_NAMES, **gguf_moe.LAYER_NAMES}
        if kind not in names:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{int(idx)}.{names[kind]}.{suffix}"
    if base not in GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{GLOBAL_NAMES[base]}.{suffix}"


def shortest_f32(x: float) -> float:
    """1e-5 stored as float32 reads back as 9.99999974e-06; give the shortest decimal instead."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def read_metadata(reader: Any, source: str) -> tuple:
    """(HF ``config.json`` dict, ``tokenizers.Tokenizer``, ``tokenizer_config.json`` dict) of a GGUF.

    A file without ``tokenizer.chat_template`` takes the template of ``chat_template.jinja`` beside it,
    where there is one (Gemma 3 270M's GGUF has none: ``rawpaged.weights.gemma3`` writes that file from HF's
    ``tokenizer_config.json``); else the model has no chat template, and chat requests are refused.

    Raises:
        ValueError naming the file: an architecture other than llama/qwen2/gemma3, missing metadata, RoPE
        scaling other than linear, or a pre-tokenizer this loader cannot reproduce (its token ids would be wrong).
    """
    arch, pre = _supported(reader, source)
    hidden = int(_need(reader, f"{arch}.embedding_length", source))
    n_head = int(_need(reader, f"{arch}.attention.head_count", source))
    tokens = list(_need(reader, "tokenizer.ggml.tokens", source))
    token_types = field(reader, "tokenizer.ggml.token_type")
    token_types = [int(t) for t in token_types] if token_types is not None else None
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            f"{source}: rope_freqs.weight (Llama 3.1 RoPE scaling in GGUF form) is not supported; "
            "load the safetensors checkpoint instead (its config.json rope_scaling is read)"
        )
    if arch == "gemma3":
        config = _gemma3_config(reader, len(tokens), names, source)
    else:
        config = _hf_config(reader, arch, hidden, n_head, len(tokens), names, source)
    config["rope_scaling"] = _rope_scaling(reader, arch, source)
    # Llama 3's and SentencePiece's BOS come from the tokenizer's post-processor; the others' from
    # add_bos_token (below).
    bos_id = config["bos_token_id"]
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    if pre == "spm":
        unk = field(reader, "tokenizer.ggml.unknown_token_id")
        scores = [float(x) for x in _need(reader, "tokenizer.ggml.scores", source)]
        types = token_types if token_types is not None else [1] * len(tokens)
        tok = build_spm_tokenizer(tokens, scores, types, unk, bos_id if add_bos else None)
        bos = tokens[bos_id] if add_bos else None
    else:
        bos = tokens[bos_id] if pre == "llama-bpe" and add_bos else None
        merges = list(field(reader, "tokenizer.ggml.merges", []))  # absent: none (the writer drops empty arrays)
        tok = build_tokenizer(tokens, merges, token_types, pre, bos)
    pad_id = config.get("pad_token_id")
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos_id],
        "eos_token": tokens[config["eos_token_id"]],
        "pad_token": tokens[pad_id if pad_id is not None else config["eos_token_id"]],
        "add_bos_token": add_bos and bos is None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = field(reader, "tokenizer.chat_template")
    beside = Path(source).parent / CHAT_TEMPLATE_FILE
    if template is None and beside.is_file():
        template = beside.read_text(encoding="utf-8")
    if template is not None:
        tok_config["chat_template"] = template
    return config, tok, tok_config


def _gemma3_config(reader: Any, n_tokens: int, names: set, source: str) -> dict:
    """``gguf_gemma3.gemma3_config`` of a ``gemma3`` file. Raises ValueError naming the file and a
    missing key or a bad sliding-window pattern."""
    meta = {}
    for key in reader.fields:
        if key.startswith("gemma3.") or (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            v = field(reader, key)
            meta[key.split(".", 1)[1].removeprefix("ggml.")] = shortest_f32(v) if isinstance(v, float) else v
    try:
        return gguf_gemma3.gemma3_config(meta, n_tokens, "output.weight" not in names)
    except KeyError as e:
        raise ValueError(f"{source}: missing metadata gemma3.{e.args[0]}") from None
    except ValueError as e:
        raise ValueError(f"{source}: gemma3.attention.{e}") from None


def _rope_scaling(reader: Any, arch: str, source: str) -> dict | None:
    """HF ``rope_scaling`` of a GGUF's ``{arch}.rope.scaling.*`` keys: None, or linear position
    interpolation ``{"rope_type": "linear", "factor": f}``.

    llama.cpp (``llama_model::load_hparams``) reads ``rope.scaling.factor`` (or the older
    ``rope.scale_linear``; 0 means none) as ``rope_freq_scale = 1 / factor``, and ``rope.scaling.type``
    with ``linear`` as its default. For ``gemma3`` it scales the full-attention layers only (the sliding
    ones keep ``rope_freq_scale_train_swa = 1``), which is what HF's ``rope_scaling`` means for Gemma 3.

    Raises ValueError naming the file and the key: a type other than ``linear`` (YaRN and the others need
    keys this loader does not read), a factor that is not positive, or a factor beside type ``none``."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    key = f"{arch}.rope.scaling.factor"
    factor = field(reader, key)
    if factor is None:
        key = f"{arch}.rope.scale_linear"
        factor = field(reader, key)
    factor = None if factor is None or float(factor) == 0.0 else float(factor)
    if kind == "none" or (kind is None and factor is None):
        if factor not in (None, 1.0):
            raise ValueError(f"{source}: {key} {factor} beside {arch}.rope.scaling.type 'none' is not supported")
        return None
    if kind not in (None, "linear"):
        raise ValueError(
            f"{source}: {arch}.rope.scaling.type {kind!r} is not supported in GGUF files (only 'linear'); "
            "load the safetensors checkpoint instead (its config.json rope_scaling is read)"
        )
    if factor is None or not factor > 0:
        raise ValueError(f"{source}: {arch}.rope.scaling.type 'linear' needs a positive {key}, got {factor}")
    return None if factor == 1.0 else {"rope_type": "linear", "factor": shortest_f32(factor)}


def _need(reader: Any, key: str, source: str) -> Any:
    """A metadata value that must be there. Raises ValueError naming the file and the key."""
    v = field(reader, key)
    if v is None:
        raise ValueError(f"{source}: missing metadata {key}")
    return v


def _supported(reader: Any, source: str) -> tuple:
    """(architecture, ``tokenizer.ggml.pre``) of a GGUF this loader reads; ``"spm"`` for Gemma 3's
    SentencePiece tokenizer (``tokenizer.ggml.model`` ``llama`` without ``add_space_prefix``).

    Raises ValueError naming the file: another architecture or another tokenizer."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})")
    model = field(reader, "tokenizer.ggml.model")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if model == "llama" and arch == "gemma3":
        if field(reader, "tokenizer.ggml.add_space_prefix", True):
            raise ValueError(
                f"{source}: a SentencePiece tokenizer with tokenizer.ggml.add_space_prefix is not supported "
                "(Gemma 3's has none)"
            )
        return arch, "spm"
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {model!r} / tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: 'gpt2' with {sorted(PRE_TOKENIZERS)}, and Gemma 3's 'llama'); convert the model to "
            "safetensors instead"
        )
    return arch, pre


def _hf_config(reader: Any, arch: str, hidden: int, n_head: int, n_tokens: int, names: set, source: str) -> dict:
    """The HF ``config.json`` dict of a GGUF's ``arch.*`` metadata and tensor ``names``.

    Raises ValueError naming the file for missing metadata."""
    bos_id = int(field(reader, "tokenizer.ggml.bos_token_id", 1))
    eos_id = int(field(reader, "tokenizer.ggml.eos_token_id", 2))
    pad_id = field(reader, "tokenizer.ggml.padding_token_id")
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_need(reader, f"{arch}.feed_forward_length", source)),
        "num_hidden_layers": int(_need(reader, f"{arch}.block_count", source)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(field(reader, f"{arch}.attention.key_length", 0) or hidden // n_head),
        "rms_norm_eps": shortest_f32(float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": shortest_f32(float(field(reader, f"{arch}.rope.freq_base", 10000.0))),
        "rope_scaling": None,
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 2048)),
        "vocab_size": int(field(reader, f"{arch}.vocab_size", n_tokens)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": False,
    }
    if pad_id is not None:
        config["pad_token_id"] = int(pad_id)
    get = lambda key, default: field(reader, key, default)  # noqa: E731
    if gguf_moe.is_moe(arch, get):
        config.update(gguf_moe.moe_config(arch, get, config["num_hidden_layers"], names, source))
        gguf_moe.check_moe_tensors(names, config, source)
    return config


def read_tensors(reader: Any, config: dict, source: str, native: bool = True, progress: bool = False) -> dict:
    """HF name -> float32 array, or for a native format when ``native`` a ``QuantizedTensor`` (2-D) or
    ``QuantizedExperts`` (a mixture of experts' 3-D stacks ``[E, rows, cols]``, ``gguf_moe``).

    Raises ValueError naming the file for an unexpected or duplicate tensor."""
    import gguf  # deferred: an optional library (open_reader checked that it is installed)

    permute = config["model_type"] in ("llama", "mixtral")
    gemma = config["model_type"] == "gemma3_text"
    arch = "gemma3" if gemma else config["model_type"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, Any] = {}
    expanded: dict[str, list] = {}  # type -> [tensors, file bytes, float32 bytes] of the dequantized ones
    for t in tqdm(reader.tensors, desc="read tensors", unit="tensor", disable=not progress):
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        name = hf_name(t.name, arch)
        if name in tensors:
            raise ValueError(f"{source}: duplicate tensor {t.name}")
        kind = t.name.split(".")[-2]
        qtype = t.tensor_type.name
        if native and qtype in NATIVE and len(shape) in (2, 3):
            tensors[name] = _native_tensor(t, qtype, shape, heads.get(kind) if permute else None)
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if permute and kind in heads:
            w = unpermute_qk(w, heads[kind])
        if gemma and name.endswith("norm.weight"):
            w = gguf_gemma3.unshift_norm(w)  # the converter wrote 1 + w
        if name.endswith("mlp.shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # ne [hidden] in llama.cpp's files, HF's [1, hidden]
        # a copy even when already float32: a view would keep the whole file mapped and resident
        tensors[name] = np.array(w, dtype=np.float32, order="C", copy=True)
        if native and len(shape) >= 2 and qtype not in ("F32", "F16", "BF16"):
            counts = expanded.setdefault(qtype, [0, 0, 0])
            counts[0] += 1
            counts[1] += int(t.n_bytes)
            counts[2] += tensors[name].nbytes
    _log_formats(tensors, expanded, source)
    return tensors


def _native_tensor(t: Any, qtype: str, shape: tuple, n_head: int | None) -> QuantizedTensor | QuantizedExperts:
    """A ``gguf`` reader's tensor ``t`` of a native format kept in its blocks: 2-D (Q/K rows un-permuted
    for ``n_head`` heads unless None) or a 3-D expert stack."""
    if len(shape) == 3:
        return QuantizedExperts.from_blocks(qtype, shape, np.asarray(t.data).reshape(shape[0], shape[1], -1))
    data = np.asarray(t.data).reshape(shape[0], -1)
    if n_head is not None:
        data = unpermute_qk(data, n_head)
    return QuantizedTensor.from_blocks(qtype, shape, data)


def _log_formats(tensors: dict, expanded: dict, source: str) -> None:
    """Log the formats kept in their blocks, and warn of those dequantized (``read_tensors``)."""
    kept: dict[str, int] = {}
    for v in tensors.values():
        if isinstance(v, (QuantizedTensor, QuantizedExperts)):
            kept[v.qtype] = kept.get(v.qtype, 0) + 1
    if kept:
        counts = ", ".join(f"{n} {t}" for t, n in sorted(kept.items()))
        logger.info("%s: weights kept in their GGUF blocks (no float32 copy): %s", source, counts)
    for qtype, (n, file_bytes, f32_bytes) in expanded.items():
        logger.warning(
            "%s: %d %s tensors are not computed natively (native: %s): dequantized to float32, %.1f MB in "
            "place of %.1f MB in the file",
            source,
            n,
            qtype,
            ", ".join(NATIVE),
            f32_bytes / 1e6,
            file_bytes / 1e6,
        )


def is_gguf(path) -> bool:
    """True for an existing file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def open_reader(path) -> Any:
    """A ``gguf.GGUFReader`` of ``path`` (``gguf_reader``'s, which parses large metadata arrays in bulk).

    Raises:
        ValueError naming the file when it cannot be read as GGUF; MissingDependencyError (a ValueError)
        naming the package when ``gguf`` is not installed.
    """
    gguf = import_optional("gguf", "reading a GGUF file")

    try:
        return fast_reader_class(gguf)(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, FileNotFoundError, ...
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def load_gguf(path, native: bool = True) -> tuple:
    """(``ModelConfig``, ``Tokenizer``, weights: HF name -> array or ``QuantizedTensor``) of a GGUF file.

    Raises ValueError naming the file (see ``read_metadata``; shapes are checked against the config)."""
    source = str(path)
    reader = open_reader(source)
    config, tok, tok_config = read_metadata(reader, source)
    model_config = ModelConfig.from_dict(config, source)
    tensors = check_tensors(read_tensors(reader, config, source, native), model_config, source)
    return model_config, Tokenizer.from_objects(tok, tok_config), tensors


#: architecture -> token texts that end a turn, besides the file's EOS: HF's generation_config.json for
#: Gemma 3 lists ``<end_of_turn>`` beside ``<eos>`` (``eos_token_id: [1, 106]``), and llama.cpp makes it an
#: end-of-generation token (``src/llama-vocab.cpp``, ``llama_vocab::impl::load``)
END_OF_TURN = {"Gemma3ForCausalLM": ("<end_of_turn>",)}


def gguf_generation_config(model_config, tokenizer: Tokenizer) -> GenerationConfig:
    """What a GGUF file implies of ``generation_config.json``: no sampling defaults; for Gemma 3 the
    ``<end_of_turn>`` id as one more EOS (``END_OF_TURN``), so chat replies end where the turn does."""
    names = END_OF_TURN.get(model_config.architecture, ())
    vocab = tokenizer.get_vocab() if names else {}
    return GenerationConfig(eos_token_ids=tuple(vocab[n] for n in names if n in vocab), sampling_defaults={})


def check_tensors(tensors: dict, model_config, source: str) -> dict:
    """The tensors ``model_config`` needs, in its order (a mixture of experts' stacked as GGUF stacks them,
    ``gguf_moe.expected_shapes``). Raises ValueError naming the file for a missing tensor or a shape the
    metadata does not imply."""
    expected = gguf_moe.expected_shapes(model_config)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:5]}")
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ValueError(f"{source}: tensor {name!r} has shape {got}, the metadata implies {shape}")
    return {n: tensors[n] for n in expected}
