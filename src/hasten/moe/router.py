"""MoE routers on hasten::moe_route: the model's own logits GEMM, then its scoring, top-k,
renormalisation and scaling in one kernel each way (`training.moe.fused_router`).

A model type's table entry says what its router computes (RouterSpec). accelerate() takes a
router only after checking that the class's own forward computes exactly that: both run on the
router's weights copied to float64 on the CPU (the recipe: ids equal, weights and gradients to
float32's rounding, as the models' own float32 steps round), then on the router's device in its
dtype (the dtypes, and the values to that dtype's rounding). Anything else (another recipe, a
LoRA adapter on the router, attributes missing) leaves the router to the model, said once and
counted. The router's attributes the recipe reads (top_k, norm_topk_prob, the scaling factor,
the groups) are read once, at accelerate().

Router forward (T tokens, E experts, k chosen): hidden (..., H) -> logits (T, E) as the model's
F.linear -> hasten::moe_route -> (logits, weights (T, k) in the model's dtype, ids (T, k) int64),
the tuple the class returns (the MoE block and the aux loss's recorder read the same places).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from hasten.instance_forward import HOOKED_REASON, hooked, replace_forward, restore_forward
from hasten.moe.spec import ROUTER_NAMES, RouterSpec
from hasten.observability import record_fallback
from hasten.ops import moe as moe_ops


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The routers of the MoE blocks of `model`, in module order."""
    found = []
    for block in model.modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        found += [child for name, child in block.named_children() if name in ROUTER_NAMES and child is not experts]
    return found


def _attribute(router: nn.Module, name: str):
    if not hasattr(router, name):
        raise AttributeError(f"{type(router).__name__} has no attribute {name}")
    return getattr(router, name)


def route_arguments(router: nn.Module, spec: RouterSpec) -> dict:
    """hasten::moe_route's arguments for this router under `spec`, from its attributes (raises
    AttributeError or ValueError where the router does not have what the spec reads)."""
    weight = _attribute(router, "weight")
    experts, top_k = int(weight.shape[0]), int(_attribute(router, "top_k"))
    renormalize = spec.renormalize if isinstance(spec.renormalize, bool) else bool(_attribute(router,
                                                                                             spec.renormalize))
    scale = float(_attribute(router, spec.scale_attribute)) if spec.scale_attribute else 1.0
    args = dict(top_k=top_k, scoring=spec.scoring, renormalize=renormalize, renorm_epsilon=spec.renorm_epsilon,
                scale=scale, num_groups=1, top_groups=1, group_score="max", masked_choice=0.0)
    if spec.groups == "deepseek_v2":
        method = _attribute(router, "topk_method")
        if method == "group_limited_greedy":
            args.update(num_groups=int(_attribute(router, "num_group")), top_groups=int(_attribute(router,
                                                                                                   "topk_group")))
        elif method != "greedy":
            raise ValueError(f"topk_method {method!r} (the model's forward takes greedy or group_limited_greedy)")
    elif spec.groups == "deepseek_v3":
        args.update(num_groups=int(_attribute(router, "num_group")), top_groups=int(_attribute(router, "topk_group")),
                    group_score="top2_sum", masked_choice=-math.inf)
    if args["num_groups"] > 1 and experts // args["num_groups"] < (2 if spec.groups == "deepseek_v3" else 1):
        raise ValueError(f"groups of {experts // args['num_groups']} experts")
    return args


def _logits(router: nn.Module, spec: RouterSpec, hidden: torch.Tensor) -> torch.Tensor:
    if spec.logits == "float32":
        return F.linear(hidden.type(torch.float32), router.weight.type(torch.float32))
    if spec.logits == "input_bias":
        return F.linear(hidden, router.weight, router.bias)
    return F.linear(hidden, router.weight)


