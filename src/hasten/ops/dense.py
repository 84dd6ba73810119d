"""Dense-path ops with autograd: RMSNorm, SwiGLU on two tensors (silu_mul), rotary embedding.

Shapes: x (..., H) for RMSNorm; gate and up (..., I) for silu_mul; q or k (B, heads, L, D) with
cos, sin (B or 1, L, D) for rope. Each is one kernel forward and one backward (csrc/).
"""

from __future__ import annotations

import torch

from hasten.ops._lib import require_extension

require_extension()


@torch.library.register_fake("hasten::rms_norm")
def _rms_norm_fake(x, weight, eps, offset):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("hasten::rms_norm_backward")
def _rms_norm_backward_fake(grad_y, x, weight, rstd, offset):
    return torch.empty_like(x), torch.empty_like(weight)


@torch.library.register_fake("hasten::silu_mul")
def _silu_mul_fake(gate, up):
    return torch.empty_like(gate)


@torch.library.register_fake("hasten::silu_mul_backward")
def _silu_mul_backward_fake(grad_act, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


@torch.library.register_fake("hasten::rope")
def _rope_fake(x, cos, sin, backward):
    return torch.empty_like(x)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        y, rstd = torch.ops.hasten.rms_norm(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.hasten.rms_norm_backward(grad_y, x, weight, rstd, ctx.offset)
        return grad_x, grad_weight, None, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.ops.hasten.silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_act):
        gate, up = ctx.saved_tensors
        return torch.ops.hasten.silu_mul_backward(grad_act, gate, up)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.ops.hasten.rope(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return torch.ops.hasten.rope(grad, cos, sin, True), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """(weight + offset) * (x * rsqrt(mean(x^2) + eps)), the normalised value cast to x's dtype
    before the weight multiplies it (transformers' Llama/Qwen order)."""
    return _RmsNorm.apply(x, weight, float(eps), float(offset))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one kernel; backward keeps only gate and up."""
    return _SiluMul.apply(gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x (B, heads, L, D), cos/sin (B or 1, L, D)."""
    return _Rope.apply(x, cos, sin)
