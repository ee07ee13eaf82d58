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
from safetensors import SafetensorError, safe_open
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
        spec = LoRAAdapterSpec.from_local_checkpoint(request, model_config, max_lora_rank)
        path = Path(request.lora_path)
        tensors = _read_safetensors(path / "adapter_model.safetensors", request.lora_name)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        if shapes != spec.tensor_shapes:  # the file changed since its header was read
            spec = LoRAAdapterSpec.from_local_checkpoint(request, model_config, max_lora_rank)
        layers = {}
        for key, (name_a, name_b) in spec.tensor_names.items():
            a = np.ascontiguousarray(tensors[name_a], dtype=np.float32)
            b = np.ascontiguousarray(tensors[name_b], dtype=np.float32)
            layers[key] = LoRALayerWeights(a, b)
        digest = hashlib.sha256()
        for f in (path / "adapter_config.json", path / "adapter_model.safetensors"):
            digest.update(f.read_bytes())
        return cls(request, spec.rank, spec.scaling, layers, digest.hexdigest())


@dataclass(frozen=True)
class LoRAAdapterSpec:
    """What an adapter is without its weights, read from ``adapter_config.json`` and the safetensors
    header only (no tensor data): enough to check it and to size its pages before loading it.

    Attributes:
        request: the ``LoRARequest``.
        rank, scaling: as ``LoRAModel``'s.
        tensor_names: ``{(layer, module): (lora_A name, lora_B name)}`` of every adapted linear, sorted.
        tensor_shapes: ``{tensor name: shape}`` of the file's tensors.
        module_shapes: ``{module: (in_features, out_features)}`` of the base model.
    """

    request: LoRARequest
    rank: int
    scaling: float
    tensor_names: dict
    tensor_shapes: dict
    module_shapes: dict

    @property
    def num_floats(self) -> int:
        """float32 values of the adapter's A and B matrices together."""
        return sum(self.rank * sum(self.module_shapes[m]) for _, m in self.tensor_names)

    @classmethod
    def from_local_checkpoint(cls, request: LoRARequest, model_config, max_lora_rank: int) -> LoRAAdapterSpec:
        """Check ``request.lora_path`` as ``LoRAModel.from_local_checkpoint`` does (the same ValueErrors),
        reading the weights file's header only."""
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
        shapes = _read_header(weights_file, name)
        names = _layer_tensors(shapes, peft, model_config, name)
        return cls(request, peft.r, peft.scaling, names, shapes, module_shapes(model_config))


def _read_header(path: Path, name: str) -> dict:
    """``{tensor name: shape}`` of a safetensors file, from its header."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors cannot be read: {e}") from None


def _read_safetensors(path: Path, name: str) -> dict:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors cannot be read: {e}") from None


def _layer_tensors(shapes: dict, peft: PEFTHelper, model_config, name: str) -> dict:
    """``{(layer, module): (lora_A name, lora_B name)}`` of the tensors of ``shapes`` (name -> shape), each
    checked (see ``LoRAModel.from_local_checkpoint``)."""
    module_io = module_shapes(model_config)
    moe_layers = tuple(model_config.moe_layers) or (False,) * model_config.num_hidden_layers
    pairs: dict = {}
    for key in shapes:
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
        pairs.setdefault((layer, module), {})[ab] = key
    names = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise ValueError(f"LoRA adapter {name!r}: layer {layer} {module} has no {missing} weight")
        fan_in, fan_out = module_io[module]
        a, b = shapes[ab["A"]], shapes[ab["B"]]
        if a != (peft.r, fan_in) or b != (fan_out, peft.r):
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer} {module}: shape mismatch with the base model: lora_A "
                f"{list(a)} and lora_B {list(b)}, expected [{peft.r}, {fan_in}] and "
                f"[{fan_out}, {peft.r}] (rank r {peft.r}; an adapter trained for another base model?)"
            )
        names[(layer, module)] = (ab["A"], ab["B"])
    if not names:
        raise ValueError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weight")
    return names
