"""An adapter's weights, loaded from its PEFT directory and checked against the base model (vLLM's
``LoRAModel.from_local_checkpoint``).

PEFT saves ``adapter_model.safetensors`` with, per targeted linear, ``base_model.model.model.layers.{L}.
{self_attn|mlp}.{module}.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. The weights are
kept as float32 host arrays; ``models.LoRAModelManager`` copies them into its slots.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from rawpaged.lora.peft_helper import TARGET_MODULES, PEFTHelper
from rawpaged.lora.request import LoRARequest

_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.default)?\.weight"
)


def module_shapes(model_config) -> dict:
    """``{module: (in_features, out_features)}`` of the base model's targetable linears (``TARGET_MODULES``)
    for a ``ModelConfig``."""
    c = model_config
    q, kv, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    i = c.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass(frozen=True)
class LoRALayerWeights:
    """One adapted linear: lora_a float32 ``[rank, in]``, lora_b float32 ``[out, rank]``."""

    lora_a: np.ndarray
    lora_b: np.ndarray


@dataclass(frozen=True)
class LoRAModel:
    """A loaded adapter.

    Attributes:
        request: the ``LoRARequest`` it was loaded for.
        rank: its rank ``r``; scaling: ``PEFTHelper.scaling``.
        layers: ``{(layer index, module name): LoRALayerWeights}`` of every adapted linear.
        digest: a hex SHA-256 of its two files' contents (what the prefix cache keys its KV blocks by).
    """

    request: LoRARequest
    rank: int
    scaling: float
    layers: dict
    digest: str

    @property
    def id(self) -> int:
        return self.request.lora_int_id

    @classmethod
    def from_local_checkpoint(cls, request: LoRARequest, model_config, max_lora_rank: int) -> LoRAModel:
        """Load and check ``request.lora_path`` for a base model of ``model_config``.

        Raises ValueError naming the adapter and the field: a missing directory or file, a ``.bin``
        checkpoint (only safetensors is read), what ``PEFTHelper`` refuses, a tensor of no targetable
        linear (another module, a layer the model lacks, a mixture-of-experts layer's MLP) or not a target
        of ``target_modules``, a ``lora_A`` without its ``lora_B``, or shapes that do not match the base model
        (an adapter trained for another base) or the rank.
        """
        name, path = request.lora_name, Path(request.lora_path)
        if not path.is_dir():
            raise ValueError(f"LoRA adapter {name!r}: lora_path {str(path)!r} is not a directory")
        peft = PEFTHelper.from_local_dir(path, name, max_lora_rank)
        weights_file = path / "adapter_model.safetensors"
        if not weights_file.is_file():
            if (path / "adapter_model.bin").is_file():
                raise ValueError(
                    f"LoRA adapter {name!r}: adapter_model.bin (a pickled PyTorch checkpoint) is not supported; "
                    "save it as adapter_model.safetensors (PEFT's save_pretrained(safe_serialization=True))"
                )
            raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors not found in {str(path)!r}")
        tensors = _read_safetensors(weights_file, name)
        layers = _layer_weights(tensors, peft, model_config, name)
        digest = hashlib.sha256()
        for f in (path / "adapter_config.json", weights_file):
            digest.update(f.read_bytes())
        return cls(request, peft.r, peft.scaling, layers, digest.hexdigest())


def _read_safetensors(path: Path, name: str) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors cannot be read: {e}") from None


def _layer_weights(tensors: dict, peft: PEFTHelper, model_config, name: str) -> dict:
    """``{(layer, module): LoRALayerWeights}`` of ``tensors``, each checked (see ``from_local_checkpoint``)."""
    shapes = module_shapes(model_config)
    moe_layers = tuple(model_config.moe_layers) or (False,) * model_config.num_hidden_layers
    pairs: dict = {}
    for key, value in tensors.items():
        m = _TENSOR.fullmatch(key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a targetable linear")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if TARGET_MODULES.get(module) != block or layer >= model_config.num_hidden_layers:
            raise ValueError(f"LoRA adapter {name!r}: target module {key!r}: the base model has no such linear")
        if block == "mlp" and moe_layers[layer]:
            raise ValueError(
                f"LoRA adapter {name!r}: target module {module} of layer {layer}: that layer is a mixture of "
                "experts (adapting experts is not supported)"
            )
        if not peft.targets(f"model.layers.{layer}.{block}.{module}"):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not in target_modules {peft.target_modules}")
        pairs.setdefault((layer, module), {})[ab] = np.asarray(value, dtype=np.float32)
    layers = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has no {missing} weight")
        fan_in, fan_out = shapes[module]
        a, b = ab["A"], ab["B"]
        if a.shape != (peft.r, fan_in) or b.shape != (fan_out, peft.r):
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module}: shape mismatch with the base model: lora_A "
                f"{list(a.shape)} and lora_B {list(b.shape)}, expected [{peft.r}, {fan_in}] and "
                f"[{fan_out}, {peft.r}] (rank r {peft.r}; an adapter trained for another base model?)"
            )
        layers[(layer, module)] = LoRALayerWeights(np.ascontiguousarray(a), np.ascontiguousarray(b))
    if not layers:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weight")
    return layers
