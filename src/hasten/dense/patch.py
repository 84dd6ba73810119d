"""Swap a transformers model's norms, gated MLP and rotary embedding for hasten's kernels, as its
model-table entry (dense/spec.py) declares them.

  norms   modules whose class name ends in the spec's suffix with a 1-D weight: RMSNorm through
          hasten::rms_norm (weight + offset: Gemma's `1 + weight`), a bias-free LayerNorm through
          torch's fused layer_norm (Cohere); replaced on the instance
  MLP     down_proj(act(gate) * up): silu (hasten::silu_mul) or tanh GELU (hasten::gelu_tanh_mul)
          on gate_proj / up_proj, or silu on one gate_up_proj's [gate | up] (hasten::swiglu); only
          gate and up kept for backward (the projections stay the model's, LoRA included)
  RoPE    the modeling module's `apply_rotary_pos_emb` (a module-level function every attention
          layer calls): q and k through hasten::rope, halves or interleaved pairs, partial rotary
          passing the rest of the head through. Shared by all models of that module in the
          process, so it is reference-counted and restored when the last patched model is undone
          (or dropped).

Before a class is patched, its own forward is run on random inputs against what the kernel
computes (`rms_norm_mismatch`, `gated_mlp_mismatch`, `rope_mismatch`): a class that computes
anything else is left alone, with the reason, whatever the table says. A call that falls outside
what a kernel covers (another dtype for weight and input, another unsqueeze layout) runs the
original code, counted once per reason.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from hasten.dense.residual import NORM_SPEC_ATTRIBUTE
from hasten.dense.spec import MlpSpec, NormSpec, RotarySpec
from hasten.instance_forward import replace_forward, restore_forward, without_hooked
from hasten.lora.peft_layers import gated_group_act
from hasten.observability import record_fallback
from hasten.ops.dense import gelu_tanh_mul, rms_norm, rope, silu_mul
from hasten.ops.moe import swiglu

# modeling module name -> [original apply_rotary_pos_emb, the models patched with it (weak)]
_ROPE_PATCHES: dict[str, list] = {}
# modeling modules whose last patched model was garbage-collected without undo(): restored at the
# next install or undo, never from the collector itself (see install_fused_rope)
_DROPPED_ROPE_PATCHES: set[str] = set()

# Set on hasten's apply_rotary_pos_emb replacement (two-tensor form): its kernel_angles, what a
# fused head norm + rotary call (dense/qk_norm_rope.py) reads to rotate as that function would.
KERNEL_ANGLES_ATTRIBUTE = "_hasten_kernel_angles"

_LLAMA_NORM = NormSpec()
_SWIGLU = MlpSpec()
_HALVES = RotarySpec()


def _is_norm(module: nn.Module, spec: NormSpec) -> bool:
    spec = _own_eps_name(module, spec)
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith(spec.class_suffix) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and isinstance(getattr(module, spec.eps_attribute, None), float)
            and getattr(module, "bias", None) is None)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# The contract checks: each piece's own forward, run on random inputs, against what hasten's kernel
# (or the exact formula it fuses) computes. A structural difference (weight + 1, a centred norm, a
# GELU gate, interleaved rotary halves) shows as an O(1) error; the same computation as 0 or
# float32 rounding.
_FP32_TOLERANCE = 1e-5


def _norm_formula(spec: NormSpec) -> str:
    weight = "(weight + 1)" if spec.weight_offset == 1.0 else "weight"
    if spec.kind == "layer":
        return f"(x - mean(x)) * rsqrt(var(x) + eps) * {weight}"
    return f"x * rsqrt(mean(x^2) + eps) * {weight}"


def _fused_norm(module: nn.Module, x: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """What the patched norm computes (the kernel's formula, spec's layout; spec.eps_attribute the
    module's own name for its epsilon, _own_eps_name)."""
    eps = getattr(module, spec.eps_attribute)
    if spec.kind == "layer":  # torch's one-kernel LayerNorm, float32 as the models compute it
        return F.layer_norm(x.float(), x.shape[-1:], module.weight.float() + spec.weight_offset, None,
                            eps).to(x.dtype)
    return rms_norm(x, module.weight, eps, spec.weight_offset)


def rms_norm_mismatch(module: nn.Module, spec: NormSpec = _LLAMA_NORM) -> str | None:
    """None when type(module).forward computes what the patched norm computes (checked on a
    float32 CPU copy)."""
    try:
        if module.weight.device.type == "meta":
            probe = copy.deepcopy(module).to_empty(device="cpu").float()
        else:
            probe = copy.deepcopy(module).to("cpu", torch.float32)
        gen = torch.Generator().manual_seed(0)
        hidden = probe.weight.shape[0]
        with torch.no_grad():
            probe.weight.copy_(1 + 0.5 * torch.randn(hidden, generator=gen))
            # rows of small, unit and large magnitude, off-centre (a centred norm shows): eps shows in the first
            x = torch.randn(3, 4, hidden, generator=gen) * torch.tensor([1e-3, 1.0, 30.0]).view(3, 1, 1) + 0.5
            want = type(probe).forward(probe, x)
            got = _fused_norm(probe, x, _own_eps_name(probe, spec))
    except Exception as exc:  # a forward that cannot run on a copy cannot be vouched for
        return f"{type(module).__name__} could not be checked ({type(exc).__name__}: {exc})"
    error = _relative_error(got, want)
    if not error <= _FP32_TOLERANCE:
        return (f"{type(module).__name__} computes something other than {_norm_formula(spec)} "
                f"(relative difference {error:.1e} on random inputs)")
    return None


@contextlib.contextmanager
def _eval_mode(module: nn.Module):
    """Dropout and other train-only behaviour off for a check. bitsandbytes' layers keep their mode:
    in eval mode on the CPU it repacks a 4-bit weight for its inference kernel (in place)."""
    modes = [(m, m.training) for m in module.modules()]
    for m, _ in modes:
        if not type(m).__module__.startswith("bitsandbytes"):
            m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


_GATES = {"swiglu": ("silu", F.silu), "geglu_tanh": ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))}


