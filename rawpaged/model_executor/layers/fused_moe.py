"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE over the backend's MoE ops
(``Backend.moe_route``, ``moe_align``, ``grouped_linear``, ``moe_combine``), in place of a layer's dense
MLP.

Math as HF transformers' ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock`` and
``Qwen3MoeSparseMoeBlock`` (``docs/moe.md``): router logits ``x @ gate.T``; each token's top-k experts
and weights; each selected expert's SwiGLU MLP ``down(silu(gate(x)) * up(x))`` times its weight, summed;
plus, for Qwen2-MoE, the shared expert's MLP times ``sigmoid(x @ shared_expert_gate.T)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rawpaged.model_executor.model_config import ModelConfig


@dataclass(frozen=True)
class MoEWeights:
    """One sparse layer's weights on the backend.

    router: ``load_linear`` of ``[E, hidden]``; gate_up: ``load_experts`` of the gate and up stacks ``[E,
    2 I, hidden]``; down: ``load_experts`` of ``[E, hidden, I]``; shared_gate_up / shared_down /
    shared_gate: Qwen2-MoE's shared expert (``load_linear`` of ``[2 S, hidden]``, ``[hidden, S]`` and
    ``[1, hidden]``), or None.
    """

    router: object
    gate_up: object
    down: object
    shared_gate_up: object = None
    shared_down: object = None
    shared_gate: object = None


def load_moe_weights(config: ModelConfig, weights: dict, layer: int, backend, dtype: str) -> MoEWeights:
    """Layer ``layer``'s ``MoEWeights`` from ``weights`` (the contract's names: the router
    ``model.layers.{L}.mlp.gate.weight``, stacked ``mlp.experts.{gate,up,down}_proj.weight``, Qwen2-MoE's
    ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``). Raises ValueError naming a missing
    tensor or a stack whose shape disagrees with the config."""
    p = f"model.layers.{layer}.mlp."
    E, H, Fe = config.num_experts, config.hidden_size, config.moe_intermediate_size

    def get(name, shape=None):
        if p + name not in weights:
            raise ValueError(f"missing tensor {p + name!r} (layer {layer} is a sparse MoE layer)")
        w = weights[p + name]
        if shape is not None and tuple(w.shape) != shape:
            raise ValueError(f"tensor {p + name!r} has shape {tuple(w.shape)}, the config implies {shape}")
        return w

    stacks = {n: get(f"experts.{n}.weight", s) for n, s in (("gate_proj", (E, Fe, H)), ("up_proj", (E, Fe, H)))}
    down = get("experts.down_proj.weight", (E, H, Fe))
    moe = dict(
        router=backend.load_linear([get("gate.weight")], dtype),
        gate_up=backend.load_experts([stacks["gate_proj"], stacks["up_proj"]], dtype),
        down=backend.load_experts([down], dtype),
    )
    if config.shared_expert_intermediate_size:
        q = "shared_expert."
        moe.update(
            shared_gate_up=backend.load_linear([get(q + "gate_proj.weight"), get(q + "up_proj.weight")], dtype),
            shared_down=backend.load_linear([get(q + "down_proj.weight")], dtype),
            shared_gate=backend.load_linear([get("shared_expert_gate.weight")], dtype),
        )
    return MoEWeights(**moe)


def fused_moe(backend, x, moe: MoEWeights, config: ModelConfig):
    """The MoE block's output ``[T, hidden]`` for its normed input ``x [T, hidden]`` (activation dtype).

    One router product, one routing kernel, one alignment, two grouped products (the experts' gate/up,
    then down) with SwiGLU between, one weighted scatter back (with the shared expert's gated output
    added): no loop over experts here; an expert no token selects is never read.
    """
    be, k = backend, config.num_experts_per_tok
    T = x.shape[0]
    logits = be.linear(x, moe.router, float32_out=True)
    topk_ids, topk_weights = be.moe_route(logits, k, config.moe_softmax_before_topk, config.norm_topk_prob)
    sorted_ids, offsets = be.moe_align(topk_ids, config.num_experts)
    rows = x[sorted_ids // k]
    h = be.grouped_linear(be.silu_and_mul(be.grouped_linear(rows, offsets, moe.gate_up)), offsets, moe.down)
    shared = gate = None
    if moe.shared_gate_up is not None:  # added by the combine, in its pass (any activation dtype)
        shared = be.linear(be.silu_and_mul(be.linear(x, moe.shared_gate_up)), moe.shared_down)
        gate = be.linear(x, moe.shared_gate, float32_out=True)  # [T, 1]
    return be.moe_combine(h, sorted_ids, topk_weights, T, shared, gate)
