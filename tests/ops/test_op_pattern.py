"""The op pattern, for every op hasten declares (CPU):

  * each op has a fake, and each differentiable op its autograd formula registered on the op
    (torch.library.register_autograd); backward ops refuse a second derivative;
  * torch.library.opcheck passes with and without inputs that require a gradient (schema,
    fake against the kernel, autograd registration, AOT dispatch with static and dynamic shapes);
  * the fakes refuse what the kernels refuse, with the same message (tracing cannot accept an
    input the kernel would reject);
  * the autograd formulas save only what the inputs that need a gradient require.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hasten.ops import moe as moe_ops
from hasten.ops import op_names

ops = torch.ops.hasten
DIFFERENTIABLE = {"rms_norm", "add_rms_norm", "silu_mul", "gelu_tanh_mul", "rope", "rms_norm_rope", "varlen_attention",
                  "linear_cross_entropy",
                  "moe_permute", "moe_combine", "moe_grouped_mm", "moe_route", "swiglu", "clamped_swiglu", "moe_weighted_swiglu", "lora_linear",
                  "lora_linear_group", "lora_gated_group"}
BACKWARD_OPS = {"rms_norm_backward", "rms_norm_rope_backward", "silu_mul_backward", "gelu_tanh_mul_backward", "varlen_attention_backward",
                "moe_combine_weight_grad", "moe_grouped_mm_weight_grad", "moe_route_backward", "swiglu_backward",
                "clamped_swiglu_backward", "moe_weighted_swiglu_backward",
                "lora_linear_backward",
                "lora_linear_group_backward", "lora_gated_group_backward"}
# integer-valued or in-place ops, with no derivative to define
NOT_DIFFERENTIABLE = {"varlen_meta", "moe_group", "cross_entropy_rows_"}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _routing(tokens=7, top_k=2, experts=3, seed=0):
    ids = torch.randint(0, experts, (tokens, top_k), generator=_gen(seed))
    return moe_ops.group(ids, experts)


def _cases(requires_grad: bool):
    """(op name, args) for every op; float inputs require a gradient when asked (those the
    op differentiates)."""
    g = _gen(1)

    def t(*shape, dtype=torch.float32, grad=True):
        x = torch.randn(*shape, generator=g, dtype=dtype)
        return x.requires_grad_(requires_grad and grad)

    bf16 = torch.bfloat16
    cu = torch.tensor([0, 1, 6, 11], dtype=torch.int32)  # a one-token sequence, two of 5
    q, k, v = t(11, 4, 8), t(11, 2, 8), t(11, 2, 8)
    out, lse = ops.varlen_attention(q.detach(), k.detach(), v.detach(), cu, 5, 0.3, True, 0, 0.0)
    grouping = _routing()
    tokens, top_k, hidden = 7, 2, 5
    x_rms, w_rms = t(3, 17), t(17)
    _, rstd = ops.rms_norm(x_rms.detach(), w_rms.detach(), 1e-6, 0.0)
    x_rope, w_rope = t(2, 3, 5, 8), t(8)
    _, rstd_rope = ops.rms_norm(x_rope.detach(), w_rope.detach(), 1e-6, 0.0)
    hidden_states, lm_head = t(9, 16), t(23, 16)
    targets = torch.randint(0, 23, (9,), generator=g)
    targets[2] = -100
    cases = [
        ("rms_norm", (x_rms, w_rms, 1e-6, 0.0)),
        ("rms_norm", (t(2, 3, 8), t(8), 1e-5, 1.0)),  # Gemma's weight + 1
        ("rms_norm_backward", (t(3, 17, grad=False), x_rms.detach(), w_rms.detach(), rstd, 0.0)),
        ("rms_norm_backward", (t(3, 17, grad=False), x_rms.detach(), w_rms.detach(), rstd, 0.0, False)),
        ("rms_norm_backward", (t(3, 17, grad=False), x_rms.detach(), w_rms.detach(), rstd, 0.0, True,
                               t(3, 17, grad=False))),  # add_rms_norm's: the residual stream's gradient added
        ("add_rms_norm", (t(3, 17), t(3, 17), t(17), 1e-6, 0.0)),
        ("add_rms_norm", (t(2, 3, 8), t(2, 3, 8), t(8), 1e-5, 1.0)),
        ("silu_mul", (t(4, 6), t(4, 6))),
        ("silu_mul_backward", (t(4, 6, grad=False), t(4, 6, grad=False), t(4, 6, grad=False))),
        ("gelu_tanh_mul", (t(4, 6), t(4, 6))),
        ("gelu_tanh_mul", (t(2, 3, 5), t(2, 3, 5))),
        ("gelu_tanh_mul_backward", (t(4, 6, grad=False), t(4, 6, grad=False), t(4, 6, grad=False))),
        ("rope", (t(2, 3, 5, 8), t(1, 5, 8, grad=False), t(1, 5, 8, grad=False), False, False)),
        ("rope", (t(2, 5, 3, 8).transpose(1, 2), t(2, 5, 8, grad=False), t(2, 5, 8, grad=False), True, False)),
        # partial rotary (R = 4 of D = 10), both pairings; interleaved on transposed q
        ("rope", (t(2, 3, 5, 10), t(1, 5, 4, grad=False), t(1, 5, 4, grad=False), False, False)),
        ("rope", (t(2, 5, 3, 8).transpose(1, 2), t(2, 5, 8, grad=False), t(2, 5, 8, grad=False), False, True)),
        ("rope", (t(2, 3, 5, 16), t(2, 5, 8, grad=False), t(2, 5, 8, grad=False), True, True)),
        # a head norm over D = 8 and the rotary after it: q transposed from (B, L, H, D), Gemma's
        # weight + 1, partial rotary (R = 4 of 8) interleaved, a length-1 sequence
        ("rms_norm_rope", (t(2, 5, 3, 8).transpose(1, 2), t(8), t(2, 5, 8, grad=False), t(2, 5, 8, grad=False), 1e-6,
                           0.0, False)),
        ("rms_norm_rope", (t(2, 3, 5, 8), t(8), t(1, 5, 4, grad=False), t(1, 5, 4, grad=False), 1e-5, 1.0, True)),
        ("rms_norm_rope", (t(1, 2, 1, 8), t(8), t(1, 1, 8, grad=False), t(1, 1, 8, grad=False), 1e-6, 0.0, False)),
        ("rms_norm_rope_backward", (t(2, 3, 5, 8, grad=False), x_rope.detach(), w_rope.detach(), rstd_rope,
                                    t(2, 5, 8, grad=False), t(2, 5, 8, grad=False), 0.0, False)),
        ("rms_norm_rope_backward", (t(2, 3, 5, 8, grad=False), x_rope.detach(), w_rope.detach(), rstd_rope,
                                    t(1, 5, 4, grad=False), t(1, 5, 4, grad=False), 1.0, True, False)),
        ("varlen_attention", (q, k, v, cu, 5, 0.3, True, 0, 0.0)),
        ("varlen_attention", (q, k, v, cu, 5, 0.3, False, 0, 0.0)),
        ("varlen_attention", (q, k, v, cu, 5, 0.3, True, 2, 0.0)),  # a sliding window of 2
        ("varlen_attention", (q, k, v, cu, 5, 0.3, True, 2, 0.5)),  # and a softcap of 0.5
        ("varlen_attention_backward", (t(11, 4, 8, grad=False), q.detach(), k.detach(), v.detach(), out, lse, cu, 5,
                                       0.3, True, 0, 0.0)),
        ("varlen_meta", (torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]]),)),
        ("linear_cross_entropy", (hidden_states, lm_head, None, targets, torch.tensor(8.0), -100, 0.1, 0.0, 4,
                                  requires_grad)),
        ("linear_cross_entropy", (hidden_states, lm_head, t(23), targets, torch.tensor(8.0), -100, 0.0, 30.0, 0,
                                  requires_grad)),
        ("cross_entropy_rows_", (t(9, 23, grad=False), targets, torch.tensor([0.125]), -100, 0.0, 0.0)),
        ("moe_group", (torch.randint(0, 5, (6, 2), generator=g), 5)),
        ("moe_permute", (t(tokens, hidden), grouping.permutation, grouping.offsets, top_k, None)),
        ("moe_permute", (t(tokens, hidden), grouping.permutation, grouping.offsets, top_k, t(tokens * top_k))),
        ("moe_combine", (t(tokens * top_k, hidden), grouping.inverse, grouping.offsets, top_k, t(tokens, top_k))),
        ("moe_combine", (t(tokens * top_k, hidden), grouping.inverse, grouping.offsets, top_k, None)),
        # with an expert bias (E, H) per row's expert (gpt-oss's down_proj bias)
        ("moe_combine", (t(tokens * top_k, hidden), grouping.inverse, grouping.offsets, top_k, t(tokens, top_k),
                         t(grouping.offsets.numel() - 1, hidden))),
        ("moe_combine_weight_grad", (t(tokens, hidden, grad=False), t(tokens * top_k, hidden, grad=False),
                                     grouping.inverse, grouping.offsets, top_k)),
        ("moe_combine_weight_grad", (t(tokens, hidden, grad=False), t(tokens * top_k, hidden, grad=False),
                                     grouping.inverse, grouping.offsets, top_k,
                                     t(grouping.offsets.numel() - 1, hidden, grad=False))),
        # 3 experts over 7 rows, the middle one empty, the last row past every group; both layouts
        ("moe_grouped_mm", (t(7, 5), t(3, 4, 5), torch.tensor([2, 2, 6], dtype=torch.int32), False)),
        ("moe_grouped_mm", (t(7, 5), t(3, 5, 4), torch.tensor([2, 2, 6], dtype=torch.int32), True)),
        ("moe_grouped_mm_weight_grad", (t(7, 4, grad=False), t(7, 5, grad=False),
                                        torch.tensor([2, 2, 6], dtype=torch.int32))),
        # the router's choice: Qwen3's softmax with renormalisation; DeepSeek-V3's sigmoid with a
        # selection bias and 4 groups of 3 keeping 2 (-inf outside); gpt-oss's softmax of the top-k
        ("moe_route", (t(9, 12), 3, "softmax", True, 0.0, 1.0, 1, 1, "max", 0.0, None)),
        ("moe_route", (t(9, 12), 3, "sigmoid", True, 1e-20, 2.5, 4, 2, "top2_sum", float("-inf"), t(12, grad=False))),
        ("moe_route", (t(9, 12), 2, "topk_softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),
        ("moe_route_backward", (t(9, 3, grad=False), t(9, 12, grad=False),
                                torch.stack([torch.randperm(12, generator=g)[:3] for _ in range(9)]), 3, "softmax",
                                False, 0.0, 16.0, 4, 2, "max", 0.0, None)),
        ("swiglu", (t(4, 10),)),
        ("swiglu_backward", (t(4, 5, grad=False), t(4, 10, grad=False))),
        ("clamped_swiglu", (t(4, 10), 1.702, 0.8)),
        # with gpt-oss's expert biases: 3 experts, the middle one empty, ends (E,) int32
        ("clamped_swiglu", (t(4, 10), 1.702, 0.8, t(3, 10), torch.tensor([1, 1, 4], dtype=torch.int32))),
        ("clamped_swiglu_backward", (t(4, 5, grad=False), t(4, 10, grad=False), 1.702, 0.8)),
        ("clamped_swiglu_backward", (t(4, 5, grad=False), t(4, 10, grad=False), 1.702, 0.8, t(3, 10, grad=False),
                                     torch.tensor([1, 1, 4], dtype=torch.int32))),
        # the experts' SwiGLU with the router's weights: 14 slots of the 7 x 2 grouping, weights (7, 2)
        ("moe_weighted_swiglu", (t(14, 10), t(tokens, top_k), grouping.permutation, grouping.offsets)),
        ("moe_weighted_swiglu_backward", (t(14, 5, grad=False), t(14, 10, grad=False), t(tokens, top_k, grad=False),
                                          grouping.permutation, grouping.offsets)),
        # x (2, 3, 8), a frozen base (6, 8) with bias, rank 4 adapters; then with a dropout input
        ("lora_linear", (t(2, 3, 8), None, t(6, 8, grad=False), t(6, grad=False), t(4, 8), t(6, 4), 0.5)),
        ("lora_linear", (t(2, 3, 8), t(2, 3, 8), t(6, 8, grad=False), None, t(4, 8), t(6, 4), 2.0)),
        ("lora_linear_backward", (t(2, 3, 6, grad=False), t(2, 3, 8, grad=False), t(6, 8, grad=False),
                                  t(4, 8, grad=False), t(6, 4, grad=False), t(2, 3, 4, grad=False), 0.5, True)),
        # q/k/v-like: x (2, 3, 8), three frozen bases (6, 8), (2, 8), (2, 8) with biases, ranks 4, 2, 4
        ("lora_linear_group", (t(2, 3, 8), [t(6, 8, grad=False), t(2, 8, grad=False), t(2, 8, grad=False)],
                               [t(6, grad=False), t(2, grad=False), t(2, grad=False)], [t(4, 8), t(2, 8), t(4, 8)],
                               [t(6, 4), t(2, 2), t(2, 4)], [0.5, 2.0, 1.0])),
        ("lora_linear_group", (t(5, 7), [t(9, 7, grad=False), t(4, 7, grad=False)], [], [t(3, 7), t(3, 7)],
                               [t(9, 3), t(4, 3)], [1.5, 1.0])),
        ("lora_linear_group_backward", ([t(2, 3, 6, grad=False), t(2, 3, 2, grad=False)], t(2, 3, 8, grad=False),
                                        [t(6, 8, grad=False), t(2, 8, grad=False)], [t(4, 8, grad=False),
                                        t(2, 8, grad=False)], [t(6, 4, grad=False), t(2, 2, grad=False)],
                                        t(2, 3, 6, grad=False), [0.5, 2.0])),
        # an input that needs no gradient (the first layer's, under a frozen embedding): d x empty
        ("lora_linear_group_backward", ([t(5, 9, grad=False)], t(5, 7, grad=False), [t(9, 7, grad=False)],
                                        [t(3, 7, grad=False)], [t(9, 3, grad=False)], t(5, 3, grad=False), [1.5],
                                        False)),
        # PEFT's default: float32 adapters under a bfloat16 base: the forward returns its one bfloat16
        # copy of them ([A | B] flat), which the backward reads
        ("lora_linear", (t(2, 3, 8, dtype=bf16), None, t(6, 8, dtype=bf16, grad=False), None, t(4, 8), t(6, 4), 0.5)),
        ("lora_linear_group", (t(5, 8, dtype=bf16), [t(6, 8, dtype=bf16, grad=False), t(2, 8, dtype=bf16, grad=False)],
                               [], [t(4, 8), t(2, 8)], [t(6, 4), t(2, 2)], [0.5, 2.0])),
        ("lora_linear_backward", (t(2, 3, 6, dtype=bf16, grad=False), t(2, 3, 8, dtype=bf16, grad=False),
                                  t(6, 8, dtype=bf16, grad=False), t(4, 8, grad=False), t(6, 4, grad=False),
                                  t(2, 3, 4, dtype=bf16, grad=False), 0.5, True, t(56, dtype=bf16, grad=False))),
        ("lora_linear_group_backward", ([t(5, 6, dtype=bf16, grad=False), t(5, 2, dtype=bf16, grad=False)],
                                        t(5, 8, dtype=bf16, grad=False),
                                        [t(6, 8, dtype=bf16, grad=False), t(2, 8, dtype=bf16, grad=False)],
                                        [t(4, 8, grad=False), t(2, 8, grad=False)],
                                        [t(6, 4, grad=False), t(2, 2, grad=False)], t(5, 6, dtype=bf16, grad=False),
                                        [0.5, 2.0], True, t(76, dtype=bf16, grad=False))),
        # a gated MLP's [gate, up]: x (2, 3, 8), two frozen bases (6, 8), ranks 4 and 2; GeGLU with biases
        ("lora_gated_group", (t(2, 3, 8), [t(6, 8, grad=False), t(6, 8, grad=False)], [], [t(4, 8), t(2, 8)],
                              [t(6, 4), t(6, 2)], [0.5, 2.0], "silu")),
        ("lora_gated_group", (t(5, 7), [t(9, 7, grad=False), t(9, 7, grad=False)],
                              [t(9, grad=False), t(9, grad=False)], [t(3, 7), t(3, 7)], [t(9, 3), t(9, 3)],
                              [1.5, 1.0], "gelu_tanh")),
        ("lora_gated_group_backward", (t(2, 3, 6, grad=False), t(2, 3, 6, grad=False), t(2, 3, 6, grad=False),
                                       t(2, 3, 8, grad=False), [t(6, 8, grad=False), t(6, 8, grad=False)],
                                       [t(4, 8, grad=False), t(2, 8, grad=False)],
                                       [t(6, 4, grad=False), t(6, 2, grad=False)], t(2, 3, 6, grad=False),
                                       [0.5, 2.0], "silu")),
        ("lora_gated_group_backward", (t(5, 9, grad=False), t(5, 9, grad=False), t(5, 9, grad=False),
                                       t(5, 7, grad=False), [t(9, 7, grad=False), t(9, 7, grad=False)],
                                       [t(3, 7, grad=False), t(3, 7, grad=False)],
                                       [t(9, 3, grad=False), t(9, 3, grad=False)], t(5, 6, grad=False),
                                       [1.5, 1.0], "gelu_tanh", False)),
    ]
    return cases


def test_every_op_is_covered_and_registered():
    declared = set(op_names())
    assert declared == DIFFERENTIABLE | BACKWARD_OPS | NOT_DIFFERENTIABLE, "classify the new op here"
    assert {name for name, _ in _cases(False)} == declared, "add the new op to _cases"
    for name in declared:
        qualname = f"hasten::{name}"
        entry = torch._library.simple_registry.singleton.find(qualname)
        assert entry.fake_impl.kernel is not None, f"{qualname} has no fake"
        has_autograd = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Autograd")
        assert has_autograd == (name in DIFFERENTIABLE | BACKWARD_OPS), qualname


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("index", range(len(_cases(False))))
def test_opcheck(index, requires_grad):
    name, args = _cases(requires_grad)[index]
    if requires_grad and name not in DIFFERENTIABLE:
        pytest.skip(f"{name} has no derivative (backward ops refuse one: test_backward_ops_refuse_double_backward)")
    if name == "cross_entropy_rows_":  # overwrites its logits: each check gets its own copy
        args = (args[0].clone(), *args[1:])
    torch.library.opcheck(getattr(ops, name).default, args)


def test_backward_ops_refuse_double_backward():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    from hasten.ops.dense import rms_norm
    (grad_x,) = torch.autograd.grad(rms_norm(x, w, 1e-6).sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match="rms_norm_backward has no derivative"):
        grad_x.sum().backward()


def test_rope_refuses_a_gradient_for_cos_and_sin():
    from hasten.ops.dense import rope
    x, cos, sin = torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4, requires_grad=True), torch.randn(1, 3, 4)
    with pytest.raises(NotImplementedError, match="no gradient for cos and sin"):
        rope(x, cos, sin)
    with pytest.raises(NotImplementedError, match="no gradient for cos and sin"):
        rope(x, cos[..., :2], sin[..., :2], interleaved=True)


def test_moe_gradients_match_finite_differences():
    """float64 on the CPU: permute with a slot scale, combine with weights, every input."""
    g = _routing(tokens=5, top_k=3, experts=4, seed=3)
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(15, dtype=torch.float64, requires_grad=True)
    y = torch.randn(15, 6, dtype=torch.float64, requires_grad=True)
    w = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, s: ops.moe_permute(a, g.permutation, g.offsets, 3, s), (x, scale))
    torch.autograd.gradcheck(lambda b, c: ops.moe_combine(b, g.inverse, g.offsets, 3, c), (y, w))


def _bad_inputs():
    f, i32 = torch.randn, torch.int32
    cu = torch.tensor([0, 3], dtype=i32)
    g = _routing()
    return [
        ("rms_norm", (f(2, 8), f(7), 1e-6, 0.0)),
        ("rms_norm", (f(2, 8, dtype=torch.float64), f(8, dtype=torch.float64), 1e-6, 0.0)),
        ("rms_norm", (f(2, 8), f(8, dtype=torch.bfloat16), 1e-6, 0.0)),
        ("rms_norm_backward", (f(2, 7), f(2, 8), f(8), torch.ones(2), 0.0)),
        ("rms_norm_backward", (f(2, 8), f(2, 8), f(8), torch.ones(2), 0.0, True, f(2, 7))),  # grad_add's shape
        ("add_rms_norm", (f(2, 8), f(2, 7), f(8), 1e-6, 0.0)),
        ("add_rms_norm", (f(2, 8), f(2, 8, dtype=torch.bfloat16), f(8), 1e-6, 0.0)),
        ("silu_mul", (f(2, 3), f(3, 2))),
        ("silu_mul_backward", (f(2, 3), f(2, 3), f(2, 3, dtype=torch.bfloat16))),
        ("gelu_tanh_mul", (f(2, 3), f(3, 2))),
        ("gelu_tanh_mul_backward", (f(2, 3), f(2, 3), f(2, 3, dtype=torch.bfloat16))),
        ("gelu_tanh_mul_backward", (f(2, 4), f(2, 3), f(2, 3))),
        ("rope", (f(1, 1, 3, 8), f(1, 3, 3), f(1, 3, 3), False, False)),  # odd rotary dim
        ("rope", (f(1, 1, 3, 7), f(1, 3, 7), f(1, 3, 7), False, True)),
        ("rope", (f(1, 1, 3, 4), f(1, 3, 6), f(1, 3, 6), False, False)),  # rotary dim > head_dim
        ("rope", (f(2, 1, 3, 8), f(1, 3, 8), f(2, 3, 8), False, False)),  # cos and sin differ
        ("rope", (f(1, 1, 3, 8), f(1, 4, 8), f(1, 4, 8), False, False)),  # another length
        ("rope", (f(1, 1, 3, 8), f(1, 3, 0), f(1, 3, 0), False, False)),  # no rotary dim
        ("rope", (torch.zeros(1, 1, 3, 8, dtype=i32), f(1, 3, 8), f(1, 3, 8), False, False)),
        ("rms_norm_rope", (f(1, 2, 3, 8), f(7), f(1, 3, 8), f(1, 3, 8), 1e-6, 0.0, False)),  # weight over head_dim
        ("rms_norm_rope", (f(1, 2, 3, 8), f(8), f(1, 3, 8, dtype=torch.bfloat16), f(1, 3, 8, dtype=torch.bfloat16),
                           1e-6, 0.0, False)),  # cos and sin of another dtype than x
        ("rms_norm_rope", (f(1, 2, 3, 8), f(8), f(1, 3, 10), f(1, 3, 10), 1e-6, 0.0, True)),  # rotary dim > head_dim
        ("rms_norm_rope", (f(2, 8), f(8), f(1, 3, 8), f(1, 3, 8), 1e-6, 0.0, False)),  # not (B, H, L, D)
        ("rms_norm_rope_backward", (f(1, 2, 3, 8), f(1, 2, 3, 8), f(8), torch.ones(1, 2, 4), f(1, 3, 8), f(1, 3, 8),
                                    0.0, False)),  # rstd of another length
        ("rms_norm_rope_backward", (f(1, 2, 4, 8), f(1, 2, 3, 8), f(8), torch.ones(1, 2, 3), f(1, 3, 8), f(1, 3, 8),
                                    0.0, False)),  # grad_out of another shape
        ("varlen_attention", (f(3, 4, 8), f(3, 3, 8), f(3, 3, 8), cu, 3, 0.3, True, 0, 0.0)),
        ("varlen_attention", (f(3, 4, 8), f(3, 2, 8), f(3, 2, 8), cu.long(), 3, 0.3, True, 0, 0.0)),
        ("varlen_attention", (f(3, 4, 8), f(3, 2, 8), f(3, 2, 4), cu, 3, 0.3, True, 0, 0.0)),
        ("varlen_attention", (f(3, 4, 8), f(3, 2, 8), f(3, 2, 8), cu, 3, 0.3, False, 2, 0.0)),  # two-sided window
        ("varlen_attention", (f(3, 4, 8), f(3, 2, 8), f(3, 2, 8), cu, 3, 0.3, True, -1, 0.0)),
        ("varlen_attention", (f(3, 4, 8), f(3, 2, 8), f(3, 2, 8), cu, 3, 0.3, True, 0, -2.0)),
        ("varlen_attention_backward", (f(3, 4, 8), f(3, 4, 8), f(3, 2, 8), f(3, 2, 8), f(3, 4, 8), f(3, 2), cu, 3,
                                       0.3, True, 0, 0.0)),
        ("varlen_meta", (torch.zeros(4),)),
        ("varlen_meta", (torch.tensor(3),)),
        ("linear_cross_entropy", (f(4, 8), f(10, 7), None, torch.zeros(4, dtype=torch.long), torch.tensor(4.0), -100,
                                  0.0, 0.0, 0, False)),
        ("linear_cross_entropy", (f(4, 8), f(10, 8), None, torch.zeros(3, dtype=torch.long), torch.tensor(4.0), -100,
                                  0.0, 0.0, 0, False)),
        ("linear_cross_entropy", (f(4, 8), f(10, 8), None, torch.zeros(4, dtype=torch.long), torch.tensor(4.0), -100,
                                  1.5, 0.0, 0, False)),
        ("cross_entropy_rows_", (f(4, 10), torch.zeros(4, dtype=torch.int32), None, -100, 0.0, 0.0)),
        ("moe_group", (torch.tensor([0, 1]), 4)),
        ("moe_group", (torch.zeros(2, 2, dtype=torch.long), 0)),
        ("moe_permute", (f(2, 4), torch.zeros(4, dtype=i32), torch.zeros(3, dtype=i32), 3, None)),
        ("moe_permute", (f(2, 4), torch.zeros(4, dtype=i32), torch.tensor([0, 4], dtype=i32), 2, torch.ones(3))),
        ("moe_combine", (f(4, 8), torch.zeros(4, dtype=i32), torch.zeros(3, dtype=i32), 2, f(3))),
        ("moe_combine_weight_grad", (f(6, 5), f(14, 5), g.inverse, g.offsets, 2)),
        ("moe_combine", (f(14, 5), g.inverse, g.offsets, 2, None, f(g.offsets.numel(), 5))),  # bias: experts
        ("moe_combine", (f(14, 5), g.inverse, g.offsets, 2, None, f(g.offsets.numel() - 1, 5, dtype=torch.float64))),
        ("moe_route", (f(4, 8), 9, "softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),  # top_k > experts
        ("moe_route", (f(4, 8), 2, "softplus", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),
        ("moe_route", (f(4, 8), 2, "softmax", False, 0.0, 1.0, 3, 1, "max", 0.0, None)),  # 3 groups of 8
        ("moe_route", (f(4, 8), 3, "softmax", False, 0.0, 1.0, 4, 1, "max", 0.0, None)),  # 1 group of 2 < top_k
        ("moe_route", (f(4, 8), 2, "sigmoid", False, 0.0, 1.0, 8, 2, "top2_sum", 0.0, None)),  # groups of 1
        ("moe_route", (f(4, 8), 2, "topk_softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, f(8))),
        ("moe_route", (f(4, 8), 2, "sigmoid", False, 0.0, 1.0, 1, 1, "max", 0.0, f(7))),  # bias of 7 experts
        ("moe_route", (f(4, 8), 2, "softmax", False, 0.0, 1.0, 1, 1, "mean", 0.0, None)),
        ("moe_route_backward", (f(4, 2, dtype=torch.float64), f(4, 8), torch.zeros(4, 2, dtype=torch.long), 2,
                                "softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),  # float64 grad, float32 logits
        ("moe_route_backward", (f(4, 2), f(4, 8), torch.zeros(4, 3, dtype=torch.long), 2, "softmax", False, 0.0,
                                1.0, 1, 1, "max", 0.0, None)),  # ids of another top_k
        ("moe_grouped_mm", (f(4, 5), f(2, 3, 6), torch.tensor([2, 4], dtype=i32), False)),  # in
        ("moe_grouped_mm", (f(4, 5), f(2, 3, 5), torch.tensor([2, 4], dtype=i32), True)),  # in, transposed
        ("moe_grouped_mm", (f(4, 5), f(2, 3, 5), torch.tensor([2, 2, 4], dtype=i32), False)),  # experts
        ("moe_grouped_mm", (f(4, 5), f(2, 3, 5), torch.tensor([2, 4]), False)),  # int64 ends
        ("moe_grouped_mm", (f(4, 5), f(2, 3, 5, dtype=torch.float64), torch.tensor([2, 4], dtype=i32), False)),
        ("moe_grouped_mm", (f(4, 5), f(3, 5), torch.tensor([2, 4], dtype=i32), False)),  # a 2-D weight
        ("moe_grouped_mm", (torch.ones(4, 5, dtype=i32), f(2, 3, 5), torch.tensor([2, 4], dtype=i32), False)),
        ("moe_grouped_mm_weight_grad", (f(4, 3), f(5, 6), torch.tensor([2, 4], dtype=i32))),  # rows
        ("moe_grouped_mm_weight_grad", (f(4, 3), f(4, 6), torch.zeros(0, dtype=i32))),  # no experts
        ("swiglu", (f(2, 3),)),
        ("swiglu_backward", (f(2, 4), f(2, 10))),
        ("clamped_swiglu", (f(2, 3), 1.702, 7.0)),
        ("clamped_swiglu", (f(2, 4), 1.702, 0.0)),
        ("clamped_swiglu", (f(2, 4), float("nan"), 7.0)),
        ("clamped_swiglu_backward", (f(2, 3), f(2, 4), 1.702, 7.0)),
        ("clamped_swiglu", (f(2, 4), 1.702, 7.0, f(3, 4), None)),  # a bias without its rows' experts
        ("clamped_swiglu", (f(2, 4), 1.702, 7.0, f(3, 6), torch.tensor([1, 1, 2], dtype=i32))),  # width
        ("clamped_swiglu", (f(2, 4), 1.702, 7.0, f(3, 4), torch.tensor([1, 2], dtype=i32))),  # one end an expert
        ("clamped_swiglu", (f(2, 4), 1.702, 7.0, f(3, 4), torch.tensor([1, 1, 2]))),  # int64 ends
        ("clamped_swiglu_backward", (f(2, 2), f(2, 4), 1.702, 7.0, f(3, 4, dtype=torch.float64),
                                     torch.tensor([1, 1, 2], dtype=i32))),  # the bias's dtype
        ("lora_linear", (f(3, 8), None, f(6, 8), None, f(4, 8), f(6, 3), 1.0)),  # lora_b's rank
        ("lora_linear", (f(3, 8), None, f(6, 8, dtype=torch.bfloat16), None, f(4, 8), f(6, 4), 1.0)),
        ("lora_linear", (f(3, 8), f(3, 7), f(6, 8), None, f(4, 8), f(6, 4), 1.0)),
        ("lora_linear_backward", (f(3, 5), f(3, 8), f(6, 8), f(4, 8), f(6, 4), f(3, 4), 1.0, True)),
        ("lora_linear_group", (f(3, 8), [f(6, 8), f(2, 8)], [], [f(4, 8), f(2, 8)], [f(6, 4)], [1.0, 1.0])),
        ("lora_linear_group", (f(3, 8), [f(6, 8)], [f(6)], [f(4, 7)], [f(6, 4)], [1.0])),
        ("lora_linear_group", (f(3, 8), [f(6, 8), f(2, 8)], [f(6)], [f(4, 8), f(2, 8)], [f(6, 4), f(2, 2)],
                               [1.0, 1.0])),
        ("lora_linear_group_backward", ([f(3, 6)], f(3, 8), [f(6, 8)], [f(4, 8)], [f(6, 4)], f(3, 5), [1.0])),
        # `adapters` that are not the forward's flat copy: a wrong size, then a wrong dtype
        ("lora_linear_backward", (f(3, 6), f(3, 8), f(6, 8), f(4, 8), f(6, 4), f(3, 4), 1.0, True, f(55))),
        ("lora_linear_group_backward", ([f(3, 6)], f(3, 8), [f(6, 8)], [f(4, 8)], [f(6, 4)], f(3, 4), [1.0], True,
                                        f(56, dtype=torch.float64))),
        ("lora_gated_group", (f(3, 8), [f(6, 8), f(5, 8)], [], [f(4, 8), f(2, 8)], [f(6, 4), f(5, 2)], [1.0, 1.0],
                              "silu")),  # gate and up of different sizes
        ("lora_gated_group", (f(3, 8), [f(6, 8), f(6, 8)], [], [f(4, 8), f(2, 8)], [f(6, 4), f(6, 2)], [1.0, 1.0],
                              "relu")),
        ("moe_weighted_swiglu", (f(14, 10), f(6, 2), g.permutation, g.offsets)),  # a weight short
        ("moe_weighted_swiglu", (f(14, 10), f(7, 2, dtype=torch.bfloat16), g.permutation, g.offsets)),
        ("moe_weighted_swiglu", (f(13, 10), f(7, 2), g.permutation, g.offsets)),  # rows not the slots
        ("moe_weighted_swiglu", (f(14, 10), f(7, 2), g.permutation.long(), g.offsets)),
        ("moe_weighted_swiglu_backward", (f(14, 4), f(14, 10), f(7, 2), g.permutation, g.offsets)),
        ("lora_gated_group_backward", (f(3, 5), f(3, 6), f(3, 6), f(3, 8), [f(6, 8), f(6, 8)], [f(4, 8), f(2, 8)],
                                       [f(6, 4), f(6, 2)], f(3, 6), [1.0, 1.0], "silu")),  # grad_act's width
    ]


@pytest.mark.parametrize("index", range(len(_bad_inputs())))
def test_fake_refuses_what_the_kernel_refuses_with_its_message(index):
    name, args = _bad_inputs()[index]
    op = getattr(ops, name)
    with pytest.raises(RuntimeError) as real:
        op(*args)
    mode = FakeTensorMode()
    def fake(a):
        if isinstance(a, list):  # Tensor[] and Tensor?[] arguments
            return [fake(item) for item in a]
        return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

    fake_args = tuple(fake(a) for a in args)
    with mode, pytest.raises(RuntimeError) as fake:
        op(*fake_args)
    real_message = str(real.value).splitlines()[0]
    assert real_message.startswith(f"hasten::{name}") or real_message.startswith("hasten::cross_entropy_rows_")
    assert str(fake.value).splitlines()[0] == real_message


def _saved_tensor_count(fn, *inputs) -> int:
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return count


def test_formulas_save_only_what_the_needed_gradients_read():
    g = _routing(tokens=6, top_k=2, experts=3)
    y, w = torch.randn(12, 4), torch.rand(6, 2)
    combine = lambda a, b: moe_ops.combine(a, b, g)  # noqa: E731
    # inverse, offsets, and the other input of the product for each gradient asked for
    assert _saved_tensor_count(combine, y.requires_grad_(), w) == 3
    assert _saved_tensor_count(combine, y.detach(), w.requires_grad_()) == 3
    assert _saved_tensor_count(combine, y.requires_grad_(), w) == 4
    x, scale = torch.randn(6, 4), torch.rand(12)
    permute = lambda a, s: ops.moe_permute(a, g.permutation, g.offsets, 2, s)  # noqa: E731
    assert _saved_tensor_count(permute, x.requires_grad_(), None) == 2
    assert _saved_tensor_count(permute, x.detach(), scale.requires_grad_()) == 3
    gate_up, w = torch.randn(12, 6), torch.rand(6, 2)
    weighted = lambda a, b: moe_ops.weighted_swiglu(a, b, g)  # noqa: E731
    # gate_up, the weights (d gate_up scales by them), permutation and offsets, for either gradient
    assert _saved_tensor_count(weighted, gate_up.requires_grad_(), w) == 4
    assert _saved_tensor_count(weighted, gate_up.detach(), w.requires_grad_()) == 4


@pytest.mark.parametrize("index", range(len(_cases(False))))
def test_eager_function_and_registered_formula_agree(index):
    """Eager calls take an autograd.Function built from the op's registered formula (hasten.ops._lib
    .register_autograd); both entry points give the same outputs and gradients."""
    from hasten.ops._lib import _EAGER_FUNCTIONS

    name, args = _cases(True)[index]
    if name not in DIFFERENTIABLE:
        pytest.skip(f"{name} has no derivative")
    if name in ("lora_linear_group", "lora_gated_group"):
        pytest.skip(f"{name} takes lists of tensors, which an autograd.Function does not track: eager "
                    "calls take the op's own autograd kernel (hasten/ops/lora.py)")
    results = []
    for entry in (getattr(ops, name), _EAGER_FUNCTIONS[name].apply):
        leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.requires_grad else a
                  for a in args]
        out = entry(*leaves)
        first = out[0] if isinstance(out, tuple) else out
        grads = torch.autograd.grad((first * torch.linspace(-1, 1, first.numel()).view(first.shape)).sum(),
                                    [a for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad])
        results.append((first.detach(), grads))
    (out_registered, grads_registered), (out_eager, grads_eager) = results
    assert torch.equal(out_registered, out_eager)
    assert all(torch.equal(a, b) for a, b in zip(grads_registered, grads_eager))
