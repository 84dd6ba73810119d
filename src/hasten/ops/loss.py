"""Loss ops: the chunked LM head + cross-entropy (hasten::linear_cross_entropy) with autograd.

Shapes: T tokens, H hidden size, V vocabulary. The op computes the gradients in its forward
pass (one pass over the vocabulary per chunk, logits never kept), and backward scales them by
the upstream gradient.
"""

from __future__ import annotations

import torch

from hasten.ops import _checks
from hasten.ops._lib import call, load, register_autograd

IGNORE_INDEX = -100


def _cross_entropy_rows_fake(logits, targets, grad_scale, ignore_index, label_smoothing, softcap):
    _checks.check_cross_entropy_rows_args(logits, targets, grad_scale, label_smoothing, softcap)
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


def _linear_cross_entropy_fake(hidden, weight, bias, targets, denominator, ignore_index, label_smoothing, softcap,
                               chunk_tokens, compute_grad, weight_grad=True):
    _checks.check_linear_cross_entropy_args(hidden, weight, bias, targets, denominator)
    _checks.check_smoothing_and_softcap(label_smoothing, softcap)
    loss = hidden.new_empty((), dtype=torch.float32)
    if not compute_grad:
        return loss, *(hidden.new_empty((0,)) for _ in range(3))  # three tensors, as the kernel: none aliases
    grad_bias = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,))
    grad_weight = weight.new_empty(weight.shape) if weight_grad else weight.new_empty((0,))
    return loss, hidden.new_empty(hidden.shape), grad_weight, grad_bias


def _setup(ctx, inputs, output):
    bias, compute_grad = inputs[2], inputs[9]
    weight_grad = inputs[10] if len(inputs) > 10 else True  # the schema's default, where a caller leaves it
    _loss, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)
    if any(ctx.needs_input_grad[3:5]):
        raise NotImplementedError("hasten::linear_cross_entropy has no gradient for targets or denominator")
    if any(ctx.needs_input_grad[:3]) and not compute_grad:
        raise RuntimeError("hasten::linear_cross_entropy was called with compute_grad=False on inputs that need a "
                           "gradient; call hasten.ops.loss.linear_cross_entropy, which sets it")
    if ctx.needs_input_grad[1] and not weight_grad:
        raise RuntimeError("hasten::linear_cross_entropy was called with weight_grad=False on a weight that needs a "
                           "gradient; call hasten.ops.loss.linear_cross_entropy, which sets it")
    ctx.has_bias = bias is not None
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)


def _backward(ctx, grad_loss, *_unused):
    grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
    scale = grad_loss.to(grad_hidden.dtype)  # a device scalar: no host sync
    return (grad_hidden * scale if ctx.needs_input_grad[0] else None,
            grad_weight * scale if ctx.needs_input_grad[1] else None,
            grad_bias * scale if ctx.has_bias and ctx.needs_input_grad[2] else None,
            None, None, None, None, None, None, None, None)


def _register() -> None:
    """Run once by hasten.ops._lib.load(), after hasten._C defined the schemas."""
    torch.library.register_fake("hasten::cross_entropy_rows_", _cross_entropy_rows_fake)
    torch.library.register_fake("hasten::linear_cross_entropy", _linear_cross_entropy_fake)
    register_autograd("linear_cross_entropy", _backward, setup_context=_setup)


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
    load()
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(torch.long)
    if num_items_in_batch is None:
        denominator = (flat_targets != ignore_index).sum().to(torch.float32)
    else:
        denominator = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    # the gradients come out of the forward pass (no logits are kept), so the forward must know
    compute_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    # a frozen LM head (LoRA) needs no (V, H) gradient: no float32 accumulator, one GEMM per chunk fewer
    weight_grad = compute_grad and weight.requires_grad
    loss = call("linear_cross_entropy", hidden2d, weight, bias, flat_targets, denominator, int(ignore_index),
                                                 float(label_smoothing), float(softcap or 0.0), int(chunk_tokens),
                                                 compute_grad, weight_grad)[0]
    return loss