def fused_router_forward(router: nn.Module, hidden_states: torch.Tensor):
    """The router's forward on hasten::moe_route: (logits (T, E), weights (T, k), ids (T, k))."""
    spec: RouterSpec = router._hasten_router_spec
    args = router._hasten_route_arguments
    if torch.is_autocast_enabled(hidden_states.device.type):
        # autocast recasts the model's own ops (its float32 linear, a softmax with a dtype): which
        # it does is the model's business; hasten's recipe was checked without autocast
        record_fallback("moe_router_autocast", f"{type(router).__name__} runs its own forward under autocast; "
                        "hasten's fused router was checked without it")
        return type(router).forward(router, hidden_states)
    if hidden_states.dim() != 2 and not spec.flattens_input:
        # a router that takes its input's shape as it comes (its MoE block flattens first): on
        # another shape its own forward decides what it computes
        record_fallback("moe_router_shape", f"{type(router).__name__} got a {hidden_states.dim()}-D input, which its "
                        "MoE block does not give it; its own forward runs")
        return type(router).forward(router, hidden_states)
    hidden = hidden_states.reshape(-1, router.weight.shape[1])
    logits = _logits(router, spec, hidden)
    bias = getattr(router, spec.bias_attribute) if spec.bias_attribute else None
    weights, ids = moe_ops.route(logits, selection_bias=bias, **args)
    weights = weights.to(logits.dtype if spec.weights_dtype == "logits" else torch.float32)
    return logits, weights, ids


def refusal(router: nn.Module) -> str | None:
    """Why this router cannot take the fused forward whatever its recipe, or None."""
    name = type(router).__name__
    if not isinstance(getattr(router, "weight", None), torch.Tensor):
        return f"{name} has no weight tensor of its own"
    if any(hasattr(m, "lora_A") for m in router.modules()) or parametrize.is_parametrized(router):
        return f"{name} carries adapters or parametrizations (PEFT), which its fused forward would skip"
    if hooked(router):
        return f"{name}: {HOOKED_REASON}"
    if "forward" in router.__dict__:
        return f"{name}'s forward is already replaced on the instance (hub kernels, another library)"
    if router.weight.device.type == "meta":
        return f"{name}'s weights are on the meta device, so its forward cannot be checked"
    return None


