"""RMSNorm, SwiGLU, GeGLU and RoPE CUDA kernels equal the CPU ops, and a model trains the same with them."""

import math

import pytest
import torch

from hasten.ops.dense import add_rms_norm, gelu_tanh_mul, rms_norm, rope, silu_mul
from tests.gpu.training_curves import learnable_batches, train_curve

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _both(fn, *inputs):
    """Output and input gradients on the CPU and on the GPU, same inputs and upstream gradient."""
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_() for t in inputs]
        out = fn(*leaves)
        upstream = torch.ones_like(out) * 0.5 + torch.arange(out.numel(), device=device).reshape(out.shape) % 3
        out.backward(upstream.to(out.dtype))
        results.append((out.detach().cpu().float(), [t.grad.cpu().float() for t in leaves]))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# 16 lanes per row for a 128-wide head norm, a full warp from 256 up, element path for 1001, 100,
# 250 and 1, 20000 columns need more than the default 48 KiB of shared memory in the backward.
# Backward kernels: registers for 1-2 vectors per lane (128; 100 and 200 in fp32); per-warp shared
# sums for 3-4 (1000 and 1024 in 16-bit, 100 element-wise in 16-bit) and 5-8 (1536 and 2048 in
# 16-bit, 1000 and 1024 in fp32, 250 element-wise; 64 KiB for 2048); the general kernel for 4096,
# 1001 and 20000, and 1536/2048 in fp32. Forward: rows held in registers up to 16 vectors a lane
# (3072 in 16-bit: 12 of 16 slots used), the looping kernel past that (20000; 4096 in fp32).
@pytest.mark.parametrize("rows,hidden", [(1, 1), (37, 128), (16387, 128), (45, 100), (45, 200), (45, 250),
                                         (300, 1000), (2051, 1024), (70, 1536), (600, 2048), (33, 1001),
                                         (77, 3072), (5, 4096), (9, 20000), (0, 64)])
def test_rms_norm_cuda_equals_cpu(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    (cpu_out, cpu_grads), (gpu_out, gpu_grads) = _both(lambda a, b: rms_norm(a, b, 1e-6), x, w)
    torch.testing.assert_close(gpu_out, cpu_out, **TOL[dtype])
    torch.testing.assert_close(gpu_grads[0], cpu_grads[0], **TOL[dtype])
    # the weight gradient sums over rows: compare relative to its size
    scale = cpu_grads[1].abs().max().clamp_min(1.0)
    torch.testing.assert_close(gpu_grads[1] / scale, cpu_grads[1] / scale, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(37, 128), (2051, 1024), (600, 2048), (300, 3072), (16387, 4096),
                                         (45, 250), (9, 20000), (0, 64)])
def test_rms_norm_backward_without_weight_gradient_equals_cpu(dtype, rows, hidden):
    """A frozen weight (LoRA): the backward kernel without the weight gradient's sums gives the
    grad_x of the full kernel and of the CPU reference, and an empty grad_weight."""
    gen = torch.Generator().manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    g = torch.randn(rows, hidden, generator=gen).to(dtype)
    _, rstd = torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0)
    want, _ = torch.ops.hasten.rms_norm_backward(g, x, w, rstd, 0.0, True)
    full, _ = torch.ops.hasten.rms_norm_backward(g.cuda(), x.cuda(), w.cuda(), rstd.cuda(), 0.0, True)
    got, grad_w = torch.ops.hasten.rms_norm_backward(g.cuda(), x.cuda(), w.cuda(), rstd.cuda(), 0.0, False)
    assert grad_w.numel() == 0
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(got, full, rtol=0, atol=0)  # the same arithmetic for grad_x


