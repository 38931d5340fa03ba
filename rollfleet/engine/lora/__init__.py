"""LoRA adapters in the embedded engine: reading and checking a peft adapter (lora), serving one by
merge on activation, the one way to the model's parameters (lora_merge), and which loaded adapter
goes first (lora_recency)."""
