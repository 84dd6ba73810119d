"""A frozen base projection and its LoRA update in one op (hasten::lora_linear), with autograd.

Shapes: x (..., in), weight (out, in) frozen, lora_a (r, in), lora_b (out, r), scale the LoRA
scaling. y = x W^T (+ bias) + scale * (x_lora A^T) B^T, with x_lora = dropout(x) or x itself.
What autograd keeps: x_lora (x itself without dropout, which the caller holds anyway: q, k and v
of one layer keep one tensor between them), xa = x_lora A^T (..., r), and references to the
weights. No gradient for the base weight or bias: the op refuses them requiring one.

`lora_linear_quantized`: the same over a quantized base (bitsandbytes NF4/FP4, QLoRA), the weight
dequantized by the caller's function for the forward and again for the backward, never kept.
"""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, call_in_backward, load, no_double_backward, register_autograd


def _lora_linear_fake(x, x_lora, weight, bias, lora_a, lora_b, scale):
    _checks.check_lora_linear_args("lora_linear", x, x_lora, weight, bias, lora_a, lora_b)
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((*x.shape[:-1], lora_a.shape[0]))


def _lora_linear_backward_fake(grad_y, x_lora, weight, lora_a, lora_b, xa, scale, shared_input):
    _checks.check_lora_linear_backward_args(grad_y, x_lora, weight, lora_a, lora_b, xa)
    grad_x_lora = x_lora.new_empty((0,)) if shared_input else x_lora.new_empty(x_lora.shape)
    return x_lora.new_empty(x_lora.shape), grad_x_lora, lora_a.new_empty(lora_a.shape), lora_b.new_empty(lora_b.shape)


def _setup(ctx, inputs, output):
    x, x_lora, weight, bias, lora_a, lora_b, scale = inputs
    _y, xa = output
    ctx.mark_non_differentiable(xa)  # kept for the backward, not a result
    if ctx.needs_input_grad[2] or (bias is not None and ctx.needs_input_grad[3]):
        raise NotImplementedError("hasten::lora_linear computes no gradient for the base weight or bias: it is for a "
                                  "frozen base layer (requires_grad=False)")
    ctx.shared_input, ctx.scale, ctx.x_shape = x_lora is None, scale, x.shape
    # d lora_a reads x_lora (x itself without dropout), d lora_b reads xa; d x reads the weights only
    ctx.save_for_backward((x if x_lora is None else x_lora) if ctx.needs_input_grad[4] else None, weight, lora_a,
                          lora_b, xa if ctx.needs_input_grad[5] else None)


def _backward(ctx, grad_y, _grad_xa):
    x_lora, weight, lora_a, lora_b, xa = ctx.saved_tensors
    # what was not kept is not read for a gradient anyone asked for: zero-stride stand-ins, no memory
    if x_lora is None:
        x_lora = grad_y.new_zeros(()).expand(ctx.x_shape)
    if xa is None:
        xa = grad_y.new_zeros(()).expand((*ctx.x_shape[:-1], lora_a.shape[0]))
    grad_x, grad_x_lora, grad_a, grad_b = call_in_backward("lora_linear_backward", grad_y.contiguous(), x_lora, weight,
                                                           lora_a, lora_b, xa, ctx.scale, ctx.shared_input)
    need = ctx.needs_input_grad
    return (grad_x if need[0] else None, None if ctx.shared_input or not need[1] else grad_x_lora, None, None,
            grad_a if need[4] else None, grad_b if need[5] else None, None)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    torch.library.register_fake("hasten::lora_linear", _lora_linear_fake)
    torch.library.register_fake("hasten::lora_linear_backward", _lora_linear_backward_fake)
    register_autograd("lora_linear", _backward, setup_context=_setup)
    no_double_backward("lora_linear_backward")


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scale: float, x_lora: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) + scale * (x_lora A^T) B^T for a frozen W; x_lora: the LoRA path's input
    after dropout (None: x). Returns (..., out) in x's dtype."""
    load()
    return call("lora_linear", x, x_lora, weight, bias, lora_a, lora_b, float(scale))[0]


class _QuantizedLoraLinear(torch.autograd.Function):
    """hasten::lora_linear over a base weight that exists only quantized (QLoRA). An
    autograd.Function rather than a registered formula: the quantized weight comes with a Python
    object (bitsandbytes' QuantState) that no op schema takes, so the dequantization runs here,
    once in the forward and once in the backward (bitsandbytes' own 4-bit matmul does the same);
    the dequantized (out, in) weight lives for one GEMM, not until the backward."""

    @staticmethod
    def forward(ctx, x, x_lora, bias, lora_a, lora_b, scale, dequantize):
        weight = dequantize()  # (out, in) in x's dtype
        y, xa = torch.ops.hasten.lora_linear(x, x_lora, weight, bias, lora_a, lora_b, scale)
        ctx.dequantize, ctx.scale, ctx.shared_input = dequantize, scale, x_lora is None
        ctx.save_for_backward(x if x_lora is None else x_lora, lora_a, lora_b, xa)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_lora, lora_a, lora_b, xa = ctx.saved_tensors
        weight = ctx.dequantize()
        grad_x, grad_x_lora, grad_a, grad_b = torch.ops.hasten.lora_linear_backward(
            grad_y.contiguous(), x_lora, weight, lora_a, lora_b, xa, ctx.scale, ctx.shared_input)
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
