"""LoRA adapters: the layer, splitting and merging a model, a quantised frozen base (QLoRA)
and PEFT checkpoints in and out (docs/lora.md)."""
