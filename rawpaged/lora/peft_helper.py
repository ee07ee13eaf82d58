"""An adapter's ``adapter_config.json`` (PEFT's ``LoraConfig``), read and checked as vLLM's ``PEFTHelper``:
the rank ``r``, ``lora_alpha`` and ``use_rslora`` give the scale, ``target_modules`` the linears it adapts;
what rawpaged cannot apply (a rank over ``max_lora_rank``, biases, DoRA, ``modules_to_save``) is refused."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

#: the linears an adapter may target, by PEFT's module name: (the block they sit in, their own name)
TARGET_MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass(frozen=True)
class PEFTHelper:
    """The fields of ``adapter_config.json`` rawpaged reads.

    Attributes:
        r: the rank (``lora_A`` is ``[r, in]``, ``lora_B`` ``[out, r]``).
        lora_alpha: the scale's numerator.
        target_modules: the module names or suffixes (a list), or a regex PEFT matches against each
            module's full name (a string; ``"all-linear"``: every linear but the LM head).
        use_rslora: rank-stabilized LoRA: scale ``lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``.
        bias, use_dora, modules_to_save: refused unless ``"none"``, false and None.
        name: the adapter's name, for errors.
    """

    r: int
    lora_alpha: float
    target_modules: tuple | str
    use_rslora: bool = False
    bias: str = "none"
    use_dora: bool = False
    modules_to_save: tuple | None = None
    name: str = "adapter"

    @classmethod
    def from_local_dir(cls, lora_dir, name: str = "adapter", max_lora_rank: int | None = None) -> PEFTHelper:
        """Read ``lora_dir/adapter_config.json`` (and ``validate_legal(max_lora_rank)`` when given).

        Raises ValueError naming the adapter and the field: the file missing or not a JSON object, ``r``
        or ``lora_alpha`` missing or not a number, ``target_modules`` missing or empty, or what
        ``validate_legal`` refuses."""
        path = Path(lora_dir) / "adapter_config.json"
        if not path.is_file():
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json not found in {str(lora_dir)!r}")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"LoRA adapter {name!r}: adapter_config.json must be a JSON object")
        for field, types in (("r", int), ("lora_alpha", (int, float))):
            value = cfg.get(field)
            if isinstance(value, bool) or not isinstance(value, types) or value <= 0:
                raise ValueError(f"LoRA adapter {name!r}: {field} must be a positive number, got {value!r}")
        targets = cfg.get("target_modules")
        if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) for t in targets):
            targets = tuple(targets)
        elif not (isinstance(targets, str) and targets):
            raise ValueError(f"LoRA adapter {name!r}: target_modules must be a non-empty list or string")
        saved = cfg.get("modules_to_save")
        helper = cls(
            r=cfg["r"],
            lora_alpha=float(cfg["lora_alpha"]),
            target_modules=targets,
            use_rslora=bool(cfg.get("use_rslora", False)),
            bias=cfg.get("bias") or "none",
            use_dora=bool(cfg.get("use_dora", False)),
            modules_to_save=tuple(saved) if saved else None,
            name=name,
        )
        if max_lora_rank is not None:
            helper.validate_legal(max_lora_rank)
        return helper

    @property
    def scaling(self) -> float:
        """The factor ``B @ A`` is scaled by: ``lora_alpha / sqrt(r)`` with ``use_rslora``, else
        ``lora_alpha / r`` (vLLM's ``vllm_lora_scaling_factor``)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def validate_legal(self, max_lora_rank: int) -> None:
        """Raises ValueError naming the adapter and the field for a rank over ``max_lora_rank``, a bias
        other than "none", DoRA, or ``modules_to_save``."""
        if self.r > max_lora_rank:
            raise ValueError(
                f"LoRA adapter {self.name!r}: rank (r) {self.r} is greater than max_lora_rank {max_lora_rank}"
            )
        if self.bias != "none":
            raise ValueError(f"LoRA adapter {self.name!r}: bias {self.bias!r} is not supported (only 'none')")
        if self.use_dora:
            raise ValueError(f"LoRA adapter {self.name!r}: use_dora: DoRA is not supported")
        if self.modules_to_save:
            raise ValueError(
                f"LoRA adapter {self.name!r}: modules_to_save {list(self.modules_to_save)} is not supported"
            )

    def targets(self, module_name: str) -> bool:
        """Whether ``module_name`` (a full name, ``model.layers.0.self_attn.q_proj``) is a target: PEFT's
        rule (a list entry equal to the name or to a dot-separated suffix of it; a string is a regex the
        whole name must match; ``"all-linear"`` every linear of ``TARGET_MODULES``)."""
        t = self.target_modules
        if t == "all-linear":
            return module_name.rsplit(".", 1)[-1] in TARGET_MODULES
        if isinstance(t, str):
            return re.fullmatch(t, module_name) is not None
        return any(module_name == m or module_name.endswith("." + m) for m in t)
