"""The request for an adapter, as vLLM's ``LoRARequest``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with.

    Attributes:
        lora_name: the adapter's name (what errors and, later, the server call it).
        lora_int_id: its id, an int >= 1, unique per adapter in an engine (vLLM's rule: 0 is no adapter).
        lora_path: the PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises ValueError for an id below 1 or an empty name or path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path must be a non-empty path")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
