"""The request bodies of vLLM's adapter routes (``serving``): ``POST /v1/load_lora_adapter`` and ``POST
/v1/unload_lora_adapter``, as pydantic models in ``generation.protocol``'s strict style (vLLM's
``LoadLoRAAdapterRequest`` and ``UnloadLoRAAdapterRequest``)."""

from __future__ import annotations

from pydantic import Field

from rawpaged.entrypoints.generation.protocol import OpenAIBaseModel
from rawpaged.entrypoints.server.config import Limits


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """``{"lora_name": str, "lora_path": str}``: serve the PEFT directory ``lora_path`` (a path on the
    server's machine) as the model ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)

    def check(self, limits: Limits) -> None:
        """Nothing beyond the JSON types."""


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """``{"lora_name": str, "lora_int_id": int | null}``: stop serving ``lora_name`` (``lora_int_id``, when
    given, must be its id)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None

    def check(self, limits: Limits) -> None:
        """Nothing beyond the JSON types."""
