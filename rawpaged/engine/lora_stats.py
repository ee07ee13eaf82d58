"""The LoRA part of ``LLMEngine.stats()``: the adapters registered and resident, the loads so far, and the
requests each adapter has running and waiting (what vLLM's ``lora_requests_info`` gauge reports)."""

from __future__ import annotations


def lora_stats(manager, running: list, requests: dict) -> dict:
    """``{"lora": ...}`` for ``LLMEngine.stats()`` (``{"lora": None}`` with LoRA off).

    Args:
        manager: the engine's ``rawpaged.lora.models.LoRAModelManager``, or None.
        running: the scheduler's running ``Sequence``s.
        requests: the engine's unfinished ``Request``s by id (each with its ``lora_request`` or None).

    Returns ``{"lora": {"max_loras", "num_registered", "num_resident", "num_loads", "adapters",
    "running_lora_adapters", "waiting_lora_adapters"}}``: ``adapters`` maps each registered adapter's name
    to ``{"lora_int_id", "resident" (in a slot now), "num_requests_running", "num_requests_waiting"}``; a
    request runs while one of its sequences is in the running batch, else it waits; the two lists name the
    adapters with a running and with a waiting request.
    """
    if manager is None:
        return {"lora": None}
    running_ids = {s.request_id for s in running}
    resident = manager.resident
    adapters = {
        req.lora_name: {
            "lora_int_id": lid,
            "resident": lid in resident,
            "num_requests_running": 0,
            "num_requests_waiting": 0,
        }
        for lid, req in sorted(manager.list_adapters().items())
    }
    for rid, req in requests.items():
        lora = req.lora_request
        if lora is None or lora.lora_name not in adapters:
            continue
        key = "num_requests_running" if rid in running_ids else "num_requests_waiting"
        adapters[lora.lora_name][key] += 1
    return {
        "lora": {
            "max_loras": manager.max_loras,
            "num_registered": len(adapters),
            "num_resident": len(resident),
            "num_loads": manager.num_loads,
            "adapters": adapters,
            "running_lora_adapters": [n for n, a in adapters.items() if a["num_requests_running"]],
            "waiting_lora_adapters": [n for n, a in adapters.items() if a["num_requests_waiting"]],
        }
    }
