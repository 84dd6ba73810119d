"""Float32 router logits on tensor cores (hasten.moe.router, hasten.ops.moe.router_logits*), CPU.

The arithmetic: a float32 weight is the exact sum of its three bfloat16 parts; the logits, the
input's gradient and the weight's from the parts equal the float64 products within float32 sums
(the GEMMs emulated here by float64 products of the same bfloat16 operands, as tensor cores form
them exactly). The rewrite: the routers written as `F.linear(x.type(torch.float32),
self.weight.type(torch.float32))` get it (DeepSeek-V2/V3, GLM-4.5, dots.llm1), others keep their
forward, undo restores it; on the CPU the statement runs as written, said once, bit for bit."""

from __future__ import annotations

import pytest
import torch

import hasten
from hasten.config import Config
from hasten.moe.router import FALLBACK, install_float32_router_logits
from hasten.observability import fallback_counts, reset_fallbacks
from hasten.ops.moe import (bfloat16_parts, router_logits_applies, router_logits_forward, router_logits_grad_weight,
                            router_logits_grad_x)
from tests import model_zoo as zoo


def _mm_float32(a, b):  # the GEMM of bfloat16 operands with float32 output, its products exact
    return (a.double() @ b.double()).float()


def outputs_and_gradients(fn, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """(fn(x, weight), d x, d weight) for the upstream gradient `grad`, on fresh leaves."""
    xr, wr = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(xr, wr)
    out.backward(grad)
    return out.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("scale", [1.0, 0.02, 3e-30])
def test_a_float32_tensor_is_the_exact_sum_of_its_three_bfloat16_parts(scale):
    t = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * scale
    parts = bfloat16_parts(t)
    assert len(parts) == 3 and all(p.dtype == torch.bfloat16 for p in parts)
    assert torch.equal(sum(p.double() for p in parts), t.double())
    bf16 = t.to(torch.bfloat16)
    assert bfloat16_parts(bf16) == [bf16]


@pytest.mark.parametrize("tokens", [1, 7, 333])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_logits_and_both_gradients_from_the_parts_equal_the_float32_linear(tokens, weight_dtype):
    gen = torch.Generator().manual_seed(tokens)
    hidden, experts = 264, 24
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(experts, hidden, generator=gen) * 0.02).to(weight_dtype)
    grad = torch.randn(tokens, experts, generator=gen) * 1e-3

    logits = router_logits_forward(x, weight, _mm_float32)
    want = x.double() @ weight.double().t()
    assert logits.dtype == torch.float32 and logits.shape == (tokens, experts)
    assert (logits.double() - want).abs().max() <= 4e-7 * want.abs().max()

    grad_x = router_logits_grad_x(grad, weight, torch.bfloat16, _mm_float32)
    want_x = grad.double() @ weight.double()
    assert grad_x.dtype == torch.bfloat16
    # one rounding to bfloat16 of a value within float32 sums of the exact one: at most an ulp apart
    ulp = want_x.abs().to(torch.bfloat16).double() * 2.0 ** -7
    assert ((grad_x.double() - want_x).abs() <= ulp + 1e-30).all()
    assert (grad_x != want_x.to(torch.bfloat16)).float().mean() < 1e-3

    grad_w = router_logits_grad_weight(grad, x, weight_dtype, _mm_float32)
    want_w = grad.double().t() @ x.double()
    assert grad_w.dtype == weight_dtype
    tolerance = 4e-7 if weight_dtype == torch.float32 else 2.0 ** -8
    assert (grad_w.double() - want_w).abs().max() <= tolerance * want_w.abs().max()


def test_on_the_cpu_or_in_float32_the_op_does_not_apply():
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert "CUDA" in router_logits_applies(x, torch.randn(8, 16))


ROUTED = ["deepseek_v2", "deepseek_v3", "glm4_moe", "dots1"]


@pytest.mark.parametrize("name", ROUTED)
def test_the_routers_that_write_float32_logits_get_the_rewrite_and_the_cpu_runs_them_as_written(name):
    model = zoo.build(zoo.ENTRIES[name])
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    assert routers, name
    batch = zoo.packed_batch(zoo.samples())
    reset_fallbacks()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"router_logits": True}}))
    try:
        assert any(item.startswith("float32 router logits on tensor cores x") for item in handle.active), handle.active
        assert all("forward" in m.__dict__ for m in routers)
        got = model(**batch).loss
        assert FALLBACK in fallback_counts()  # the CPU runs the statement as written, and says so
    finally:
        handle.undo()
    assert all("forward" not in m.__dict__ for m in routers)
    hasten_default = hasten.accelerate(model)  # without the switch: the same loss, bit for bit
    try:
        assert torch.equal(got, model(**batch).loss)
    finally:
        hasten_default.undo()


