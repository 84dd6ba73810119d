"""hasten::rms_norm, add_rms_norm, silu_mul, gelu_tanh_mul and rope (with their backward ops) against plain
PyTorch, CPU."""

import pytest
import torch
import torch.nn.functional as F

from hasten.ops.dense import add_rms_norm, gelu_tanh_mul, rms_norm, rope, silu_mul


def _reference_rms_norm(x, weight, eps):
    # transformers' LlamaRMSNorm / Qwen3RMSNorm
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x):
    # GLM / Cohere: pairs (2j, 2j + 1) -> (-x[2j + 1], x[2j])
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _reference_rope(x, cos, sin, interleaved=False):
    """x (B, heads, L, D), cos/sin (B or 1, L, R): the first R features rotate, the rest pass through."""
    rotary = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    rotated = _rotate_interleaved(x_rot) if interleaved else _rotate_half(x_rot)
    return torch.cat((x_rot * cos.unsqueeze(1) + rotated * sin.unsqueeze(1), x_pass), dim=-1)


def _cos_sin(cs_batch, length, rotary, interleaved, gen, dtype=torch.float32):
    """cos, sin (cs_batch, L, R) laid out as the models make them: each angle twice, as the halves
    (rotate_half) or as neighbours (interleaved)."""
    angles = 3 * torch.randn(cs_batch, length, rotary // 2, generator=gen, dtype=dtype)
    emb = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    gen = torch.Generator().manual_seed(99)
    upstream = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    out.backward(upstream)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 64), (0, 8), (7, 1000)])
