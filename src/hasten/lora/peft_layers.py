"""PEFT's `lora.Linear` layers on hasten::lora_linear.

What PEFT's vanilla LoRA layer computes (peft/tuners/lora/layer.py, `Linear.forward`), for one
active adapter: result = base_layer(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling, cast
back to the base output's dtype. hasten::lora_linear computes the same with the base GEMM and the
update in one op. A layer is taken only when that is all it does:
  - exactly PEFT's `lora.Linear` over a plain `nn.Linear` base (not a tensor-parallel base, not
    GPT-2's transposed Conv1D: fan_in_fan_out), or PEFT's 4-bit `lora.bnb.Linear4bit` over
    bitsandbytes' Linear4bit computing in bf16/fp16 (QLoRA: NF4 or FP4, the weight dequantized
    for each GEMM and never kept), the base weight and bias frozen;
  - every adapter vanilla: no DoRA or other variant, no bias on lora_B, dropout an nn.Dropout or
    Identity;
and each call takes hasten's path only while it still holds: one active adapter, adapters on and
not merged, no extra arguments (adapter_names for mixed batches), x in the base weight's dtype,
no autocast. Otherwise the layer runs PEFT's own forward for that call (a setting change, not an
error). A probe checks the formula against PEFT's forward at install, on the first layer of each
PEFT class (random lora_B for the probe, since PEFT initialises it to zero), so a PEFT release that
changes the formula turns hasten's path off instead of training something else.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn

from hasten.instance_forward import HOOKED_REASON, has_call_hooks, hooked, replace_forward, restore_forward
from hasten.moe.spec import ROUTER_NAMES
from hasten.observability import record_fallback
from hasten.ops.lora import lora_gated_group, lora_linear, lora_linear_group, lora_linear_quantized
from hasten.shared_input import SHARED_INPUT_NAMES, WaitingOutputs


# PEFT's LoRA layer classes hasten computes, by (module, name): over a plain nn.Linear, and over
# bitsandbytes' 4-bit Linear (QLoRA: PEFT picks its bnb class for a model loaded in 4 bits)
_PEFT_LINEAR = ("peft.tuners.lora.layer", "Linear")
_PEFT_LINEAR_4BIT = ("peft.tuners.lora.bnb", "Linear4bit")


def _kind(module: nn.Module) -> tuple[str, str]:
    return type(module).__module__, type(module).__name__


def lora_layers(model: nn.Module) -> list[nn.Module]:
    """PEFT's LoRA Linear layers of `model`, plain and 4-bit (without importing PEFT)."""
    return [m for m in model.modules() if _kind(m) in (_PEFT_LINEAR, _PEFT_LINEAR_4BIT)]


def _is_bnb_4bit(base: nn.Module) -> bool:
    return type(base).__name__ == "Linear4bit" and type(base).__module__.startswith("bitsandbytes")


def _quant_state(base: nn.Module):
    """A 4-bit base's bitsandbytes QuantState. It lives on the weight (a Params4bit) and, as
    bitsandbytes keeps it, on the module too: FSDP2 gathers a sharded Params4bit into a plain
    Parameter holding the packed bytes (`bnb_4bit_quant_storage` = the training dtype), without
    the state, so the module's copy is the one that survives."""
    state = getattr(base.weight, "quant_state", None)
    return state if state is not None else getattr(base, "quant_state", None)


def _compute_dtype(base: nn.Module) -> torch.dtype:
    """The dtype the base layer computes in: its weight's, or a 4-bit layer's compute_dtype."""
    return base.compute_dtype if _is_bnb_4bit(base) else base.weight.dtype


def unsupported_reason(module: nn.Module) -> str | None:
    """Why hasten's op cannot compute this LoRA layer (None: it can)."""
    base = module.get_base_layer()
    if _kind(module) == _PEFT_LINEAR_4BIT:
        if not _is_bnb_4bit(base) or _quant_state(base) is None:
            return f"its base layer is {type(base).__name__} without a 4-bit quantization state"
        if base.compute_dtype not in (torch.bfloat16, torch.float16):
            return (f"its 4-bit base computes in {base.compute_dtype} (bnb_4bit_compute_dtype); hasten's quantized "
                    "path takes bfloat16 or float16")
    elif type(base) is not nn.Linear:
        return (f"its base layer is {type(base).__name__}, not a plain nn.Linear (or, under PEFT's 4-bit LoRA layer, "
                "a bitsandbytes Linear4bit)")
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out (a transposed Conv1D base)"
    if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
        return "its base weight or bias trains (hasten's op is for a frozen base)"
    for adapter in module.lora_A:
        if adapter in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(adapter, False):
            return f"adapter '{adapter}' is a LoRA variant (DoRA or another)"
        lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
        if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None:
            return f"adapter '{adapter}' is not a pair of bias-free nn.Linear"
        if lora_b.bias is not None:
            return f"adapter '{adapter}' has a bias on lora_B (lora_bias)"
        if type(module.lora_dropout[adapter]) not in (nn.Dropout, nn.Identity):
            return f"adapter '{adapter}' has a dropout of type {type(module.lora_dropout[adapter]).__name__}"
    return None