def _outputs(router: nn.Module, forward, hidden: torch.Tensor, grad: torch.Tensor):
    """(logits, weights by expert (T, E), ids sorted, the gradients of hidden and each parameter,
    and the three outputs' shapes) for `forward`, with `grad` (T, E) on the weights by expert."""
    leaves = [hidden] + [p for p in router.parameters() if p.requires_grad]
    logits, weights, ids = forward(hidden)
    shapes = tuple(tuple(t.shape) for t in (logits, weights, ids))
    top_k = ids.shape[-1]
    logits, weights, ids = logits.reshape(-1, grad.shape[1]), weights.reshape(-1, top_k), ids.reshape(-1, top_k)
    dense = torch.zeros(ids.shape[0], grad.shape[1], dtype=weights.dtype, device=weights.device).scatter(1, ids, weights)
    grads = torch.autograd.grad((dense.to(grad.dtype) * grad).sum() + (logits.to(grad.dtype) * 1e-3).sum(), leaves,
                                allow_unused=True)
    return logits, dense, ids.sort(-1).values, grads, shapes


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def mismatch(router: nn.Module, spec: RouterSpec, tokens: int = 48) -> str | None:
    """None where the class's own forward computes `spec` (checked in float64 on a CPU copy, then
    on the router's device in its dtype), else why not."""
    name = type(router).__name__
    try:
        arguments = route_arguments(router, spec)
    except (AttributeError, ValueError) as exc:
        return f"{name}: {exc}"
    own = type(router).forward
    gen = torch.Generator().manual_seed(0)
    hidden_size = router.weight.shape[1]
    try:
        with torch.inference_mode(False), torch.enable_grad():
            # float64 on (T, H) and, where the recipe flattens its input, on (2, T / 2, H) as a
            # decoder hands it over (a router that flattens and one that does not show apart in the
            # outputs' shapes); then as loaded on (T, H)
            stages = [("float64", (tokens,))] + ([("float64", (2, tokens // 2))] if spec.flattens_input else [])
            for where, leading in stages + [("as loaded", (tokens,))]:
                if where == "float64":
                    probe = _copy_to(router, torch.device("cpu"), torch.float64)
                    if spec.bias_attribute:  # a trained model's bias, not a fresh one's zeros: an omission shows
                        bias = getattr(probe, spec.bias_attribute)
                        bias.data = torch.randn(bias.shape, generator=gen, dtype=torch.float64) * 0.1
                    # the models compute steps in float32 whatever their input (a float32 linear, a softmax
                    # with dtype=torch.float): float32's rounding in another order; an omission is far larger
                    dtype, device, tolerance = torch.float64, torch.device("cpu"), 2e-5
                else:
                    probe = router
                    dtype, device = router.weight.dtype, router.weight.device
                    tolerance = {torch.float32: 1e-4, torch.float64: 1e-10}.get(dtype, 2e-2)
                probe._hasten_router_spec, probe._hasten_route_arguments = spec, arguments
                hidden = torch.randn(*leading, hidden_size, generator=gen, dtype=torch.float64)
                hidden = (hidden * 4 / math.sqrt(hidden_size)).to(device, dtype).requires_grad_()
                grad = torch.randn(tokens, router.weight.shape[0], generator=gen, dtype=torch.float64).to(device)
                want = _outputs(probe, lambda h: own(probe, h), hidden, grad)
                got = _outputs(probe, lambda h: fused_router_forward(probe, h), hidden, grad)
                if want[4] != got[4]:
                    return (f"{name}'s forward returns outputs of shapes {want[4]}; the recipe gives {got[4]} "
                            f"(for hidden states of shape {tuple(hidden.shape)})")
                if want[0].dtype != got[0].dtype or want[1].dtype != got[1].dtype:
                    return (f"{name}'s forward returns logits {want[0].dtype} and weights {want[1].dtype}; the "
                            f"recipe gives {got[0].dtype} and {got[1].dtype}")
                if where == "as loaded" and not torch.equal(want[2], got[2]):
                    # in the model's dtype a near tie may round either way: compare the tokens both chose alike
                    same = (want[2] == got[2]).all(-1)
                    if same.float().mean() < 0.9:
                        return f"{name} chose other experts than the recipe on {int((~same).sum())} of {tokens} tokens"
                    errors = [_relative(want[1][same], got[1][same])]
                else:
                    if not torch.equal(want[2], got[2]):
                        return f"{name} chose other experts than the recipe (float64, {tokens} random tokens)"
                    errors = [_relative(got[0], want[0]), _relative(got[1], want[1])]
                    errors += [_relative(a, b) for a, b in zip(got[3], want[3])]
                if not max(errors) <= tolerance:
                    return (f"{name}'s forward computes something other than the recipe ({spec.describe()}): "
                            f"relative difference {max(errors):.1e} {where}")
    except Exception as exc:  # a router that cannot run on a probe cannot be vouched for
        return f"{name}'s forward could not be checked ({type(exc).__name__}: {exc})"
    finally:  # the probe's state on the router itself (the float64 copy is dropped)
        router.__dict__.pop("_hasten_router_spec", None)
        router.__dict__.pop("_hasten_route_arguments", None)
    return None


def _copy_to(router: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of the router on `device` with its floating parameters and buffers in `dtype`."""
    probe = copy.deepcopy(router).to(device)
    for p in list(probe.parameters()) + list(probe.buffers()):
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return probe


def install_fused_routers(routers: list[nn.Module], spec: RouterSpec):
    """Give each router the fused forward where its class passes `mismatch`, checked once per
    class, device, dtype, shape and route arguments (layers whose routers read other settings are
    checked apart). Returns (undo, routers patched, reasons others were left)."""
    checks: dict[tuple, str | None] = {}
    patched, reasons = [], set()
    for router in routers:
        reason, arguments = refusal(router), None
        if reason is None:
            try:
                arguments = route_arguments(router, spec)
            except (AttributeError, ValueError) as exc:
                reason = f"{type(router).__name__}: {exc}"
        if reason is None:
            key = (type(router), router.weight.device, router.weight.dtype, tuple(router.weight.shape),
                   tuple(sorted(arguments.items())))
            if key not in checks:
                checks[key] = mismatch(router, spec)
            reason = checks[key]
        if reason is not None:
            reasons.add(reason)
            continue
        router._hasten_router_spec, router._hasten_route_arguments = spec, arguments
        replace_forward(router, fused_router_forward.__get__(router))
        patched.append(router)

    def undo() -> None:
        for router in patched:
            restore_forward(router)
            router.__dict__.pop("_hasten_router_spec", None)
            router.__dict__.pop("_hasten_route_arguments", None)

    return undo, len(patched), sorted(reasons)
