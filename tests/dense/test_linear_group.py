"""kernels.fused_linear_groups (hasten/dense/linear_group.py): sibling nn.Linear projections fed one
tensor, computed together with one input gradient, against the same modules run one by one (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hasten.dense.linear_group import install_linear_groups
from hasten.observability import fallback_reasons, reset_fallbacks


class Attention(nn.Module):
    def __init__(self, bias: bool, hidden=12, q=16, kv=8):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, n, bias=bias) for n in (q, kv, kv))

    def forward(self, x, use_v=True):
        q, k = self.q_proj(x), self.k_proj(x)
        out = (q[..., :8] * k).sum(-1)
        return out + self.v_proj(x).sum(-1) if use_v else out


def _grads(module, x, **kwargs):
    x = x.detach().clone().requires_grad_()
    out = module(x, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("use_v", [True, False], ids=["all_used", "v_unused"])
def test_grouped_projections_give_the_separate_ones_gradients(bias, use_v):
    torch.manual_seed(0)
    plain = Attention(bias).double()
    grouped = copy.deepcopy(plain)
    undo, count, reasons = install_linear_groups(grouped)
    assert (count, reasons) == (1, [])
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    want, got = _grads(plain, x, use_v=use_v), _grads(grouped, x, use_v=use_v)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for name, grad in want[2].items():
        if grad is None:  # v unused: no gradient for its parameters, as one by one
            assert got[2][name] is None, name
        else:
            torch.testing.assert_close(got[2][name], grad, msg=name)
    undo()
    assert not any("forward" in m.__dict__ for m in grouped.modules())


def test_frozen_weights_and_an_input_without_gradient():
    torch.manual_seed(1)
    plain = Attention(True)
    grouped = copy.deepcopy(plain)
    install_linear_groups(grouped)
    for p in (*plain.parameters(), *grouped.parameters()):
        p.requires_grad_(False)
    x = torch.randn(3, 12)
    want, got = _grads(plain, x), _grads(grouped, x)  # only d x
    torch.testing.assert_close(got[1], want[1])
    for p in (*plain.parameters(), *grouped.parameters()):
        p.requires_grad_(True)
    x = torch.randn(3, 12)  # and only the weights' gradients
    out_plain, out_grouped = plain(x).sum(), grouped(x).sum()
    out_plain.backward()
    out_grouped.backward()
    for (name, p), q in zip(plain.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_a_parent_that_feeds_another_tensor_turns_its_group_off_and_says_so():
    torch.manual_seed(2)
    grouped = Attention(False)
    install_linear_groups(grouped)
    group = grouped.q_proj.__dict__["_hasten_linear_group"][0]
    reset_fallbacks()
    x, other = torch.randn(4, 12, requires_grad=True), torch.randn(4, 12)
    grouped.q_proj(x)
    k = grouped.k_proj(other)  # cross-attention-like: k and v from another tensor
    torch.testing.assert_close(k, other @ grouped.k_proj.weight.t())  # computed for `other`, not taken
    assert group.off and "linear_group_off" in fallback_reasons()
    q = grouped.q_proj(x)  # one by one from now on
    torch.testing.assert_close(q, x @ grouped.q_proj.weight.t())


def test_an_input_changed_in_place_between_members_is_not_served_stale_outputs():
    torch.manual_seed(3)
    grouped = Attention(False)
    install_linear_groups(grouped)
    x = torch.randn(4, 12)
    w = torch.randn(12, requires_grad=True)
    h = x * w  # needs a gradient: the group computes
    grouped.q_proj(h)
    with torch.no_grad():
        h.mul_(2)
    k = grouped.k_proj(h)
    torch.testing.assert_close(k, h @ grouped.k_proj.weight.t())


def test_no_group_under_no_grad_and_for_other_modules():
    torch.manual_seed(4)
    grouped = Attention(True)
    install_linear_groups(grouped)
    group = grouped.q_proj.__dict__["_hasten_linear_group"][0]
    with torch.no_grad():
        grouped(torch.randn(2, 12))
    assert group.waiting_for is None and not group.off

    class Mixed(nn.Module):  # a subclass of nn.Linear is not a plain projection: no group
        def __init__(self):
            super().__init__()
            self.gate_proj = type("Mine", (nn.Linear,), {})(4, 6)
            self.up_proj = nn.Linear(4, 6)

    assert install_linear_groups(Mixed())[1] == 0
