"""torch's varlen attention, with K/V heads read natively and repeated, equals attention computed
one sequence at a time on the GPU, output and gradients, without falling back."""

import pytest
import torch

from hasten.attention import varlen
from hasten.observability import fallback_counts, reset_fallbacks


def _outputs(backend, gqa, q, k, v, cu, max_len, grad):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = varlen.varlen_attention(*leaves, cu, max_len, backend=backend, gqa=gqa)
    out.backward(grad)
    return [out.detach().float()] + [x.grad.float() for x in leaves]


@pytest.mark.parametrize("backend,gqa", [("torch_varlen", "native"), ("torch_varlen", "repeat")])
@pytest.mark.parametrize("lengths,hq,hkv,head_dim", [([1], 2, 1, 128), ([300, 1, 77, 1000, 5], 16, 8, 128),
                                                     ([129, 64, 1], 4, 4, 64), ([2048, 700], 8, 2, 128)])
def test_backend_equals_one_sequence_at_a_time(backend, gqa, lengths, hq, hkv, head_dim):
    reset_fallbacks()
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths) + hq)
    t = sum(lengths)
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    got = _outputs(backend, gqa, q, k, v, cu, max(lengths), grad)
    want = _outputs("per_sequence", gqa, q, k, v, cu, max(lengths), grad)
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = w.abs().max().clamp_min(1.0)
        torch.testing.assert_close(g / scale, w / scale, rtol=0, atol=2e-2, msg=f"{backend}/{gqa}: {label}")
    # per_sequence is the reference, not a fallback; the backend under test must not have fallen back
    assert not {k: n for k, n in fallback_counts().items() if k != "attention_per_sequence"}, fallback_counts()
