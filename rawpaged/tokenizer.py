"""Tokenizer (HF ``tokenizers``) and chat templates (``jinja2``); incremental detokenization is
``rawpaged.engine.detokenizer``.

A conversation's special tokens come from its template only: ``encode_chat`` encodes every message's
content as literal text, so a user who types ``<|im_end|>`` gets those characters, not the end of their
turn. A raw prompt (``encode``) is parsed as vLLM and HF do: special-token text in it becomes the token.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders


def _byte_level_alphabet() -> dict:
    """GPT-2's byte-level BPE alphabet (Radford et al. 2019, ``encoder.py``): printable bytes stand for
    themselves, the others for ``chr(256 + n)``. Returns ``{character: byte}``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
#: Chat template variables ``chat_template_kwargs`` may not replace.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _special_token(value):
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


def _ids(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list:
    """``tok.encode(text).ids`` through ``encode_batch``, which releases the GIL while it works (``encode``
    holds it: a 4 MB prompt stalled every other thread for 5 s)."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


def _up_to_final_content(text: str, final: str) -> str:
    """``text`` cut where its last occurrence of ``final`` (the last message's content) ends, as HF's
    ``continue_final_message`` cuts it: with the content's trailing whitespace where the template kept it.

    Raises:
        ValueError: ``text`` does not hold ``final`` (stripped).
    """
    core = final.strip()
    if core not in text:
        raise ValueError(
            "continue_final_message is set, but the chat template does not write the last message's content as given"
        )
    at = text.rindex(core)
    keep = len(final.lstrip())
    return text[: at + keep] if text[at : at + keep] == final else text[: at + len(core)]


class Tokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` of a model directory.

    Raises:
        ValueError: if ``tokenizer.json`` is missing or unreadable.
    """

    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ValueError(f"{model_dir}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a generic Exception
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self._setup(tok, json.loads(cfg_path.read_text()) if cfg_path.exists() else {})

    @classmethod
    def from_objects(cls, tokenizer: HFTokenizer, config: dict) -> Tokenizer:
        """From a ``tokenizers.Tokenizer`` and a ``tokenizer_config.json`` dict (e.g. built from a GGUF's
        metadata)."""
        self = cls.__new__(cls)
        self._setup(tokenizer, config)
        return self

    def _setup(self, tok: HFTokenizer, cfg: dict) -> None:
        self._tok = tok
        self.config = dict(cfg)  # tokenizer_config.json as read (``pad_token``, ``model_max_length``, ...)
        self.chat_template = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            self.chat_template = next(
                (t["template"] for t in self.chat_template if t.get("name") == "default"),
                self.chat_template[0]["template"],
            )
        self.bos_token = _special_token(cfg.get("bos_token"))
        self.eos_token = _special_token(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.special_tokens = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        self._byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        self._template = None

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (what grammar engines such as llguidance read)."""
        return self._tok.to_str()

    def to_config(self) -> dict:
        """``tokenizer_config.json`` (``config``) with the fields this class reads as it reads them: with
        ``to_json``, what ``from_objects`` rebuilds it from (e.g. in another process)."""
        return {
            **self.config,
            "chat_template": self.chat_template,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
        }

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        """Token ids of a raw prompt as HF's ``tokenizer(text, add_special_tokens=...)`` and vLLM give
        them: special-token text parsed as the special token; with ``add_special_tokens``, also the tokens
        ``tokenizer.json``'s post-processor adds (Llama 3's BOS), or BOS first where
        ``tokenizer_config.json`` sets ``add_bos_token`` (never twice)."""
        if not add_special_tokens:
            return _ids(self._tok, text, add_special_tokens=False)
        return self._with_bos(_ids(self._tok, text, add_special_tokens=True))

    @functools.cached_property
    def _special_affixes(self) -> tuple:
        """``(prefix, suffix)``: the ids ``tokenizer.json``'s post-processor puts before and after a text
        (Llama 3: ``([BOS], [])``), found by encoding one character with and without them."""
        core = _ids(self._tok, "a", add_special_tokens=False)
        full = _ids(self._tok, "a", add_special_tokens=True)
        for i in range(len(full) - len(core) + 1):
            if core and full[i : i + len(core)] == core:
                return full[:i], full[i + len(core) :]
        return full, []

    def convert_ids_to_tokens(self, ids) -> list:
        """Each id's vocabulary entry as ``tokenizer.json`` spells it (HF's ``convert_ids_to_tokens``:
        byte-level ``"Ġthe"``, SentencePiece ``"▁the"``, ``"<|im_end|>"``); None for an id that names no
        token (negative, past the vocabulary, or a gap in it)."""
        return [self._tok.id_to_token(int(i)) if 0 <= int(i) < 1 << 32 else None for i in ids]

    def added_tokens(self) -> dict:
        """``{id: content}`` of the added tokens (special or not), as HF's ``added_tokens_decoder``."""
        return {i: t.content for i, t in sorted(self._tok.get_added_tokens_decoder().items())}

    def get_vocab(self) -> dict:
        """Token string -> id, added tokens included (as HF's ``get_vocab``)."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters the longest vocabulary entry spells (byte-level: its bytes), added tokens included."""
        return max(1, *(len(t) for t in self._tok.get_vocab(with_added_tokens=True)))

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` encodes to, known without encoding it: a token spells at
        most ``max_token_chars`` characters (a normalizer may compose characters, so it gets a margin of
        4). The server refuses a prompt that cannot fit before spending seconds tokenizing it."""
        per_token = self.max_token_chars * (4 if self._tok.normalizer is not None else 1)
        return -(-len(text) // per_token)

    @functools.cached_property
    def _literal(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as text (built when first used: a copy
        of a 262,144-piece vocabulary takes a second or more)."""
        literal = HFTokenizer.from_str(self._tok.to_str())
        literal.encode_special_tokens = True
        return literal

    def encode_literal(self, text: str) -> list:
        """Token ids of ``text`` with any special-token text encoded as plain characters (no BOS)."""
        return _ids(self._literal, text, add_special_tokens=False)

    def _with_bos(self, ids: list) -> list:
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def encode_chat(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> tuple:
        """``(prompt text, token ids)`` of a conversation rendered with the chat template, every message's
        content encoded as literal text: only the template's own markers are special tokens.

        The template writes its special tokens (any BOS too), so nothing is added but ``add_bos_token``'s
        BOS where the template has none. Contents without special-token text take the plain path (the
        rendered text encoded as a whole). Others are rendered as placeholders, and the template's pieces
        and the literal contents are encoded apart. ``continue_final_message``: see
        ``apply_chat_template``. ``add_special_tokens``: also the tokens the post-processor puts around a
        text (vLLM's ``/tokenize`` option: a Llama 3 chat then starts with two BOS, the template's and the
        post-processor's, as HF's ``tokenizer(text)`` of the rendered text gives).

        Raises:
            ValueError: see ``apply_chat_template``; also when a template rewrites a content that spells a
                special token, since then it cannot be kept literal.
        """
        render = functools.partial(
            self.apply_chat_template,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
            tools=tools,
            continue_final_message=continue_final_message,
        )
        text = render(messages)
        ids = self._encode_conversation(text, messages, render)
        if add_special_tokens:
            prefix, suffix = self._special_affixes
            ids = prefix + ids + suffix
        return text, self._with_bos(ids)

    def _encode_conversation(self, text: str, messages: list, render) -> list:
        """The ids of ``text`` (``messages`` rendered by ``render``), the contents literal (``encode_chat``)."""
        contents = [m["content"] for m in messages]
        if not any(s in c for c in contents for s in self.special_tokens):
            return _ids(self._tok, text, add_special_tokens=False)
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = render([{**m, "content": k} for m, k in zip(messages, marks)])
        pieces = re.split("(\ue000\\d+\ue001)", marked)
        is_content = [p in marks for p in pieces]
        if "".join(contents[marks.index(p)] if c else p for p, c in zip(pieces, is_content)) != text:
            raise ValueError(
                "the chat template rewrites message contents, so special-token text in them cannot be kept literal"
            )
        ids = []
        for p, c in zip(pieces, is_content):
            ids += self.encode_literal(contents[marks.index(p)]) if c else _ids(self._tok, p, add_special_tokens=False)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for, also when they are a piece of a UTF-8 character (byte-level
        BPE pieces, SentencePiece byte fallback ``<0xNN>``), where decoding it alone gives U+FFFD."""
        piece = self._tok.id_to_token(int(token_id)) or ""
        if self._byte_level and piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools`` itself (it reads a ``tools`` variable)."""
        try:
            return bool(self.chat_template) and "tools" in jinja2.meta.find_undeclared_variables(
                self._environment().parse(self.chat_template)
            )
        except jinja2.exceptions.TemplateError:  # apply_chat_template reports it
            return False

    def apply_chat_template(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
        tools: list | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render ``messages`` ([{"role", "content", ...}]: HF transformers' message dicts, with
        ``tool_calls`` and ``tool_call_id`` where they have them) with the model's Jinja chat template;
        ``template_kwargs`` are extra template variables (vLLM's ``chat_template_kwargs``, e.g. Qwen3's
        ``enable_thinking``), ``tools`` OpenAI's tool dicts (for templates that render them: see
        ``supports_tools``). ``continue_final_message`` ends the text where the last message's content
        ends, leaving that message open for the model to go on (HF's option of that name; not with
        ``add_generation_prompt``).

        Raises:
            ValueError: the model has no chat template, a message is malformed, the template raises, or
                ``continue_final_message`` is set with ``add_generation_prompt`` or the template does not
                write the last content as given.
        """
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json: chat_template; a GGUF file: "
                "tokenizer.chat_template, or a chat_template.jinja beside it)"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if template_kwargs is not None:
            if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
                raise ValueError("chat_template_kwargs must be a mapping of names to values")
            reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
            if reserved:
                raise ValueError(f"chat_template_kwargs may not set {reserved}")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be an object with string 'role' and 'content'")
        try:
            if self._template is None:
                self._template = self._environment().from_string(self.chat_template)
            text = self._template.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None
        return _up_to_final_content(text, messages[-1]["content"]) if continue_final_message else text

    @staticmethod
    def _environment() -> jinja2.Environment:
        """A Jinja environment as HF transformers renders chat templates in: sandboxed, ``trim_blocks``,
        ``lstrip_blocks``, ``raise_exception`` and ``strftime_now``, and ``tojson`` as ``json.dumps``
        (keys in their order, non-ASCII kept, not HTML-escaped: Jinja's own sorts and escapes)."""
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        return env
