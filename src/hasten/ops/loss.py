"""Loss ops: the chunked LM head + cross-entropy (hasten::linear_cross_entropy) with autograd.

Shapes: T tokens, H hidden size, V vocabulary. The op computes the gradients in its forward
pass (one pass over the vocabulary per chunk, logits never kept), and backward scales them by
the upstream gradient.
"""

from __future__ import annotations

import torch

from hasten.ops._lib import require_extension

require_extension()

IGNORE_INDEX = -100


@torch.library.register_fake("hasten::cross_entropy_rows_")
def _cross_entropy_rows_fake(logits, targets, grad_scale, ignore_index, label_smoothing, softcap):
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


@torch.library.register_fake("hasten::linear_cross_entropy")
def _linear_cross_entropy_fake(hidden, weight, bias, targets, denominator, ignore_index, label_smoothing, softcap,
                               chunk_tokens, compute_grad):
    loss = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        empty = hidden.new_empty((0,))
        return loss, empty, empty, empty
    grad_bias = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,))
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), grad_bias


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, denominator, ignore_index, label_smoothing, softcap, chunk_tokens):
        compute_grad = any(ctx.needs_input_grad[:3])
        loss, grad_hidden, grad_weight, grad_bias = torch.ops.hasten.linear_cross_entropy(
            hidden, weight, bias, targets, denominator, ignore_index, label_smoothing, softcap, chunk_tokens,
            compute_grad)
        ctx.has_bias = bias is not None
        if compute_grad:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)  # a device scalar: no host sync
        return (grad_hidden * scale if ctx.needs_input_grad[0] else None,
                grad_weight * scale if ctx.needs_input_grad[1] else None,
                grad_bias * scale if ctx.has_bias and ctx.needs_input_grad[2] else None,
                None, None, None, None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: torch.Tensor | None = None, num_items_in_batch: int | torch.Tensor | None = None,
                         ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                         softcap: float | None = None, chunk_tokens: int = 0) -> torch.Tensor:
    """mean cross-entropy of `hidden @ weight.T (+ bias)` against `targets`, without materialising
    the (T, V) logits.

    hidden (..., H) and targets (...) are flattened; targets are the next-token labels already
    shifted (ignore_index where there is none). The mean is over `num_items_in_batch` when given
    (transformers' semantics: the count of target tokens across gradient accumulation and ranks),
    else over this call's non-ignored targets.
    """
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(torch.long)
    if num_items_in_batch is None:
        denominator = (flat_targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    return _LinearCrossEntropy.apply(hidden2d, weight, bias, flat_targets, denominator, int(ignore_index),
                                     float(label_smoothing), float(softcap or 0.0), int(chunk_tokens))
