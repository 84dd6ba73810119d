"""Swap a transformers model's RMSNorm, SwiGLU MLP and rotary embedding for hasten's kernels.

  RMSNorm   every `*RMSNorm` module with a 1-D `weight` and `variance_epsilon` (Llama/Qwen
            semantics: normalise in float32, cast, multiply by the weight); its forward is
            replaced on the instance
  MLP       every `*MLP` module with gate_proj / up_proj / down_proj and a SiLU activation:
            down_proj(silu_mul(gate_proj(x), up_proj(x))), one kernel for silu(gate) * up and
            only gate and up kept for backward (the projections stay the model's, LoRA included)
  RoPE      the modeling module's `apply_rotary_pos_emb` (a module-level function every attention
            layer calls): q and k through hasten::rope, one kernel each instead of five
            elementwise ones. Shared by all models of that architecture in the process, so it is
            reference-counted and restored when the last patched model is undone.

A call that falls outside what a kernel covers (another dtype for weight and input, partial
rotary dims, another unsqueeze layout) runs the original code, counted once per reason.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from hasten.observability import record_fallback
from hasten.ops.dense import rms_norm, rope, silu_mul

_ROPE_PATCHES: dict[str, list] = {}  # modeling module name -> [original function, patched models]


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and hasattr(module, "variance_epsilon"))


def _is_swiglu_mlp(module: nn.Module, activation: str) -> bool:
    return (type(module).__name__.endswith("MLP") and activation in ("silu", "swish")
            and all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")))


def _restore_forwards(modules: list[nn.Module]):
    def undo() -> None:
        for module in modules:
            module.__dict__.pop("forward", None)
    return undo


def install_fused_rms_norm(model: nn.Module):
    """Returns (undo, number of modules patched)."""
    patched = [m for m in model.modules() if _is_rms_norm(m)]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            record_fallback("fused_rms_norm", f"input {hidden_states.dtype} and weight {self.weight.dtype} differ "
                            "(mixed precision without a bf16 model); transformers' RMSNorm runs")
            return type(self).forward(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    for module in patched:
        module.forward = types.MethodType(forward, module)
    return _restore_forwards(patched), len(patched)


def install_fused_mlp(model: nn.Module):
    """Returns (undo, number of modules patched)."""
    activation = str(getattr(model.config, "hidden_act", ""))
    patched = [m for m in model.modules() if _is_swiglu_mlp(m, activation)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    for module in patched:
        module.forward = types.MethodType(forward, module)
    return _restore_forwards(patched), len(patched)


def install_fused_rope(model: nn.Module):
    """Returns (undo, True) when the model's modeling module has `apply_rotary_pos_emb`."""
    name = type(model).__module__
    modeling = sys.modules.get(name)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if modeling is None or original is None:
        return (lambda: None), False
    if name not in _ROPE_PATCHES:
        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
            if (unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3 or cos.shape[-1] != q.shape[-1]
                    or q.shape[-1] % 2):
                record_fallback("fused_rope", "a rotary layout hasten::rope does not cover (partial rotary dims or "
                                "another unsqueeze_dim); transformers' rotary code runs")
                return original(q, k, cos, sin, *args, **kwargs)
            return rope(q, cos, sin), rope(k, cos, sin)

        _ROPE_PATCHES[name] = [original, set()]
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    _ROPE_PATCHES[name][1].add(id(model))

    def undo() -> None:
        entry = _ROPE_PATCHES.get(name)
        if entry is None:
            return
        entry[1].discard(id(model))
        if not entry[1]:
            modeling.apply_rotary_pos_emb = entry[0]
            del _ROPE_PATCHES[name]
    return undo, True
