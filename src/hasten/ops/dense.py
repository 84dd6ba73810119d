"""Dense-path ops with autograd: RMSNorm (and the residual add before it, add_rms_norm), gated MLP
products on two tensors (silu_mul for SwiGLU, gelu_tanh_mul for GeGLU), rotary embedding.

Shapes: x (..., H) for RMSNorm; gate and up (..., I) for silu_mul and gelu_tanh_mul; q or k
(B, heads, L, D) with cos, sin (B or 1, L, R), R <= D the rotary dim, for rope and for
rms_norm_rope (a head norm over D, then rope). Each is one kernel forward and one backward (csrc/).
The autograd formulas are registered on the ops themselves (torch.library.register_autograd), so
torch.compile and AOTAutograd see one op each way, and the saved tensors are what the backward
needs for the inputs that require a gradient.
"""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, call_in_backward, load, no_double_backward, register_autograd


def _rms_norm_fake(x, weight, eps, offset):
    _checks.check_rms_norm_args("rms_norm", x, weight)
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _rms_norm_backward_fake(grad_y, x, weight, rstd, offset, weight_grad=True, grad_add=None):
    _checks.check_rms_norm_backward_args(grad_y, x, weight, rstd)
    if grad_add is not None:
        _checks.check_grad_add(grad_add, x)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight) if weight_grad else weight.new_empty((0,)))


def _add_rms_norm_fake(x, residual, weight, eps, offset):
    _checks.check_add_rms_norm_args(x, residual, weight)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32))


def _gated_mul_fake(op: str):
    """The fake of silu_mul or gelu_tanh_mul: (..., I) contiguous, like the kernels' output."""
    def fake(gate, up):
        _checks.check_gated_mul_args(op, gate, up)
        return torch.empty_like(gate, memory_format=torch.contiguous_format)
    return fake


def _gated_mul_backward_fake(op: str):
    def fake(grad_act, gate, up):
        _checks.check_gated_mul_backward_args(op, grad_act, gate, up)
        return (torch.empty_like(gate, memory_format=torch.contiguous_format),
                torch.empty_like(up, memory_format=torch.contiguous_format))
    return fake


def _rope_fake(x, cos, sin, backward, interleaved):
    _checks.check_rope_args(x, cos, sin)
    return torch.empty_like(x)  # the kernel keeps x's strides (q and k arrive transposed)


def _rms_norm_rope_fake(x, weight, cos, sin, eps, offset, interleaved):
    _checks.check_rms_norm_rope_args("rms_norm_rope", x, weight, cos, sin)
    # out keeps x's strides (q and k arrive transposed); rstd (B, H, L) contiguous
    return torch.empty_like(x), x.new_empty(x.shape[:3], dtype=torch.float32)


def _rms_norm_rope_backward_fake(grad_out, x, weight, rstd, cos, sin, offset, interleaved, weight_grad=True):
    _checks.check_rms_norm_rope_backward_args(grad_out, x, weight, rstd, cos, sin)
    return torch.empty_like(x), torch.empty_like(weight) if weight_grad else weight.new_empty((0,))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _eps, offset = inputs
    _y, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.offset = offset
    # the kernel's backward computes both gradients from x, weight and rstd
    ctx.save_for_backward(x, weight, rstd)


def _rms_norm_grads(ctx, grad_y, grad_add=None):
    """(d x, d weight, None, None) from what _rms_norm_setup saved; `grad_add`, a gradient of x from
    elsewhere, summed into d x in the same kernel."""
    x, weight, rstd = ctx.saved_tensors
    # a frozen weight (LoRA): the kernel skips the weight gradient's per-block sums
    grad_x, grad_weight = call_in_backward("rms_norm_backward", grad_y, x, weight, rstd, ctx.offset,
                                           ctx.needs_input_grad[1], grad_add)
    return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
            None, None)


def _rms_norm_backward(ctx, grad_y, _grad_rstd):
    return _rms_norm_grads(ctx, grad_y)


def _add_rms_norm_setup(ctx, inputs, output):
    _x, _residual, weight, _eps, offset = inputs
    _y, total, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.offset = offset
    ctx.save_for_backward(total, weight, rstd)  # the norm's backward reads the sum, not its parts


