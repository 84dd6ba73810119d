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
            reference-counted and restored when the last patched model is undone (or dropped).

Before a class is patched, its own forward is run on random inputs against what the kernel
computes (`rms_norm_mismatch`, `swiglu_mlp_mismatch`, `rope_mismatch`): a class that computes
anything else is left alone, with the reason. A call that falls outside what a kernel covers (another dtype for weight and input, partial
rotary dims, another unsqueeze layout) runs the original code, counted once per reason.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from hasten.observability import record_fallback
from hasten.ops.dense import rms_norm, rope, silu_mul

# modeling module name -> [original apply_rotary_pos_emb, the models patched with it (weak)]
_ROPE_PATCHES: dict[str, list] = {}


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and hasattr(module, "variance_epsilon"))


def _is_swiglu_mlp(module: nn.Module, activation: str) -> bool:
    return (type(module).__name__.endswith("MLP") and activation in ("silu", "swish")
            and all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# The contract checks: each piece's own forward, run on random inputs, against what hasten's kernel
# (or the exact formula it fuses) computes. A structural difference (weight + 1, a centred norm, a
# GELU gate, interleaved rotary halves) shows as an O(1) error; the same computation as 0 or
# float32 rounding.
_FP32_TOLERANCE = 1e-5


def rms_norm_mismatch(module: nn.Module) -> str | None:
    """None when type(module).forward computes hasten::rms_norm (checked on a float32 CPU copy)."""
    try:
        if module.weight.device.type == "meta":
            probe = copy.deepcopy(module).to_empty(device="cpu").float()
        else:
            probe = copy.deepcopy(module).to("cpu", torch.float32)
        gen = torch.Generator().manual_seed(0)
        hidden = probe.weight.shape[0]
        with torch.no_grad():
            probe.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))
            # rows of small, unit and large magnitude: eps shows in the first
            x = torch.randn(3, 4, hidden, generator=gen) * torch.tensor([1e-3, 1.0, 30.0]).view(3, 1, 1)
            want = type(probe).forward(probe, x)
            got = rms_norm(x, probe.weight, probe.variance_epsilon)
    except Exception as exc:  # a forward that cannot run on a copy cannot be vouched for
        return f"{type(module).__name__} could not be checked ({type(exc).__name__}: {exc})"
    error = _relative_error(got, want)
    if not error <= _FP32_TOLERANCE:
        return (f"{type(module).__name__} computes something other than x * rsqrt(mean(x^2) + eps) * weight "
                f"(relative difference {error:.1e} on random inputs)")
    return None


@contextlib.contextmanager
def _eval_mode(module: nn.Module):
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def swiglu_mlp_mismatch(module: nn.Module) -> str | None:
    """None when type(module).forward is down_proj(silu(gate_proj(x)) * up_proj(x)) exactly.

    Checked in place (the module's own weights, device and dtype, dropout off) on three random
    tokens; a dropout inside the MLP stops it, since the fused forward applies none."""
    name = type(module).__name__
    for child in module.modules():
        if isinstance(child, nn.Dropout) and child.p > 0:
            return f"{name} applies dropout (p={child.p}) inside the MLP"
    weight = getattr(module.gate_proj, "weight", None)
    in_features = getattr(module.gate_proj, "in_features", None)
    if not isinstance(weight, torch.Tensor) or in_features is None:
        return f"{name}.gate_proj is not a linear layer hasten can feed"
    if weight.device.type == "meta":
        return f"{name}'s weights are on the meta device, so its forward cannot be checked"
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(3, in_features, generator=gen, device=weight.device).to(weight.dtype)
    try:
        with torch.no_grad(), _eval_mode(module):
            want = type(module).forward(module, x)
            got = module.down_proj(F.silu(module.gate_proj(x)) * module.up_proj(x))
    except Exception as exc:
        return f"{name} could not be checked ({type(exc).__name__}: {exc})"
    error = _relative_error(got, want)
    if not error <= _FP32_TOLERANCE:
        return f"{name} computes something other than down_proj(silu(gate_proj(x)) * up_proj(x)) " \
               f"(relative difference {error:.1e} on random inputs)"
    return None


