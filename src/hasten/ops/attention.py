"""Packed attention with autograd: hasten::varlen_attention (cuDNN's fused SDPA on CUDA, a float32
per-sequence reference on the CPU), and hasten_py::varlen_attention_sinks on top of it.

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


# ---- attention sinks (gpt-oss) ------------------------------------------------------------------
# A sink is a learned logit per query head in the softmax's denominator only (no value): with the
# attention's own log-sum-exp L over the keys, the sink's LSE' = logaddexp(L, sink) and
#   out' = out * exp(L - LSE')                      (each row's probabilities scaled down)
# The gradient is the plain attention backward run with (out', LSE'): it recomputes the
# probabilities as exp(score - LSE') (the sink-normalised ones) and D = rowsum(dout' * out'), so
# dscore = P' (dP - D) is exact; the sink's own gradient is -sum over tokens of p_sink * D with
# p_sink = exp(sink - LSE'). cuDNN's backward and the CPU reference both take the statistics as
# given, which is what this relies on (the CPU reference is the tested definition).
@torch.library.custom_op("hasten_py::varlen_attention_sinks", mutates_args=())
def _varlen_attention_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float, causal: bool, window: int, softcap: float,
                            sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.hasten.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, softcap)
    lse_all = torch.logaddexp(lse, sinks.float().unsqueeze(0))  # (T, Hq)
    scaled = out.float() * torch.exp(lse - lse_all).unsqueeze(-1)
    covered = _covered_tokens(q, cu_seqlens)  # tokens past the last boundary: no attention, no sink
    return torch.where(covered[:, None, None], scaled, 0.0).to(out.dtype), torch.where(covered[:, None], lse_all, 0.0)


def _covered_tokens(q: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(T,) bool, on the device without a sync: the tokens inside cu_seqlens' last boundary."""
    return torch.arange(q.shape[0], device=q.device) < cu_seqlens[-1].to(q.device)


@_varlen_attention_sinks.register_fake
def _varlen_attention_sinks_fake(q, k, v, cu_seqlens, max_seqlen, scale, causal, window, softcap, sinks):
    _checks.check_varlen_attention_args("varlen_attention_sinks", q, k, v, cu_seqlens, max_seqlen)
    _checks.check_attention_window("varlen_attention_sinks", causal, window)
    _checks.check_attention_softcap("varlen_attention_sinks", softcap)
    _checks.check_attention_sinks("varlen_attention_sinks", q, sinks)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:2], dtype=torch.float32))


def _sinks_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale, causal, window, softcap, sinks = inputs
    out, lse_all = output
    ctx.mark_non_differentiable(lse_all)
    ctx.args = (max_seqlen, scale, causal, window, softcap)
    ctx.save_for_backward(q, k, v, out, lse_all, cu_seqlens, sinks)


def _sinks_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse_all, cu_seqlens, sinks = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grads = call_in_backward("varlen_attention_backward", grad_out, q, k, v, out, lse_all, cu_seqlens, *ctx.args)
    grad_sinks = None
    if ctx.needs_input_grad[9]:
        rows = (grad_out.float() * out.float()).sum(-1)  # (T, Hq): D = dout' . out'
        p_sink = torch.exp(sinks.float().unsqueeze(0) - lse_all)
        covered = _covered_tokens(q, cu_seqlens)[:, None]
        grad_sinks = -torch.where(covered, p_sink * rows, 0.0).sum(0).to(sinks.dtype)
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3])), None, None, None, None,
            None, None, grad_sinks)


_varlen_attention_sinks.register_autograd(_sinks_backward, setup_context=_sinks_setup)


def varlen_attention_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, sinks: torch.Tensor, scale: float | None = None, causal: bool = True,
                           window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """varlen_attention with one sink logit per query head, `sinks` (Hq,), in each softmax's
    denominator (gpt-oss's s_aux). Returns (T, Hq, D); `sinks` gets its gradient."""
    load()
    _checks.check_attention_sinks("varlen_attention_sinks", q, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _varlen_attention_sinks(q, k, v, cu_seqlens, int(max_seqlen), scale, bool(causal), int(window),
                                   float(softcap or 0.0), sinks)[0]
