"""MoE routing ops: grouping statistics, permute / combine with autograd, fused SwiGLU.

Shapes: T tokens, k choices per token, S = T * k slots (slot s = token s // k, choice
s % k), E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, call_in_backward, load, no_double_backward, register_autograd


def _moe_group_fake(expert_ids, num_experts):
    _checks.check_moe_group_args(expert_ids, num_experts)
    slots = expert_ids.numel()
    new = expert_ids.new_empty
    return (new((num_experts,), dtype=torch.int32), new((num_experts + 1,), dtype=torch.int32),
            new((slots,), dtype=torch.int32), new((slots,), dtype=torch.int32))


def _moe_permute_fake(x, permutation, offsets, top_k, slot_scale=None):
    _checks.check_permute_args(x, permutation, offsets, top_k, slot_scale)
    return x.new_empty((permutation.numel(), x.shape[1]))


def _moe_combine_fake(y, inverse, offsets, top_k, weights=None, bias=None):
    _checks.check_combine_args(y, inverse, offsets, top_k, weights, bias)
    return y.new_empty((inverse.numel() // top_k, y.shape[1]))


def _moe_combine_weight_grad_fake(grad_out, y, inverse, offsets, top_k, bias=None):
    _checks.check_weight_grad_args(grad_out, y, inverse, offsets, top_k, bias)
    return y.new_empty((inverse.numel() // top_k, top_k))


def _moe_route_fake(logits, top_k, scoring, renormalize, renorm_epsilon, scale, num_groups, top_groups, group_score,
                    masked_choice, selection_bias=None):
    _checks.check_route_args("moe_route", logits, top_k, scoring, num_groups, top_groups, group_score, selection_bias)
    weight_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (logits.new_empty((logits.shape[0], top_k), dtype=weight_dtype),
            logits.new_empty((logits.shape[0], top_k), dtype=torch.int64))


def _moe_route_backward_fake(grad_weights, logits, ids, top_k, scoring, renormalize, renorm_epsilon, scale, num_groups,
                             top_groups, group_score, masked_choice, selection_bias=None):
    _checks.check_route_args("moe_route_backward", logits, top_k, scoring, num_groups, top_groups, group_score,
                             selection_bias)
    _checks.check_route_backward_args(grad_weights, logits, ids, top_k)
    return torch.empty_like(logits)


def _swiglu_fake(gate_up):
    _checks.check_swiglu_args("swiglu", gate_up)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _swiglu_backward_fake(grad_act, gate_up):
    _checks.check_swiglu_backward_args(grad_act, gate_up)
    return gate_up.new_empty(gate_up.shape)


def _weighted_swiglu_fake(gate_up, weights, permutation, offsets):
    _checks.check_weighted_swiglu_args("moe_weighted_swiglu", gate_up, weights, permutation, offsets)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _weighted_swiglu_backward_fake(grad_act, gate_up, weights, permutation, offsets):
    _checks.check_weighted_swiglu_backward_args(grad_act, gate_up, weights, permutation, offsets)
    return gate_up.new_empty(gate_up.shape), weights.new_empty(weights.shape)


def _clamped_swiglu_fake(gate_up, alpha, limit, bias=None, group_ends=None):
    _checks.check_clamped_swiglu_args("clamped_swiglu", gate_up, alpha, limit)
    _checks.check_clamped_swiglu_bias("clamped_swiglu", gate_up, bias, group_ends)
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


def _clamped_swiglu_backward_fake(grad_act, gate_up, alpha, limit, bias=None, group_ends=None):
    _checks.check_clamped_swiglu_backward_args(grad_act, gate_up, alpha, limit)
    _checks.check_clamped_swiglu_bias("clamped_swiglu_backward", gate_up, bias, group_ends)
    return gate_up.new_empty(gate_up.shape)


def _grouped_mm_fake(x, weight, group_ends, transposed):
    _checks.check_grouped_mm_args(x, weight, group_ends, transposed)
    return x.new_empty((x.shape[0], weight.shape[2] if transposed else weight.shape[1]))


def _grouped_mm_weight_grad_fake(a, b, group_ends):
    _checks.check_grouped_mm_weight_grad_args(a, b, group_ends)
    return a.new_empty((group_ends.shape[0], a.shape[1], b.shape[1]))


def _inverse_of(index: torch.Tensor) -> torch.Tensor:
    """The inverse of a permutation of the S slots (permutation <-> inverse), one scatter on the
    index's device: the backward of permute needs the inverse and that of combine the permutation,
    and each op takes only the one its forward reads."""
    positions = torch.arange(index.numel(), dtype=index.dtype, device=index.device)
    return torch.empty_like(index).scatter_(0, index.long(), positions)


# permute: out[p] = slot_scale[s] * x[s // k], s = permutation[p]
def _permute_setup(ctx, inputs, output):
    x, permutation, offsets, top_k, slot_scale = inputs
    ctx.top_k = top_k
    ctx.has_scale = slot_scale is not None
    # x's gradient needs slot_scale; slot_scale's needs x
    ctx.save_for_backward(permutation, offsets, slot_scale if ctx.needs_input_grad[0] else None,
                          x if ctx.needs_input_grad[4] else None)


def _permute_backward(ctx, grad):
    permutation, offsets, slot_scale, x = ctx.saved_tensors
    grad = grad.contiguous()
    inverse = _inverse_of(permutation)
    grad_x = grad_scale = None
    if ctx.needs_input_grad[0]:
        # each token sums the gradients of its k slots (scaled): a gather, deterministic
        weights = slot_scale.reshape(-1, ctx.top_k) if ctx.has_scale else None
        grad_x = call_in_backward("moe_combine", grad, inverse, offsets, ctx.top_k, weights)
    if ctx.needs_input_grad[4]:
        # d slot_scale[s] = dot(grad[inverse[s]], x[s // k])
        grad_scale = call_in_backward("moe_combine_weight_grad", x, grad, inverse, offsets, ctx.top_k).reshape(-1)
    return grad_x, None, None, None, grad_scale


# combine: out[t] = sum_j weights[t, j] * y'[inverse[t * k + j]], y'[p] = y[p] (+ bias[expert of p])
def _combine_setup(ctx, inputs, output):
    y, inverse, offsets, top_k, weights, bias = (*inputs, None)[:6]
    ctx.top_k = top_k
    ctx.has_weights = weights is not None
    ctx.has_bias = bias is not None
    ctx.weights_shape = weights.shape if weights is not None else None
    # y's and the bias's gradients need the weights; the weights' need y and the bias
    needs_grad_y = ctx.needs_input_grad[0] or (ctx.has_bias and ctx.needs_input_grad[5])
    ctx.save_for_backward(inverse, offsets, weights if needs_grad_y else None,
                          y if ctx.needs_input_grad[4] else None, bias if ctx.needs_input_grad[4] else None)


def _combine_backward(ctx, grad_out):
    """d y[p] = weights[t, j] * grad_out[t] (a permute of grad_out); d weights[t, j] =
    dot(grad_out[t], y'[p]); d bias (E, H) = rows' one-hot^T @ d y (each row of an expert got its
    bias: the GEMM torch.addmm's backward runs, float32 accumulation); dropped rows of d y are zero."""
    inverse, offsets, weights, y, bias = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    needs_bias = ctx.has_bias and ctx.needs_input_grad[5]
    grad_y = grad_weights = grad_bias = None
    if ctx.needs_input_grad[0] or needs_bias:
        slot_scale = weights.reshape(-1) if ctx.has_weights else None
        grad_y = call_in_backward("moe_permute", grad_out, _inverse_of(inverse), offsets, ctx.top_k, slot_scale)
    if ctx.needs_input_grad[4]:
        extra = () if bias is None else (bias,)
        grad_weights = call_in_backward("moe_combine_weight_grad", grad_out, y, inverse, offsets, ctx.top_k, *extra)
        grad_weights = grad_weights.reshape(ctx.weights_shape)
    if needs_bias:
        grad_bias = row_experts_one_hot(offsets[1:], grad_y.shape[0], grad_y.dtype).t().mm(grad_y)
    return grad_y if ctx.needs_input_grad[0] else None, None, None, None, grad_weights, grad_bias


# grouped_mm: y[rows of g] = x[rows of g] @ W_g^T, weight (E, out, in), or (E, in, out) when transposed
def _grouped_mm_setup(ctx, inputs, output):
    x, weight, group_ends, ctx.transposed = inputs
    # x's gradient needs the weight; the weight's needs x
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None,
                          group_ends)


def _grouped_mm_backward(ctx, grad):
    x, weight, group_ends = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        # grad_x[rows of g] = grad @ W_g: the same GEMM on the other layout of the weight
        grad_x = call_in_backward("moe_grouped_mm", grad, weight, group_ends, not ctx.transposed)
    if ctx.needs_input_grad[1]:
        # (E, out, in): grad^T @ x per expert; (E, in, out): x^T @ grad
        a, b = (x, grad) if ctx.transposed else (grad, x)
        grad_weight = call_in_backward("moe_grouped_mm_weight_grad", a, b, group_ends)
    return grad_x, grad_weight, None, None


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, grad_act):
    (gate_up,) = ctx.saved_tensors
    return call_in_backward("swiglu_backward", grad_act.contiguous(), gate_up)


