"""What describes a model's architecture: ``ModelConfig`` (the fields of ``config.json`` the decoder forward
needs) and ``GenerationConfig`` (what ``generation_config.json`` adds). Plain data, parsed from dicts; the
loaders (``model_loader`` for safetensors, ``gguf_loader`` for GGUF metadata) read the files.

Field meanings follow HF transformers' ``LlamaConfig``/``MistralConfig``/``Qwen2Config``/``Qwen3Config``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rawpaged.model_executor.layers.rotary_embedding import RopeScaling

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.json`` the decoder forward needs (Llama, Mistral, Qwen2, Qwen3).

    ``rope``: the RoPE variant (``RopeScaling``); ``sliding_window``: tokens a query sees, itself
    included, on the layers whose ``layer_types`` entry is ``"sliding_attention"``, or None;
    ``layer_types``: each layer's attention type in HF's words, ``"full_attention"`` or
    ``"sliding_attention"`` (Mistral: every layer; Qwen2/Qwen3 with ``use_sliding_window``: layers from
    ``max_window_layers`` on, as HF's ``Qwen2Config`` derives them); ``qk_norm``: per-head RMSNorm of q and
    k before RoPE (Qwen3).
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

    layer_types: tuple = ()  # filled in by __post_init__ when empty

    def __post_init__(self):
        if not self.layer_types:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)

    @property
    def shared_sliding_window(self) -> int | None:
        """The window every layer applies, or None when some layer (or every one) attends in full."""
        return self.sliding_window if set(self.layer_types) == {"sliding_attention"} else None

    def layer_windows(self) -> tuple:
        """Per layer, the window its attention applies (``sliding_window``) or None (full attention)."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

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
                **_windows(cfg, arch, source),
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


def _windows(cfg: dict, arch: str, source: str) -> dict:
    """``sliding_window`` and ``layer_types`` as HF derives them: Mistral windows every layer; Qwen2/Qwen3
    window the layers from ``max_window_layers`` (default 28) on when ``use_sliding_window`` is set; an
    explicit ``layer_types`` list wins. Llama has none. Raises ValueError naming the field."""
    n = int(cfg["num_hidden_layers"])
    if arch.startswith("Qwen"):
        window = _window_size(cfg, source) if cfg.get("use_sliding_window") else None
        start = int(cfg.get("max_window_layers", 28))
        derived = tuple("sliding_attention" if window and i >= start else "full_attention" for i in range(n))
    elif arch == "MistralForCausalLM":
        window = _window_size(cfg, source)
        derived = ("full_attention" if window is None else "sliding_attention",) * n
    else:
        window, derived = None, ("full_attention",) * n
    explicit = cfg.get("layer_types")
    types = tuple(explicit) if explicit is not None and window is not None else derived
    if len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"{source}: layer_types must list 'full_attention' or 'sliding_attention' for each of the {n} layers,"
            f" got {list(types)!r}"
        )
    return {"sliding_window": window if "sliding_attention" in types else None, "layer_types": types}


def _window_size(cfg: dict, source: str) -> int | None:
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    return window


#: generation_config.json fields applied as sampling defaults (as vLLM's ``--generation-config auto``).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationConfig:
    """What ``generation_config.json`` adds: more end-of-sequence ids and sampling defaults.

    eos_token_ids: its ``eos_token_id`` (an id or a list; Llama 3 and Qwen3 list several).
    sampling_defaults: ``SamplingParams`` keyword -> value for the fields in ``GENERATION_DEFAULTS`` the
        file sets; the server and ``LLM`` apply them where a request leaves the field unset.
    ignored: fields the file sets that this engine does not apply (``max_new_tokens``).
    """

    eos_token_ids: tuple = ()
    sampling_defaults: dict = None
    ignored: tuple = ()
