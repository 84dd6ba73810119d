"""hasten::lora_linear and its backward against LoRA written out in float64 (CPU): outputs and the
gradients of x, x_lora and both adapters, with bias, dropout input, float32 adapters under a bf16
base, one-token and empty inputs; what autograd keeps; the frozen base enforced."""

import pytest
import torch

from hasten.ops.lora import lora_linear


def _reference(x, weight, bias, a, b, scale, x_lora=None):
    x_lora = x if x_lora is None else x_lora
    y = x @ weight.T + scale * (x_lora @ a.T) @ b.T
    return y if bias is None else y + bias


def _inputs(rows, n_in, n_out, rank, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, n_in, generator=gen, dtype=dtype)
    weight, bias = torch.randn(n_out, n_in, generator=gen, dtype=dtype), torch.randn(n_out, generator=gen, dtype=dtype)
    a, b = torch.randn(rank, n_in, generator=gen, dtype=dtype), torch.randn(n_out, rank, generator=gen, dtype=dtype)
    return x, weight, bias, a, b


@pytest.mark.parametrize("with_bias,with_dropout", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rows,n_in,n_out,rank", [((1,), 8, 6, 1), ((2, 7), 24, 40, 4), ((0,), 8, 6, 2),
                                                  ((3, 1), 33, 17, 16)])
def test_matches_lora_written_out(rows, n_in, n_out, rank, with_bias, with_dropout):
    x, weight, bias, a, b = _inputs(rows, n_in, n_out, rank, seed=n_in + rank)
    bias = bias if with_bias else None
    x_lora = x * (torch.rand(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype) > 0.3) / 0.7 \
        if with_dropout else None
    leaves = [t.clone().requires_grad_() for t in (x, a, b)] + ([x_lora.clone().requires_grad_()] if with_dropout
                                                                 else [])
    ref_leaves = [t.clone().requires_grad_() for t in (x, a, b)] + ([x_lora.clone().requires_grad_()] if with_dropout
                                                                     else [])
    got = lora_linear(leaves[0], weight, bias, leaves[1], leaves[2], 0.75, x_lora=leaves[3] if with_dropout else None)
    want = _reference(ref_leaves[0], weight, bias, ref_leaves[1], ref_leaves[2], 0.75,
                      ref_leaves[3] if with_dropout else None)
    torch.testing.assert_close(got, want)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=want.dtype)
    got.backward(upstream)
    want.backward(upstream)
    for name, g, w in zip(("x", "lora_a", "lora_b", "x_lora"), leaves, ref_leaves):
        torch.testing.assert_close(g.grad, w.grad, msg=f"grad of {name}")


def test_float32_adapters_under_a_bf16_base_keep_their_dtype():
    """PEFT's default: float32 adapters on a bf16 model. The op computes in bf16 and hands the
    adapters float32 gradients, within bf16 rounding of the float64 formula."""
    x, weight, bias, a, b = _inputs((5, 3), 32, 24, 8, seed=3)
    xb, wb = x.bfloat16().requires_grad_(), weight.bfloat16()
    a32, b32 = a.float().requires_grad_(), b.float().requires_grad_()
    kept = _saved(lambda: lora_linear(xb, wb, None, a32, b32, 0.5))
    copies = [t for t in kept if t.dim() == 1 and t.numel() == a.numel() + b.numel()]
    assert len(copies) == 1 and copies[0].dtype == torch.bfloat16  # the forward's one copy, for the backward
    y = lora_linear(xb, wb, None, a32, b32, 0.5)
    assert y.dtype == torch.bfloat16
    ref_a, ref_b = a.clone().requires_grad_(), b.clone().requires_grad_()
    want = _reference(xb.detach().double(), wb.double(), None, ref_a, ref_b, 0.5)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y.backward(upstream.bfloat16())
    want.backward(upstream.bfloat16().double())
    assert a32.grad.dtype == torch.float32 and b32.grad.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    for got, ref in ((y.detach().double(), want.detach()), (a32.grad.double(), ref_a.grad),
                     (b32.grad.double(), ref_b.grad)):
        assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("group", [False, True])
