import dataclasses

import pytest
import torch

from hasten.ops import moe as moe_ops
from tests.reference import (expert_biased_rows, grouped_mm_reference, moe_combine_reference, moe_group_reference,
                             moe_permute_reference, swiglu_reference, weighted_swiglu_reference)


def _ids(gen, tokens, top_k, experts, dtype=torch.int64, skew=False):
    if skew:  # one expert takes most slots, several get none
        ids = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.8, 0,
                          torch.randint(0, experts, (tokens, top_k), generator=gen))
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    return ids.to(dtype)


def check_grouping(ids, experts, device="cpu"):
    counts, offsets, permutation, inverse = torch.ops.hasten.moe_group(ids.to(device), experts)
    ref = moe_group_reference(ids, experts)
    for got, want in zip((counts, offsets, permutation, inverse), ref):
        assert got.dtype == torch.int32
        assert torch.equal(got.cpu().long(), want)


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 1), (1, 8, 128), (37, 2, 8), (513, 8, 64), (2000, 1, 3),
                                                  (300, 4, 257)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_group_matches_sort_and_bincount(tokens, top_k, experts, dtype):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    for skew in (False, True):
        check_grouping(_ids(gen, tokens, top_k, experts, dtype, skew), experts)


def test_group_empty_and_single_expert_takes_all():
    check_grouping(torch.zeros(0, 8, dtype=torch.long), 16)
    counts, offsets, permutation, _ = torch.ops.hasten.moe_group(torch.full((5, 2), 3), 4)
    assert counts.tolist() == [0, 0, 0, 10] and offsets.tolist() == [0, 0, 0, 0, 10]
    assert permutation.tolist() == list(range(10))  # stable: token order inside the expert


def test_permute_writes_zero_rows_for_dropped_slots():
    """A grouping with dropped slots (as the GPU grouping makes for ids outside [0, E)): positions
    past offsets[E] are zero rows, the others the scaled rows of their slots' tokens."""
    x = torch.randn(3, 5, dtype=torch.float64)
    permutation = torch.tensor([0, 3, 4, 1, 2, 5], dtype=torch.int32)  # slots 1, 2, 5 dropped
    offsets = torch.tensor([0, 1, 3, 3, 3], dtype=torch.int32)
    scale = torch.arange(1.0, 7.0, dtype=torch.float64)
    for s in (None, scale):
        got = torch.ops.hasten.moe_permute(x, permutation, offsets, 2, s)
        assert torch.equal(got, moe_permute_reference(x, permutation, 2, 3, s))
    assert torch.equal(got[:3], x * torch.tensor([[1.0], [4.0], [5.0]], dtype=torch.float64))
    assert torch.all(got[3:] == 0)


def test_group_rejects_out_of_range_ids_on_cpu():
    with pytest.raises(RuntimeError, match=r"expert id 9 at token 1, choice 0 is outside \[0, 4\)"):
        torch.ops.hasten.moe_group(torch.tensor([[0, 1], [9, 2]]), 4)
    with pytest.raises(RuntimeError, match=r"expert_ids.*\(tokens, top_k\)"):
        torch.ops.hasten.moe_group(torch.tensor([0, 1]), 4)


def _routing(gen, tokens, top_k, experts):
    ids = _ids(gen, tokens, top_k, experts)
    return ids, moe_ops.group(ids, experts)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (19, 3, 33), (64, 8, 64)])
def test_permute_and_combine_match_reference(dtype, tol, tokens, top_k, hidden):
    gen = torch.Generator().manual_seed(tokens + hidden)
    _, g = _routing(gen, tokens, top_k, 6)
    valid = int(g.offsets[-1])
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    scale = torch.rand(tokens * top_k, generator=gen).to(dtype)
    for s in (None, scale):
        got = torch.ops.hasten.moe_permute(x, g.permutation, g.offsets, top_k, s)
        assert torch.allclose(got.double(), moe_permute_reference(x, g.permutation, top_k, valid, s), atol=tol, rtol=tol)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(dtype)
    for weights in (None, w):
        got = torch.ops.hasten.moe_combine(y, g.inverse, g.offsets, top_k, weights)
        want = moe_combine_reference(y, g.inverse, top_k, valid, weights)
        assert torch.allclose(got.double(), want, atol=tol * 4, rtol=tol * 4)
    grad_out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    got = torch.ops.hasten.moe_combine_weight_grad(grad_out, y, g.inverse, g.offsets, top_k)
    want = (grad_out.double().unsqueeze(1) * y.double()[g.inverse.long()].reshape(tokens, top_k, hidden)).sum(-1)
    assert torch.allclose(got.double(), want, atol=tol * hidden, rtol=tol * 4)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 1, 8), (19, 3, 33), (64, 4, 64)])