def _fused_adapter(module: nn.Module, x: torch.Tensor, args, kwargs) -> str | None:
    """The adapter hasten computes for this call, or None when PEFT's own forward must run it."""
    if args or kwargs or module.disable_adapters or module.merged:
        return None
    active = module.active_adapters
    if len(active) != 1 or active[0] not in module.lora_A:
        return None
    base = module.get_base_layer()
    if x.dtype != _compute_dtype(base) or torch.is_autocast_enabled(x.device.type):
        return None
    # bitsandbytes repacks a 4-bit weight for its CPU inference kernel (in eval mode on AVX512-BF16
    # CPUs): that layout is not what dequantize_4bit reads, so such a layer stays bitsandbytes'
    if _is_bnb_4bit(base) and getattr(_quant_state(base), "packing_format_for_cpu", False):
        return None
    return active[0]


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapter = _fused_adapter(self, x, args, kwargs)
    if adapter is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.get_base_layer()
    dropout = self.lora_dropout[adapter]
    x_lora = dropout(x) if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0 else None
    lora_a, lora_b, scale = self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.scaling[adapter]
    if _is_bnb_4bit(base):  # QLoRA: the weight dequantized for each GEMM, as bitsandbytes' own matmul does
        bias = None if base.bias is None else base.bias.to(x.dtype)
        return lora_linear_quantized(x, _dequantizer(base, x.dtype), bias, lora_a, lora_b, scale, x_lora=x_lora)
    return lora_linear(x, base.weight, base.bias, lora_a, lora_b, scale, x_lora=x_lora)


def _dequantizer(base: nn.Module, dtype: torch.dtype):
    """A function that returns the 4-bit base's weight (out, in) in `dtype` (bitsandbytes'
    dequantize_4bit: NF4 or FP4, nested statistics included). It reads `base.weight` when called
    (in forward and again in backward): under FSDP2 that is the gathered parameter of the moment."""
    import bitsandbytes.functional as bnb_functional

    def dequantize() -> torch.Tensor:
        return bnb_functional.dequantize_4bit(base.weight.data, _quant_state(base)).to(dtype)

    return dequantize


# --- projections one module feeds the same tensor: hasten::lora_linear_group ----------------------

class SharedInputGroup(WaitingOutputs):
    """LoRA projections (over plain frozen bases) of one parent module, computed together.

    The first member called with x computes every member's output in one hasten::lora_linear_group
    and keeps the others' until they are called with the same tensor x (hasten/shared_input.py)."""

    def __init__(self, members: list[nn.Module], names: list[str]):
        super().__init__(names, "lora_group_off")
        self.members = members

    def adapter(self, x: torch.Tensor, args, kwargs) -> str | None:
        """The adapter the group computes for this call, or None when a member must run alone."""
        if self.off or torch.compiler.is_compiling():  # compiled: no state kept between calls
            return None
        adapters = {_fused_adapter(m, x, args, kwargs) for m in self.members}
        if len(adapters) != 1 or (adapter := adapters.pop()) is None:
            return None
        for m in self.members:
            dropout = m.lora_dropout[adapter]
            if isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0:
                return None  # each projection draws its own dropout mask: one by one
        first = self.members[0]
        if any(m.lora_A[adapter].weight.dtype != first.lora_A[adapter].weight.dtype or
               m.lora_B[adapter].weight.dtype != first.lora_B[adapter].weight.dtype for m in self.members):
            return None
        return adapter

    def compute(self, index: int, x: torch.Tensor, adapter: str) -> torch.Tensor:
        bases = [m.get_base_layer() for m in self.members]
        biased = bases[0].bias is not None  # on every member or on none (shared_input_groups)
        ys = lora_linear_group(x, [b.weight for b in bases], [b.bias for b in bases] if biased else [],
                               [m.lora_A[adapter].weight for m in self.members],
                               [m.lora_B[adapter].weight for m in self.members],
                               [m.scaling[adapter] for m in self.members])
        return self.keep(index, x, ys)


