import pytest
import torch
import torch.nn.functional as F

from hasten.attention.varlen import select_backend, varlen_attention
from hasten.observability import fallback_counts


def _dense_reference(q, k, v, cu, scale, window=None, softcap=None):
    """Block-diagonal causal attention through one dense masked SDPA on repeated K/V (float64);
    softcap c: scaled scores s -> c * tanh(s / c) before the mask."""
    t = q.shape[0]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff().long())
    idx = torch.arange(t)
    mask = (seq[:, None] == seq[None, :]) & (idx[:, None] >= idx[None, :])
    if window is not None:
        mask &= idx[:, None] - idx[None, :] < window
    qd, kd, vd = (x.transpose(0, 1).double() for x in (q, k, v))
    if softcap is None:
        return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale).transpose(0, 1)
    scores = torch.tanh(qd @ kd.transpose(1, 2) * scale / softcap) * softcap
    return (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vd).transpose(0, 1)


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("lengths,hq,hkv,window", [([1], 2, 1, None), ([5, 1, 17, 3], 4, 2, None),
                                                   ([33, 64, 1, 1, 7], 8, 8, None), ([40, 9], 6, 3, 4)])
def test_per_sequence_matches_dense_block_diagonal(lengths, hq, hkv, window, softcap):
    gen = torch.Generator().manual_seed(sum(lengths) + hq)
    t, d = sum(lengths), 16
    q, k, v = (torch.randn(t, h, d, generator=gen) for h in (hq, hkv, hkv))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, max(lengths), scale=0.3, sliding_window=window, softcap=softcap)
    ref = _dense_reference(q, k, v, cu, 0.3, window, softcap)
    if softcap is not None and max(lengths) > 1:
        assert not torch.allclose(ref, _dense_reference(q, k, v, cu, 0.3, window), atol=1e-3)
    assert out.shape == (t, hq, d)
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_gradients_flow_through_per_sequence_path():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    torch.autograd.gradcheck(lambda a, b, c: varlen_attention(a, b, c, cu, 6), (q, k, v))


def test_cpu_selects_per_sequence_and_says_why_once():
    q = torch.randn(3, 2, 8)
    assert select_backend(q) == "per_sequence"
    assert select_backend(q) == "per_sequence"
    assert fallback_counts() == {"attention_per_sequence": 2}


def test_rejects_head_counts_that_do_not_divide():
    q, k = torch.randn(4, 3, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        varlen_attention(q, k, k, torch.tensor([0, 4], dtype=torch.int32), 4)


@pytest.mark.parametrize("causal,window,softcap", [(True, None, 0.0), (True, 4, 0.0), (False, None, 0.0),
                                                   (True, 4, 0.5)])
def test_per_sequence_op_under_compile_equals_eager(causal, window, softcap):
    """Compiled, the per-sequence path runs as one op (hasten_host::per_sequence_attention): schema,
    fake and autograd consistent, and forward and gradients those of the eager loop, GQA, a window
    and one-token sequences included."""
    from hasten.attention.varlen import _per_sequence_op

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(27, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor([0, 9, 10, 25, 26, 27], dtype=torch.int32)
    left = window - 1 if window is not None else -1
    torch.library.opcheck(_per_sequence_op, (q, k, v, cu, 0.3, causal, left, softcap))
    upstream = torch.randn(27, 4, 8, generator=gen, dtype=torch.float64)

    def attend(a, b, c):
        return varlen_attention(a, b, c, cu, 15, scale=0.3, causal=causal, sliding_window=window, softcap=softcap)

    want = attend(q, k, v)
    got = torch.compile(attend, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), upstream), torch.autograd.grad(want, (q, k, v), upstream)):
        torch.testing.assert_close(g, w)


def test_cudnn_op_under_compile_recompiles_per_power_of_two_of_the_longest_sequence():
    """hasten::varlen_attention takes `int max_seqlen` (not SymInt): compiled, the dispatch passes the
    op's own power-of-two bucket, so new longest sequences within a bucket reuse the graph. Run
    with the op's CPU kernel (the float32 reference), which accepts any max_seqlen above the
    longest sequence, as the cuDNN kernel does."""
    from torch._dynamo.utils import counters

    from hasten.attention.varlen import _cudnn_max_seqlen
    from hasten.ops.attention import varlen_attention as cudnn_op

    def attend(q, k, v, cu, longest):
        return cudnn_op(q, k, v, cu, _cudnn_max_seqlen(longest), 0.25, True)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(2)
    for lengths in ([5, 1, 9], [3, 20], [1, 1, 1, 40, 2], [70, 3]):
        q, k, v = (torch.randn(sum(lengths), h, 16, generator=gen) for h in (6, 3, 3))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        torch.testing.assert_close(compiled(q, k, v, cu, max(lengths)), attend(q, k, v, cu, max(lengths)))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # longest <= 64, then 128
    assert [_cudnn_max_seqlen(n) for n in (1, 64, 65, 1000)] == [64, 64, 128, 1024]
