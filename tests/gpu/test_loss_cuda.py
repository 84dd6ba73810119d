"""The fused linear cross-entropy on the GPU: CUDA rows equal the CPU op, loss and gradients
match PyTorch in bf16 noise on vocabulary sizes that take the vector and the scalar paths, and a
model trains the same with it, at a lower peak."""

import pytest
import torch
import torch.nn.functional as F

from hasten.ops.loss import linear_cross_entropy
from tests.gpu.training_curves import learnable_batches, train_curve


@pytest.mark.parametrize("vocab", [151936, 4096, 1001, 259, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"softcap": 30.0}], ids=["plain", "eps", "cap"])
def test_rows_kernel_equals_the_cpu_op(vocab, dtype, options):
    gen = torch.Generator().manual_seed(vocab)
    rows = 33
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::6] = -100
    scale = torch.tensor([0.37])
    args = (-100, options.get("label_smoothing", 0.0), options.get("softcap", 0.0))
    cpu_logits = logits.clone()
    want = torch.ops.hasten.cross_entropy_rows_(cpu_logits, targets, scale, *args)
    gpu_logits = logits.cuda()
    got = torch.ops.hasten.cross_entropy_rows_(gpu_logits, targets.cuda(), scale.cuda(), *args)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    # gradients are 0.37 x probabilities: float32 differs from the CPU's double in the last bits
    # (measured up to 3.3e-7 absolute on the H200), half types by their rounding
    rtol, atol = {torch.float32: (1e-4, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1e-2, 1e-4)}[dtype]
    torch.testing.assert_close(gpu_logits.cpu().float(), cpu_logits.float(), rtol=rtol, atol=atol)


def _kernel_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


# HASTEN_CE_CLUSTER=1 (experimental, sm_90): the row in a thread-block cluster's shared memory, one
# slice a block: Qwen3's vocab in 2 slices (bf16) or 3 (float32), Gemma's in 3 (bf16) or 6, 4096 in one;
# 1001 is not whole 16-byte vectors and takes the one-block kernel
@pytest.mark.parametrize("vocab", [151936, 262144, 4096, 1001])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"softcap": 30.0}], ids=["plain", "eps", "cap"])
@pytest.mark.parametrize("with_grad", [True, False], ids=["grad", "loss_only"])
def test_cluster_rows_kernel_equals_the_cpu_op(monkeypatch, vocab, dtype, options, with_grad):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    monkeypatch.setenv("HASTEN_CE_CLUSTER", "1")
    gen = torch.Generator().manual_seed(vocab + 1)
    rows = 37
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[::6] = -100
    targets[5] = vocab - 1  # the last slice's last element
    targets[7] = vocab  # invalid: NaN, zero gradient
    scale = torch.tensor([0.37]) if with_grad else None
    args = (-100, options.get("label_smoothing", 0.0), options.get("softcap", 0.0))
    cpu_logits = logits.clone()
    valid = targets.clone()
    valid[7] = 0  # the CPU op refuses an invalid target; its row is compared apart
    want = torch.ops.hasten.cross_entropy_rows_(cpu_logits, valid, scale, *args)
    gpu_logits = logits.cuda()
    holder = {}
    names = _kernel_names(lambda: holder.setdefault("loss", torch.ops.hasten.cross_entropy_rows_(
        gpu_logits, targets.cuda(), None if scale is None else scale.cuda(), *args)))
    got = holder["loss"].cpu()
    clustered = any("cluster_kernel" in name for name in names)
    assert clustered == (vocab % (16 // logits.element_size()) == 0), names
    keep = torch.arange(rows) != 7
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)
    assert torch.isnan(got[7])
    if with_grad:
        rtol, atol = {torch.float32: (1e-4, 1e-6), torch.bfloat16: (1e-2, 1e-4)}[dtype]
        torch.testing.assert_close(gpu_logits.cpu().float()[keep], cpu_logits.float()[keep], rtol=rtol, atol=atol)
        assert torch.equal(gpu_logits[7].cpu(), torch.zeros_like(gpu_logits[7].cpu()))
    else:
        assert torch.equal(gpu_logits.cpu(), logits)  # loss only: the logits untouched


def test_unaligned_rows_take_the_scalar_path_correctly():
    logits = torch.randn(9, 1025, device="cuda", dtype=torch.bfloat16)[:, 1:]  # 2-byte offset: no 16-byte loads
    targets = torch.randint(0, 1024, (9,), device="cuda")
    loss = torch.ops.hasten.cross_entropy_rows_(logits, targets, None, -100, 0.0, 0.0)
    want = F.cross_entropy(logits.float(), targets, reduction="none")
    torch.testing.assert_close(loss, want, rtol=1e-4, atol=1e-4)


def test_invalid_targets_give_nan_not_a_crash():
    logits = torch.randn(4, 100, device="cuda")
    targets = torch.tensor([1, 100, -5, -100], device="cuda")
    loss = torch.ops.hasten.cross_entropy_rows_(logits, targets, None, -100, 0.0, 0.0).cpu()
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and torch.isnan(loss[2]) and loss[3] == 0


@pytest.mark.parametrize("tokens,chunk", [(4099, 0), (4099, 1000), (1, 0)])
def test_linear_cross_entropy_matches_pytorch_bf16(tokens, chunk):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden = torch.randn(tokens, 1024, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(151936, 1024, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    targets = torch.randint(0, 151936, (tokens,), device="cuda", generator=gen)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(h1, w1, targets, chunk_tokens=chunk)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).float(), targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-3 * abs(ref.item())
    for got, want in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel <= 2e-2, rel


def test_training_with_the_fused_loss_follows_the_unfused_curve_at_a_lower_peak():
    batches = learnable_batches(20)
    curves, peaks = {}, {}
    for fused in (False, True):
        curves[fused], peaks[fused] = train_curve({"fused_cross_entropy": fused}, batches)
    print("unfused", [round(x, 4) for x in curves[False]])
    print("fused  ", [round(x, 4) for x in curves[True]])
    assert curves[True][-1] < curves[True][0] - 1.0  # it learns
    assert max(abs(a - b) for a, b in zip(curves[True], curves[False])) <= 0.05
    assert peaks[True] < peaks[False]
