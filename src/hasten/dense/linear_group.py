"""Sibling projections that read one tensor (attention's q/k/v, a gated MLP's gate/up) in full
fine-tuning, with one input gradient (kernels.fused_linear_groups).

Autograd gives each nn.Linear its own d x = g_i W_i and adds them with one kernel per member past
the first: two adds a layer for q/k/v and one for gate/up, each reading two (tokens, hidden) tensors
and writing one (84 of W1's step, about 24 us each on the H200). Here the first member called with
x computes every member's output (the same F.linear each) as one autograd node, whose backward
forms d x = g_0 W_0 and accumulates each further g_i W_i in the GEMM itself (addmm, beta 1: the
running sum read in the GEMM's epilogue, rounded once per member instead of twice), and each
weight's and bias's gradient as nn.Linear's backward does (g_i^T x, the sum of g_i).

The others' outputs wait until they are called with that very tensor, unchanged since; anything
else turns the group off for good, said once (`linear_group_off`; hasten/shared_input.py). Members
are nominated by name under one parent (SHARED_INPUT_NAMES, the LoRA groups' names) and must be
plain nn.Linear of one input size, biased alike. A call runs the member alone under torch.compile (no state between calls there), autocast,
without grad mode or any gradient to compute, with hooks on a member, or with weights of another
dtype or device than x.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hasten.instance_forward import has_call_hooks, replace_forward, restore_forward, without_hooked
from hasten.shared_input import SHARED_INPUT_NAMES, WaitingOutputs

_GROUP_ATTRIBUTE = "_hasten_linear_group"  # on each member: (its LinearGroup, its index)


class _SharedInputLinears(torch.autograd.Function):
    """(F.linear(x, W_i, b_i) for each member) with one d x (module docstring)."""

    @staticmethod
    def forward(ctx, x, count: int, *params):
        weights, biases = params[:count], params[count:] or (None,) * count
        ctx.count, ctx.biased = count, len(params) > count
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros
        ctx.save_for_backward(x, *weights)
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in)
        outputs = []
        for w, b in zip(weights, biases):
            # a tensor of its own, not a view of one made in here: models change a projection's
            # output in place (OLMo clamps q, k and v), which autograd refuses on such views
            y = x.new_empty(*x.shape[:-1], w.shape[0])
            if b is None:
                torch.mm(rows, w.t(), out=y.view(-1, w.shape[0]))
            else:
                torch.addmm(b, rows, w.t(), out=y.view(-1, w.shape[0]))
            outputs.append(y)
        return tuple(outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        count = ctx.count
        rows = x.reshape(-1, x.shape[-1])  # (tokens, in)
        grad_x, grad_weights, grad_biases = None, [None] * count, [None] * count
        for i, (grad, weight) in enumerate(zip(grads, weights)):
            if grad is None:
                continue
            grad = grad.reshape(-1, grad.shape[-1])  # (tokens, out_i)
            if ctx.needs_input_grad[0]:
                # the first member's product, then each further one added by its own GEMM
                grad_x = torch.mm(grad, weight) if grad_x is None else grad_x.addmm_(grad, weight)
            if ctx.needs_input_grad[2 + i]:
                grad_weights[i] = grad.t().mm(rows)
            if ctx.biased and ctx.needs_input_grad[2 + count + i]:
                grad_biases[i] = grad.sum(0)
        grad_x = grad_x.view(x.shape) if grad_x is not None else None
        return (grad_x, None, *grad_weights, *(grad_biases if ctx.biased else ()))


class LinearGroup(WaitingOutputs):
    """nn.Linear members of one parent that it feeds one tensor, computed together (module docstring)."""

    def __init__(self, members: list[nn.Linear], names: list[str]):
        super().__init__(names, "linear_group_off")
        self.members = members

    def _together(self, x: torch.Tensor) -> bool:
        """Whether this call computes every member (else the member runs alone)."""
        if self.off or torch.compiler.is_compiling() or not torch.is_grad_enabled() or torch.is_autocast_enabled():
            return False
        if not (x.requires_grad or any(m.weight.requires_grad for m in self.members)):
            return False
        return all(m.weight.dtype == x.dtype and m.weight.device == x.device and not has_call_hooks(m)
                   for m in self.members)

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        waiting = self.take(index, x)
        if waiting is not None:
            return waiting
        member = self.members[index]
        if not self._together(x):
            return F.linear(x, member.weight, member.bias)
        params = [m.weight for m in self.members] + ([m.bias for m in self.members] if member.bias is not None else [])
        return self.keep(index, x, _SharedInputLinears.apply(x, len(self.members), *params))


def _grouped_forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
    group, index = self.__dict__[_GROUP_ATTRIBUTE]
    return group.forward(index, input)


def linear_groups(model: nn.Module) -> list[LinearGroup]:
    """The groups SHARED_INPUT_NAMES nominates among `model`'s plain nn.Linear children: at least
    two siblings under one parent, one input size, a bias on every member or on none."""
    groups = []
    for parent_name, parent in model.named_modules():
        for names in SHARED_INPUT_NAMES:
            members = [(n, parent._modules.get(n)) for n in names]
            members = [(n, m) for n, m in members if type(m) is nn.Linear]
            if (len(members) < 2 or len({m.in_features for _, m in members}) != 1
                    or len({m.bias is None for _, m in members}) != 1):
                continue
            prefix = f"{parent_name}." if parent_name else ""
            groups.append(LinearGroup([m for _, m in members], [prefix + n for n, _ in members]))
    return groups


def install_linear_groups(model: nn.Module):
    """Give the members of each of `model`'s linear groups the grouped forward. Returns (undo,
    number of groups, reasons groups were left alone)."""
    groups, reasons = [], set()
    for group in linear_groups(model):
        kept, hooked = without_hooked(group.members)
        if hooked or any(_GROUP_ATTRIBUTE in m.__dict__ or "forward" in m.__dict__ for m in group.members):
            reasons.update(hooked or [f"{', '.join(group.names)}: a member's forward is replaced already"])
            continue
        for index, member in enumerate(kept):
            member.__dict__[_GROUP_ATTRIBUTE] = (group, index)
            replace_forward(member, types.MethodType(_grouped_forward, member))
        groups.append(group)

    def undo() -> None:
        for group in groups:
            for member in group.members:
                restore_forward(member)
                member.__dict__.pop(_GROUP_ATTRIBUTE, None)

    return undo, len(groups), sorted(reasons)
