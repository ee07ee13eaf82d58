"""A byte-level BPE tokenizer (GGUF ``tokenizer.ggml.model`` = ``gpt2``) rebuilt with the ``tokenizers``
library from a GGUF's ``tokenizer.ggml.*`` metadata, with the normalizer, pre-tokenizer, decoder and
post-processor of HF's ``tokenizer.json`` of its family (``tokenizer.ggml.pre``: ``PRE_TOKENIZERS``).
Gemma 3's SentencePiece tokenizer: ``gguf_spm``."""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from rawpaged.model_executor.gguf_spm import TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED

#: ``tokenizer.ggml.pre`` -> the split regex of HF's pre-tokenizer for it (None: GPT-2's, after splitting
#: digits one by one), as the families' tokenizer.json files give them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "smollm": None,
    "qwen2": _QWEN2_SPLIT,
    "llama-bpe": _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|"),
}


def build_tokenizer(
    tokens: list[str], merges: list[str], token_types: list[int] | None, pre: str = "smollm", bos: str | None = None
) -> Any:
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata, with the
    pre-tokenizer HF's tokenizer.json of that family has.

    Args:
        tokens: the vocabulary in id order.
        merges: merge rules as ``"left right"`` strings, in priority order.
        token_types: llama.cpp token types per id; type 3 (control) tokens become special tokens,
            type 4 (user-defined) tokens become added (non-special) tokens, both keeping their ids.
        pre: ``tokenizer.ggml.pre``: ``smollm`` (digits one by one, then GPT-2's byte-level regex),
            ``qwen2`` (Qwen2's split regex, NFC normalization) or ``llama-bpe`` (Llama 3's regex, whole
            words in the vocabulary taken before merges).
        bos: a BOS token the post-processor adds to raw prompts (Llama 3), or None.

    Returns:
        A ``tokenizers.Tokenizer`` with byte-level decoder.

    Raises:
        ValueError: duplicate tokens, a malformed merge, or an unknown ``pre``.
    """
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported (supported: {sorted(PRE_TOKENIZERS)})")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    pairs = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed merge {m!r}")
        pairs.append((parts[0], parts[1]))
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            unk_token=None,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre == "llama-bpe",
        )
    )
    _byte_level_pipeline(tok, pre, bos, vocab)
    if token_types is not None:
        _add_typed_tokens(tok, tokens, token_types)
    return tok


def _byte_level_pipeline(tok: Any, pre: str, bos: str | None, vocab: dict) -> None:
    """Give ``tok`` the normalizer, pre-tokenizer, decoder and post-processor of family ``pre``'s
    tokenizer.json (``build_tokenizer``'s arguments)."""
    split = PRE_TOKENIZERS[pre]
    tok.normalizer = normalizers.NFC() if pre == "qwen2" else None
    if split is None:
        steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    else:
        steps = [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if bos is not None:
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
                ),
            ]
        )


def _add_typed_tokens(tok: Any, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens (type 3) become special tokens of ``tok``, user-defined ones (type 4) added tokens."""
    special = [tokens[i] for i, t in enumerate(token_types) if t == TOKEN_TYPE_CONTROL]
    user = [tokens[i] for i, t in enumerate(token_types) if t == TOKEN_TYPE_USER_DEFINED]
    if special:
        tok.add_special_tokens(
            [
                AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
                for s in special
            ]
        )
    if user:
        tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])
