"""LoRA adapters on one base model (vLLM's ``vllm/lora`` names): ``request.LoRARequest`` picks an adapter,
``peft_helper.PEFTHelper`` reads and checks its ``adapter_config.json``, ``lora_model.LoRAModel`` loads and
checks its weights against the base model, ``models.LoRAModelManager`` owns the adapter slots a step
computes with, and ``punica`` applies them beside the base model's linears (docs/lora.md)."""