def _is_gated_mlp(module: nn.Module, spec: MlpSpec) -> bool:
    projections = ("gate_up_proj", "down_proj") if spec.fused_gate_up else spec.projections
    return (spec.kind in _GATES and type(module).__name__.endswith("MLP")
            and all(isinstance(getattr(module, name, None), nn.Module) for name in projections))


def _gated_formula(module: nn.Module, x: torch.Tensor, spec: MlpSpec) -> torch.Tensor:
    """down(act(gate) * up) in plain PyTorch, from the module's projections."""
    act = _GATES[spec.kind][1]
    if spec.fused_gate_up:
        gate, up = module.gate_up_proj(x).chunk(2, dim=-1)
        return module.down_proj(act(gate) * up)
    gate_proj, up_proj, down_proj = (getattr(module, name) for name in spec.projections)
    return down_proj(act(gate_proj(x)) * up_proj(x))


def _input_dtype(projection: nn.Module) -> torch.dtype | None:
    """The dtype a linear layer takes its input in: its weight's, or, for a quantized base whose
    weight is packed integers (bitsandbytes' 4-bit Linear4bit, under PEFT's LoRA layer or not), the
    floating compute dtype it names; None when it names none."""
    base = projection.get_base_layer() if hasattr(projection, "get_base_layer") else projection
    if base.weight.is_floating_point():
        return base.weight.dtype
    compute = getattr(base, "compute_dtype", None)
    return compute if isinstance(compute, torch.dtype) and compute.is_floating_point else None


