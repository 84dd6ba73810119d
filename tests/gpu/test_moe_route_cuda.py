"""hasten::moe_route's CUDA kernels against the routers they stand in for, run by torch on the
same GPU (tests/ops/route_reference.py), and against the CPU reference: ids, weights, the logits'
gradient; torch's softmax bit for bit; no host sync."""

from __future__ import annotations

import pytest
import torch

from hasten.observability import count_host_syncs
from hasten.ops import moe as moe_ops
from tests.ops.route_reference import by_expert, qwen3, recipes

pytestmark = pytest.mark.gpu

# tokens off the 4-per-block multiple, one token, none; experts off 32's multiples up to 512
SHAPES = [(1, 8, 2), (37, 60, 4), (5, 7, 3), (1027, 128, 8), (4099, 64, 6), (3, 256, 8), (301, 512, 10),
          (0, 128, 8), (16387, 128, 8)]


def _logits(tokens: int, experts: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random logits without ties (a tie at the k-th choice may go either way in torch.topk):
    float32 normals, or in bf16 each token's experts at distinct multiples of 1/16 (exact in bf16
    up to 512 experts)."""
    if dtype == torch.float32:
        return (torch.randn(tokens, experts, generator=gen) * 2).cuda()
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]) if tokens else \
        torch.zeros(0, experts)
    return ((ranks.float() - experts // 2) / 16).to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_route_equals_the_models_router_on_the_gpu(shape, dtype):
    tokens, experts, top_k = shape
    gen = torch.Generator().manual_seed(tokens * 7 + experts)
    bias = (torch.randn(experts, generator=gen) * 0.3).cuda()
    for name, (reference, args) in recipes(experts, top_k, bias).items():
        logits = _logits(tokens, experts, dtype, gen).requires_grad_()
        want_w, want_ids = reference(logits.float() if name != "gpt_oss" else logits)
        with count_host_syncs() as syncs:
            got_w, got_ids = moe_ops.route(logits, *args)
        assert syncs.count == 0, name
        if tokens == 0:
            assert got_w.shape == (0, top_k) and got_ids.shape == (0, top_k)
            continue
        assert torch.equal(want_ids.sort(-1).values, got_ids.sort(-1).values), name
        want_dense = by_expert(want_w.float(), want_ids, experts)
        got_dense = by_expert(got_w, got_ids, experts)
        tolerance = 1e-2 if name == "gpt_oss" and dtype == torch.bfloat16 else 2e-6
        torch.testing.assert_close(got_dense, want_dense, rtol=tolerance, atol=tolerance, msg=name)
        grad = torch.randn(tokens, experts, generator=gen).cuda()
        (want_grad,) = torch.autograd.grad((by_expert(want_w, want_ids, experts) * grad.to(want_w.dtype)).sum(),
                                           logits)
        (got_grad,) = torch.autograd.grad((got_dense * grad).sum(), logits)
        assert got_grad.dtype == dtype
        scale = want_grad.float().abs().max().clamp_min(1e-30)
        limit = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert float((got_grad.float() - want_grad.float()).abs().max() / scale) <= limit, name
        # and the CPU reference on the same logits
        cpu_w, cpu_ids = moe_ops.route(logits.detach().cpu(), *[a.cpu() if isinstance(a, torch.Tensor) else a
                                                                for a in args])
        assert torch.equal(cpu_ids.sort(-1).values, got_ids.cpu().sort(-1).values), name
        torch.testing.assert_close(by_expert(cpu_w, cpu_ids, experts), got_dense.cpu(), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("experts", [8, 60, 128, 512])
def test_the_softmax_scores_are_torchs_bit_for_bit(experts):
    """Qwen3's router without renormalisation: the weights are torch's softmax values themselves."""
    logits = torch.randn(2053, experts, device="cuda") * 3
    want_w, want_ids = qwen3(logits, 4, False)
    got_w, got_ids = moe_ops.route(logits, 4, "softmax", False)
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_w, want_w)