def test_combine_with_expert_bias_matches_reference(dtype, tol, tokens, top_k, hidden):
    """gpt-oss's down_proj bias inside the combine: each row's expert bias added in y's dtype, then
    weighted; the router-weight gradient dots grad_out with the biased rows."""
    gen = torch.Generator().manual_seed(tokens * hidden)
    _, g = _routing(gen, tokens, top_k, 5)
    valid = int(g.offsets[-1])
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(dtype)
    bias = (torch.randn(5, hidden, generator=gen) * 4).to(dtype)  # large: a dropped bias shows
    for weights in (None, w):
        got = torch.ops.hasten.moe_combine(y, g.inverse, g.offsets, top_k, weights, bias)
        want = moe_combine_reference(y, g.inverse, top_k, valid, weights, g.offsets, bias)
        assert torch.allclose(got.double(), want, atol=tol * 16, rtol=tol * 4)
    grad_out = torch.randn(tokens, hidden, generator=gen).to(dtype)
    got = torch.ops.hasten.moe_combine_weight_grad(grad_out, y, g.inverse, g.offsets, top_k, bias)
    biased = expert_biased_rows(y, g.offsets, bias).double()[g.inverse.long()].reshape(tokens, top_k, hidden)
    want = (grad_out.double().unsqueeze(1) * biased).sum(-1)
    assert torch.allclose(got.double(), want, atol=tol * hidden * 8, rtol=tol * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_with_bias_equals_the_bias_added_apart(dtype):
    """The fused bias is the model's computation: combine(y + one_hot @ bias) (what the experts ran
    before, torch.addmm) and combine(y, bias=bias) give the same output bit for bit, and the same
    gradients of y, the weights and the bias."""
    gen = torch.Generator().manual_seed(3)
    tokens, top_k, hidden, experts = 23, 3, 40, 6
    _, g = _routing(gen, tokens, top_k, experts)
    y0 = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    w0 = torch.rand(tokens, top_k, generator=gen).to(dtype)
    b0 = (torch.randn(experts, hidden, generator=gen) * 3).to(dtype)
    grad = torch.randn(tokens, hidden, generator=gen).to(dtype)
    one_hot = moe_ops.row_experts_one_hot(g.group_ends, tokens * top_k, dtype)

    def run(fused):
        y, w, b = (t.clone().requires_grad_() for t in (y0, w0, b0))
        out = moe_ops.combine(y, w, g, b) if fused else moe_ops.combine(torch.addmm(y, one_hot, b), w, g)
        out.backward(grad)
        return out.detach(), y.grad, w.grad, b.grad

    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)