def gated_mlp_mismatch(module: nn.Module, spec: MlpSpec = _SWIGLU) -> str | None:
    """None when type(module).forward is down_proj(act(gate) * up) exactly, act and projections as
    the spec says.

    Checked in place (the module's own weights, device and dtype, dropout off) on three random
    tokens; a dropout inside the MLP stops it, since the fused forward applies none."""
    name = type(module).__name__
    for child in module.modules():
        if isinstance(child, nn.Dropout) and child.p > 0:
            return f"{name} applies dropout (p={child.p}) inside the MLP"
    first = module.gate_up_proj if spec.fused_gate_up else getattr(module, spec.projections[0])
    weight, in_features = getattr(first, "weight", None), getattr(first, "in_features", None)
    if not isinstance(weight, torch.Tensor) or in_features is None:
        return f"{name}'s input projection is not a linear layer hasten can feed"
    if weight.device.type == "meta":
        return f"{name}'s weights are on the meta device, so its forward cannot be checked"
    dtype = _input_dtype(first)
    if dtype is None:
        return (f"{name}'s input projection holds a {weight.dtype} weight and names no compute dtype, so its forward "
                "cannot be checked")
    gen = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(3, in_features, generator=gen, device=weight.device).to(dtype)
    try:
        with torch.no_grad(), _eval_mode(module):
            want = type(module).forward(module, x)
            got = _gated_formula(module, x, spec)
    except Exception as exc:
        return f"{name} could not be checked ({type(exc).__name__}: {exc})"
    error = _relative_error(got, want)
    if not error <= _FP32_TOLERANCE:
        gate = "gate_up_proj's [gate | up]" if spec.fused_gate_up else "gate_proj(x), up_proj(x)"
        return (f"{name} computes something other than down_proj({_GATES[spec.kind][0]}(gate) * up) on {gate} "
                f"(relative difference {error:.1e} on random inputs)")
    return None



def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _kernel_cos_sin(cos: torch.Tensor, sin: torch.Tensor, spec: RotarySpec):
    """cos/sin (B or 1, L, R) as the model passes them -> as the kernel reads them (per element):
    re-interleaved from their first half where the model does that itself (GLM, Helium, ERNIE).
    Once per call, shared by q and k."""
    if spec.cos_first_half:
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    if spec.half_width_cos:  # one value per frequency, for both halves
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return cos, sin


def _hasten_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RotarySpec,
                 unsqueeze_dim: int = 1) -> torch.Tensor:
    """hasten::rope on x (B, heads, L, D) for unsqueeze_dim 1, (B, L, heads, D) for 2 (Gemma 4, as a
    strided view); cos/sin already as `_kernel_cos_sin` returns them."""
    if unsqueeze_dim == 2:
        return rope(x.transpose(1, 2), cos, sin, interleaved=spec.interleaved).transpose(1, 2)
    return rope(x, cos, sin, interleaved=spec.interleaved)


def _rope_call(original, spec: RotarySpec, tensors: tuple, cos, sin, unsqueeze_dim: int):
    """original's own call: (q, k, cos, sin) or, single_tensor, (x, cos, sin)."""
    if spec.single_tensor:
        return (original(tensors[0], cos, sin, unsqueeze_dim=unsqueeze_dim),)
    return original(tensors[0], tensors[1], cos, sin, unsqueeze_dim=unsqueeze_dim)


def rope_mismatch(original, head_dim: int, spec: RotarySpec = _HALVES, rotary_dim: int | None = None) -> str | None:
    """None when `original` is hasten::rope on q and k (or one x) as the spec lays it out, for both
    layouts (unsqueeze_dim 1 and 2; float32, CPU, random cos and sin of the model's rotary width)."""
    head_dim = max(2, head_dim - head_dim % 2)
    width = rotary_dim or head_dim
    width = max(2, width - width % 2)
    gen = torch.Generator().manual_seed(0)
    # any cos and sin, not only rotary ones: the kernel reads them per element, as the model does;
    # as wide as the model passes them (half the rotary width where one value serves both halves)
    passed = width // 2 if spec.half_width_cos else width
    cos, sin = torch.randn(2, 5, passed, generator=gen), torch.randn(2, 5, passed, generator=gen)
    error = 0.0
    for unsqueeze_dim in (1, 2):
        heads_at = unsqueeze_dim  # (B, heads, L, D) or (B, L, heads, D)
        shapes = [[2, 5, head_dim], [2, 5, head_dim]]
        for shape, heads in zip(shapes, (3, 2)):
            shape.insert(heads_at, heads)
        tensors = tuple(torch.randn(*shape, generator=gen) for shape in shapes)
        try:
            with torch.no_grad():
                want = _rope_call(original, spec, tensors, cos, sin, unsqueeze_dim)
                kernel_cos, kernel_sin = _kernel_cos_sin(cos, sin, spec)
                got = [_hasten_rope(x, kernel_cos, kernel_sin, spec, unsqueeze_dim) for x in tensors[:len(want)]]
        except Exception as exc:
            return f"its apply_rotary_pos_emb could not be checked ({type(exc).__name__}: {exc})"
        error = max([error] + [_relative_error(g, w) for g, w in zip(got, want)])
    if not error <= _FP32_TOLERANCE:
        layout = "interleaved pairs" if spec.interleaved else "rotate_half"
        return (f"its apply_rotary_pos_emb computes something other than x * cos + rotate(x) * sin with {layout} "
                f"on the first {width} of {head_dim} features (relative difference {error:.1e} on random inputs)")
    return None


