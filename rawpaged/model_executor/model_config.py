"""What describes a model's architecture: ``ModelConfig`` (the fields of ``config.json`` the decoder forward
needs) and ``GenerationConfig`` (what ``generation_config.json`` adds). Plain data, parsed from dicts; the
loaders (``model_loader`` for safetensors, ``gguf_loader`` for GGUF metadata) read the files.

Field meanings follow HF transformers' ``LlamaConfig``/``MistralConfig``/``Qwen2Config``/``Qwen3Config``,
``Gemma2Config``/``Gemma3TextConfig`` and the mixture-of-experts ``MixtralConfig``/``Qwen2MoeConfig``/
``Qwen3MoeConfig`` (``docs/moe.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rawpaged.model_executor.layers.rotary_embedding import RopeScaling

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *GEMMA_ARCHITECTURES,
    *MOE_ARCHITECTURES,
)
#: config.json fields of MoE variants this engine does not compute (DeepSeek's grouped top-k and MLA
#: attention, other routers' scoring and scaling, DeepSeek's dense-first layers): refused when set
UNSUPPORTED_MOE_FIELDS = (
    "n_group",
    "topk_group",
    "topk_method",
    "kv_lora_rank",
    "q_lora_rank",
    "n_routed_experts",
    "n_shared_experts",
    "scoring_func",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_experts_group",
    "moe_topk_group",
)
#: the expert/router fields of Mixtral's, Qwen2-MoE's and Qwen3-MoE's configs (the rest of their kind is
#: refused); the router's jitter and auxiliary loss are training-only
KNOWN_MOE_FIELDS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_jitter_noise",
    "router_aux_loss_coef",
    "output_router_logits",
)
#: Gemma's window when config.json gives none (HF's ``Gemma2Config``/``Gemma3TextConfig`` default)
GEMMA_DEFAULT_WINDOW = 4096


@dataclass(frozen=True)
class ModelConfig:
    """The fields of ``config.json`` the decoder forward needs (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3).

    ``rope``: the RoPE variant (``RopeScaling``); ``sliding_window``: tokens a query sees, itself
    included, on the layers whose ``layer_types`` entry is ``"sliding_attention"``, or None;
    ``layer_types``: each layer's attention type in HF's words, ``"full_attention"`` or
    ``"sliding_attention"`` (Mistral: every layer; Qwen2/Qwen3 with ``use_sliding_window``: layers from
    ``max_window_layers`` on, as HF's ``Qwen2Config`` derives them; Gemma 2: even layers; Gemma 3: all but
    every ``sliding_window_pattern``-th); ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3,
    Qwen3-MoE, Gemma 3).

    Mixture of experts only (``moe``; ``docs/moe.md``): ``num_experts`` routed experts (Mixtral's
    ``num_local_experts``), ``num_experts_per_tok`` (k) of them per token, each a SwiGLU MLP of
    ``moe_intermediate_size`` (Mixtral: ``intermediate_size``); ``moe_softmax_before_topk``: the router's
    weights are the softmax over all experts of the k selected (Qwen2-MoE, Qwen3-MoE), renormalized to sum
    1 when ``norm_topk_prob``; else the softmax over the k selected logits (Mixtral);
    ``shared_expert_intermediate_size``: Qwen2-MoE's shared expert (0: none), added times the sigmoid of
    its gate; ``moe_layers``: each layer's FFN kind, True for the sparse MoE block, False for a dense MLP
    of ``intermediate_size`` (HF: ``mlp_only_layers`` and every ``decoder_sparse_step``-th layer).

    Gemma only (``gemma``): ``hidden_activation`` (``"gelu_pytorch_tanh"``; else ``"silu"``);
    ``query_pre_attn_scalar``: attention scores scale by its ``** -0.5`` (None: ``head_dim ** -0.5``);
    ``attn_logit_softcapping`` / ``final_logit_softcapping``: ``cap * tanh(x / cap)`` of the attention
    scores (Gemma 2) / of the logits, or None; ``local_rope``: the RoPE of the sliding layers (Gemma 3's
    ``rope_local_base_freq``), None where every layer uses ``rope``.
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
    hidden_activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    local_rope: RopeScaling | None = None

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_softmax_before_topk: bool = True
    moe_layers: tuple = ()

    def __post_init__(self):
        if not self.layer_types:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            object.__setattr__(self, "layer_types", (kind,) * self.num_hidden_layers)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", (False,) * self.num_hidden_layers)

    def layer_windows(self) -> tuple:
        """Per layer, the window its attention applies (``sliding_window``) or None (full attention)."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def gemma(self) -> bool:
        """Gemma 2 or 3: (1 + weight) RMSNorms, four norms a layer, scaled embeddings, GeLU-tanh MLP."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def moe(self) -> bool:
        """A mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE): some layer's FFN is a sparse MoE block."""
        return any(self.moe_layers)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention scores: ``query_pre_attn_scalar ** -0.5`` (Gemma), else
        ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_ropes(self) -> tuple:
        """Per layer, its ``RopeScaling``: ``local_rope`` on the sliding layers where there is one, else ``rope``."""
        return tuple(
            self.local_rope if self.local_rope is not None and t == "sliding_attention" else self.rope
            for t in self.layer_types
        )

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
            _refuse_unsupported_moe(cfg, arch, source)
            gemma = _gemma_fields(cfg, arch, source) if arch in GEMMA_ARCHITECTURES else None
            moe = _moe_fields(cfg, arch, source) if arch in MOE_ARCHITECTURES else {}
            checked = (("mlp_bias", False),) if gemma else (("hidden_act", "silu"), ("mlp_bias", False))
            for field, supported in checked:
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
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
                attention_bias=_attention_bias(cfg, arch),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                rope=gemma.pop("rope") if gemma else RopeScaling.from_hf_config(cfg, source),
                **_windows(cfg, arch, source),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
                **(gemma or {}),
                **moe,
            )
        except KeyError as e:
            raise ValueError(f"{source}: missing field {e.args[0]!r}") from None

    @property
    def context_len(self) -> int:
        """The longest sequence the model serves (``max_position_embeddings``, stretched by RoPE scaling;
        Gemma 3's ``max_position_embeddings`` is the scaled context already, as vLLM reads it)."""
        if self.architecture == "Gemma3ForCausalLM":
            return self.max_position_embeddings
        return self.rope.context_len(self.max_position_embeddings)

    def checkpoint_expert_shapes(self, layer: int) -> dict:
        """HF checkpoint tensor name -> shape of sparse layer ``layer``'s MoE block: the router, each expert's
        three projections (Mixtral: ``block_sparse_moe.experts.{e}.w1`` gate, ``w3`` up, ``w2`` down; Qwen:
        ``mlp.experts.{e}.{gate,up,down}_proj``) and Qwen2-MoE's shared expert and its gate."""
        H, E, Fe, S = (
            self.hidden_size,
            self.num_experts,
            self.moe_intermediate_size,
            self.shared_expert_intermediate_size,
        )
        p = f"model.layers.{layer}."
        if self.architecture == "MixtralForCausalLM":
            shapes = {p + "block_sparse_moe.gate.weight": (E, H)}
            for e in range(E):
                q = p + f"block_sparse_moe.experts.{e}."
                shapes.update({q + "w1.weight": (Fe, H), q + "w3.weight": (Fe, H), q + "w2.weight": (H, Fe)})
            return shapes
        shapes = {p + "mlp.gate.weight": (E, H)}
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            shapes.update(
                {q + "gate_proj.weight": (Fe, H), q + "up_proj.weight": (Fe, H), q + "down_proj.weight": (H, Fe)}
            )
        if S:
            q = p + "mlp.shared_expert."
            shapes.update(
                {q + "gate_proj.weight": (S, H), q + "up_proj.weight": (S, H), q + "down_proj.weight": (H, S)}
            )
            shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
        return shapes

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
                }
            )
            if self.moe_layers[i]:
                shapes.update(self.checkpoint_expert_shapes(i))
            else:
                shapes.update(
                    {
                        p + "mlp.gate_proj.weight": (F, H),
                        p + "mlp.up_proj.weight": (F, H),
                        p + "mlp.down_proj.weight": (H, F),
                    }
                )
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
            if self.gemma:
                shapes.update(
                    {p + "pre_feedforward_layernorm.weight": (H,), p + "post_feedforward_layernorm.weight": (H,)}
                )
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
    window the layers from ``max_window_layers`` (default 28) on when ``use_sliding_window`` is set; Gemma 2
    windows layers 0, 2, 4, ...; Gemma 3 every layer but each ``sliding_window_pattern``-th (default 6:
    layers 5, 11, ... attend in full); an explicit ``layer_types`` list wins. Llama has none. Raises
    ValueError naming the field."""
    n = int(cfg["num_hidden_layers"])
    if arch.startswith("Qwen"):
        window = _window_size(cfg, source) if cfg.get("use_sliding_window") else None
        start = int(cfg.get("max_window_layers", 28))
        derived = tuple("sliding_attention" if window and i >= start else "full_attention" for i in range(n))
    elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        window = _window_size(cfg, source)
        derived = ("full_attention" if window is None else "sliding_attention",) * n
    elif arch in GEMMA_ARCHITECTURES:
        window = _window_size(cfg, source, GEMMA_DEFAULT_WINDOW)
        every = 2 if arch == "Gemma2ForCausalLM" else _pattern(cfg, source)
        derived = tuple("sliding_attention" if (i + 1) % every else "full_attention" for i in range(n))
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


def _attention_bias(cfg: dict, arch: str) -> bool:
    """q/k/v biases: Qwen2's by default, Qwen2-MoE's ``qkv_bias`` (default true), else ``attention_bias``."""
    if arch == "Qwen2MoeForCausalLM":
        return bool(cfg.get("qkv_bias", cfg.get("attention_bias", True)))
    return bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))


def _refuse_unsupported_moe(cfg: dict, arch: str, source: str) -> None:
    """ValueError naming the file and the field for a set ``UNSUPPORTED_MOE_FIELDS`` entry (DeepSeek's
    grouped top-k, MLA attention, ...) or, on an MoE architecture, an expert/router field that is not
    ``KNOWN_MOE_FIELDS``: such a model would be computed wrongly in silence."""
    for field in UNSUPPORTED_MOE_FIELDS:
        value = cfg.get(field)
        if value in (None, 0) or (field, value) in (("scoring_func", "softmax"), ("routed_scaling_factor", 1.0)):
            continue
        raise ValueError(f"{source}: {field} {value!r} is not supported (an MoE variant this engine does not compute)")
    if arch in MOE_ARCHITECTURES:
        for field in cfg:
            if any(w in field for w in ("expert", "moe", "router", "topk")) and field not in KNOWN_MOE_FIELDS:
                raise ValueError(f"{source}: {field} {cfg[field]!r} is not supported (an unknown MoE field)")


def _positive_int(cfg: dict, field: str, default, source: str) -> int:
    value = cfg.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {field} must be a positive integer, got {value!r}")
    return value


def _moe_fields(cfg: dict, arch: str, source: str) -> dict:
    """The ``ModelConfig`` fields of a mixture-of-experts architecture, with HF's defaults
    (``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``). Raises ValueError naming the file and the
    field: ``num_experts_per_tok`` above the number of experts, a bad ``decoder_sparse_step`` or
    ``mlp_only_layers`` entry, a sliding window on Qwen2-MoE/Qwen3-MoE (HF derives their windowed layers
    differently from Qwen2's; none is published), a router jitter or activation this engine does not
    apply."""
    n = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        experts = _positive_int(cfg, "num_local_experts", 8, source)
        top_k = _positive_int(cfg, "num_experts_per_tok", 2, source)
        return {
            "num_experts": experts,
            "num_experts_per_tok": _check_top_k(top_k, experts, "num_local_experts", source),
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
            "moe_softmax_before_topk": False,
            "moe_layers": (True,) * n,
        }
    if cfg.get("use_sliding_window"):
        raise ValueError(f"{source}: use_sliding_window {cfg['use_sliding_window']!r} is not supported for {arch}")
    qwen2 = arch == "Qwen2MoeForCausalLM"
    experts = _positive_int(cfg, "num_experts", 60 if qwen2 else 128, source)
    top_k = _positive_int(cfg, "num_experts_per_tok", 4 if qwen2 else 8, source)
    step = _positive_int(cfg, "decoder_sparse_step", 1, source)
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in dense
    ):
        raise ValueError(f"{source}: mlp_only_layers must list layer indices in [0, {n}), got {dense!r}")
    return {
        "num_experts": experts,
        "num_experts_per_tok": _check_top_k(top_k, experts, "num_experts", source),
        "moe_intermediate_size": _positive_int(cfg, "moe_intermediate_size", 1408 if qwen2 else 768, source),
        "shared_expert_intermediate_size": (
            _positive_int(cfg, "shared_expert_intermediate_size", 5632, source) if qwen2 else 0
        ),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "moe_softmax_before_topk": True,
        "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(n)),
    }


def _check_top_k(top_k: int, experts: int, experts_field: str, source: str) -> int:
    if top_k > experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} is greater than {experts_field} {experts}")
    return top_k


def _window_size(cfg: dict, source: str, default: int | None = None) -> int | None:
    window = cfg.get("sliding_window", default)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    return window


def _pattern(cfg: dict, source: str) -> int:
    """Gemma 3's ``sliding_window_pattern`` (default 6, as HF's ``Gemma3TextConfig``)."""
    every = cfg.get("sliding_window_pattern", 6)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{source}: sliding_window_pattern must be a positive integer, got {every!r}")
    return every


def _cap(cfg: dict, field: str, default, source: str) -> float | None:
    """A soft-cap field: a positive number, or None (off)."""
    value = cfg.get(field, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"{source}: {field} must be a positive number or null, got {value!r}")
    return None if value is None else float(value)


def _gemma_ropes(cfg: dict, arch: str, source: str) -> tuple:
    """(RoPE of the full-attention layers, RoPE of the sliding layers or None) as HF's Gemma configs read
    them. Gemma 2: one RoPE for all (``rope_theta``, default 10000). Gemma 3: ``rope_theta`` (default
    1e6) with ``rope_scaling`` on the full layers, ``rope_local_base_freq`` (default 10000, unscaled) on
    the sliding ones; or transformers v5's per-layer-type ``rope_parameters``."""
    if arch != "Gemma3ForCausalLM":
        return RopeScaling.from_hf_config(cfg, source), None
    params = cfg.get("rope_parameters")
    context = {"max_position_embeddings": cfg.get("max_position_embeddings", 131072)}
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        unknown = set(params) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"{source}: rope_parameters for layer types {sorted(unknown)} are not supported")
        ropes = []
        for kind, theta in (("full_attention", cfg.get("rope_theta", 1e6)), ("sliding_attention", None)):
            sub = dict(params.get(kind) or {})
            sub.setdefault("rope_theta", theta if theta is not None else cfg.get("rope_local_base_freq", 10000.0))
            ropes.append(RopeScaling.from_hf_config({**context, "rope_parameters": sub}, f"{source} ({kind})"))
        return tuple(ropes)
    full = RopeScaling.from_hf_config({**cfg, "rope_theta": cfg.get("rope_theta", 1e6)}, source)
    local = RopeScaling.from_hf_config({"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}, source)
    return full, local


def _gemma_fields(cfg: dict, arch: str, source: str) -> dict:
    """The ``ModelConfig`` fields only Gemma has (``rope`` included), with HF's defaults; raises
    ValueError naming the file and the field for what this engine does not compute: an activation other
    than ``gelu_pytorch_tanh``, ``use_bidirectional_attention``, ``attention_bias``, a null window."""
    activation = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"{source}: hidden_activation {activation!r} is not supported (only 'gelu_pytorch_tanh')")
    for field in ("use_bidirectional_attention", "attention_bias"):
        if cfg.get(field):
            raise ValueError(f"{source}: {field} {cfg[field]!r} is not supported (only false)")
    if "sliding_window" in cfg and cfg["sliding_window"] is None:
        raise ValueError(f"{source}: sliding_window must be a positive integer for {arch}, got null")
    scalar = _cap(cfg, "query_pre_attn_scalar", 256, source)
    if scalar is None:
        raise ValueError(f"{source}: query_pre_attn_scalar must be a positive number, got null")
    gemma2 = arch == "Gemma2ForCausalLM"
    rope, local_rope = _gemma_ropes(cfg, arch, source)
    return {
        "rope": rope,
        "local_rope": local_rope,
        "hidden_activation": activation,
        "query_pre_attn_scalar": scalar,
        # HF's Gemma 3 attention never applies its attn_logit_softcapping (Gemma 2's does, default 50)
        "attn_logit_softcapping": _cap(cfg, "attn_logit_softcapping", 50.0, source) if gemma2 else None,
        "final_logit_softcapping": _cap(cfg, "final_logit_softcapping", 30.0 if gemma2 else None, source),
    }


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