def test_rms_norm_matches_transformers(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    w = torch.randn(shape[-1], generator=gen)
    got, got_grads = _grads(lambda a, b: rms_norm(a, b, 1e-6), x, w)
    want, want_grads = _grads(lambda a, b: _reference_rms_norm(a, b, 1e-6), x, w)
    torch.testing.assert_close(got, want)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_rms_norm_with_a_frozen_weight_computes_no_weight_gradient():
    """A frozen weight (LoRA's norms): the backward skips the weight gradient (weight_grad=False
    reaches the kernel) and grad_x is the full backward's."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 33, generator=gen), torch.randn(33, generator=gen)
    leaf = x.clone().requires_grad_()
    frozen = rms_norm(leaf, w, 1e-6)
    frozen.backward(torch.ones_like(frozen))
    full_x, full_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = rms_norm(full_x, full_w, 1e-6)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(leaf.grad, full_x.grad, rtol=0, atol=0)
    _, rstd = torch.ops.hasten.rms_norm(x, w, 1e-6, 0.0)
    assert torch.ops.hasten.rms_norm_backward(torch.ones_like(x), x, w, rstd, 0.0, False)[1].numel() == 0


def _decoder_step(fused, x, residual, weight, offset):
    """A pre-norm decoder's `h = residual + x; y = norm(h)`, then both used downstream (y by the
    MLP, h by the next residual add): the loss reads both, so both gradients flow into h."""
    if fused == "torch":  # plain PyTorch: the add, transformers' RMSNorm formula
        h = residual + x
        y = _reference_rms_norm(h, weight + offset, 1e-6)
    elif fused:
        y, h = add_rms_norm(x, residual, weight, 1e-6, offset)
    else:
        h = residual + x
        y = rms_norm(h, weight, 1e-6, offset)
    gen = torch.Generator().manual_seed(7)
    loss = (y.float() * torch.randn(y.shape, generator=gen)).sum() + (h.float() * torch.randn(h.shape, generator=gen)).sum()
    loss.backward()
    return y.detach(), h.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset,weight_grad", [(0.0, True), (1.0, True), (0.0, False)])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 5, 64)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, offset, weight_grad, shape):
    """The fused residual add: the same sum and output as `residual + x` then rms_norm (bitwise:
    the sum is rounded as the add rounds it), and the same gradients for x, residual and weight
    (float32: to rounding; bf16: the fused backward adds the two gradients of the sum in float32
    and rounds once, the separate path rounds each first, so within a bf16 step)."""
    gen = torch.Generator().manual_seed(sum(shape))
    base = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)] + [torch.randn(shape[-1], generator=gen).to(dtype)]
    runs = []
    for fused in (True, False, "torch"):
        x, residual, weight = (t.clone().requires_grad_(i < 2 or weight_grad) for i, t in enumerate(base))
        y, h = _decoder_step(fused, x, residual, weight, offset)
        runs.append((y, h, x.grad, residual.grad, weight.grad))
    (y, h, gx, gr, gw), (y0, h0, gx0, gr0, gw0), (y1, h1, gx1, gr1, gw1) = runs
    assert torch.equal(h, h0) and torch.equal(y, y0)
    # and plain PyTorch's add and transformers' RMSNorm formula (weight + offset), gradients too
    torch.testing.assert_close(h, h1, rtol=0, atol=0)
    loose = {torch.float32: dict(rtol=1e-4, atol=1e-5)}.get(dtype, dict(rtol=3e-2, atol=3e-2))
    torch.testing.assert_close(y.float(), y1.float(), **loose)
    torch.testing.assert_close(gx.float(), gx1.float(), **loose)
    if weight_grad:
        torch.testing.assert_close(gw.float(), gw1.float(), **loose)
    assert torch.equal(gx, gr)  # d(x + r)/dx = d(x + r)/dr
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}[dtype]
    torch.testing.assert_close(gx, gx0, **tol)
    torch.testing.assert_close(gr, gr0, **tol)
    if weight_grad:
        torch.testing.assert_close(gw, gw0, **tol)
    else:
        assert gw is None


def test_rms_norm_bfloat16_in_bf16_noise_and_offset():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=gen).to(torch.bfloat16)
    w = torch.randn(300, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5).float(), _reference_rms_norm(x, w, 1e-5).float(),
                               rtol=1e-2, atol=1e-2)
    shifted = rms_norm(x.float(), w.float(), 1e-5, offset=1.0)
    torch.testing.assert_close(shifted, _reference_rms_norm(x.float(), w.float() + 1.0, 1e-5))


@pytest.mark.parametrize("shape", [(1, 1), (4, 3), (2, 7, 129), (0, 5)])
def test_silu_mul_matches_pytorch(shape):
    gen = torch.Generator().manual_seed(len(shape))
    gate, up = torch.randn(shape, generator=gen) * 4, torch.randn(shape, generator=gen)
    got, got_grads = _grads(silu_mul, gate, up)
    want, want_grads = _grads(lambda g, u: F.silu(g) * u, gate, up)
    torch.testing.assert_close(got, want)
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,heads,length,dim,cs_batch", [(1, 1, 1, 2, 1), (2, 3, 5, 8, 2), (2, 4, 33, 64, 1),
                                                             (1, 2, 0, 4, 1)])
def test_rope_matches_transformers_and_its_gradient(batch, heads, length, dim, cs_batch):
    gen = torch.Generator().manual_seed(dim + length)
    # q as transformers makes it: (B, L, heads, D) viewed as (B, heads, L, D)
    x = torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)
    angles = torch.randn(cs_batch, length, dim // 2, generator=gen)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    got, (got_grad,) = _grads(lambda a: rope(a, cos, sin), x)
    want, (want_grad,) = _grads(lambda a: _reference_rope(a, cos, sin), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert got.stride() == x.stride() or length == 0  # the layout of q is kept


def test_rope_backward_is_exact_for_any_cos_sin():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 4, 6, generator=gen)
    cos, sin = torch.randn(1, 4, 6, generator=gen), torch.randn(1, 4, 6, generator=gen)  # halves differ
    _, (got,) = _grads(lambda a: rope(a, cos, sin), x)
    _, (want,) = _grads(lambda a: _reference_rope(a, cos, sin), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1), (4, 3), (2, 7, 129), (0, 5), (3, 0), (5, 33)])
def test_gelu_tanh_mul_matches_pytorch(shape, dtype):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    gate = torch.randn(shape, generator=gen, dtype=dtype) * 4  # both tails of the tanh
    up = torch.randn(shape, generator=gen, dtype=dtype)
    got, got_grads = _grads(gelu_tanh_mul, gate, up)
    want, _ = _grads(lambda g, u: F.gelu(g, approximate="tanh") * u, gate, up)
    torch.testing.assert_close(got, want)
    # gradients against torch in float64: torch's float32 backward rounds 1 + tanh(...) to 0 below
    # gate ~ -5, where the gradient is ~1e-6 (ours keeps it); float32 rounding is the yardstick
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(99), dtype=dtype)  # _grads' one
    leaves = [gate.double().requires_grad_(), up.double().requires_grad_()]
    want_grads = torch.autograd.grad(F.gelu(leaves[0], approximate="tanh") * leaves[1], leaves, upstream.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    for g, r in zip(got_grads, want_grads):
        torch.testing.assert_close(g, r.to(dtype), **tol)


def test_gelu_tanh_mul_of_a_fused_projection_and_its_float64_gradient():
    """gate and up as the two non-contiguous halves of one (rows, 2I) projection; gradcheck in float64."""
    gen = torch.Generator().manual_seed(11)
    gate_up = torch.randn(6, 2 * 9, generator=gen, dtype=torch.float64) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    torch.testing.assert_close(gelu_tanh_mul(gate, up), F.gelu(gate, approximate="tanh") * up)
    leaves = (gate.clone().requires_grad_(), up.clone().requires_grad_())
    assert torch.autograd.gradcheck(gelu_tanh_mul, leaves)


def test_gelu_tanh_mul_refuses_a_second_derivative():
    gate, up = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    (grad_gate,) = torch.autograd.grad(gelu_tanh_mul(gate, up).sum(), gate, create_graph=True)
    with pytest.raises(NotImplementedError, match="gelu_tanh_mul_backward has no derivative"):
        grad_gate.sum().backward()


# (batch, heads, length, head_dim D, rotary dim R, batch of cos/sin): full rotary, Phi/GLM-like
# halves (D=16, R=8), a rotary dim that is no power of two (D=10, R=4), an odd head_dim (D=7, R=4)
ROPE_CASES = [(1, 1, 1, 2, 2, 1), (2, 3, 5, 8, 8, 2), (2, 3, 5, 16, 8, 1), (2, 2, 6, 16, 8, 2), (1, 2, 4, 10, 4, 1),
              (2, 1, 3, 10, 4, 2), (1, 2, 3, 7, 4, 1), (1, 2, 0, 8, 4, 1)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch,heads,length,dim,rotary,cs_batch", ROPE_CASES)
def test_rope_partial_and_interleaved_match_pytorch_and_their_gradient(batch, heads, length, dim, rotary, cs_batch,
                                                                       dtype, interleaved):
    gen = torch.Generator().manual_seed(dim * 10 + rotary + length)
    # q as transformers makes it: (B, L, heads, D) viewed as (B, heads, L, D)
    x = torch.randn(batch, length, heads, dim, generator=gen, dtype=dtype).transpose(1, 2)
    cos, sin = _cos_sin(cs_batch, length, rotary, interleaved, gen, dtype=dtype)
    got, (got_grad,) = _grads(lambda a: rope(a, cos, sin, interleaved=interleaved), x)
    want, (want_grad,) = _grads(lambda a: _reference_rope(a, cos, sin, interleaved), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)
    torch.testing.assert_close(got[..., rotary:], x[..., rotary:], rtol=0, atol=0)  # passed through, bit for bit
    assert got.stride() == x.stride() or length == 0  # the layout of q is kept


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dim,rotary", [(6, 6), (10, 4), (7, 2)])
def test_rope_backward_is_the_exact_transpose_for_any_cos_sin(dim, rotary, interleaved):
    """Random cos and sin (the two elements of a pair use different values): gradcheck in float64."""
    gen = torch.Generator().manual_seed(dim + rotary)
    x = torch.randn(2, 2, 3, dim, generator=gen, dtype=torch.float64).requires_grad_()
    cos = torch.randn(2, 3, rotary, generator=gen, dtype=torch.float64)
    sin = torch.randn(2, 3, rotary, generator=gen, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a: rope(a, cos, sin, interleaved=interleaved), (x,))
    torch.testing.assert_close(rope(x, cos, sin, interleaved=interleaved), _reference_rope(x, cos, sin, interleaved))


def test_rope_layouts_differ():
    """The flag is honoured: the two pairings of one input disagree."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 2, 8, generator=gen)
    cos, sin = torch.randn(1, 2, 8, generator=gen), torch.randn(1, 2, 8, generator=gen)
    assert not torch.allclose(rope(x, cos, sin), rope(x, cos, sin, interleaved=True))


