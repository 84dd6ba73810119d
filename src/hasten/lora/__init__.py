"""LoRA at hasten's speed: PEFT's LoRA layers run through hasten::lora_linear (the frozen base GEMM
and the low-rank update in one op that keeps no float32 copy of its input). The PEFT model stays a
PEFT model: its modules, parameters, save, load and merge are untouched; only the forward of each
qualifying LoRA layer is replaced, and undo restores it.

Imported on first use (the installer loads hasten's ops)."""

__all__ = ["install_fused_lora", "lora_layers"]


def __getattr__(name: str):
    if name in __all__:
        from hasten.lora import peft_layers

        return getattr(peft_layers, name)
    raise AttributeError(f"module 'hasten.lora' has no attribute {name!r}")