@pytest.mark.parametrize("hidden", [128, 1024, 2048, 4096])  # each backward kernel, with Gemma's weight + 1
def test_rms_norm_weight_offset_cuda_equals_cpu(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(513, hidden, generator=gen).to(torch.bfloat16)
    w = (torch.randn(hidden, generator=gen) * 0.1).to(torch.bfloat16)
    (cpu_out, cpu_grads), (gpu_out, gpu_grads) = _both(lambda a, b: rms_norm(a, b, 1e-6, 1.0), x, w)
    torch.testing.assert_close(gpu_out, cpu_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(gpu_grads[0], cpu_grads[0], **TOL[torch.bfloat16])
    scale = cpu_grads[1].abs().max().clamp_min(1.0)
    torch.testing.assert_close(gpu_grads[1] / scale, cpu_grads[1] / scale, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["trained_weight", "frozen_weight"])
# each kernel family with the residual add: cached rows (128, 1024, 3072 and 4096 in bf16), the
# weight-gradient kernels (registers, per-warp sums, general), the looping forward (20000), the
# element path (250 off the 16-byte grid in bf16; 100 in fp32)
@pytest.mark.parametrize("rows,hidden", [(37, 128), (2051, 1024), (300, 3072), (4099, 4096), (9, 20000), (45, 250),
                                         (1, 1), (0, 64)])
def test_add_rms_norm_cuda_equals_cpu(dtype, weight_grad, rows, hidden):
    """hasten::add_rms_norm on the GPU against the CPU reference: the sum bitwise (one rounding of
    x + residual either way), y, and the backward with grad_add (the sum's gradient from the
    residual stream) for x, residual and the weight."""
    gen = torch.Generator().manual_seed(rows + hidden)
    x, residual, grad_y, grad_sum = ((torch.randn(rows, hidden, generator=gen) * 2).to(dtype) for _ in range(4))
    w = torch.randn(hidden, generator=gen).to(dtype)
    results = []
    for device in ("cpu", "cuda"):
        leaves = [t.detach().to(device).requires_grad_(i < 2 or weight_grad) for i, t in enumerate((x, residual, w))]
        y, total = add_rms_norm(*leaves, 1e-6)
        torch.autograd.backward((y, total), (grad_y.to(device), grad_sum.to(device)))
        results.append((y.detach().cpu().float(), total.detach().cpu().float(),
                        [t.grad.cpu().float() if t.grad is not None else None for t in leaves]))
    (y_cpu, sum_cpu, grads_cpu), (y_gpu, sum_gpu, grads_gpu) = results
    assert torch.equal(sum_gpu, sum_cpu)
    torch.testing.assert_close(y_gpu, y_cpu, **TOL[dtype])
    torch.testing.assert_close(grads_gpu[0], grads_cpu[0], **TOL[dtype])
    assert torch.equal(grads_gpu[0], grads_gpu[1])
    if weight_grad:
        scale = grads_cpu[2].abs().max().clamp_min(1.0)
        torch.testing.assert_close(grads_gpu[2] / scale, grads_cpu[2] / scale, **TOL[dtype])
    else:
        assert grads_gpu[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 129), (4096, 3072), (70001, 8)])  # rows past the grid's 65535
def test_silu_mul_cuda_equals_cpu(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    gate, up = (torch.randn(shape, generator=gen) * 3).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    (cpu_out, cpu_grads), (gpu_out, gpu_grads) = _both(silu_mul, gate, up)
    torch.testing.assert_close(gpu_out, cpu_out, **TOL[dtype])
    for g, c in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(g, c, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 129), (4096, 3072), (70001, 8)])  # rows past the grid's 65535
def test_gelu_tanh_mul_cuda_equals_cpu(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) + 1)
    gate, up = (torch.randn(shape, generator=gen) * 3).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    (cpu_out, cpu_grads), (gpu_out, gpu_grads) = _both(gelu_tanh_mul, gate, up)
    torch.testing.assert_close(gpu_out, cpu_out, **TOL[dtype])
    for g, c in zip(gpu_grads, cpu_grads):
        torch.testing.assert_close(g, c, **TOL[dtype])


def _misaligned(shape, dtype, gen):
    """A contiguous CUDA tensor whose data starts one element past a 16-byte boundary."""
    numel = math.prod(shape)
    flat = torch.randn(numel + 1, generator=gen).to(dtype).cuda()
    return flat[1:].view(shape)