# moe_weighted_swiglu: act[p] = weights[s] * silu(gate[p]) * up[p], s = permutation[p]
def _weighted_swiglu_setup(ctx, inputs, output):
    gate_up, weights, permutation, offsets = inputs
    ctx.save_for_backward(gate_up, weights, permutation, offsets)


def _weighted_swiglu_backward(ctx, grad_act):
    """Both gradients from one pass over gate_up and grad_act (the weights' is a row sum of values
    that pass reads anyway); neither needs the down projection's output."""
    gate_up, weights, permutation, offsets = ctx.saved_tensors
    grad_gate_up, grad_weights = call_in_backward("moe_weighted_swiglu_backward", grad_act.contiguous(), gate_up,
                                                  weights, permutation, offsets)
    return (grad_gate_up if ctx.needs_input_grad[0] else None,
            grad_weights if ctx.needs_input_grad[1] else None, None, None)


def _clamped_swiglu_setup(ctx, inputs, output):
    gate_up, ctx.alpha, ctx.limit, bias, group_ends = (*inputs, None, None)[:5]
    ctx.save_for_backward(gate_up, bias, group_ends)


def _clamped_swiglu_backward(ctx, grad_act):
    """d gate_up (R, 2I) from the kernel; d bias (E, 2I) = rows' one-hot^T @ d gate_up (the bias is
    added to each row of its expert), a GEMM with float32 accumulation, as torch.addmm's is."""
    gate_up, bias, group_ends = ctx.saved_tensors
    extra = () if bias is None else (bias, group_ends)
    grad_gate_up = call_in_backward("clamped_swiglu_backward", grad_act.contiguous(), gate_up, ctx.alpha, ctx.limit,
                                    *extra)
    grad_bias = None
    if bias is not None and ctx.needs_input_grad[3]:
        grad_bias = row_experts_one_hot(group_ends, gate_up.shape[0], grad_gate_up.dtype).t().mm(grad_gate_up)
    return grad_gate_up, None, None, grad_bias, None