def test_float32_adapters_are_cast_once_and_the_backward_reads_that_copy(group):
    """Under a bf16 base the forward casts float32 adapters once, as one flat bf16 copy [A... | B...]
    it returns and autograd keeps, and the backward's GEMMs read that copy instead of casting the
    adapters again: the backward given the copy equals the backward that casts (bit for bit), and a
    copy scaled by 2 moves d x and d B (so the copy is what it reads); bf16 adapters make no copy;
    a copy of the wrong size is refused by name."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, generator=gen).bfloat16()
    weights = [torch.randn(12, 16, generator=gen).bfloat16(), torch.randn(4, 16, generator=gen).bfloat16()]
    lora_a = [torch.randn(4, 16, generator=gen), torch.randn(2, 16, generator=gen)]
    lora_b = [torch.randn(12, 4, generator=gen), torch.randn(4, 2, generator=gen)]
    if not group:
        weights, lora_a, lora_b = weights[:1], lora_a[:1], lora_b[:1]
    scales = [0.5, 2.0][:len(weights)]
    if group:
        ys, xa, adapters = torch.ops.hasten.lora_linear_group(x, weights, [], lora_a, lora_b, scales)
        grads = [torch.randn(y.shape, generator=gen).bfloat16() for y in ys]
        backward = lambda copy: torch.ops.hasten.lora_linear_group_backward(  # noqa: E731
            grads, x, weights, lora_a, lora_b, xa, scales, True, copy)
    else:
        y, xa, adapters = torch.ops.hasten.lora_linear(x, None, weights[0], None, lora_a[0], lora_b[0], scales[0])
        grad = torch.randn(y.shape, generator=gen).bfloat16()
        backward = lambda copy: torch.ops.hasten.lora_linear_backward(  # noqa: E731
            grad, x, weights[0], lora_a[0], lora_b[0], xa, scales[0], True, copy)
    flat = torch.cat([t.reshape(-1) for t in (*lora_a, *lora_b)]).bfloat16()
    assert adapters.dtype == torch.bfloat16 and torch.equal(adapters, flat)

    def results(copy):
        out = backward(copy)
        grad_x, grad_a, grad_b = out[0], out[-2], out[-1]
        grad_a = list(grad_a.split([a.shape[0] for a in lora_a]))  # the group's comes stacked (R, in)
        grad_b = grad_b if isinstance(grad_b, list) else [grad_b]
        assert all(g.dtype == torch.float32 for g in (*grad_a, *grad_b))
        return [grad_x, *grad_a, *grad_b]

    with_copy, casting = results(adapters), results(None)
    assert all(torch.equal(a, b) for a, b in zip(with_copy, casting))
    doubled = results(adapters * 2)
    n = len(weights)
    assert not torch.equal(doubled[0], with_copy[0])  # d x = g W + gb A reads A (and B) from the copy
    # d A = gb^T x with gb = s g B reads B from the copy
    assert all(not torch.equal(d, w) for d, w in zip(doubled[1:1 + n], with_copy[1:1 + n]))
    with pytest.raises(RuntimeError, match="`adapters` must be the forward's flat copy"):
        backward(adapters[1:])
    lora_a16, lora_b16 = [a.bfloat16() for a in lora_a], [b.bfloat16() for b in lora_b]
    if group:
        none = torch.ops.hasten.lora_linear_group(x, weights, [], lora_a16, lora_b16, scales)[2]
    else:
        none = torch.ops.hasten.lora_linear(x, None, weights[0], None, lora_a16[0], lora_b16[0], scales[0])[2]
    assert none.numel() == 0


def _saved(fn):
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fn()
    return kept


def test_keeps_x_itself_and_the_rank_sized_product_only():
    x, weight, _, a, b = _inputs((6,), 16, 12, 4, seed=5)
    x.requires_grad_()
    a, b = a.requires_grad_(), b.requires_grad_()
    kept = _saved(lambda: lora_linear(x, weight, None, a, b, 1.0))
    activations = [t for t in kept if t.shape[:-1] == x.shape[:-1]]
    assert len(activations) == 2 and activations[0] is x and activations[1].shape == (6, 4)  # x (no copy) and xa
    frozen_adapters = _saved(lambda: lora_linear(x, weight, None, a.detach(), b.detach(), 1.0))
    assert all(t.shape[:-1] != x.shape[:-1] for t in frozen_adapters)  # d x needs the weights only


def test_a_trainable_base_is_refused():
    x, weight, _, a, b = _inputs((3,), 8, 6, 2, seed=6)
    with pytest.raises(NotImplementedError, match="frozen base layer"):
        lora_linear(x, weight.requires_grad_(), None, a.requires_grad_(), b, 1.0)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows,n_in,outs,ranks", [((1,), 8, (6, 3, 3), (2, 1, 4)), ((2, 7), 24, (40, 40), (4, 4)),
                                                  ((0,), 8, (6, 2), (2, 2)), ((3, 1), 33, (17,), (16,))])
def test_group_matches_each_projection_written_out(rows, n_in, outs, ranks, with_bias):
    """hasten::lora_linear_group: q/k/v- and gate/up-like members (ranks and scales of their own),
    one-token, empty and one-member inputs: outputs and the gradients of x and every adapter."""
    from hasten.ops.lora import lora_linear_group

    gen = torch.Generator().manual_seed(sum(outs) + n_in)
    x = torch.randn(*rows, n_in, generator=gen, dtype=torch.float64)
    weights = [torch.randn(n, n_in, generator=gen, dtype=torch.float64) for n in outs]
    biases = [torch.randn(n, generator=gen, dtype=torch.float64) for n in outs] if with_bias else []
    adapters_a = [torch.randn(r, n_in, generator=gen, dtype=torch.float64) for r in ranks]
    adapters_b = [torch.randn(n, r, generator=gen, dtype=torch.float64) for n, r in zip(outs, ranks)]
    scales = [0.75, 2.0, 1.0][:len(outs)]
    leaves = [t.clone().requires_grad_() for t in [x, *adapters_a, *adapters_b]]
    ref = [t.clone().requires_grad_() for t in [x, *adapters_a, *adapters_b]]
    n = len(outs)
    got = lora_linear_group(leaves[0], weights, biases, leaves[1:1 + n], leaves[1 + n:], scales)
    want = [_reference(ref[0], w, biases[i] if biases else None, ref[1 + i], ref[1 + n + i], scales[i])
            for i, w in enumerate(weights)]
    upstream = [torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    sum((g * u).sum() for g, u in zip(got, upstream)).backward()
    sum((w * u).sum() for w, u in zip(want, upstream)).backward()
    for i, (g, w) in enumerate(zip(leaves, ref)):
        torch.testing.assert_close(g.grad, w.grad, msg=f"grad of leaf {i} (x, then each lora_a, then each lora_b)")


@pytest.mark.parametrize("gated", [False, True])
def test_an_input_without_gradient_gets_no_input_gradient_computed(gated):
    """The first layer's q/k/v under a frozen embedding: x needs no gradient, so the backward op is
    asked for none (grad_input false: its d x GEMMs do not run) and the adapters' gradients are the
    ones an x that needs a gradient gets."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hasten.ops.lora import lora_gated_group, lora_linear_group

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 24, generator=gen, dtype=torch.float64)
    weights = [torch.randn(10, 24, generator=gen, dtype=torch.float64) for _ in range(2)]
    scales = [0.5, 2.0]

    def adapters_and_grads(x_needs_grad):
        g = torch.Generator().manual_seed(4)
        adapters = [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
                    for shape in ((3, 24), (3, 24), (10, 3), (10, 3))]
        leaf = x.clone().requires_grad_(x_needs_grad)
        calls = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if "group_backward" in func.__name__:  # grad_input: the backward's one bool (default True)
                    calls.append(next((a for a in args if isinstance(a, bool)), True))
                return func(*args, **(kwargs or {}))

        if gated:
            out = lora_gated_group(leaf, weights, [], adapters[:2], adapters[2:], scales, "silu")
        else:
            out = sum(y * (i + 1) for i, y in enumerate(lora_linear_group(leaf, weights, [], adapters[:2], adapters[2:],
                                                                          scales)))
        with Record():
            (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        return [a.grad for a in adapters], leaf.grad, calls

    grads_with, x_grad, calls_with = adapters_and_grads(True)
    grads_without, no_x_grad, calls_without = adapters_and_grads(False)
    assert calls_with == [True] and calls_without == [False]
    assert x_grad is not None and no_x_grad is None
    for got, want in zip(grads_without, grads_with):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _two_member_inputs():
    """x (6, 16) and a frozen (12, 16) base with two rank-4 adapter pairs, all but the base trainable."""
    x, weight, _, a, b = _inputs((6,), 16, 12, 4, seed=7)
    x.requires_grad_()
    a, b = a.requires_grad_(), b.requires_grad_()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    return x, weight, a, b, a2, b2


def test_group_keeps_x_itself_and_the_stacked_rank_sized_product_only():
    from hasten.ops.lora import lora_linear_group

    x, weight, a, b, a2, b2 = _two_member_inputs()
    kept = _saved(lambda: lora_linear_group(x, [weight, weight], [], [a, a2], [b, b2], [1.0, 1.0]))
    activations = [t for t in kept if t.shape[:-1] == x.shape[:-1]]
    assert len(activations) == 2 and activations[0] is x and activations[1].shape == (6, 8)  # x and [xa_0 | xa_1]
    with pytest.raises(NotImplementedError, match="frozen base layers"):
        lora_linear_group(x, [weight.clone().requires_grad_()], [], [a], [b], [1.0])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows,n_in,inner,ranks", [((1,), 8, 6, (2, 1)), ((2, 7), 24, 40, (4, 4)),
                                                   ((0,), 8, 6, (2, 2)), ((3, 1), 33, 17, (16, 16))])
