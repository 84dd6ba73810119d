"""A frozen base projection and its LoRA update in one op (hasten::lora_linear), with autograd.

Shapes: x (..., in), weight (out, in) frozen, lora_a (r, in), lora_b (out, r), scale the LoRA
scaling. y = x W^T (+ bias) + scale * (x_lora A^T) B^T, with x_lora = dropout(x) or x itself.
What autograd keeps: x_lora (x itself without dropout, which the caller holds anyway: q, k and v
of one layer keep one tensor between them), xa = x_lora A^T (..., r), references to the weights,
and for adapters in another dtype than x's (PEFT's float32 under a bf16 base) the forward's one
flat copy of them in x's dtype, which the backward's GEMMs read instead of casting them again (the
op's third output; empty when the adapters have x's dtype). No gradient for the base weight or
bias: the op refuses them requiring one.

`lora_linear_group`: projections that read the same x (q/k/v, gate/up) in one op: x is read once for
all members' thin GEMM and for all d A, and d x is one tensor their base GEMMs accumulate onto.

`lora_gated_group`: a gated MLP's [gate, up] group and its activation f(gate) * up in one op, so that
the backward can form the activation's gradient and both members' thin products in one pass.

`lora_linear_quantized`: the same over a quantized base (bitsandbytes NF4/FP4, QLoRA), the weight
dequantized by the caller's function for the forward and again for the backward, never kept.
"""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, call_in_backward, load, no_double_backward, register_autograd


def _adapters_fake(x, lora_a, lora_b):
    """The forward's flat copy of the adapters in x's dtype (csrc/lora/lora_backward.h,
    cast_adapters): empty when every adapter has x's dtype already."""
    tensors = [*lora_a, *lora_b]
    if all(t.dtype == x.dtype for t in tensors):
        return x.new_empty((0,))
    return x.new_empty((sum(t.numel() for t in tensors),))


def _lora_linear_fake(x, x_lora, weight, bias, lora_a, lora_b, scale):
    _checks.check_lora_linear_args("lora_linear", x, x_lora, weight, bias, lora_a, lora_b)
    return (x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((*x.shape[:-1], lora_a.shape[0])),
            _adapters_fake(x, [lora_a], [lora_b]))


def _lora_linear_backward_fake(grad_y, x_lora, weight, lora_a, lora_b, xa, scale, shared_input, adapters=None):
    _checks.check_lora_linear_backward_args(grad_y, x_lora, weight, lora_a, lora_b, xa)
    _checks.check_lora_adapters("lora_linear_backward", adapters, [lora_a], [lora_b], x_lora.dtype)
    grad_x_lora = x_lora.new_empty((0,)) if shared_input else x_lora.new_empty(x_lora.shape)
    return x_lora.new_empty(x_lora.shape), grad_x_lora, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def _setup(ctx, inputs, output):
    x, x_lora, weight, bias, lora_a, lora_b, scale = inputs
    _y, xa, adapters = output
    ctx.mark_non_differentiable(xa, adapters)  # kept for the backward, not results
    if ctx.needs_input_grad[2] or (bias is not None and ctx.needs_input_grad[3]):
        raise NotImplementedError("hasten::lora_linear computes no gradient for the base weight or bias: it is for a "
                                  "frozen base layer (requires_grad=False)")
    ctx.shared_input, ctx.scale, ctx.x_shape = x_lora is None, scale, x.shape
    # d lora_a reads x_lora (x itself without dropout), d lora_b reads xa; d x reads the weights only
    # (adapters: the forward's copy of lora_a and lora_b in x's dtype, which the backward's GEMMs read
    # instead of casting them again; empty when they have x's dtype)
    ctx.save_for_backward((x if x_lora is None else x_lora) if ctx.needs_input_grad[4] else None, weight, lora_a,
                          lora_b, xa if ctx.needs_input_grad[5] else None, adapters)


def _backward(ctx, grad_y, _grad_xa, _grad_adapters):
    x_lora, weight, lora_a, lora_b, xa, adapters = ctx.saved_tensors
    # what was not kept is not read for a gradient anyone asked for: zero-stride stand-ins, no memory
    if x_lora is None:
        x_lora = grad_y.new_zeros(()).expand(ctx.x_shape)
    if xa is None:
        xa = grad_y.new_zeros(()).expand((*ctx.x_shape[:-1], lora_a.shape[0]))
    grad_x, grad_x_lora, grad_a, grad_b = call_in_backward("lora_linear_backward", grad_y.contiguous(), x_lora, weight,
                                                           lora_a, lora_b, xa, ctx.scale, ctx.shared_input, adapters)
    need = ctx.needs_input_grad
    return (grad_x if need[0] else None, None if ctx.shared_input or not need[1] else grad_x_lora, None, None,
            grad_a if need[4] else None, grad_b if need[5] else None, None)


