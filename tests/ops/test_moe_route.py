"""hasten::moe_route on the CPU against the routers it stands in for (tests/ops/route_reference.py):
weights, ids and the logits' gradient, in float64 (equal to rounding) and float32."""

from __future__ import annotations

import pytest
import torch

from hasten.ops import moe as moe_ops
from tests.ops.route_reference import by_expert, recipes

SHAPES = [(1, 8, 2), (37, 60, 4), (5, 7, 3), (23, 128, 8), (3, 256, 8), (2, 33, 33 // 2)]


def _logits(tokens, experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_route_equals_the_models_router_forward_and_backward(shape, dtype):
    tokens, experts, top_k = shape
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(1), dtype=dtype) * 0.3
    tolerance = 1e-13 if dtype == torch.float64 else 2e-6
    for seed, (name, (reference, args)) in enumerate(recipes(experts, top_k, bias).items()):
        logits = _logits(tokens, experts, dtype, seed=seed).requires_grad_()
        want_w, want_ids = reference(logits)
        got_w, got_ids = moe_ops.route(logits, *args)
        assert got_ids.dtype == torch.int64 and got_w.shape == (tokens, top_k)
        assert torch.equal(want_ids.sort(-1).values, got_ids.sort(-1).values), name
        want_dense, got_dense = by_expert(want_w, want_ids, experts), by_expert(got_w.to(dtype), got_ids, experts)
        torch.testing.assert_close(got_dense, want_dense, rtol=tolerance, atol=tolerance, msg=name)
        # the same gradient per (token, expert) on both sides
        grad = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(2), dtype=dtype)
        (want_grad,) = torch.autograd.grad((want_dense * grad).sum(), logits)
        (got_grad,) = torch.autograd.grad((by_expert(got_w, got_ids, experts) * grad.to(got_w.dtype)).sum(), logits)
        scale = want_grad.abs().max().clamp_min(1e-30)
        assert float((got_grad - want_grad).abs().max() / scale) <= tolerance * 10, name


def test_ties_go_to_the_lower_expert_and_ids_come_in_rank_order():
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.5, 1.0]])
    weights, ids = moe_ops.route(logits, 3)
    assert ids.tolist() == [[1, 2, 4]]
    weights, ids = moe_ops.route(torch.tensor([[0.1, 3.0, -1.0, 2.0]]), 2, "topk_softmax")
    assert ids.tolist() == [[1, 3]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))


def test_a_chosen_expert_outside_the_kept_groups_weighs_the_masked_value_without_gradient():
    # DeepSeek-V2's 0.0 mask, 2 groups of 2, one kept ({2, 3}); expert 3's score underflows to 0.0
    # and ties with the masked experts' 0.0: the lower expert (0, masked) is second
    logits = torch.tensor([[-800.0, -800.0, 5.0, -800.0]], dtype=torch.float64, requires_grad=True)
    weights, ids = moe_ops.route(logits, 2, "softmax", False, 0.0, 3.0, 2, 1, "max", 0.0)
    assert ids.tolist() == [[2, 0]]
    assert weights.tolist() == [[3.0, 0.0]]
    grad = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    (d_logits,) = torch.autograd.grad(weights, logits, grad)
    assert torch.equal(d_logits, torch.zeros_like(d_logits))
    # with a selection bias the chosen expert weighs its score, masked or not
    weights, ids = moe_ops.route(logits.detach(), 2, "sigmoid", False, 0.0, 1.0, 2, 1, "max", 0.0,
                                 torch.zeros(4, dtype=torch.float64))
    assert ids.tolist() == [[2, 0]] and weights[0, 1] == torch.sigmoid(torch.tensor(-800.0, dtype=torch.float64))


def test_no_tokens_and_no_gradient_asked():
    weights, ids = moe_ops.route(torch.zeros(0, 16), 4)
    assert weights.shape == (0, 4) and ids.shape == (0, 4)
    logits = torch.randn(5, 16)
    weights, ids = moe_ops.route(logits, 4)  # logits without grad: nothing saved, no graph
    assert not weights.requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_logits_route_in_float_and_return_their_dtypes_gradient(dtype):
    logits = _logits(9, 24, dtype, seed=3).requires_grad_()
    want_w, want_ids = moe_ops.route(logits.detach().float(), 5, "softmax", True)
    got_w, got_ids = moe_ops.route(logits, 5, "softmax", True)
    assert got_w.dtype == torch.float32 and torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)
    (grad,) = torch.autograd.grad(got_w.sum(), logits)
    assert grad.dtype == dtype