def _restore_forwards(modules: list[nn.Module], *attributes: str):
    """undo() for modules given an instance forward (and the instance `attributes`): each gets back
    the forward it had (instance_forward.py)."""
    def undo() -> None:
        for module in modules:
            restore_forward(module)
            for name in attributes:
                module.__dict__.pop(name, None)
    return undo


# instance attributes that number a module rather than configure it (one check serves every layer)
_BOOKKEEPING = ("layer_idx", "layer_id", "layer_number", "idx", "name")


def _configuration(module: nn.Module) -> tuple:
    """What can make two modules of one class compute differently: the class, the shapes of its own
    parameters and buffers, and its plain-valued attributes (eps, flags, sizes). A class may serve
    several roles (Qwen4-exp's RMSNorm also normalises grouped hyper-connection streams; a norm with
    a per-instance flag): each configuration is checked, not just the class's first module."""
    tensors = tuple((name, tuple(t.shape)) for name, t in [*module._parameters.items(), *module._buffers.items()]
                    if t is not None)
    plain = tuple(sorted((key, value) for key, value in vars(module).items()
                         if not key.startswith("_") and key != "training" and key not in _BOOKKEEPING
                         and isinstance(value, (bool, int, float, str, type(None)))))
    return type(module), tensors, plain


def _checked_by_class(candidates: list[nn.Module], check) -> tuple[list[nn.Module], list[str]]:
    """The candidates that pass `check` (run once per class and configuration: `_configuration`),
    and the reasons of the others."""
    keyed = [(_configuration(module), module) for module in candidates]
    verdicts: dict[tuple, str | None] = {}
    for key, module in keyed:
        if key not in verdicts:
            verdicts[key] = check(module)
    passed = [module for key, module in keyed if verdicts[key] is None]
    return passed, sorted({reason for reason in verdicts.values() if reason is not None})


# The names transformers' norm classes keep their epsilon under. Releases rename it (5.25: Llama 4's,
# Gemma 3n's and Gemma 4's RMSNorm went from `eps` to `variance_epsilon`); the number and its place
# in the formula stay, which rms_norm_mismatch checks on every class before it is patched.
_EPS_NAMES = ("variance_epsilon", "eps")


def _own_eps_name(module: nn.Module, spec: NormSpec) -> NormSpec:
    """`spec` with the epsilon name `module` uses, where the table's is not its (one class of a
    model may follow a rename and another not)."""
    if isinstance(getattr(module, spec.eps_attribute, None), float):
        return spec
    found = next((name for name in _EPS_NAMES if isinstance(getattr(module, name, None), float)), None)
    return spec if found is None else dataclasses.replace(spec, eps_attribute=found)


def install_fused_norms(model: nn.Module, spec: NormSpec = _LLAMA_NORM):
    """Returns (undo, number of modules patched, reasons other norm classes were left alone)."""
    if not spec.fused:
        return (lambda: None), 0, []
    candidates, hooked = without_hooked([m for m in model.modules() if _is_norm(m, spec)])
    patched, refused = _checked_by_class(candidates, lambda m: rms_norm_mismatch(m, spec))
    refused += hooked

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if spec.kind == "rms" and hidden_states.dtype != self.weight.dtype:
            record_fallback("fused_rms_norm", f"input {hidden_states.dtype} and weight {self.weight.dtype} differ "
                            "(mixed precision without a bf16 model); transformers' RMSNorm runs")
            return type(self).forward(self, hidden_states)
        return _fused_norm(self, hidden_states, self.__dict__[NORM_SPEC_ATTRIBUTE])  # the module's own eps name

    for module in patched:
        replace_forward(module, types.MethodType(forward, module))
        # what the fused residual add may compute for it, the epsilon under the module's own name
        setattr(module, NORM_SPEC_ATTRIBUTE, _own_eps_name(module, spec))
    return _restore_forwards(patched, NORM_SPEC_ATTRIBUTE), len(patched), refused



