"""hasten::linear_cross_entropy and cross_entropy_rows_ against plain PyTorch, on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from hasten.ops.loss import linear_cross_entropy


def _reference(hidden, weight, targets, bias=None, label_smoothing=0.0, softcap=None, denominator=None):
    logits = hidden.double() @ weight.double().t()
    if bias is not None:
        logits = logits + bias.double()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(logits, targets, ignore_index=-100, reduction="none", label_smoothing=label_smoothing)
    count = (targets != -100).sum() if denominator is None else denominator
    return losses.sum() / count


def _case(seed, tokens, hidden, vocab, dtype=torch.float32, ignored_every=5, bias=False):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype)
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype) if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=gen)
    if ignored_every:
        t[::ignored_every] = -100
    return h, w, b, t


@pytest.mark.parametrize("tokens,hidden,vocab,chunk", [(37, 16, 103, 5), (1, 8, 5, 0), (64, 32, 259, 64),
                                                      (130, 24, 1001, 7)])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"softcap": 3.0}, {"bias": True}],
                         ids=["plain", "smoothing", "softcap", "bias"])
def test_loss_and_gradients_match_pytorch(tokens, hidden, vocab, chunk, options):
    h, w, b, t = _case(tokens, tokens, hidden, vocab, bias=options.get("bias", False))
    t[0] = 1  # at least one target
    kwargs = {k: v for k, v in options.items() if k != "bias"}
    params = [x.clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    loss = linear_cross_entropy(params[0], params[1], t, bias=params[2] if b is not None else None,
                                chunk_tokens=chunk, **kwargs)
    (loss * 1.7).backward()  # an upstream gradient other than 1
    ref_params = [x.double().clone().requires_grad_() for x in (h, w) + ((b,) if b is not None else ())]
    ref = _reference(ref_params[0], ref_params[1], t, bias=ref_params[2] if b is not None else None, **kwargs)
    (ref * 1.7).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-6)


def test_num_items_in_batch_sets_the_denominator_across_calls():
    h, w, _, t = _case(0, 40, 16, 97)
    halves = [linear_cross_entropy(h[i:i + 20], w, t[i:i + 20], num_items_in_batch=int((t != -100).sum()))
              for i in (0, 20)]
    whole = linear_cross_entropy(h, w, t)
    torch.testing.assert_close(halves[0] + halves[1], whole)  # gradient accumulation adds up to the mean


def test_bfloat16_matches_float_reference_in_bf16_noise():
    h, w, _, t = _case(1, 50, 32, 300, dtype=torch.bfloat16)
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hb, wb, t, chunk_tokens=16)
    loss.backward()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ref = _reference(hr, wr, t)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    for got, want in ((hb, hr), (wb, wr)):
        rel = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert rel <= 2e-2


def test_all_ignored_and_empty_inputs():
    h, w, _, t = _case(2, 6, 8, 11)
    t[:] = -100
    hg = h.clone().requires_grad_()
    loss = linear_cross_entropy(hg, w, t, num_items_in_batch=1)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(hg.grad) == 0
    empty = linear_cross_entropy(torch.zeros(0, 8), w, torch.zeros(0, dtype=torch.long), num_items_in_batch=1)
    assert empty.item() == 0.0


def test_out_of_range_target_is_an_error_naming_it():
    h, w, _, t = _case(3, 4, 8, 11, ignored_every=0)
    t[2] = 11
    with pytest.raises(RuntimeError, match=r"target 11 at row 2 is outside the vocabulary \[0, 11\)"):
        linear_cross_entropy(h, w, t)


def test_bad_shapes_are_named():
    h, w, _, t = _case(4, 4, 8, 11)
    with pytest.raises(RuntimeError, match=r"`weight` must be \(vocab, hidden_size=8\)"):
        linear_cross_entropy(h, w[:, :5], t)
    with pytest.raises(RuntimeError, match=r"`targets` must be \(4,\)"):
        torch.ops.hasten.linear_cross_entropy(h, w, None, t[:3], torch.tensor(1.0), -100, 0.0, 0.0, 0, False)


def test_a_frozen_head_gets_no_weight_gradient_and_the_same_rest():
    """LoRA's LM head is frozen: the op skips the (V, H) gradient (its float32 accumulator and a GEMM
    per chunk) and returns an empty one; the loss and the hidden states' gradient are unchanged."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen)
    weight = torch.randn(53, 16, generator=gen)
    targets = torch.randint(0, 53, (37,), generator=gen)
    denominator = torch.tensor(37.0)
    args = (hidden, weight, None, targets, denominator, -100, 0.0, 0.0, 8, True)
    loss, grad_hidden, grad_weight, _ = torch.ops.hasten.linear_cross_entropy(*args)
    frozen_loss, frozen_grad_hidden, frozen_grad_weight, _ = torch.ops.hasten.linear_cross_entropy(*args, False)
    assert grad_weight.shape == weight.shape and frozen_grad_weight.numel() == 0
    assert torch.equal(loss, frozen_loss) and torch.equal(grad_hidden, frozen_grad_hidden)
    leaf = hidden.clone().requires_grad_()
    got = linear_cross_entropy(leaf, weight, targets, chunk_tokens=8)  # weight.requires_grad False
    got.backward()
    want_leaf = hidden.clone().requires_grad_()
    F.cross_entropy(want_leaf @ weight.t(), targets).backward()
    torch.testing.assert_close(leaf.grad, want_leaf.grad)
    torch.library.opcheck(torch.ops.hasten.linear_cross_entropy.default, (*args, False))
