"""The LoRA adapters a server serves, by the name a request's ``model`` gives (vLLM's
``OpenAIServingModels.lora_requests`` and ``LoRAModulePath``): those of ``--lora-modules``, parsed by
``parse_lora_module``, and those ``POST /v1/load_lora_adapter`` adds at run time. Each gets a fresh
``lora_int_id`` (1, 2, ...; never reused, so an unloaded adapter's id names nothing again). docs/lora.md,
"Server"."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

from rawpaged.lora.request import LoRARequest


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): the name requests use, the PEFT directory, and the served base
    model it adapts (None: the first served name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value, in vLLM's two forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name`` optional). Raises
    ValueError naming the entry for another form, invalid JSON, an unknown or missing key, or an empty name
    or path."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r} is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"--lora-modules {text!r} must be a JSON object")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {text!r}: unknown key(s) {unknown} (known: name, path, base_model_name)")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: base_model_name must be a string")
    elif "=" in text:
        name, path = text.split("=", 1)
        base = None
    else:
        raise ValueError(
            f"--lora-modules {text!r}: expected name=path or a JSON object "
            '{"name": ..., "path": ..., "base_model_name": ...}'
        )
    for field, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"--lora-modules {text!r}: {field} must be a non-empty string")
    return LoRAModulePath(name.strip(), path.strip(), base)


class LoRARegistry:
    """The served adapters: ``requests`` ``{name: LoRARequest}`` in the order they were added, ``parents``
    ``{name: base model name}`` (``/v1/models``' ``parent``).

    Args:
        modules: ``LoRAModulePath``s served from the start (``--lora-modules``).
        base_model_name: the served model's reported name (the default ``parent``).
        base_names: every name a request may give for the base model; an adapter may not take one.

    Raises ValueError naming the entry for a name given twice or one of the base model's names.
    """

    def __init__(self, modules=(), base_model_name: str = "", base_names=()):
        self.base_model_name = base_model_name
        self.base_names = frozenset(base_names) | {base_model_name}
        self.requests: dict[str, LoRARequest] = {}
        self.parents: dict[str, str] = {}
        self.loading: set[str] = set()  # names a load_lora_adapter is loading now
        self._ids = itertools.count(1)
        self.static = [self.register(m.name, m.path, m.base_model_name) for m in modules]

    def __contains__(self, name) -> bool:
        return name in self.requests

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as ``name``, or None."""
        return self.requests.get(name) if name is not None else None

    def check_new_name(self, name: str) -> None:
        """Raises ValueError where ``name`` is an adapter's already (or one being loaded) or the base model's."""
        if name in self.requests or name in self.loading:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        if name in self.base_names:
            raise ValueError(f"lora_name '{name}' is a name of the base model")

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A ``LoRARequest`` for ``name`` and ``path`` with the next id (not registered: ``add`` it once
        the engine has loaded it). Raises ValueError as ``check_new_name``."""
        self.check_new_name(name)
        return LoRARequest(name, next(self._ids), path)

    def add(self, lora: LoRARequest, base_model_name: str | None = None) -> None:
        """Serve ``lora`` under its name, its ``parent`` ``base_model_name`` where that is a base model
        name, else the served model's."""
        self.requests[lora.lora_name] = lora
        parent = base_model_name if base_model_name in self.base_names else self.base_model_name
        self.parents[lora.lora_name] = parent

    def register(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """``new_request`` and ``add`` at once; the ``LoRARequest``."""
        lora = self.new_request(name, path)
        self.add(lora, base_model_name)
        return lora

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving ``name``; its ``LoRARequest``, or None if it was not served."""
        self.parents.pop(name, None)
        return self.requests.pop(name, None)