def _activation(config) -> str:
    return str(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "")


# config activations that are the spec's gate: anything else leaves the MLP to transformers
_ACTIVATIONS = {"swiglu": ("silu", "swish"), "geglu_tanh": ("gelu_pytorch_tanh", "gelu_tanh")}


def install_fused_mlp(model: nn.Module, spec: MlpSpec = _SWIGLU, config=None):
    """Returns (undo, number of modules patched, reasons other MLP classes were left alone)."""
    if spec.kind not in _GATES:
        return (lambda: None), 0, []
    candidates, hooked = without_hooked([m for m in model.modules() if _is_gated_mlp(m, spec)])
    if not candidates:  # e.g. an MoE model whose experts are all its MLPs (JetMoE, DBRX: no hidden_act either)
        return (lambda: None), 0, hooked
    activation = _activation(config if config is not None else model.config)
    if activation not in _ACTIVATIONS[spec.kind] and not spec.fixed_activation:
        return (lambda: None), 0, [f"the config's activation '{activation}' is not the table's "
                                   f"{_GATES[spec.kind][0]} gate"]
    patched, refused = _checked_by_class(candidates, lambda m: gated_mlp_mismatch(m, spec))
    refused += hooked
    if spec.fused_gate_up:
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate_up = self.gate_up_proj(x)  # (..., 2I): [gate | up]
            act = swiglu(gate_up.reshape(-1, gate_up.shape[-1]))  # (tokens, I)
            return self.down_proj(act.view(*gate_up.shape[:-1], act.shape[-1]))
    else:
        gated = silu_mul if spec.kind == "swiglu" else gelu_tanh_mul
        activation = "silu" if spec.kind == "swiglu" else "gelu_tanh"
        gate_name, up_name, down_name = spec.projections

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            gate_proj, up_proj = getattr(self, gate_name), getattr(self, up_name)
            # gate/up as one fused LoRA group with the activation (one backward pass), where they are
            # and HASTEN_LORA_GATED=1 asks for it (experimental)
            act = gated_group_act(gate_proj, up_proj, x, activation)
            if act is None:
                act = gated(gate_proj(x), up_proj(x))
            return getattr(self, down_name)(act)

    for module in patched:
        replace_forward(module, types.MethodType(forward, module))
    return _restore_forwards(patched), len(patched), refused


def _config_value(config, key: str, default=None):
    """config.key, or default where it is absent or a per-layer value (transformers >= 5.24 raises
    on the global read of an attribute that varies across layers, e.g. Gemma 4's head_dim)."""
    try:
        return getattr(config, key, default)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, whose module moves
        return default


