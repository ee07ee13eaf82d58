"""A SentencePiece BPE tokenizer (GGUF ``tokenizer.ggml.model`` = ``llama``) rebuilt with the ``tokenizers``
library as HF's ``tokenizer.json`` of the model defines it (HF's ``GemmaConverter``): a BPE model with byte
fallback over the SentencePiece pieces, merges derived from the vocabulary and the pieces' scores, spaces
normalized to ``▁`` and no pre-tokenizer split; decoding turns ``▁`` back into spaces and fuses the
``<0xNN>`` byte pieces.

What the GGUF changed on the way from the SentencePiece model, undone here:

- llama.cpp's converter writes user-defined pieces (token type 4) with ``▁`` replaced by spaces
  (``convert_hf_to_gguf.py``, ``_create_vocab_sentencepiece``): Gemma's runs of ``▁``; they get it back.
- It scores control and user-defined pieces -1000, where the SentencePiece model scores them 0 (the score
  HF's merges are ordered by): they count as 0 here, or runs such as ``"  the"`` would merge differently.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, processors

SPIECE_UNDERLINE = "\u2581"
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6


def spm_pieces(tokens: list[str], token_types: list[int]) -> list[str]:
    """The SentencePiece pieces of a GGUF vocabulary: user-defined tokens with their spaces back as ``▁``."""
    return [
        t.replace(" ", SPIECE_UNDERLINE) if ty == TOKEN_TYPE_USER_DEFINED else t
        for t, ty in zip(tokens, token_types, strict=True)
    ]


def spm_merges(pieces: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary, highest priority first.

    Every split ``(left, right)`` of a piece whose two halves are pieces too is a merge; merges are ordered
    by the score of the piece they make (highest first; control and user-defined pieces score 0), then by
    the length of ``left`` and of ``right`` (longest first), then by the ids of ``left`` and ``right``. A
    SentencePiece BPE model applies the pair whose result scores highest first; this order gives
    ``tokenizers``' BPE the same choice.

    Args:
        pieces: the vocabulary in id order (``spm_pieces``).
        scores: each piece's score (``tokenizer.ggml.scores``).
        token_types: each piece's llama.cpp token type.

    Returns:
        ``(left, right)`` pairs.
    """
    ids = {p: i for i, p in enumerate(pieces)}
    ranked = []
    for piece, score, ty in zip(pieces, scores, token_types, strict=True):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            score = 0.0
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None:
                ranked.append((-score, -len(left), -len(right), li, ri))
    ranked.sort()
    return [(pieces[li], pieces[ri]) for *_, li, ri in ranked]


def build_spm_tokenizer(
    tokens: list[str], scores: list[float], token_types: list[int], unk: int | None, bos: int | None
) -> Any:
    """A ``tokenizers.Tokenizer`` of a GGUF SentencePiece vocabulary (see the module's docstring).

    Args:
        tokens: ``tokenizer.ggml.tokens``, in id order.
        scores: ``tokenizer.ggml.scores``.
        token_types: ``tokenizer.ggml.token_type``: control tokens (3) become special tokens, user-defined
            ones (4) added tokens; both are matched in the text before normalization, as HF does.
        unk: the unknown token's id, or None.
        bos: the id the post-processor puts first in a raw prompt (``add_bos_token``), or None.

    Returns:
        The tokenizer.

    Raises:
        ValueError: the three lists differ in length, or the vocabulary has duplicate pieces.
    """
    if not len(tokens) == len(scores) == len(token_types):
        raise ValueError(
            f"tokenizer.ggml.tokens/scores/token_type differ in length: {len(tokens)}, {len(scores)}, "
            f"{len(token_types)}"
        )
    pieces = spm_pieces(tokens, token_types)
    vocab = {p: i for i, p in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=spm_merges(pieces, scores, token_types),
            dropout=None,
            unk_token=pieces[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", SPIECE_UNDERLINE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()])
    if bos is not None:
        b = pieces[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b}:1 $B:1", special_tokens=[(b, bos)]
        )
    typed = [(TOKEN_TYPE_CONTROL, True), (TOKEN_TYPE_USER_DEFINED, False)]
    for kind, special in typed:
        added = [
            AddedToken(p, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for p, ty in zip(pieces, token_types, strict=True)
            if ty == kind
        ]
        if added:
            (tok.add_special_tokens if special else tok.add_tokens)(added)
    return tok