def test_combine_with_bias_gradients():
    gen = torch.Generator().manual_seed(1)
    _, g = _routing(gen, 7, 3, 4)
    y = torch.randn(21, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    torch.autograd.gradcheck(lambda a, c, d: moe_ops.combine(a, c, g, d), (y, w, b))
    # the bias alone needing its gradient (the experts' outputs frozen): d y is still formed for it
    torch.autograd.gradcheck(lambda d: moe_ops.combine(y.detach(), w.detach(), g, d), (b,))


def test_combine_rejects_a_bias_of_the_wrong_shape():
    gen = torch.Generator().manual_seed(2)
    _, g = _routing(gen, 4, 2, 3)
    y = torch.randn(8, 6)
    with pytest.raises(RuntimeError, match=r"bias.*experts = offsets - 1"):
        torch.ops.hasten.moe_combine(y, g.inverse, g.offsets, 2, None, torch.zeros(4, 6))
    with pytest.raises(RuntimeError, match=r"bias.*hidden of y"):
        torch.ops.hasten.moe_combine_weight_grad(torch.randn(4, 6), y, g.inverse, g.offsets, 2, torch.zeros(3, 5))


def test_permute_combine_gradients():
    gen = torch.Generator().manual_seed(0)
    _, g = _routing(gen, 7, 3, 4)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    torch.autograd.gradcheck(lambda t: moe_ops.permute(t, g), (x,))
    y = torch.randn(21, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(7, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: moe_ops.combine(a, b, g), (y, w))


@pytest.mark.parametrize("rows,inner", [(1, 1), (17, 24), (0, 8)])
def test_swiglu_matches_reference_and_gradcheck(rows, inner):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inner, generator=gen, dtype=torch.float64) * 3
    assert torch.allclose(torch.ops.hasten.swiglu(gate_up), swiglu_reference(gate_up), atol=1e-12)
    if rows:
        torch.autograd.gradcheck(moe_ops.swiglu, (gate_up.requires_grad_(),))
    bf = torch.ops.hasten.swiglu(gate_up.bfloat16())
    assert torch.allclose(bf.double(), swiglu_reference(gate_up.bfloat16()), atol=2e-2, rtol=2e-2)


def test_swiglu_rejects_odd_width():
    with pytest.raises(RuntimeError, match="odd width"):
        torch.ops.hasten.swiglu(torch.randn(2, 3))


def _weighted_case(gen, tokens, top_k, experts, inner, dtype, dropped=False):
    """gate_up (S, 2I), weights (T, k) and the grouping for moe_weighted_swiglu; `dropped`: the last
    two positions past offsets[E] (dropped slots, as the GPU grouping makes for ids outside [0, E))."""
    _, g = _routing(gen, tokens, top_k, experts)
    slots = tokens * top_k
    if dropped and slots > 2:
        offsets = g.offsets.clamp(max=slots - 2)
        g = dataclasses.replace(g, offsets=offsets, counts=torch.diff(offsets))
    gate_up = (torch.randn(slots, 2 * inner, generator=gen, dtype=torch.float64) * 3).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64).to(dtype)
    return gate_up, weights, g


@pytest.mark.parametrize("tokens,top_k,experts,inner", [(1, 1, 1, 1), (7, 3, 4, 5), (19, 2, 3, 24), (0, 2, 3, 8),
                                                        (5, 2, 3, 0)])
@pytest.mark.parametrize("dropped", [False, True])
def test_weighted_swiglu_matches_reference_with_its_gradients(tokens, top_k, experts, inner, dropped):
    """act[p] = w[permutation[p]] * silu(gate[p]) * up[p], dropped rows zero; d gate_up and d w
    equal torch's autograd of that formula (float64: exact but for rounding), and gradcheck."""
    gen = torch.Generator().manual_seed(tokens * 10 + inner)
    gate_up, weights, g = _weighted_case(gen, tokens, top_k, experts, inner, torch.float64, dropped)
    permutation, offsets = g.permutation, g.offsets
    valid = int(offsets[-1])
    gate_up.requires_grad_()
    weights.requires_grad_()
    got = torch.ops.hasten.moe_weighted_swiglu(gate_up, weights, permutation, offsets)
    want = weighted_swiglu_reference(gate_up, weights, permutation, valid)
    assert torch.allclose(got, want, atol=1e-12)
    grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (gate_up, weights), grad, allow_unused=True)
    want_grads = torch.autograd.grad(want, (gate_up, weights), grad, allow_unused=True)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b if b is not None else torch.zeros_like(a), atol=1e-12)
    if dropped and tokens * top_k > 2:  # dropped slots: zero rows and a zero weight gradient
        assert torch.all(got[valid:] == 0) and torch.all(got_grads[0][valid:] == 0)
        assert torch.all(got_grads[1].reshape(-1)[permutation[valid:].long()] == 0)
    if tokens and inner:
        torch.autograd.gradcheck(lambda a, b: torch.ops.hasten.moe_weighted_swiglu(a, b, permutation, offsets),
                                 (gate_up, weights))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_weighted_swiglu_low_precision_rounds_once(dtype, tol):
    """float32 and bfloat16: the float math rounded once to the dtype (the CUDA kernels' rule)."""
    gen = torch.Generator().manual_seed(5)
    gate_up, weights, g = _weighted_case(gen, 33, 4, 6, 40, dtype)
    got = moe_ops.weighted_swiglu(gate_up, weights, g)
    want = weighted_swiglu_reference(gate_up, weights, g.permutation, int(g.offsets[-1]))
    assert got.dtype == dtype
    assert torch.allclose(got.double(), want, atol=tol, rtol=tol)