def rope_mismatch(original, head_dim: int) -> str | None:
    """None when `original(q, k, cos, sin)` is hasten::rope on q and k (float32, CPU, random angles)."""
    head_dim = max(2, head_dim - head_dim % 2)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, head_dim, generator=gen)
    k = torch.randn(2, 2, 5, head_dim, generator=gen)
    angles = 3 * torch.randn(2, 5, head_dim // 2, generator=gen)
    emb = torch.cat([angles, angles], dim=-1)  # how transformers' rotary embeddings lay out cos and sin
    cos, sin = emb.cos(), emb.sin()
    try:
        with torch.no_grad():
            want_q, want_k = original(q, k, cos, sin)
            got_q, got_k = rope(q, cos, sin), rope(k, cos, sin)
    except Exception as exc:
        return f"its apply_rotary_pos_emb could not be checked ({type(exc).__name__}: {exc})"
    error = max(_relative_error(got_q, want_q), _relative_error(got_k, want_k))
    if not error <= _FP32_TOLERANCE:
        return ("its apply_rotary_pos_emb computes something other than x * cos + rotate_half(x) * sin "
                f"(relative difference {error:.1e} on random angles; interleaved or partial rotary?)")
    return None


def _restore_forwards(modules: list[nn.Module]):
    def undo() -> None:
        for module in modules:
            module.__dict__.pop("forward", None)
    return undo


def _checked_by_class(candidates: list[nn.Module], check) -> tuple[list[nn.Module], list[str]]:
    """The candidates whose class passes `check` (run once per class), and the reasons of the others."""
    verdicts: dict[type, str | None] = {}
    for module in candidates:
        if type(module) not in verdicts:
            verdicts[type(module)] = check(module)
    passed = [m for m in candidates if verdicts[type(m)] is None]
    return passed, sorted({reason for reason in verdicts.values() if reason is not None})


def install_fused_rms_norm(model: nn.Module):
    """Returns (undo, number of modules patched, reasons other RMSNorm classes were left alone)."""
    patched, refused = _checked_by_class([m for m in model.modules() if _is_rms_norm(m)], rms_norm_mismatch)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype != self.weight.dtype:
            record_fallback("fused_rms_norm", f"input {hidden_states.dtype} and weight {self.weight.dtype} differ "
                            "(mixed precision without a bf16 model); transformers' RMSNorm runs")
            return type(self).forward(self, hidden_states)
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    for module in patched:
        module.forward = types.MethodType(forward, module)
    return _restore_forwards(patched), len(patched), refused


def install_fused_mlp(model: nn.Module):
    """Returns (undo, number of modules patched, reasons other MLP classes were left alone)."""
    activation = str(getattr(model.config, "hidden_act", ""))
    patched, refused = _checked_by_class([m for m in model.modules() if _is_swiglu_mlp(m, activation)],
                                         swiglu_mlp_mismatch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    for module in patched:
        module.forward = types.MethodType(forward, module)
    return _restore_forwards(patched), len(patched), refused


def _head_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(getattr(config, "hidden_size", 64) // max(1, getattr(config, "num_attention_heads", 1)))


def install_fused_rope(model: nn.Module):
    """Returns (undo, None) when the modeling module's `apply_rotary_pos_emb` was replaced, else
    (no-op, the reason). Shared by every model of that modeling module in the process: restored
    when the last patched model is undone or garbage-collected."""
    name = type(model).__module__
    modeling = sys.modules.get(name)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if modeling is None or original is None:
        return (lambda: None), f"{name} has no apply_rotary_pos_emb to replace"
    if name not in _ROPE_PATCHES:
        mismatch = rope_mismatch(original, _head_dim(model.config))
        if mismatch is not None:
            return (lambda: None), mismatch

        def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
            unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
            if (len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or unsqueeze_dim != 1 or q.dim() != 4
                    or cos.dim() != 3 or cos.shape[-1] != q.shape[-1] or q.shape[-1] % 2):
                record_fallback("fused_rope", "a rotary layout hasten::rope does not cover (partial rotary dims, "
                                "another unsqueeze_dim or extra arguments); transformers' rotary code runs")
                return original(q, k, cos, sin, *args, **kwargs)
            return rope(q, cos, sin), rope(k, cos, sin)

        _ROPE_PATCHES[name] = [original, weakref.WeakSet()]
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    _ROPE_PATCHES[name][1].add(model)

    def release(model_ref=None) -> None:
        entry = _ROPE_PATCHES.get(name)
        if entry is None:
            return
        if model_ref is not None and (m := model_ref()) is not None:
            entry[1].discard(m)
        if not list(entry[1]):  # iterating yields live models only (a dying one may not be removed yet)
            modeling.apply_rotary_pos_emb = entry[0]
            del _ROPE_PATCHES[name]

    model_ref = weakref.ref(model)
    finalizer = weakref.finalize(model, release)  # a patched model that is dropped without undo()

    def undo() -> None:
        finalizer.detach()
        release(model_ref)
    return undo, None