def test_bad_inputs_are_named():
    with pytest.raises(RuntimeError, match=r"`weight` must be \(8,\)"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match=r"Convert it with .to\(torch.float32\)"):
        rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="`gate` and `up` must have one shape"):
        silu_mul(torch.randn(2, 3), torch.randn(3, 2))
    with pytest.raises(RuntimeError, match=r"must be even and in \[2, head_dim=8\], got 3"):
        rope(torch.randn(1, 1, 3, 8), torch.randn(1, 3, 3), torch.randn(1, 3, 3))
    with pytest.raises(RuntimeError, match=r"must be even and in \[2, head_dim=4\], got 6"):
        rope(torch.randn(1, 1, 3, 4), torch.randn(1, 3, 6), torch.randn(1, 3, 6), interleaved=True)
    with pytest.raises(RuntimeError, match="`cos` and `sin` must have one shape"):
        rope(torch.randn(2, 1, 3, 4), torch.randn(1, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="`gate` and `up` must have one shape"):
        gelu_tanh_mul(torch.randn(2, 3), torch.randn(3, 2))


# --- hasten::rms_norm_rope: a head norm and the rotary embedding after it -----------------------

# (batch, heads, length, head_dim, rotary, cos batch): a one-token sequence, partial rotary, one head
NORM_ROPE_CASES = [(1, 1, 1, 8, 8, 1), (2, 3, 7, 16, 16, 2), (2, 4, 5, 16, 8, 1), (1, 2, 9, 24, 8, 1)]


def _norm_rope_inputs(batch, heads, length, dim, rotary, cs_batch, interleaved, dtype, transposed, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, heads, dim, generator=gen) * 3 + 0.5
    x = (x.transpose(1, 2) if transposed else x.permute(0, 2, 1, 3).contiguous()).to(dtype)  # (B, H, L, D)
    weight = (1 + 0.5 * torch.randn(dim, generator=gen)).to(dtype)
    cos, sin = _cos_sin(cs_batch, length, rotary, interleaved, gen)
    return x, weight, cos.to(dtype), sin.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("case", NORM_ROPE_CASES)
def test_rms_norm_rope_is_the_norm_then_the_rotary(dtype, interleaved, offset, case):
    """The fused op gives what hasten::rms_norm then hasten::rope give, bit for bit, output and both
    gradients (the CPU reference is that composition; the CUDA kernel is held to it in tests/gpu),
    and within float rounding what transformers' RMSNorm then apply_rotary_pos_emb compute."""
    from hasten.ops.dense import rms_norm_rope

    x, weight, cos, sin = _norm_rope_inputs(*case, interleaved, dtype, transposed=True)
    fused = _grads(lambda a, w: rms_norm_rope(a, w, cos, sin, 1e-6, offset, interleaved), x, weight)
    separate = _grads(lambda a, w: rope(rms_norm(a, w, 1e-6, offset), cos, sin, interleaved), x, weight)
    assert torch.equal(fused[0], separate[0])
    assert all(torch.equal(a, b) for a, b in zip(fused[1], separate[1]))
    model = _reference_rope(_reference_rms_norm(x.float(), weight.float() + offset, 1e-6), cos.float(), sin.float(),
                            interleaved)
    torch.testing.assert_close(fused[0].float(), model, **({} if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)))


