"""MoE routing ops: grouping statistics, permute / combine with autograd, fused SwiGLU.

Shapes: T tokens, k choices per token, S = T * k slots (slot s = token s // k, choice
s % k), E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hasten.ops._lib import require_extension

require_extension()


@torch.library.register_fake("hasten::moe_group")
def _moe_group_fake(expert_ids, num_experts):
    slots = expert_ids.numel()
    new = expert_ids.new_empty
    return (new((num_experts,), dtype=torch.int32), new((num_experts + 1,), dtype=torch.int32),
            new((slots,), dtype=torch.int32), new((slots,), dtype=torch.int32))


@torch.library.register_fake("hasten::moe_permute")
def _moe_permute_fake(x, permutation, offsets, top_k, slot_scale=None):
    return x.new_empty((permutation.numel(), x.shape[1]))


@torch.library.register_fake("hasten::moe_combine")
def _moe_combine_fake(y, inverse, offsets, top_k, weights=None):
    return y.new_empty((inverse.numel() // top_k, y.shape[1]))


@torch.library.register_fake("hasten::moe_combine_weight_grad")
def _moe_combine_weight_grad_fake(grad_out, y, inverse, offsets, top_k):
    return y.new_empty((inverse.numel() // top_k, top_k))


@torch.library.register_fake("hasten::swiglu")
def _swiglu_fake(gate_up):
    return gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))


@torch.library.register_fake("hasten::swiglu_backward")
def _swiglu_backward_fake(grad_act, gate_up):
    return torch.empty_like(gate_up)


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
    counts, offsets, permutation, inverse = torch.ops.hasten.moe_group(expert_ids, num_experts)
    return Grouping(counts, offsets, permutation, inverse, expert_ids.shape[-1])


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: Grouping):
        ctx.g = g
        return torch.ops.hasten.moe_permute(x, g.permutation, g.offsets, g.top_k, None)

    @staticmethod
    def backward(ctx, grad):
        g = ctx.g
        # each token sums the gradients of its k slots: a gather, deterministic
        return torch.ops.hasten.moe_combine(grad.contiguous(), g.inverse, g.offsets, g.top_k, None), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, g: Grouping):
        ctx.g = g
        ctx.save_for_backward(y, weights)
        return torch.ops.hasten.moe_combine(y, g.inverse, g.offsets, g.top_k, weights)

    @staticmethod
    def backward(ctx, grad_out):
        g = ctx.g
        y, weights = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_y = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_y = torch.ops.hasten.moe_permute(grad_out, g.permutation, g.offsets, g.top_k, weights.reshape(-1))
        if ctx.needs_input_grad[1]:
            grad_weights = torch.ops.hasten.moe_combine_weight_grad(grad_out, y, g.inverse, g.offsets, g.top_k)
        return grad_y, grad_weights, None


class _Swiglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return torch.ops.hasten.swiglu(gate_up)

    @staticmethod
    def backward(ctx, grad_act):
        (gate_up,) = ctx.saved_tensors
        return torch.ops.hasten.swiglu_backward(grad_act.contiguous(), gate_up)


def permute(x: torch.Tensor, g: Grouping) -> torch.Tensor:
    """Tokens (T, H) -> slots in expert order (S, H); dropped slots are zero rows."""
    return _Permute.apply(x, g)


def combine(y: torch.Tensor, weights: torch.Tensor, g: Grouping) -> torch.Tensor:
    """Expert outputs in expert order (S, H) -> tokens (T, H), weighted by the router's (T, k)."""
    return _Combine.apply(y, weights, g)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[gate | up] rows (R, 2I) -> silu(gate) * up (R, I), one kernel each way."""
    return _Swiglu.apply(gate_up)