def _grouped_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    group, index = self._hasten_lora_group
    waiting = group.take(index, x)
    if waiting is not None:
        return waiting
    adapter = group.adapter(x, args, kwargs)
    if adapter is None:
        return _forward(self, x, *args, **kwargs)
    return group.compute(index, x, adapter)


# Experimental, off by default: HASTEN_LORA_GATED=1 runs each gated MLP's gate/up LoRA group and its
# activation as one hasten::lora_gated_group, whose CUDA backward forms the activation's gradient and
# both members' thin products in one pass. On the H200 that pass is slower than what it replaces
# (8f75139: 922 us a layer at W4's shape against 541 us for the SwiGLU kernel plus 333 us for the
# two thin passes; W4 17,701 against 17,833 tokens/s with the first version), until the kernel
# reaches the memory's rate (docs/design.md, LoRA).


def gated_group_act(gate_proj: nn.Module, up_proj: nn.Module, x: torch.Tensor, activation: str) -> torch.Tensor | None:
    """f(gate_proj(x)) * up_proj(x) as one hasten::lora_gated_group (f: "silu" or "gelu_tanh"), when
    HASTEN_LORA_GATED=1 is set and gate_proj and up_proj are, in this order, the two members of one
    SharedInputGroup that computes this call and neither has hooks; None otherwise (the caller calls
    the projections and the activation one by one). The same kernels as that path, with one
    backward: on CUDA the activation's gradient and both members' thin products in one pass."""
    entry = gate_proj.__dict__.get("_hasten_lora_group")
    if entry is None or os.environ.get("HASTEN_LORA_GATED") != "1":
        return None
    group, index = entry
    if index != 0 or len(group.members) != 2 or group.members[1] is not up_proj or group.waiting_for is not None:
        return None
    if has_call_hooks(gate_proj) or has_call_hooks(up_proj):
        record_fallback("lora_gated_hooked", "HASTEN_LORA_GATED=1, but a gate or up projection has forward hooks, "
                        "which one op for the pair would skip: that MLP calls them one by one")
        return None
    adapter = group.adapter(x, (), {})
    if adapter is None:
        return None
    bases = [m.get_base_layer() for m in group.members]
    biased = bases[0].bias is not None  # on both members or on neither (shared_input_groups)
    return lora_gated_group(x, [b.weight for b in bases], [b.bias for b in bases] if biased else [],
                            [m.lora_A[adapter].weight for m in group.members],
                            [m.lora_B[adapter].weight for m in group.members],
                            [m.scaling[adapter] for m in group.members], activation)


def shared_input_groups(model: nn.Module, patched: list[nn.Module]) -> list[SharedInputGroup]:
    """The groups of `patched` layers (plain bases only) that SHARED_INPUT_NAMES nominates: siblings
    under one parent, at least two, with one input size."""
    eligible = {id(m) for m in patched if not _is_bnb_4bit(m.get_base_layer())}
    groups = []
    for parent_name, parent in model.named_modules():
        for names in SHARED_INPUT_NAMES:
            # direct children only: PEFT's wrappers forward getattr to the model they wrap
            members = [(n, parent._modules.get(n)) for n in names]
            members = [(n, m) for n, m in members if m is not None and id(m) in eligible]
            bases = [m.get_base_layer() for _, m in members]
            one_input_size = len({b.in_features for b in bases}) == 1
            biases_alike = len({b.bias is None for b in bases}) == 1
            if len(members) < 2 or not (one_input_size and biases_alike):
                continue  # one input size; a bias on every member or on none
            prefix = f"{parent_name}." if parent_name else ""
            groups.append(SharedInputGroup([m for _, m in members], [prefix + n for n, _ in members]))
    return groups