# --- projections that share their input (q/k/v, gate/up): hasten::lora_linear_group ---------------

def _check_group(op, weights, biases, lora_a, lora_b, scales) -> None:
    """The group's counts and dtypes, as csrc/lora's check_group words them (its members' shapes
    follow, per op, in the kernel's order)."""
    n = len(weights)
    _checks.check(n >= 1, op, "the group needs at least one projection, got none")
    _checks.check(len(lora_a) == len(lora_b) == len(scales) == n and len(biases) in (0, n), op,
                  lambda: "weights, lora_a, lora_b and scales must have one entry per projection, and biases none or "
                  f"one per projection, got {n}, {len(lora_a)}, {len(lora_b)}, {len(scales)} and {len(biases)}")
    for a, b in zip(lora_a, lora_b):
        _checks.check(a.dtype == lora_a[0].dtype and b.dtype == lora_b[0].dtype, op,
                      "every projection's lora_a must share one dtype, and every lora_b one dtype")


def _lora_linear_group_fake(x, weights, biases, lora_a, lora_b, scales):
    op = "lora_linear_group"
    _check_group(op, weights, biases, lora_a, lora_b, scales)
    for i, (w, a, b) in enumerate(zip(weights, lora_a, lora_b)):
        _checks.check_lora_linear_args(op, x, None, w, biases[i] if biases else None, a, b)
    ranks = sum(a.shape[0] for a in lora_a)
    return ([x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights], x.new_empty((*x.shape[:-1], ranks)),
            _adapters_fake(x, lora_a, lora_b))