def test_rms_norm_rope_keeps_the_input_layout_and_takes_empty_inputs():
    from hasten.ops.dense import rms_norm_rope

    x, weight, cos, sin = _norm_rope_inputs(2, 3, 5, 8, 8, 1, False, torch.float32, transposed=True)
    out = rms_norm_rope(x, weight, cos, sin, 1e-6)
    assert out.stride() == x.stride()  # q and k stay views of (B, L, H, D) for the attention
    empty = torch.randn(2, 3, 0, 8, requires_grad=True)
    out = rms_norm_rope(empty, weight.requires_grad_(), cos[:, :0], sin[:, :0], 1e-6)
    out.sum().backward()
    assert out.shape == empty.shape and torch.equal(weight.grad, torch.zeros_like(weight))


def test_rms_norm_rope_with_a_frozen_weight_and_without_a_gradient_for_cos():
    from hasten.ops.dense import rms_norm_rope

    x, weight, cos, sin = _norm_rope_inputs(1, 2, 4, 8, 8, 1, False, torch.float32, transposed=False)
    x.requires_grad_()
    rms_norm_rope(x, weight, cos, sin, 1e-6).sum().backward()  # weight frozen (LoRA): no weight gradient
    assert x.grad is not None and weight.grad is None
    with pytest.raises(NotImplementedError, match="no gradient for cos and sin"):
        rms_norm_rope(x, weight, cos.requires_grad_(), sin, 1e-6)


def test_rms_norm_rope_covers_every_cpu_shape_and_the_kernels_cuda_shapes():
    from hasten.ops.dense import rms_norm_rope_covers

    assert rms_norm_rope_covers(torch.empty(1, 1, 1, 6), 4, False)  # the CPU reference takes any shape
    meta = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="meta")
    cuda_like = type("CudaLike", (), {"device": torch.device("cuda"), "shape": meta.shape,
                                      "element_size": lambda self: 2})()
    assert rms_norm_rope_covers(cuda_like, 128, False)
    assert rms_norm_rope_covers(cuda_like, 32, False)  # Qwen3-Next's partial rotary: halves of 16
    assert not rms_norm_rope_covers(cuda_like, 24, False)  # halves of 12: off the 8-element vectors
    assert rms_norm_rope_covers(cuda_like, 24, True) and not rms_norm_rope_covers(cuda_like, 12, True)  # pairs in vectors
