"""hasten_py::varlen_attention_sinks (gpt-oss's attention sinks) against the softmax written out
with the sink logit as an extra column (float64), CPU: output and the gradients of q, k, v and the
sinks; GQA, one-token and empty sequences, windows, a softcap, tokens past the last boundary; the
per-sequence fallback computes the same; opcheck with and without gradients."""

import pytest
import torch

from hasten.attention.varlen import _per_sequence
from hasten.ops.attention import varlen_attention_sinks
from tests.ops.test_attention_ops import _reference as attention_reference


def _reference(q, k, v, cu, sinks, scale, causal, window=0, softcap=0.0):
    return attention_reference(q, k, v, cu, scale, causal, window, softcap, sinks)[0]


def _inputs(lengths, hq, hkv, head_dim, seed, tail=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths) + tail
    q, k, v = (torch.randn(t, h, head_dim, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64) * 2
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return q, k, v, cu, sinks


@pytest.mark.parametrize("causal,window,softcap", [(True, 0, 0.0), (True, 5, 0.0), (False, 0, 0.0), (True, 0, 0.7)])
@pytest.mark.parametrize("lengths,hq,hkv,head_dim,tail", [([1], 2, 1, 8, 0), ([7, 1, 0, 19], 4, 2, 16, 0),
                                                          ([33, 5], 3, 3, 24, 3)])
def test_matches_the_softmax_with_a_sink_column(lengths, hq, hkv, head_dim, tail, causal, window, softcap):
    q, k, v, cu, sinks = _inputs(lengths, hq, hkv, head_dim, seed=sum(lengths) + hq, tail=tail)
    scale = head_dim ** -0.5
    leaves = [x.float().requires_grad_() for x in (q, k, v, sinks)]
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = varlen_attention_sinks(*leaves[:3], cu, max(lengths), leaves[3], scale, causal, window, softcap)
    want = _reference(*ref_leaves[:3], cu, ref_leaves[3], scale, causal, window, softcap)
    without = _reference(q, k, v, cu, sinks.new_full(sinks.shape, -1e4), scale, causal, window, softcap)
    assert not torch.allclose(want, without, atol=1e-2)  # the sinks matter at these values
    torch.testing.assert_close(out.double(), want.detach(), atol=1e-5, rtol=1e-5)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(upstream.float())
    want.backward(upstream)
    for name, got, ref in zip(("q", "k", "v", "sinks"), leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=2e-5, rtol=1e-5, msg=f"grad of {name}")


def test_the_per_sequence_fallback_computes_the_same():
    q, k, v, cu, sinks = _inputs([7, 1, 19], 4, 2, 16, seed=3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out = _per_sequence(*leaves[:3], cu, 0.25, True, 4, 0.0, 0.0, leaves[3])  # window 5: left bound 4
    want = _reference(q, k, v, cu, sinks, 0.25, True, window=5)
    torch.testing.assert_close(out, want)
    out.square().sum().backward()
    assert leaves[3].grad is not None and leaves[3].grad.abs().sum() > 0


def test_empty_input_and_bad_sinks():
    q = torch.zeros(0, 4, 8)
    k = v = torch.zeros(0, 2, 8)
    sinks = torch.zeros(4, requires_grad=True)
    out = varlen_attention_sinks(q, k, v, torch.zeros(1, dtype=torch.int32), 0, sinks)
    assert out.shape == (0, 4, 8)
    q, k, v, cu, _ = _inputs([4, 4], 4, 2, 8, seed=0)
    with pytest.raises(RuntimeError, match="one logit per query head"):
        varlen_attention_sinks(q.float(), k.float(), v.float(), cu, 4, torch.zeros(2))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(requires_grad):
    q, k, v, cu, sinks = _inputs([1, 5, 5], 4, 2, 8, seed=1)
    args = [x.float().requires_grad_(requires_grad) for x in (q, k, v)]
    from hasten.ops._lib import load

    load()
    torch.library.opcheck(torch.ops.hasten_py.varlen_attention_sinks.default,
                          (*args, cu, 5, 0.3, True, 0, 0.0, sinks.float().requires_grad_(requires_grad)))