@torch.no_grad()
def formula_mismatch(module: nn.Module) -> str | None:
    """Run PEFT's forward and hasten's on one random input, with a random lora_B for the probe
    (restored after) and the adapter's dropout in eval mode (the base layer keeps its mode:
    bitsandbytes repacks a 4-bit weight for CPU inference in eval mode). None when they agree."""
    adapter = module.active_adapters[0] if module.active_adapters else next(iter(module.lora_A))
    base, lora_b = module.get_base_layer(), module.lora_B[adapter].weight
    dropout = module.lora_dropout[adapter]
    saved_b, was_training = lora_b.detach().clone(), dropout.training
    dtype = _compute_dtype(base)
    x = torch.randn(3, base.in_features, device=lora_b.device, dtype=dtype,
                    generator=torch.Generator(device=lora_b.device).manual_seed(0))
    try:
        dropout.eval()
        lora_b.normal_(std=1.0 / max(1, lora_b.shape[1]) ** 0.5,
                       generator=torch.Generator(device=lora_b.device).manual_seed(1))
        want = type(module).forward(module, x).float()
        got = _forward(module, x).float()
    finally:
        lora_b.copy_(saved_b)
        dropout.train(was_training)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    error = float((got - want).norm() / want.norm().clamp_min(1e-12))
    if not error <= tolerance:
        return (f"PEFT {type(module).__module__}.Linear computed something else than hasten's LoRA formula on a probe "
                f"(relative difference {error:.2e}); this PEFT release is not fused")
    return None


ROUTER_ADAPTER_REASON = (
    "the model's MoE routers carry LoRA adapters (target_modules reaches them, as 'all-linear' does "
    "where a router is a Linear): hasten's fused projections compute the low-rank update in bf16 "
    "where PEFT computes it in float32, and on the GPU that moved the router adapters' gradients "
    "5-8x past bf16 noise (DeepSeek-V2, GLM-4-MoE, GLM-4V-MoE: top-k routing amplifies small changes "
    "of its input; within noise with kernels.fused_lora false). Leave the routers out of "
    "target_modules to have the projections fused")


def router_adapters(model: nn.Module) -> list[str]:
    """Names of PEFT LoRA layers (any class: Linear, ParamWrapper) that sit on an MoE router: a
    child named in ROUTER_NAMES of a module with an `experts` child (transformers' MoE blocks), or
    inside it."""
    found = []
    for block_name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        for name, child in block.named_children():
            if child is experts or name not in ROUTER_NAMES:
                continue
            found += [f"{block_name}.{name}{'.' + sub if sub else ''}" for sub, m in child.named_modules()
                      if isinstance(getattr(m, "lora_A", None), nn.ModuleDict)]
    return found


def install_fused_lora(model: nn.Module, groups: bool = True):
    """Patch every qualifying PEFT LoRA Linear layer of `model`; with `groups`, the projections one
    module feeds the same input run as SharedInputGroups. None where MoE routers carry adapters
    (ROUTER_ADAPTER_REASON). Returns (undo, number patched, number in groups, reasons others were
    left to PEFT)."""
    layers = lora_layers(model)
    routers = router_adapters(model)
    reasons: dict[str, int] = {}
    patched = []
    for module in layers:
        reason = HOOKED_REASON if hooked(module) else ROUTER_ADAPTER_REASON if routers else unsupported_reason(module)
        if reason is None:
            patched.append(module)
        else:
            reasons[reason] = reasons.get(reason, 0) + 1
    for kind in {_kind(m) for m in patched}:  # each PEFT class against its own forward
        first = next(m for m in patched if _kind(m) == kind)
        if (mismatch := formula_mismatch(first)) is not None:
            dropped = [m for m in patched if _kind(m) == kind]
            reasons[mismatch] = len(dropped)
            patched = [m for m in patched if _kind(m) != kind]
    for module in patched:
        replace_forward(module, types.MethodType(_forward, module))
    grouped = []
    for group in shared_input_groups(model, patched) if groups else []:
        for index, module in enumerate(group.members):
            module._hasten_lora_group = (group, index)  # per-model state on the module, dropped by undo
            restore_forward(module)  # its ungrouped _forward, set above, gives way to the grouped one
            replace_forward(module, types.MethodType(_grouped_forward, module))
            grouped.append(module)
    if reasons:
        record_fallback("lora_not_fused", "; ".join(f"{count} LoRA layers: {why}" for why, count in reasons.items())
                        + "; PEFT's own forward runs them")

    def undo() -> None:
        for module in patched:
            restore_forward(module)
            module.__dict__.pop("_hasten_lora_group", None)

    return undo, len(patched), len(grouped), [f"{count} LoRA layers: {why}" for why, count in reasons.items()]