def test_weights_in_the_swiglu_equal_the_weights_in_the_combine():
    """The experts' two orders, float64: combine(down(w * swiglu)) == combine(down(swiglu), w), the
    output and the gradients of gate_up, the down weight and the router's weights."""
    gen = torch.Generator().manual_seed(11)
    tokens, top_k, experts, inner, hidden = 13, 3, 4, 6, 5
    gate_up, weights, g = _weighted_case(gen, tokens, top_k, experts, inner, torch.float64)
    down = torch.randn(experts, hidden, inner, generator=gen, dtype=torch.float64)
    results = []
    for in_gate in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (gate_up, weights, down)]
        a, w, d = leaves
        if in_gate:
            out = moe_ops.combine(moe_ops.grouped_mm(moe_ops.weighted_swiglu(a, w, g), d, g.group_ends), None, g)
        else:
            out = moe_ops.combine(moe_ops.grouped_mm(moe_ops.swiglu(a), d, g.group_ends), w, g)
        grad = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
        results.append((out.detach(), torch.autograd.grad(out, leaves, grad)))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.allclose(out_a, out_b, atol=1e-12)
    for x, y in zip(grads_a, grads_b):
        assert torch.allclose(x, y, atol=1e-12)


def test_weighted_swiglu_rejects_what_does_not_fit():
    g = torch.ops.hasten.moe_group(torch.tensor([[0, 1], [1, 2]]), 3)
    permutation, offsets = g[2], g[1]
    with pytest.raises(RuntimeError, match="one value per slot"):
        torch.ops.hasten.moe_weighted_swiglu(torch.randn(4, 6), torch.rand(3, 2), permutation, offsets)
    with pytest.raises(RuntimeError, match="odd width"):
        torch.ops.hasten.moe_weighted_swiglu(torch.randn(4, 5), torch.rand(2, 2), permutation, offsets)
    with pytest.raises(RuntimeError, match="permutation"):
        torch.ops.hasten.moe_weighted_swiglu(torch.randn(4, 6), torch.rand(2, 2), permutation.long(), offsets)
    with pytest.raises(RuntimeError, match="grad_act"):
        torch.ops.hasten.moe_weighted_swiglu_backward(torch.randn(4, 2), torch.randn(4, 6), torch.rand(2, 2),
                                                      permutation, offsets)


def clamped_swiglu_reference(gate_up, alpha, limit):
    """transformers' GptOssExperts._apply_gate."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("rows,inner", [(0, 3), (1, 1), (5, 7), (33, 40)])
def test_clamped_swiglu_matches_gpt_oss_gate_with_its_gradients(rows, inner):
    gen = torch.Generator().manual_seed(rows * 100 + inner)
    gate_up = torch.randn(rows, 2 * inner, generator=gen, dtype=torch.float64) * 2
    if rows:
        gate_up[0, :4] = torch.tensor([0.8, -0.8, 0.8, 0.8])[: 2 * inner]  # on the bounds: the gradient passes
    gate_up.requires_grad_()
    got, want = moe_ops.clamped_swiglu(gate_up, 1.702, 0.8), clamped_swiglu_reference(gate_up, 1.702, 0.8)
    assert torch.allclose(got, want, atol=1e-12)
    assert (gate_up.detach().abs() > 0.8).any() or rows * inner < 8  # the clamps are in play
    grad = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    got_grad, want_grad = (torch.autograd.grad(y, gate_up, grad)[0] for y in (got, want))
    assert torch.allclose(got_grad, want_grad, atol=1e-12)
    if rows * inner:
        inside = (gate_up.detach() * 0.3).requires_grad_()  # away from the kinks, for finite differences
        torch.autograd.gradcheck(lambda x: moe_ops.clamped_swiglu(x, 1.702, 0.8), (inside,))
        bf = moe_ops.clamped_swiglu(gate_up.detach().bfloat16(), 1.702, 0.8)
        assert torch.allclose(bf.double(), clamped_swiglu_reference(gate_up.detach().bfloat16(), 1.702, 0.8).double(),
                              atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows,inner,ends", [(11, 6, [3, 3, 8, 9]), (1, 1, [0, 1]), (0, 4, [0, 0]),
                                             (40, 8, [40])])
def test_clamped_swiglu_with_expert_biases_equals_the_biases_added_apart(rows, inner, ends):
    """gpt-oss's gate_up biases added inside the clamped kernel: each expert-sorted row gets its
    expert's bias (an empty expert, rows past the valid slots: the last expert's), forward and the
    gradients of gate_up and the bias equal adding them apart (y + one_hot @ bias, the unfused
    path) in float64, and in bfloat16 the sum is rounded once as the model's y + bias is."""
    gen = torch.Generator().manual_seed(rows + inner)
    experts = len(ends)
    group_ends = torch.tensor(ends, dtype=torch.int32)
    x = (torch.randn(rows, 2 * inner, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    bias = (torch.randn(experts, 2 * inner, generator=gen, dtype=torch.float64)).requires_grad_()
    one_hot = moe_ops.row_experts_one_hot(group_ends, rows, torch.float64)
    if rows == 11:  # rows 0-2 expert 0, none for 1, 3-7 expert 2, 8 expert 3, 9-10 past the ends: expert 3
        assert one_hot.argmax(1).tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3, 3]
    want = moe_ops.clamped_swiglu(x + one_hot @ bias, 1.702, 0.8)
    got = moe_ops.clamped_swiglu(x, 1.702, 0.8, bias, group_ends)
    assert torch.allclose(got, want, atol=1e-12)
    grad = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (x, bias), grad)
    got_grads = torch.autograd.grad(got, (x, bias), grad)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, atol=1e-12)
    if rows * inner:
        assert not torch.allclose(got, moe_ops.clamped_swiglu(x, 1.702, 0.8), atol=1e-3)  # the bias matters
        inside = [(t.detach() * 0.2).requires_grad_() for t in (x, bias)]  # away from the kinks
        torch.autograd.gradcheck(lambda a, b: moe_ops.clamped_swiglu(a, 1.702, 0.8, b, group_ends), inside)
        xb, bb = x.detach().bfloat16(), bias.detach().bfloat16()
        apart = moe_ops.clamped_swiglu(torch.addmm(xb, one_hot.bfloat16(), bb), 1.702, 0.8)
        torch.testing.assert_close(moe_ops.clamped_swiglu(xb, 1.702, 0.8, bb, group_ends), apart, rtol=0, atol=0)