def test_gated_group_matches_the_mlp_written_out(rows, n_in, inner, ranks, with_bias, activation):
    """hasten::lora_gated_group: f(gate) * up over a [gate, up] group, against the projections and
    the activation written out (float64): output, and the gradients of x and every adapter; one-token
    and empty inputs, ranks of their own."""
    from hasten.ops.lora import lora_gated_group

    gen = torch.Generator().manual_seed(inner + n_in)
    x = torch.randn(*rows, n_in, generator=gen, dtype=torch.float64)
    weights = [torch.randn(inner, n_in, generator=gen, dtype=torch.float64) for _ in range(2)]
    biases = [torch.randn(inner, generator=gen, dtype=torch.float64) for _ in range(2)] if with_bias else []
    adapters_a = [torch.randn(r, n_in, generator=gen, dtype=torch.float64) for r in ranks]
    adapters_b = [torch.randn(inner, r, generator=gen, dtype=torch.float64) for r in ranks]
    scales = [0.75, 2.0]
    leaves = [t.clone().requires_grad_() for t in [x, *adapters_a, *adapters_b]]
    ref = [t.clone().requires_grad_() for t in [x, *adapters_a, *adapters_b]]
    got = lora_gated_group(leaves[0], weights, biases, leaves[1:3], leaves[3:], scales, activation)
    gate, up = (_reference(ref[0], w, biases[i] if biases else None, ref[1 + i], ref[3 + i], scales[i])
                for i, w in enumerate(weights))
    f = torch.nn.functional.silu if activation == "silu" else (
        lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
    want = f(gate) * up
    torch.testing.assert_close(got, want)
    upstream = torch.randn(want.shape, generator=gen, dtype=want.dtype)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    for i, (g, w) in enumerate(zip(leaves, ref)):
        torch.testing.assert_close(g.grad, w.grad, msg=f"grad of leaf {i} (x, lora_a gate, up, lora_b gate, up)")


def test_gated_group_keeps_what_the_two_ops_kept_and_refuses_what_is_not_a_gate_up_pair():
    """gate, up (the activation's), x and [xa_gate | xa_up] (the group's): nothing more."""
    from hasten.ops.lora import lora_gated_group

    x, weight, a, b, a2, b2 = _two_member_inputs()
    kept = _saved(lambda: lora_gated_group(x, [weight, weight], [], [a, a2], [b, b2], [1.0, 1.0], "silu"))
    activations = sorted((t for t in kept if t.shape[:-1] == x.shape[:-1]), key=lambda t: t.shape[-1])
    assert [tuple(t.shape) for t in activations] == [(6, 8), (6, 12), (6, 12), (6, 16)]
    assert activations[-1] is x
    with pytest.raises(RuntimeError, match="the group must be \\[gate, up\\]"):
        lora_gated_group(x, [weight], [], [a], [b], [1.0], "silu")
    with pytest.raises(RuntimeError, match="`activation` must be"):
        lora_gated_group(x, [weight, weight], [], [a, a2], [b, b2], [1.0, 1.0], "gelu")
    with pytest.raises(NotImplementedError, match="frozen base layers"):
        lora_gated_group(x, [weight.clone().requires_grad_(), weight], [], [a, a2], [b, b2], [1.0, 1.0], "silu")


def test_group_d_lora_a_as_views_of_one_tensor_accumulates_and_steps_per_member():
    """The group's backward returns every member's d lora_a stacked (one GEMM's output) and autograd
    gets views of it: a second backward accumulates into each member's .grad alone, an optimizer
    step moves each member by its own gradient, and zeroing one member's grad leaves the others."""
    from hasten.ops.lora import lora_linear_group

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 12, generator=gen, dtype=torch.float64)
    weights = [torch.randn(8, 12, generator=gen, dtype=torch.float64) for _ in range(3)]
    lora_a = [torch.randn(r, 12, generator=gen, dtype=torch.float64).requires_grad_() for r in (2, 3, 2)]
    lora_b = [torch.randn(8, r, generator=gen, dtype=torch.float64).requires_grad_() for r in (2, 3, 2)]
    scales = [0.5, 1.0, 2.0]

    def loss():
        ys = lora_linear_group(x, weights, [], lora_a, lora_b, scales)
        return sum((y * (i + 1)).square().sum() for i, y in enumerate(ys))

    loss().backward()
    once = [a.grad.clone() for a in lora_a]
    loss().backward()
    for a, g in zip(lora_a, once):
        torch.testing.assert_close(a.grad, 2 * g, rtol=0, atol=0)
    lora_a[1].grad.zero_()
    torch.testing.assert_close(lora_a[0].grad, 2 * once[0], rtol=0, atol=0)
    torch.testing.assert_close(lora_a[2].grad, 2 * once[2], rtol=0, atol=0)
    before = [a.detach().clone() for a in lora_a]
    torch.optim.SGD(lora_a, lr=0.1).step()
    for a, old, g in zip(lora_a, before, (2 * once[0], torch.zeros_like(once[1]), 2 * once[2])):
        torch.testing.assert_close(a.detach(), old - 0.1 * g)