# route: ids, weights = the router's choice from logits (T, E); only the weights have a gradient
def _route_setup(ctx, inputs, output):
    ctx.spec = inputs[1:10]  # top_k .. masked_choice
    # the logits' gradient recomputes the choice from the logits, the ids and the selection bias
    needed = ctx.needs_input_grad[0]
    ctx.save_for_backward(inputs[0] if needed else None, output[1] if needed else None,
                          inputs[10] if needed else None)


def _route_backward(ctx, grad_weights, grad_ids):
    """d logits from d weights: the scores and the group choice recomputed from the logits
    (T x E, cheap) rather than saved; the selection bias has no gradient (it only ranks)."""
    logits, ids, selection_bias = ctx.saved_tensors
    if grad_weights is None or not ctx.needs_input_grad[0]:
        return (None,) * 11
    grad_logits = call_in_backward("moe_route_backward", grad_weights.contiguous(), logits, ids, *ctx.spec,
                                   selection_bias)
    return (grad_logits,) + (None,) * 10


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    lib = "hasten::"
    for name, fake in (("moe_group", _moe_group_fake), ("moe_permute", _moe_permute_fake),
                       ("moe_combine", _moe_combine_fake), ("moe_combine_weight_grad", _moe_combine_weight_grad_fake),
                       ("swiglu", _swiglu_fake), ("swiglu_backward", _swiglu_backward_fake),
                       ("moe_route", _moe_route_fake), ("moe_route_backward", _moe_route_backward_fake),
                       ("clamped_swiglu", _clamped_swiglu_fake),
                       ("clamped_swiglu_backward", _clamped_swiglu_backward_fake),
                       ("moe_weighted_swiglu", _weighted_swiglu_fake),
                       ("moe_weighted_swiglu_backward", _weighted_swiglu_backward_fake),
                       ("moe_grouped_mm", _grouped_mm_fake), ("moe_grouped_mm_weight_grad", _grouped_mm_weight_grad_fake)):
        torch.library.register_fake(lib + name, fake)
    register_autograd("moe_permute", _permute_backward, setup_context=_permute_setup)
    register_autograd("moe_combine", _combine_backward, setup_context=_combine_setup)
    register_autograd("moe_grouped_mm", _grouped_mm_backward, setup_context=_grouped_mm_setup)
    register_autograd("moe_route", _route_backward, setup_context=_route_setup)
    register_autograd("swiglu", _swiglu_backward, setup_context=_swiglu_setup)
    register_autograd("clamped_swiglu", _clamped_swiglu_backward, setup_context=_clamped_swiglu_setup)
    register_autograd("moe_weighted_swiglu", _weighted_swiglu_backward, setup_context=_weighted_swiglu_setup)
    for op in ("moe_combine_weight_grad", "moe_route_backward", "swiglu_backward", "clamped_swiglu_backward",
               "moe_grouped_mm_weight_grad", "moe_weighted_swiglu_backward"):
        no_double_backward(op)