def test_a_router_written_otherwise_keeps_its_forward():
    model = zoo.build(zoo.ENTRIES["qwen3_moe"])
    undo, count, refused = install_float32_router_logits(model)
    undo()
    assert count == 0 and refused == []


@pytest.fixture
def emulated_gemm(monkeypatch):
    """The op's float32-output GEMM of bfloat16 operands (torch.mm with out_dtype, CUDA only) as
    float64 products rounded to float32, and the applicability check passed, so the CPU runs the
    op's own autograd wiring (setup_context, backward) instead of the statement as written."""
    import hasten.ops.moe as moe_ops

    monkeypatch.setattr(moe_ops, "_mm_float32_out", _mm_float32)
    monkeypatch.setattr("hasten.moe.router.router_logits_applies", lambda x, weight: None)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_ops_autograd_gives_both_gradients_of_the_float32_linear(emulated_gemm, weight_dtype):
    from hasten.ops.moe import router_logits

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 19, 64, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(16, 64, generator=gen) * 0.02).to(weight_dtype)
    grad = torch.randn(2, 19, 16, generator=gen)

    got = outputs_and_gradients(router_logits, x, weight, grad)
    want = [t.double() for t in outputs_and_gradients(lambda a, w: torch.nn.functional.linear(a.double(), w.double()),
                                                      x, weight, grad)]
    assert got[0].shape == (2, 19, 16) and got[0].dtype == torch.float32
    assert torch.allclose(got[0].double(), want[0], rtol=0, atol=1e-6 * want[0].abs().max().item())
    assert got[1].dtype == torch.bfloat16 and torch.allclose(got[1].double(), want[1], rtol=2.0 ** -7, atol=1e-30)
    assert got[2].dtype == weight_dtype
    tolerance = 1e-6 if weight_dtype == torch.float32 else 2.0 ** -7
    assert torch.allclose(got[2].double(), want[2], rtol=0, atol=tolerance * want[2].abs().max().item())
    # only what is asked for: a frozen router weight gets no gradient, a detached input none
    xr, wr = x.clone().requires_grad_(), weight.clone()
    router_logits(xr, wr).backward(grad)
    assert xr.grad is not None and wr.grad is None


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_a_bf16_model_with_the_ops_router_trains_as_with_the_statement(emulated_gemm, name):
    """The routers on the op (float32 router weight as from_pretrained keeps it): loss and every
    gradient of a bf16 packed batch equal the same model's with the statement as written, within
    float32 sums (the routing the same: the zoo's routers have top-k margins)."""
    model = zoo.cast_as_loaded(zoo.build(zoo.ENTRIES[name]), torch.bfloat16)
    assert any(p.dtype == torch.float32 for n, p in model.named_parameters() if n.endswith("gate.weight"))
    batch = zoo.packed_batch(zoo.samples())

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    plain = hasten.accelerate(model)
    try:
        want_loss, want = loss_and_grads()
    finally:
        plain.undo()
    reset_fallbacks()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"router_logits": True}}))
    try:
        got_loss, got = loss_and_grads()
        assert FALLBACK not in fallback_counts()
    finally:
        handle.undo()
    assert abs(got_loss - want_loss) <= 1e-3 * abs(want_loss)
    assert got.keys() == want.keys()
    for key in want:
        error = (got[key] - want[key]).norm() / want[key].norm().clamp_min(1e-30)
        assert error <= 2e-2, (key, error.item())


def test_the_op_passes_opcheck_with_and_without_gradients(emulated_gemm):
    from hasten.ops.moe import _router_logits

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(13, 32, generator=gen).to(torch.bfloat16)
    weight = torch.randn(8, 32, generator=gen) * 0.02
    torch.library.opcheck(_router_logits, (x.requires_grad_(), weight.requires_grad_()))
    torch.library.opcheck(_router_logits, (x.detach(), weight.detach()))