def _add_rms_norm_backward(ctx, grad_y, grad_sum, _grad_rstd):
    """d sum = the norm's backward + the sum's own gradient (the residual stream), in one kernel;
    x and residual both get it (d(x + r)/dx = d(x + r)/dr = 1)."""
    total, weight, rstd = ctx.saved_tensors
    # an unused output's gradient arrives as zeros (autograd materialises it), never None
    grad, grad_weight = call_in_backward("rms_norm_backward", grad_y, total, weight, rstd, ctx.offset,
                                         ctx.needs_input_grad[2], grad_sum)
    return (grad if ctx.needs_input_grad[0] else None, grad if ctx.needs_input_grad[1] else None,
            grad_weight if ctx.needs_input_grad[2] else None, None, None)


def _gated_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)  # both gradients need both gate and up


def _gated_mul_backward(backward_op: str):
    """The formula of silu_mul or gelu_tanh_mul: its backward op, one kernel for both gradients."""
    def backward(ctx, grad_act):
        gate, up = ctx.saved_tensors
        grad_gate, grad_up = call_in_backward(backward_op, grad_act, gate, up)
        return grad_gate if ctx.needs_input_grad[0] else None, grad_up if ctx.needs_input_grad[1] else None
    return backward


def _rope_setup(ctx, inputs, output):
    x, cos, sin, backward, interleaved = inputs
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        raise NotImplementedError("hasten::rope has no gradient for cos and sin (transformers computes them without "
                                  "one); detach them, or leave this model's rotary embedding to transformers")
    ctx.backward = backward
    ctx.interleaved = interleaved
    ctx.save_for_backward(cos, sin)


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    if grad.stride(-1) != 1:  # e.g. the expanded gradient of a sum; the kernel reads rows of head_dim
        grad = grad.contiguous()
    # the rotation's gradient map is its transpose: the same op with `backward` flipped, the same
    # pairs; the pass-through features' gradient passes through
    return call_in_backward("rope", grad, cos, sin, not ctx.backward, ctx.interleaved), None, None, None, None


def _rms_norm_rope_setup(ctx, inputs, output):
    x, weight, cos, sin, _eps, offset, interleaved = inputs
    _out, rstd = output
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise NotImplementedError("hasten::rms_norm_rope has no gradient for cos and sin (transformers computes them "
                                  "without one); detach them, or leave this model's rotary embedding to transformers")
    ctx.mark_non_differentiable(rstd)
    ctx.offset = offset
    ctx.interleaved = interleaved
    # what rms_norm saves (x, weight, rstd) and what rope saves (cos, sin): no more than the two ops
    ctx.save_for_backward(x, weight, rstd, cos, sin)