def _lora_linear_group_backward_fake(grad_ys, x, weights, lora_a, lora_b, xa, scales, grad_input=True,
                                     adapters=None):
    op = "lora_linear_group_backward"
    _check_group(op, weights, [], lora_a, lora_b, scales)
    n, rows = len(weights), x.numel() // x.shape[-1] if x.shape[-1] else 0
    _checks.check(len(grad_ys) == n, op, lambda: f"one grad_y per projection, got {len(grad_ys)} for {n}")
    ranks = sum(a.shape[0] for a in lora_a)
    _checks.check(xa.shape[-1] == ranks and (xa.numel() // ranks if ranks else 0) == rows, op,
                  lambda: f"`xa` {_checks.shape(xa.shape)} must be (..., {ranks}) over x's rows")
    for i, (g, w, a, b) in enumerate(zip(grad_ys, weights, lora_a, lora_b)):
        _checks.check_lora_linear_args(op, x, None, w, None, a, b)
        _checks.check(g.shape[-1] == w.shape[0] and (g.numel() // w.shape[0] if w.shape[0] else 0) == rows, op,
                      lambda: f"`grad_ys[{i}]` {_checks.shape(g.shape)} must be (..., {w.shape[0]}) over x's rows")
    _checks.check_lora_adapters(op, adapters, lora_a, lora_b, x.dtype)
    # d lora_a stacked (sum r_i, in), as its one GEMM writes it (the caller splits it: views)
    return (x.new_empty(x.shape if grad_input else (0,)), lora_a[0].new_empty((ranks, x.shape[-1])),
            [b.new_empty(b.shape) for b in lora_b])


def _setup_group(ctx, inputs, output):
    x, weights, biases, lora_a, lora_b, scales = inputs
    _ys, xa, adapters = output
    ctx.mark_non_differentiable(xa, adapters)
    if any(w.requires_grad for w in weights) or any(b.requires_grad for b in biases):
        raise NotImplementedError("hasten::lora_linear_group computes no gradient for the base weights or biases: it "
                                  "is for frozen base layers (requires_grad=False)")
    ctx.n, ctx.scales, ctx.x_shape, ctx.ranks = len(weights), list(scales), x.shape, [a.shape[0] for a in lora_a]
    ctx.biases = len(biases)
    ctx.x_needs_grad = x.requires_grad
    ctx.a_needs_grad = [a.requires_grad for a in lora_a]
    ctx.b_needs_grad = [b.requires_grad for b in lora_b]
    # d lora_a reads x, d lora_b reads xa; d x reads the weights only
    ctx.save_for_backward(x if any(ctx.a_needs_grad) else None, xa if any(ctx.b_needs_grad) else None, adapters,
                          *weights, *lora_a, *lora_b)


def _backward_group(ctx, grad_ys, _grad_xa, _grad_adapters):
    x, xa, adapters, *rest = ctx.saved_tensors
    n = ctx.n
    weights, lora_a, lora_b = rest[:n], rest[n:2 * n], rest[2 * n:]
    any_grad = next(g for g in grad_ys if g is not None)
    if x is None:  # not kept, not read for a gradient anyone asked for: a zero-stride stand-in
        x = any_grad.new_zeros(()).expand(ctx.x_shape)
    if xa is None:
        xa = any_grad.new_zeros(()).expand((*ctx.x_shape[:-1], sum(ctx.ranks)))
    grads = [g.contiguous() if g is not None else any_grad.new_zeros((*ctx.x_shape[:-1], w.shape[0]))
             for g, w in zip(grad_ys, weights)]
    # grad_input: the first layer's input under a frozen embedding needs no d x (its GEMMs skipped)
    grad_x, grad_a, grad_b = call_in_backward("lora_linear_group_backward", grads, x, list(weights), list(lora_a),
                                              list(lora_b), xa, ctx.scales, ctx.x_needs_grad, adapters)
    # the inputs' structure: a list for each Tensor[] (the frozen weights and biases: Nones), one
    # entry for the float[] scales; d lora_a comes stacked, each member's rows a view of it
    return (grad_x if ctx.x_needs_grad else None, [None] * n, [None] * ctx.biases,
            [g if need else None for g, need in zip(grad_a.split(ctx.ranks), ctx.a_needs_grad)],
            [g if need else None for g, need in zip(grad_b, ctx.b_needs_grad)], None)


class _EagerLoraGroup(torch.autograd.Function):
    """Eager calls of hasten::lora_linear_group: the registered formula (_setup_group,
    _backward_group) in an autograd.Function over the op's tensors passed one by one (a Function
    tracks only tensors it is given directly, not lists). The op's own Python autograd kernel
    flattens and rebuilds its list arguments on every call: a q/k/v group's forward and backward
    took 387 us of host time that way on an idle CPU, 268 us as this Function, against 280 us for
    three single lora_linear calls: the kind of time small, host-bound LoRA models wait for.
    torch.compile traces the op (lora_linear_group)."""

    @staticmethod
    def forward(ctx, n: int, with_bias: bool, scales: list[float], x, *tensors):
        weights, rest = tensors[:n], tensors[n:]
        biases, rest = (rest[:n], rest[n:]) if with_bias else ((), rest)
        inputs = (x, list(weights), list(biases), list(rest[:n]), list(rest[n:]), scales)
        with torch._C._AutoDispatchBelowAutograd():  # straight to the CPU/CUDA kernel
            output = torch.ops.hasten.lora_linear_group.default(*inputs)
        _setup_group(ctx, inputs, output)
        ctx.set_materialize_grads(False)  # an unused member's gradient stays None (the formula fills it)
        ys, xa, adapters = output
        return (*ys, xa, adapters)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        grad_x, _weights, _biases, grad_a, grad_b, _scales = _backward_group(ctx, grads[:n], grads[n], grads[n + 1])
        return (None, None, None, grad_x, *([None] * n), *([None] * ctx.biases), *grad_a, *grad_b)


# --- a gated MLP over a gate/up group: hasten::lora_gated_group ------------------------------------

GATED_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU's and GeGLU's gate, as the op's `activation` names them


def _check_gated_group(op, weights, biases, lora_a, lora_b, scales, activation) -> None:
    _check_group(op, weights, biases, lora_a, lora_b, scales)
    _checks.check(len(weights) == 2 and weights[0].shape[0] == weights[1].shape[0], op,
                  lambda: f"the group must be [gate, up], two projections of one output size, got {len(weights)} "
                  "projections" + (f" of output sizes {weights[0].shape[0]} and {weights[1].shape[0]}"
                                   if len(weights) == 2 else ""))
    _checks.check(activation in GATED_ACTIVATIONS, op,
                  lambda: f'`activation` must be "silu" or "gelu_tanh", got "{activation}"')


def _lora_gated_group_fake(x, weights, biases, lora_a, lora_b, scales, activation):
    _check_gated_group("lora_gated_group", weights, biases, lora_a, lora_b, scales, activation)
    (gate, up), xa, _adapters = _lora_linear_group_fake(x, weights, biases, lora_a, lora_b, scales)
    return gate.new_empty(gate.shape), gate, up, xa


def _lora_gated_group_backward_fake(grad_act, gate, up, x, weights, lora_a, lora_b, xa, scales, activation,
                                    grad_input=True):
    op = "lora_gated_group_backward"
    _check_gated_group(op, weights, [], lora_a, lora_b, scales, activation)
    inner, rows = weights[0].shape[0], x.numel() // x.shape[-1] if x.shape[-1] else 0
    for t in (grad_act, gate, up):
        _checks.check(t.shape[-1] == inner and (t.numel() // inner if inner else 0) == rows and t.dtype == x.dtype, op,
                      lambda: f"`grad_act`, `gate` and `up` must be (..., {inner}) over x's rows in x's dtype, got "
                      f"{_checks.shape(t.shape)} {_checks.dtype_name(t.dtype)}")
    return _lora_linear_group_backward_fake([gate, up], x, weights, lora_a, lora_b, xa, scales, grad_input)


def _setup_gated(ctx, inputs, output):
    x, weights, biases, lora_a, lora_b, scales, activation = inputs
    _act, gate, up, xa = output
    ctx.mark_non_differentiable(gate, up, xa)  # kept for the backward, not results
    ctx.set_materialize_grads(False)  # no (T, out) zeros made for gate's and up's unused gradients
    if any(w.requires_grad for w in weights) or any(b.requires_grad for b in biases):
        raise NotImplementedError("hasten::lora_gated_group computes no gradient for the base weights or biases: it "
                                  "is for frozen base layers (requires_grad=False)")
    ctx.scales, ctx.x_shape, ctx.ranks, ctx.biases = list(scales), x.shape, [a.shape[0] for a in lora_a], len(biases)
    ctx.activation = activation
    ctx.x_needs_grad = x.requires_grad
    ctx.a_needs_grad = [a.requires_grad for a in lora_a]
    ctx.b_needs_grad = [b.requires_grad for b in lora_b]
    # d gate and d up read gate and up; d lora_a reads x, d lora_b reads xa; d x reads the weights
    ctx.save_for_backward(gate, up, x if any(ctx.a_needs_grad) else None, xa if any(ctx.b_needs_grad) else None,
                          *weights, *lora_a, *lora_b)


def _backward_gated(ctx, grad_act, _grad_gate, _grad_up, _grad_xa):
    if grad_act is None:  # the activation was not used for the loss
        return None, [None, None], [None] * ctx.biases, [None, None], [None, None], None, None
    gate, up, x, xa, *rest = ctx.saved_tensors
    weights, lora_a, lora_b = rest[:2], rest[2:4], rest[4:]
    if x is None:  # not kept, not read for a gradient anyone asked for: a zero-stride stand-in
        x = grad_act.new_zeros(()).expand(ctx.x_shape)
    if xa is None:
        xa = grad_act.new_zeros(()).expand((*ctx.x_shape[:-1], sum(ctx.ranks)))
    grad_x, grad_a, grad_b = call_in_backward("lora_gated_group_backward", grad_act.contiguous(), gate, up, x,
                                              list(weights), list(lora_a), list(lora_b), xa, ctx.scales,
                                              ctx.activation, ctx.x_needs_grad)
    return (grad_x if ctx.x_needs_grad else None, [None, None], [None] * ctx.biases,
            [g if need else None for g, need in zip(grad_a.split(ctx.ranks), ctx.a_needs_grad)],
            [g if need else None for g, need in zip(grad_b, ctx.b_needs_grad)], None, None)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    torch.library.register_fake("hasten::lora_linear", _lora_linear_fake)
    torch.library.register_fake("hasten::lora_linear_backward", _lora_linear_backward_fake)
    register_autograd("lora_linear", _backward, setup_context=_setup)
    no_double_backward("lora_linear_backward")
    torch.library.register_fake("hasten::lora_linear_group", _lora_linear_group_fake)
    torch.library.register_fake("hasten::lora_linear_group_backward", _lora_linear_group_backward_fake)
    # the formula for torch.compile; eager calls take _EagerLoraGroup (the same two functions)
    torch.library.register_autograd("hasten::lora_linear_group", _backward_group, setup_context=_setup_group)
    no_double_backward("lora_linear_group_backward")
    torch.library.register_fake("hasten::lora_gated_group", _lora_gated_group_fake)
    torch.library.register_fake("hasten::lora_gated_group_backward", _lora_gated_group_backward_fake)
    torch.library.register_autograd("hasten::lora_gated_group", _backward_gated, setup_context=_setup_gated)
    no_double_backward("lora_gated_group_backward")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, x_lora: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) + scale * (x_lora A^T) B^T for a frozen W; x_lora: the LoRA path's input
    after dropout (None: x). Returns (..., out) in x's dtype."""
    load()
    return call("lora_linear", x, x_lora, weight, bias, lora_a, lora_b, float(scale))[0]


def lora_linear_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                      lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                      scales: list[float]) -> list[torch.Tensor]:
    """[x W_i^T (+ b_i) + s_i (x A_i^T) B_i^T for each member i]: frozen projections that read the
    same x (q/k/v, gate/up), without dropout on the LoRA path; `biases` empty (none) or one per
    member. One thin GEMM for all members' A, one read of x for all d A, and one d x the members'
    base GEMMs accumulate onto."""
    load()
    scales = [float(s) for s in scales]
    if torch.compiler.is_compiling():
        return torch.ops.hasten.lora_linear_group(x, list(weights), list(biases), list(lora_a), list(lora_b),
                                                  scales)[0]
    # the list lengths before they are flattened into one argument list (the kernel's own words)
    _check_group("lora_linear_group", weights, biases, lora_a, lora_b, scales)
    n = len(weights)
    outputs = _EagerLoraGroup.apply(n, len(biases) > 0, scales, x, *weights, *biases, *lora_a, *lora_b)
    return list(outputs[:n])


def lora_gated_group(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                     lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scales: list[float],
                     activation: str) -> torch.Tensor:
    """f(gate) * up for the group [gate, up] of lora_linear_group, f silu ("silu") or tanh GELU
    ("gelu_tanh"): the same kernels as the group and the activation one after the other, with one
    backward (on CUDA the activation's gradient and both members' thin products in one pass).
    Returns (..., out) in x's dtype."""
    load()
    return torch.ops.hasten.lora_gated_group(x, list(weights), list(biases), list(lora_a), list(lora_b),
                                             [float(s) for s in scales], activation)[0]


class _QuantizedLoraLinear(torch.autograd.Function):
    """hasten::lora_linear over a base weight that exists only quantized (QLoRA). An
    autograd.Function rather than a registered formula: the quantized weight comes with a Python
    object (bitsandbytes' QuantState) that no op schema takes, so the dequantization runs here,
    once in the forward and once in the backward (bitsandbytes' own 4-bit matmul does the same);
    the dequantized (out, in) weight lives for one GEMM, not until the backward."""

    @staticmethod
    def forward(ctx, x, x_lora, bias, lora_a, lora_b, scale, dequantize):
        weight = dequantize()  # (out, in) in x's dtype
        y, xa, adapters = torch.ops.hasten.lora_linear(x, x_lora, weight, bias, lora_a, lora_b, scale)
        ctx.dequantize, ctx.scale, ctx.shared_input = dequantize, scale, x_lora is None
        ctx.save_for_backward(x if x_lora is None else x_lora, lora_a, lora_b, xa, adapters)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_lora, lora_a, lora_b, xa, adapters = ctx.saved_tensors
        weight = ctx.dequantize()
        grad_x, grad_x_lora, grad_a, grad_b = torch.ops.hasten.lora_linear_backward(
            grad_y.contiguous(), x_lora, weight, lora_a, lora_b, xa, ctx.scale, ctx.shared_input, adapters)
        need = ctx.needs_input_grad
        return (grad_x if need[0] else None, None if ctx.shared_input or not need[1] else grad_x_lora, None,
                grad_a if need[3] else None, grad_b if need[4] else None, None, None)


def lora_linear_quantized(x: torch.Tensor, dequantize, bias: torch.Tensor | None, lora_a: torch.Tensor,
                          lora_b: torch.Tensor, scale: float, x_lora: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) + scale * (x_lora A^T) B^T with W = dequantize() (out, in) in x's dtype,
    called in the forward and again in the backward. The base weight and bias get no gradient."""
    load()
    if bias is not None and bias.requires_grad:
        raise NotImplementedError("hasten's quantized LoRA projection computes no gradient for the base bias")
    return _QuantizedLoraLinear.apply(x, x_lora, bias, lora_a, lora_b, float(scale), dequantize)