@pytest.mark.parametrize("with_bias", [False, True])
def test_group_eager_function_and_registered_formula_agree(with_bias):
    """Eager calls of lora_linear_group take an autograd.Function over the flattened lists
    (_EagerLoraGroup); the op called directly takes its registered formula: the same outputs and
    gradients bit for bit, an unused member included; list lengths refused in the kernel's words."""
    from hasten.ops.lora import lora_linear_group

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 10, generator=gen, dtype=torch.float64)
    weights = [torch.randn(o, 10, generator=gen, dtype=torch.float64) for o in (6, 4, 4)]
    biases = [torch.randn(o, generator=gen, dtype=torch.float64) for o in (6, 4, 4)] if with_bias else []
    lora_a = [torch.randn(r, 10, generator=gen, dtype=torch.float64) for r in (2, 3, 2)]
    lora_b = [torch.randn(o, r, generator=gen, dtype=torch.float64) for o, r in ((6, 2), (4, 3), (4, 2))]
    scales = [0.5, 1.0, 2.0]

    def run(entry):
        leaves = [t.clone().requires_grad_() for t in (x, *lora_a, *lora_b)]
        ys = entry(leaves[0], weights, biases, leaves[1:4], leaves[4:], scales)
        (ys[0].square().sum() + (ys[2] * 3).sum()).backward()  # ys[1] unused
        return [y.detach() for y in ys], [t.grad for t in leaves]

    eager = run(lora_linear_group)
    direct = run(lambda *args: torch.ops.hasten.lora_linear_group(*args)[0])
    for got, want in zip(eager[0] + eager[1], direct[0] + direct[1]):
        assert torch.equal(got, want)
    with pytest.raises(RuntimeError) as kernel:
        torch.ops.hasten.lora_linear_group(x, weights, biases[:1] or weights[:1], lora_a, lora_b, scales)
    with pytest.raises(RuntimeError) as wrapper:
        lora_linear_group(x, weights, biases[:1] or weights[:1], lora_a, lora_b, scales)
    assert str(wrapper.value).splitlines()[0] == str(kernel.value).splitlines()[0]