def test_rows_off_the_16_byte_grid_take_the_element_path():
    gen = torch.Generator().manual_seed(5)
    x, w = _misaligned((40, 256), torch.bfloat16, gen), torch.randn(256, generator=gen).to(torch.bfloat16)
    assert x.data_ptr() % 16 != 0
    torch.testing.assert_close(rms_norm(x, w.cuda(), 1e-6).cpu().float(), rms_norm(x.cpu(), w, 1e-6).float(),
                               **TOL[torch.bfloat16])
    gate, up = _misaligned((40, 256), torch.bfloat16, gen), _misaligned((40, 256), torch.bfloat16, gen)
    torch.testing.assert_close(silu_mul(gate, up).cpu().float(), silu_mul(gate.cpu(), up.cpu()).float(),
                               **TOL[torch.bfloat16])
    torch.testing.assert_close(gelu_tanh_mul(gate, up).cpu().float(), gelu_tanh_mul(gate.cpu(), up.cpu()).float(),
                               **TOL[torch.bfloat16])
    q = _misaligned((1, 3, 10, 64), torch.bfloat16, gen)
    cos, sin = torch.randn(1, 10, 64, generator=gen).to(torch.bfloat16), torch.randn(1, 10, 64, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(rope(q, cos.cuda(), sin.cuda()).cpu().float(), rope(q.cpu(), cos, sin).float(),
                               **TOL[torch.bfloat16])


@pytest.mark.parametrize("rows,inner", [(77, 96), (131077, 24)])  # rows past the grid's 65535
def test_moe_swiglu_layout_still_matches_after_the_shared_kernel(rows, inner):
    gate_up = torch.randn(rows, 2 * inner, device="cuda", dtype=torch.bfloat16)
    got = torch.ops.hasten.swiglu(gate_up)
    want = torch.ops.hasten.swiglu(gate_up.cpu())
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[torch.bfloat16])
    grad = torch.randn(rows, inner, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(torch.ops.hasten.swiglu_backward(grad, gate_up).cpu().float(),
                               torch.ops.hasten.swiglu_backward(grad.cpu(), gate_up.cpu()).float(),
                               **TOL[torch.bfloat16])


def _rope_cuda_equals_cpu(x, cos, sin, upstream, interleaved=False) -> torch.Tensor:
    """rope forward and backward of x (B, heads, L, D) on the GPU against the CPU reference, within
    x's dtype's tolerance; returns the GPU output (float32, on the CPU)."""
    results = []
    for device in ("cpu", "cuda"):
        leaf = x.detach().to(device).requires_grad_()
        out = rope(leaf, cos.to(device), sin.to(device), interleaved=interleaved)
        out.backward(upstream.to(device))
        results.append((out.detach().cpu().float(), leaf.grad.cpu().float()))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL[x.dtype])
    torch.testing.assert_close(results[1][1], results[0][1], **TOL[x.dtype])
    return results[1][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,length,dim", [(1, 1, 1, 2), (1, 3, 50, 6), (2, 16, 333, 128),
                                                    (1, 8, 16384, 64), (2, 12, 50, 128), (1, 40, 7, 128)])