def _rms_norm_rope_backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd, cos, sin = ctx.saved_tensors
    if grad_out.stride(-1) != 1:  # e.g. the expanded gradient of a sum; the kernel reads rows of head_dim
        grad_out = grad_out.clone(memory_format=torch.contiguous_format)  # also when empty (contiguous() keeps it)
    grad_x, grad_weight = call_in_backward("rms_norm_rope_backward", grad_out, x, weight, rstd, cos, sin, ctx.offset,
                                           ctx.interleaved, ctx.needs_input_grad[1])
    return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
            None, None, None, None, None)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    lib = "hasten::"
    torch.library.register_fake(lib + "rms_norm", _rms_norm_fake)
    torch.library.register_fake(lib + "rms_norm_backward", _rms_norm_backward_fake)
    torch.library.register_fake(lib + "add_rms_norm", _add_rms_norm_fake)
    for op in ("silu_mul", "gelu_tanh_mul"):
        torch.library.register_fake(lib + op, _gated_mul_fake(op))
        torch.library.register_fake(lib + op + "_backward", _gated_mul_backward_fake(op + "_backward"))
        register_autograd(op, _gated_mul_backward(op + "_backward"), setup_context=_gated_mul_setup)
    torch.library.register_fake(lib + "rope", _rope_fake)
    register_autograd("rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
    register_autograd("add_rms_norm", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)
    register_autograd("rope", _rope_backward, setup_context=_rope_setup)
    torch.library.register_fake(lib + "rms_norm_rope", _rms_norm_rope_fake)
    torch.library.register_fake(lib + "rms_norm_rope_backward", _rms_norm_rope_backward_fake)
    register_autograd("rms_norm_rope", _rms_norm_rope_backward, setup_context=_rms_norm_rope_setup)
    for op in ("rms_norm_backward", "rms_norm_rope_backward", "silu_mul_backward", "gelu_tanh_mul_backward"):
        no_double_backward(op)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """(weight + offset) * (x * rsqrt(mean(x^2) + eps)), the normalised value cast to x's dtype
    before the weight multiplies it (transformers' Llama/Qwen order)."""
    load()
    return call("rms_norm", x, weight, float(eps), float(offset))[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) for s = x + residual: a pre-norm decoder's `h = residual + x` and the norm
    after it in one kernel each way (s rounded to x's dtype as the separate add rounds it)."""
    load()
    y, total, _rstd = call("add_rms_norm", x, residual, weight, float(eps), float(offset))
    return y, total


class _RmsNormPassingInput(torch.autograd.Function):
    """(rms_norm(x), x as a view) whose backward is rms_norm_backward with the view's gradient as
    grad_add: a pre-norm layer's `residual = h; h = norm(h)`, where `residual` carries the stream's
    gradient back to h, gets that gradient and the norm's summed in the norm's kernel, not in an
    add autograd would make (one (T, hidden) read and write less a layer). An autograd.Function,
    not a registered op: an op's output may not alias its input, and a copy would cost what the
    add costs. Not under torch.compile (the caller runs the two statements there)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        y, rstd = torch.ops.hasten.rms_norm(x, weight, eps, offset)  # grad mode is off in here
        ctx.offset = offset
        ctx.save_for_backward(x, weight, rstd)  # what _rms_norm_setup saves: one backward for both
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, grad_y, grad_passed):
        # an output that did not reach the loss arrives as zeros (materialized), never None
        return _rms_norm_grads(ctx, grad_y, grad_passed)


def rms_norm_passing_input(x: torch.Tensor, weight: torch.Tensor, eps: float,
                           offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x as a view): the view's gradient joins the norm's in the norm's backward
    kernel (grad_add). For x that needs a gradient, outside torch.compile."""
    load()
    return _RmsNormPassingInput.apply(x, weight, float(eps), float(offset))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one kernel; backward keeps only gate and up."""
    load()
    return call("silu_mul", gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up in one kernel (GeGLU, Gemma's MLP); backward keeps only
    gate and up."""
    load()
    return call("gelu_tanh_mul", gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding of x (B, heads, L, D) with cos, sin (B or 1, L, R), R even, R <= D: the
    first R features become x * cos + rotate(x) * sin, the other D - R pass through unchanged
    (partial rotary). rotate pairs (j, j + R/2) (transformers' rotate_half), or with
    interleaved=True (2j, 2j + 1) (GLM, Cohere: x[..., ::2] and x[..., 1::2]). The output keeps
    x's strides; cos and sin get no gradient."""
    load()
    return call("rope", x, cos, sin, False, bool(interleaved))


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                  offset: float = 0.0, interleaved: bool = False) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps, offset), cos, sin, interleaved) in one kernel each way: a head
    norm (x (B, heads, L, D) normed over D, weight (D,)) and the rotary embedding after it, as
    Qwen3's and Gemma 3's attention apply q_norm / k_norm and then apply_rotary_pos_emb. The values
    of the two ops one after the other; cos and sin of x's dtype, no gradient for them. The output
    keeps x's strides. On CUDA only the shapes `rms_norm_rope_covers` accepts."""
    load()
    return call("rms_norm_rope", x, weight, cos, sin, float(eps), float(offset), bool(interleaved))[0]


def rms_norm_rope_covers(x: torch.Tensor, rotary_dim: int, interleaved: bool) -> bool:
    """Whether hasten::rms_norm_rope takes x (B, heads, L, D) with this rotary dim on x's device
    (csrc/kernels/rms_norm_rope.cuh rms_norm_rope_fits; the CPU reference takes every shape rope
    and rms_norm take)."""
    if x.device.type != "cuda":
        return True
    vector = 16 // x.element_size()
    dim = x.shape[-1]
    if dim <= 0 or dim % vector or dim // vector > 32 or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > dim:
        return False
    return rotary_dim % vector == 0 if interleaved else (rotary_dim // 2) % vector == 0
