"""hasten::varlen_attention and its backward against scaled_dot_product_attention run one sequence
at a time (float64), CPU: outputs, log-sum-exp, gradients, GQA, empty and single-token sequences."""

import pytest
import torch
import torch.nn.functional as F

from hasten.ops.attention import varlen_attention


def _reference(q, k, v, cu, scale, causal, window=0, softcap=0.0, sinks=None):
    """Per-sequence SDPA with K/V heads repeated; returns out (T, Hq, D) and lse (T, Hq). window W:
    query i sees keys i - W < j <= i (transformers' sliding_window); softcap c: scaled scores s
    become c * tanh(s / c) before the mask (Gemma 2's eager attention); sinks (Hq,): each head's
    logit joins the softmax as a column without a value (gpt-oss's eager attention), and lse
    includes it."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2], dtype=q.dtype)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if end == start:
            continue
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        if window:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).tril(-window), float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, end - start, 1)], -1)
            vs = torch.cat([vs, vs.new_zeros(vs.shape[0], 1, vs.shape[2])], 1)  # the sink has no value
        out[start:end] = (torch.softmax(scores, -1) @ vs).transpose(0, 1)
        lse[start:end] = torch.logsumexp(scores, -1).transpose(0, 1)
    return out, lse


def _inputs(lengths, hq, hkv, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, cu


# softcap 0.7: below the scaled scores' spread (about 1 here), so a dropped cap changes the result
@pytest.mark.parametrize("causal,window,softcap", [(True, 0, 0.0), (False, 0, 0.0), (True, 1, 0.0), (True, 5, 0.0),
                                                   (True, 0, 0.7), (False, 0, 0.7), (True, 5, 0.7)])
@pytest.mark.parametrize("lengths,hq,hkv,head_dim", [([1], 2, 1, 8), ([7, 1, 0, 19], 4, 2, 16),
                                                     ([33, 5], 3, 3, 24), ([65], 8, 2, 8)])
def test_matches_per_sequence_sdpa(lengths, hq, hkv, head_dim, causal, window, softcap):
    q, k, v, cu = _inputs(lengths, hq, hkv, head_dim, seed=sum(lengths) + hq)
    scale = head_dim ** -0.5
    out, lse = torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu, max(lengths), scale, causal,
                                                 window, softcap)
    want_out, want_lse = _reference(q, k, v, cu, scale, causal, window, softcap)
    if softcap and max(lengths) > 1:  # the cap must matter at these values
        assert not torch.allclose(want_out, _reference(q, k, v, cu, scale, causal, window)[0], atol=1e-3)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)

    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    varlen_attention(*leaves, cu, max(lengths), scale, causal, window, softcap).backward(upstream.float())
    _reference(*ref_leaves, cu, scale, causal, window, softcap)[0].backward(upstream)
    for name, got, want in zip("qkv", leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=1e-5, rtol=1e-5, msg=f"grad of {name}")


def test_empty_batch():
    q = torch.zeros(0, 4, 8)
    k = v = torch.zeros(0, 2, 8)
    out, lse = torch.ops.hasten.varlen_attention(q, k, v, torch.zeros(1, dtype=torch.int32), 0, 1.0, True, 0, 0.0)
    assert out.shape == (0, 4, 8) and lse.shape == (0, 4)


def test_bad_arguments_name_the_problem():
    q, k, v, cu = _inputs([4, 4], 3, 2, 8, seed=0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu, 4, 1.0, True, 0, 0.0)
    q, k, v, cu = _inputs([4, 6], 4, 2, 8, seed=0)
    with pytest.raises(RuntimeError, match="exceed max_seqlen"):
        torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu, 4, 1.0, True, 0, 0.0)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu.long(), 6, 1.0, True, 0, 0.0)
    with pytest.raises(RuntimeError, match="needs causal attention"):
        torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu, 6, 1.0, False, 3, 0.0)
    with pytest.raises(RuntimeError, match="softcap"):
        torch.ops.hasten.varlen_attention(q.float(), k.float(), v.float(), cu, 6, 1.0, True, 0, -1.0)