def test_rope_cuda_equals_cpu(dtype, batch, heads, length, dim):
    gen = torch.Generator().manual_seed(length)
    x = torch.randn(batch, length, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    angles = torch.randn(1, length, dim // 2, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    upstream = torch.randn(x.shape, generator=gen).to(dtype)
    _rope_cuda_equals_cpu(x, cos, sin, upstream)


# A thread reads its item's cos and sin once for up to 4 heads, as 16-byte vectors where they are
# aligned: float32 angles with bf16 q (two vectors a item), angles one element off the 16-byte grid
# (scalar reads), and head counts that leave a partial last chunk.
@pytest.mark.parametrize("angles", ["float32", "misaligned"])
@pytest.mark.parametrize("heads", [1, 9, 32])
def test_rope_angle_layouts_cuda_equal_cpu(angles, heads):
    gen = torch.Generator().manual_seed(heads)
    length, dim = 37, 128
    x = torch.randn(1, length, heads, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
    emb = torch.randn(1, length, dim, generator=gen)
    if angles == "float32":
        cos, sin = emb.cos().cuda(), emb.sin().cuda()
    else:
        cos = _misaligned((1, length, dim), torch.bfloat16, gen)
        sin = _misaligned((1, length, dim), torch.bfloat16, gen)
        assert cos.data_ptr() % 16 != 0
    upstream = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    _rope_cuda_equals_cpu(x, cos, sin, upstream)


def test_twenty_steps_with_fused_kernels_follow_the_unfused_curve():
    batches = learnable_batches(20)
    curves = {
        "unfused": train_curve({"fused_cross_entropy": False, "rms_norm": False, "swiglu": False, "rope": False},
                               batches)[0],
        "fused": train_curve({"rms_norm": True, "swiglu": True, "rope": True}, batches)[0],
    }
    print("unfused", [round(x, 4) for x in curves["unfused"]])
    print("fused  ", [round(x, 4) for x in curves["fused"]])
    assert curves["fused"][-1] < curves["fused"][0] - 1.0
    assert max(abs(a - b) for a, b in zip(curves["fused"], curves["unfused"])) <= 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
# (heads, length, head_dim, rotary dim): 16-byte items for rotation and pass-through (64 of 128,
# 32 of 64), rotate_half's half not a vector in bf16 (R = 8: scalar, interleaved vector), a pass-
# through not a vector (D = 72), scalar everywhere (D = 10, R = 4; odd D = 7), full rotary
# (R = D = 128), a long sequence (16384 positions)
@pytest.mark.parametrize("heads,length,dim,rotary", [(8, 333, 128, 64), (4, 50, 64, 32), (2, 17, 16, 8),
                                                     (2, 17, 72, 64), (3, 9, 10, 4), (2, 5, 7, 4),
                                                     (4, 40, 128, 128), (2, 16384, 64, 32)])
def test_rope_partial_and_interleaved_cuda_equals_cpu(dtype, interleaved, heads, length, dim, rotary):
    gen = torch.Generator().manual_seed(dim + rotary + length)
    x = torch.randn(2, length, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    cos = torch.randn(2, length, rotary, generator=gen).to(dtype)  # per element: any cos, sin
    sin = torch.randn(2, length, rotary, generator=gen).to(dtype)
    upstream = torch.randn(x.shape, generator=gen).to(dtype)
    out = _rope_cuda_equals_cpu(x, cos, sin, upstream, interleaved=interleaved)
    assert torch.equal(out[..., rotary:], x[..., rotary:].float())  # the pass-through is a copy


# --- hasten::rms_norm_rope (kernels.fused_qk_norm_rope) --------------------------------------------

def _norm_rope_case(batch, heads, length, dim, rotary, dtype, interleaved, seed=0):
    """q as the attention hands it over ((B, H, L, D) view of (B, L, H, D)), a weight near 1, cos and
    sin of x's dtype laid out as the models make them (each angle twice)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, length, heads, dim, generator=gen) * 3 + 0.5).to(dtype).transpose(1, 2)
    weight = (1 + 0.5 * torch.randn(dim, generator=gen)).to(dtype)
    angles = 3 * torch.randn(1, length, rotary // 2, generator=gen)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    upstream = torch.randn(batch, length, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    return x, weight, emb.cos().to(dtype), emb.sin().to(dtype), upstream


def _norm_rope_run(fn, x, weight, upstream, weight_grad):
    xr, wr = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_(weight_grad)
    out = fn(xr, wr)
    out.backward(upstream)
    return out.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["trained_weight", "frozen_weight"])
# W1's q (16 heads of 128), one token, D = 64, Qwen3-Next's partial rotary (64 of 256), a 96-wide
# head (12 vectors in bf16: lanes of a 16-lane group idle), rows past one grid pass (70,000 rows)
@pytest.mark.parametrize("batch,heads,length,dim,rotary", [(1, 16, 4099, 128, 128), (1, 1, 1, 128, 128),
                                                           (2, 8, 77, 64, 64), (1, 4, 333, 256, 64),
                                                           (3, 2, 50, 96, 96), (1, 8, 8750, 64, 32)])
def test_rms_norm_rope_cuda_equals_the_two_ops_and_the_cpu(dtype, interleaved, weight_grad,
                                                           batch, heads, length, dim, rotary):
    """The fused kernel against hasten::rms_norm then hasten::rope on the GPU (the same sums and
    roundings: the output bit for bit; d x and d weight within float32 summation order) and against
    the CPU reference (float tolerance)."""
    from hasten.ops.dense import rms_norm_rope, rms_norm_rope_covers

    x, weight, cos, sin, upstream = _norm_rope_case(batch, heads, length, dim, rotary, dtype, interleaved)
    if not rms_norm_rope_covers(x.cuda(), rotary, interleaved):
        pytest.skip(f"the kernel does not take head_dim {dim} / rotary {rotary} in {dtype} (the integration runs the "
                    "two ops there)")
    on = [t.cuda() for t in (x, weight, cos, sin, upstream)]
    x_c, w_c, cos_c, sin_c, up_c = on
    fused = _norm_rope_run(lambda a, w: rms_norm_rope(a, w, cos_c, sin_c, 1e-6, 0.0, interleaved), x_c, w_c, up_c,
                           weight_grad)
    separate = _norm_rope_run(lambda a, w: rope(rms_norm(a, w, 1e-6), cos_c, sin_c, interleaved), x_c, w_c, up_c,
                              weight_grad)
    cpu = _norm_rope_run(lambda a, w: rms_norm_rope(a, w, cos, sin, 1e-6, 0.0, interleaved), x, weight, upstream,
                         weight_grad)
    assert fused[0].stride() == x_c.stride()
    if dtype == torch.float32:  # no rounding to T between the steps: nvcc contracts them its own way
        torch.testing.assert_close(fused[0], separate[0], rtol=1e-6, atol=1e-6)
    else:  # the same sums and roundings: bit for bit (H100, db7c036)
        assert torch.equal(fused[0], separate[0]), (fused[0].float() - separate[0].float()).abs().max()
    torch.testing.assert_close(fused[1], separate[1], **TOL[dtype])
    torch.testing.assert_close(fused[0].cpu().float(), cpu[0].float(), **TOL[dtype])
    torch.testing.assert_close(fused[1].cpu().float(), cpu[1].float(), **TOL[dtype])
    if weight_grad:
        torch.testing.assert_close(fused[2].float(), separate[2].float(), **TOL[dtype])
        torch.testing.assert_close(fused[2].cpu().float(), cpu[2].float(), **TOL[dtype])
    else:
        assert fused[2] is None


def test_rms_norm_rope_cuda_reads_odd_layouts_and_empty_inputs():
    """A weight that is an unaligned view (FSDP2's flat parameters), a gradient that is not the
    output's layout, Gemma's weight + 1, and no rows at all."""
    from hasten.ops.dense import rms_norm_rope

    x, weight, cos, sin, upstream = _norm_rope_case(2, 4, 37, 128, 128, torch.bfloat16, False)
    flat = torch.zeros(129, device="cuda", dtype=torch.bfloat16)
    flat[1:].copy_(weight.cuda())
    flat.requires_grad_()
    shifted = flat[1:]  # 2 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 != 0
    x_c = x.cuda().requires_grad_()
    out = rms_norm_rope(x_c, shifted, cos.cuda(), sin.cuda(), 1e-6, 1.0)
    out.backward(upstream.contiguous().cuda())  # (B, H, L, D) contiguous: not the output's layout
    want = _norm_rope_run(lambda a, w: rms_norm_rope(a, w, cos, sin, 1e-6, 1.0), x, weight, upstream.contiguous(),
                          True)
    for got, expected in zip((out.detach(), x_c.grad, flat.grad[1:]), want):
        torch.testing.assert_close(got.cpu().float(), expected.float(), **TOL[torch.bfloat16])
    empty = torch.zeros(1, 4, 0, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weight.cuda().requires_grad_()
    out = rms_norm_rope(empty, w, cos.cuda()[:, :0], sin.cuda()[:, :0], 1e-6)
    out.sum().backward()
    assert out.shape == empty.shape and torch.equal(w.grad, torch.zeros_like(w))


def test_rms_norm_rope_cuda_names_a_shape_it_does_not_take():
    from hasten.ops.dense import rms_norm_rope

    x = torch.randn(1, 2, 5, 120, device="cuda", dtype=torch.bfloat16)  # rotate_half halves of 60: off vectors
    cos = torch.randn(1, 5, 120, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="rms_norm_rope_covers"):
        rms_norm_rope(x, torch.ones(120, device="cuda", dtype=torch.bfloat16), cos, cos, 1e-6)
