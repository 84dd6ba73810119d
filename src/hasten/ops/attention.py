"""Packed attention with autograd: hasten::varlen_attention (cuDNN's fused SDPA on CUDA, a float32
per-sequence reference on the CPU).

Shapes: q (T, Hq, D), k and v (T, Hk, D) with Hq a multiple of Hk, cu_seqlens (N+1) int32,
max_seqlen >= the longest sequence (the CUDA path cannot check it without a host sync).
"""

from __future__ import annotations

import torch

from hasten.ops._lib import require_extension

require_extension()


@torch.library.register_fake("hasten::varlen_attention")
def _varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("hasten::varlen_attention_backward")
def _varlen_attention_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, causal):
        out, lse = torch.ops.hasten.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.max_seqlen, ctx.scale, ctx.causal = max_seqlen, scale, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        grad_q, grad_k, grad_v = torch.ops.hasten.varlen_attention_backward(
            grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale, ctx.causal)
        return grad_q, grad_k, grad_v, None, None, None, None


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Each packed sequence attends to itself only; returns (T, Hq, D)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _VarlenAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), scale, causal)