@dataclass(frozen=True)
class Grouping:
    """One routing's grouping statistics, all int32 on the ids' device."""

    counts: torch.Tensor       # (E,) slots per expert
    offsets: torch.Tensor      # (E + 1,) exclusive starts; offsets[E] = valid slots
    permutation: torch.Tensor  # (S,) sorted position -> slot
    inverse: torch.Tensor      # (S,) slot -> sorted position
    top_k: int

    @property
    def group_ends(self) -> torch.Tensor:
        """(E,) inclusive ends, the `offs` of torch._grouped_mm."""
        return self.offsets[1:]


def group(expert_ids: torch.Tensor, num_experts: int) -> Grouping:
    """Router top-k ids (T, k) -> grouping statistics in one kernel, no host sync."""
    load()
    counts, offsets, permutation, inverse = torch.ops.hasten.moe_group(expert_ids, num_experts)
    return Grouping(counts, offsets, permutation, inverse, expert_ids.shape[-1])


def route(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
          renorm_epsilon: float = 0.0, scale: float = 1.0, num_groups: int = 1, top_groups: int = 1,
          group_score: str = "max", masked_choice: float = 0.0,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its logits (T, E) in one kernel each way, no host sync ->
    (weights (T, k) float32, ids (T, k) int64). scores: softmax (torch's own softmax, bit for
    bit on CUDA), sigmoid, or the logits ("topk_softmax": the weights are the softmax of the k
    chosen logits); the choice ranks scores + selection_bias (no gradient), kept to the
    `top_groups` best of `num_groups` contiguous expert groups (the others' choice set to
    `masked_choice`, the model's masked_fill value); weights are the chosen scores (with a
    selection bias) or choice values, then / (sum + renorm_epsilon) where `renormalize`, then
    * scale. csrc/registration.cpp has it all."""
    load()
    return call("moe_route", logits, int(top_k), scoring, bool(renormalize), float(renorm_epsilon), float(scale),
                int(num_groups), int(top_groups), group_score, float(masked_choice), selection_bias)


def permute(x: torch.Tensor, g: Grouping, slot_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens (T, H) -> slots in expert order (S, H), each slot's row times slot_scale (S,) where
    given (Llama 4 scales the experts' inputs by the router's scores); dropped slots are zero rows."""
    load()
    return call("moe_permute", x, g.permutation, g.offsets, g.top_k, slot_scale)


def combine(y: torch.Tensor, weights: torch.Tensor | None, g: Grouping, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs in expert order (S, H) -> tokens (T, H), weighted by the router's (T, k), or
    summed where weights is None. With bias (E, H), each row's expert bias is added first, rounded
    to y's dtype (what the model's `y + bias` gives), inside the kernel: no pass of its own over y."""
    load()
    extra = () if bias is None else (bias,)
    return call("moe_combine", y, g.inverse, g.offsets, g.top_k, weights, *extra)


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """The experts' grouped GEMM: x (S, in) in expert order -> (S, out), expert g's rows times
    W_g^T, weight (E, out, in), or (E, in, out) when transposed; group_ends (E,) int32 inclusive
    ends (Grouping.group_ends). On CUDA, bfloat16 on an sm90 GPU runs hasten's CUTLASS kernels
    where a tile of theirs measured faster, torch's grouped GEMM elsewhere; no host sync. Rows
    past the last end are undefined on CUDA."""
    load()
    return call("moe_grouped_mm", x, weight, group_ends, bool(transposed))


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows (R, 2I) -> silu(gate) * up (R, I), one kernel each way."""
    load()
    return call("swiglu", gate_up)


def weighted_swiglu(gate_up: torch.Tensor, weights: torch.Tensor, g: Grouping) -> torch.Tensor:
    """[gate | up] rows (S, 2I) in expert order -> each row's router weight (weights (T, k), gate_up's
    dtype) times silu(gate) * up, (S, I); dropped slots' rows zero. The down projection of it gives
    weighted rows, so `combine(y, None, g)` sums them: the combine's backward then needs no y (its
    weight gradient comes from this op's backward, from gate_up and grad_act), and nobody saves y."""
    load()
    return call("moe_weighted_swiglu", gate_up, weights, g.permutation, g.offsets)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float, bias: torch.Tensor | None = None,
                   group_ends: torch.Tensor | None = None) -> torch.Tensor:
    """gpt-oss's experts' gate: interleaved (gate, up) pairs of (R, 2I) -> (R, I),
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit); one kernel each way.
    With bias (E, 2I) and group_ends (E,) int32 (Grouping.group_ends of expert-sorted rows): each
    row's expert bias is added to gate_up first, rounded to its dtype (what y + bias in the model's
    dtype gives), inside the kernel, instead of a pass of its own over the (R, 2I) tensor."""
    load()
    extra = () if bias is None else (bias, group_ends)
    return call("clamped_swiglu", gate_up, float(alpha), float(limit), *extra)


def row_experts_one_hot(group_ends: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """(rows, E) in `dtype`: 1 where an expert-sorted row belongs to an expert, given the groups'
    inclusive ends (E,) int32, on the device without a sync (rows past the valid slots get the last
    expert: their values are never combined)."""
    ids = torch.searchsorted(group_ends, torch.arange(rows, device=group_ends.device, dtype=group_ends.dtype),
                             right=True)
    experts = group_ends.shape[0]
    ids.clamp_(max=experts - 1)
    return (ids[:, None] == torch.arange(experts, device=ids.device, dtype=ids.dtype)).to(dtype)