def _head_dim(config) -> int:
    """The head size the rotary probe uses (the rotary function is the same for every size)."""
    head_dim = _config_value(config, "head_dim")
    if head_dim:
        return int(head_dim)
    heads = _config_value(config, "num_attention_heads", 1) or 1
    return int((_config_value(config, "hidden_size", 64) or 64) // max(1, heads))


def _rotary_dim(config, spec: RotarySpec) -> int:
    """The width cos and sin have: head_dim, or its `partial_rotary_factor` share."""
    head_dim = _head_dim(config)
    if not spec.partial:
        return head_dim
    factor = _config_value(config, "partial_rotary_factor")
    if factor is None:
        factor = (_config_value(config, "rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return int(head_dim * float(factor))


def install_fused_rope(model: nn.Module, spec: RotarySpec = _HALVES, config=None):
    """Returns (undo, None) when the modeling module's `apply_rotary_pos_emb` was replaced, else
    (no-op, the reason). Shared by every model of that modeling module in the process: restored
    when the last patched model is undone, or, for models dropped without undo(), at the next
    install or undo. Not from the garbage collector: a collection can run in the middle of another
    model's backward, and swapping the function between a checkpointed layer's forward and its
    recompute changes what the recompute saves (torch.utils.checkpoint raises on it)."""
    release_dropped_rope_patches()
    config = config if config is not None else model.config
    name = type(model).__module__
    modeling = sys.modules.get(name)
    original = getattr(modeling, "apply_rotary_pos_emb", None)
    if modeling is None or original is None:
        return (lambda: None), f"{name} has no apply_rotary_pos_emb to replace"
    if name not in _ROPE_PATCHES:
        mismatch = rope_mismatch(original, _head_dim(config), spec, _rotary_dim(config, spec))
        if mismatch is not None:
            return (lambda: None), mismatch

        def layout(x, cos, args, kwargs) -> int | None:
            """The unsqueeze_dim of a call hasten::rope computes, else None."""
            unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
            width = cos.shape[-1] // 2 * 2 if spec.cos_first_half else cos.shape[-1]
            if (len(args) > 1 or set(kwargs) - {"unsqueeze_dim"} or unsqueeze_dim not in (1, 2) or x.dim() != 4
                    or cos.dim() != 3 or width > x.shape[-1] or width % 2 or width == 0):
                return None
            return unsqueeze_dim

        def covered(x, cos, args, kwargs) -> int | None:
            """layout(...), counting a call that falls back."""
            if (unsqueeze_dim := layout(x, cos, args, kwargs)) is None:
                record_fallback("fused_rope", "a rotary layout hasten::rope does not cover (another unsqueeze_dim, "
                                "extra arguments, an odd or too wide rotary dim); transformers' rotary code runs")
            return unsqueeze_dim

        def kernel_angles(tensors, cos, sin, args, kwargs):
            """(cos, sin, interleaved) as hasten::rope takes them for the call
            apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs) where it would rotate each of
            `tensors` (B, heads, L, D) with them (unsqueeze_dim 1), else None; converted once for
            all of them, counting nothing (dense/qk_norm_rope.py)."""
            if any(layout(x, cos, args, kwargs) != 1 for x in tensors):
                return None
            return (*_kernel_cos_sin(cos, sin, spec), spec.interleaved)

        if spec.single_tensor:  # Gemma 4: apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)
            def apply_rotary_pos_emb(x, cos, sin, *args, **kwargs):
                if (unsqueeze_dim := covered(x, cos, args, kwargs)) is None:
                    return original(x, cos, sin, *args, **kwargs)
                return _hasten_rope(x, *_kernel_cos_sin(cos, sin, spec), spec, unsqueeze_dim)
        else:
            def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
                if (unsqueeze_dim := covered(q, cos, args, kwargs)) is None:
                    return original(q, k, cos, sin, *args, **kwargs)
                cos, sin = _kernel_cos_sin(cos, sin, spec)
                return _hasten_rope(q, cos, sin, spec, unsqueeze_dim), _hasten_rope(k, cos, sin, spec, unsqueeze_dim)

        if not spec.single_tensor:
            setattr(apply_rotary_pos_emb, KERNEL_ANGLES_ATTRIBUTE, kernel_angles)
        _ROPE_PATCHES[name] = [original, weakref.WeakSet()]
        modeling.apply_rotary_pos_emb = apply_rotary_pos_emb
    _ROPE_PATCHES[name][1].add(model)

    def release(model_ref) -> None:
        entry = _ROPE_PATCHES.get(name)
        if entry is None:
            return
        if (m := model_ref()) is not None:
            entry[1].discard(m)
        _restore_if_unused(name)

    model_ref = weakref.ref(model)
    # a patched model dropped without undo(): marked here, restored at the next install or undo
    finalizer = weakref.finalize(model, _DROPPED_ROPE_PATCHES.add, name)

    def undo() -> None:
        finalizer.detach()
        release(model_ref)
        release_dropped_rope_patches()
    return undo, None


def _restore_if_unused(name: str) -> None:
    entry = _ROPE_PATCHES.get(name)
    if entry is not None and not list(entry[1]):  # iterating yields live models only
        sys.modules[name].apply_rotary_pos_emb = entry[0]
        del _ROPE_PATCHES[name]


def release_dropped_rope_patches() -> None:
    """Restore the `apply_rotary_pos_emb` of modeling modules whose patched models were all
    garbage-collected without undo() (until then, other models of that module run hasten's
    kernel, which computes the same rotation up to float rounding)."""
    while _DROPPED_ROPE_PATCHES:
        _restore_if_unused(_DROPPED_ROPE_PATCHES.pop())
