"""Packed attention with autograd: hasten::varlen_attention (cuDNN's fused SDPA on CUDA, a float32
per-sequence reference on the CPU).

Shapes: q (T, Hq, D), k and v (T, Hk, D) with Hq a multiple of Hk, cu_seqlens (N+1) int32,
max_seqlen >= the longest sequence (the CUDA path cannot check it without a host sync).
"""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, call_in_backward, load, no_double_backward, register_autograd


def _varlen_attention_fake(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, softcap):
    _checks.check_varlen_attention_args("varlen_attention", q, k, v, cu_seqlens, max_seqlen)
    _checks.check_attention_window("varlen_attention", causal, window)
    _checks.check_attention_softcap("varlen_attention", softcap)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32))


def _varlen_attention_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, causal, window,
                                    softcap):
    _checks.check_varlen_attention_backward_args(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen)
    _checks.check_attention_window("varlen_attention_backward", causal, window)
    _checks.check_attention_softcap("varlen_attention_backward", softcap)
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, causal, window, softcap = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the softmax statistics: saved for the backward, not a result
    ctx.args = (max_seqlen, scale, causal, window, softcap)
    # the fused backward computes dq, dk and dv together from all of these
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    grads = call_in_backward("varlen_attention_backward", grad_out, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3])), None, None, None, None,
            None, None)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    torch.library.register_fake("hasten::varlen_attention", _varlen_attention_fake)
    torch.library.register_fake("hasten::varlen_attention_backward", _varlen_attention_backward_fake)
    register_autograd("varlen_attention", _backward, setup_context=_setup)
    no_double_backward("varlen_attention_backward")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     scale: float | None = None, causal: bool = True, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Each packed sequence attends to itself only; returns (T, Hq, D). window W > 0 (causal): a
    query sees itself and the W - 1 tokens before it (transformers' sliding_window). softcap c > 0:
    the scaled scores s become c * tanh(s / c) before the mask (Gemma 2)."""
    load()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return call("varlen_attention", q, k, v, cu_seqlens, max_seqlen, scale, causal, int(window),
                float(softcap or 0.0))[0]