def test_clamped_swiglu_is_not_the_plain_swiglu_nor_unclamped():
    """The check in hasten.moe.experts tells these apart: a gate without the clamp or the + 1 is off."""
    gate_up = torch.randn(6, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    got = moe_ops.clamped_swiglu(gate_up, 1.702, 0.8)
    assert not torch.allclose(got, clamped_swiglu_reference(gate_up, 1.702, 100.0), atol=1e-3)
    gate, up = gate_up[:, ::2].clamp(max=0.8), gate_up[:, 1::2].clamp(-0.8, 0.8)
    assert not torch.allclose(got, up * gate * torch.sigmoid(1.702 * gate), atol=1e-3)


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("ends", [[3, 3, 9, 12], [0, 0, 0, 13], [13, 13, 13, 13], [1, 2, 5, 9]],
                         ids=["one_empty", "last_takes_all", "first_takes_all", "rows_past_the_end"])
def test_grouped_mm_matches_per_expert_matmul_with_its_gradients(transposed, ends):
    gen = torch.Generator().manual_seed(len(ends) + sum(ends))
    rows, experts, d_in, d_out = 13, 4, 6, 5
    x = torch.randn(rows, d_in, generator=gen, dtype=torch.float64, requires_grad=True)
    shape = (experts, d_in, d_out) if transposed else (experts, d_out, d_in)
    weight = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
    ends_t = torch.tensor(ends, dtype=torch.int32)
    y = moe_ops.grouped_mm(x, weight, ends_t, transposed)
    torch.testing.assert_close(y, grouped_mm_reference(x.detach(), weight.detach(), ends_t, transposed), rtol=0,
                               atol=1e-12)
    torch.autograd.gradcheck(lambda a, w: moe_ops.grouped_mm(a, w, ends_t, transposed), (x, weight))
    # an expert without rows gets a zero weight gradient, not an untouched buffer
    grad = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (grad_weight,) = torch.autograd.grad(y, weight, grad)
    starts = [0] + ends[:-1]
    for g, (start, end) in enumerate(zip(starts, ends)):
        if start == end:
            assert torch.count_nonzero(grad_weight[g]) == 0


def test_grouped_mm_refuses_group_ends_that_are_not_a_grouping():
    x, weight = torch.randn(5, 4), torch.randn(2, 3, 4)
    for ends in ([3, 2], [2, 6], [-1, 5]):
        with pytest.raises(RuntimeError, match="group_ends. must be non-decreasing within"):
            torch.ops.hasten.moe_grouped_mm(x, weight, torch.tensor(ends, dtype=torch.int32), False)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        torch.ops.hasten.moe_grouped_mm_weight_grad(x, torch.randn(5, 2), torch.tensor([4, 3], dtype=torch.int32))
