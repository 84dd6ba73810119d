"""Activation checkpointing policies give the loss and gradients of keeping everything."""

import functools

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hasten
from hasten.config import Config
from hasten.memory import selective_policy
from torch.utils.checkpoint import CheckpointPolicy

DENSE = dict(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=12)


def _loss_and_grads(make_model, policy, batch):
    torch.manual_seed(0)
    model = make_model().train()
    hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"activations": policy}},
                                               "attention": {"verify": True}}))
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make_model", [
    lambda: Qwen3ForCausalLM(Qwen3Config(**DENSE)),
    lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                               **{k: v for k, v in DENSE.items() if k != "intermediate_size"},
                                               intermediate_size=96)),
], ids=["dense", "moe"])
def test_policies_match_no_checkpointing(make_model):
    gen = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(0, 120, (n,), generator=gen).tolist()} for n in (9, 1, 14, 6)]
    batch = hasten.PackingCollator(max_tokens=64)(samples)
    want_loss, want_grads = _loss_and_grads(make_model, "none", batch)
    for policy in ("full", "selective"):
        loss, grads = _loss_and_grads(make_model, policy, batch)
        assert torch.allclose(loss, want_loss, atol=1e-6), policy
        assert grads.keys() == want_grads.keys()
        for name in grads:
            assert torch.allclose(grads[name], want_grads[name], atol=1e-5, rtol=1e-4), (policy, name)


def test_selective_policy_recomputes_plain_matmuls_and_elementwise_ops():
    for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
               torch.ops.aten.mul.Tensor):
        assert selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


@pytest.mark.parametrize("make_output", ["linear_3d", "matmul_4d"])
def test_selective_checkpointing_survives_an_in_place_change_to_a_matmul_output(make_output):
    """Torch's selective checkpointing hands the model the tensor it caches and watches it by its
    version counter; a 3-D linear or a batched matmul returns its matmul's output through
    `_unsafe_view`, whose counter is its own, so `y += ...` changed a cached matmul output unseen
    (Gemma 3n's AltUp: a 0.81 gradient error, silently). hasten's policy keeps no plain matmul: the
    gradients equal those of the uncheckpointed function (they did not with aten.mm kept)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, 8, generator=gen, requires_grad=True)
    b = torch.randn(2, 8, 8, generator=gen, requires_grad=True)

    def layer():
        y = torch.nn.functional.linear(x, w) if make_output == "linear_3d" else torch.matmul(
            x.unsqueeze(0).expand(2, 2, 3, 8), b.unsqueeze(1).expand(2, 2, 8, 8))
        y += 1.0  # in place, on the matmul's output
        return y.sin().sum()

    layer().backward()
    want = [t.grad.clone() for t in (x, w, b) if t.grad is not None]
    for t in (x, w, b):
        t.grad = None
    context = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    checkpoint(layer, use_reentrant=False, context_fn=context).backward()
    got = [t.grad for t in (x, w, b) if t.grad is not None]
    assert len(got) == len(want) and all(torch.allclose(g, h) for g, h in zip(got, want))


def test_policy_is_reported_and_undone():
    model = Qwen3ForCausalLM(Qwen3Config(**DENSE))
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"activations": "full"}}}))
    assert model.is_gradient_checkpointing and any("activation checkpointing (full" in a for a in handle.active)
    handle.undo()
    assert not model.is_gradient_checkpointing


def test_unknown_policy_is_refused():
    from hasten.config import ConfigError

    with pytest.raises(ConfigError, match="training.checkpoint.activations` must be one of"):
        Config.from_dict({"training": {"checkpoint": {"activations": "some"}}})


def test_moe_load_stats_not_double_counted_by_recompute():
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                               **DENSE)).train()
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"activations": "full"}}}))
    batch = hasten.PackingCollator(max_tokens=64)([{"input_ids": list(range(1, 11))}])
    model(**batch).loss.backward()  # full checkpointing re-runs every layer's forward in backward
    totals = [layer._hasten_moe_tokens for layer in handle.moe_stats._layers]
    assert len(totals) == 3 and all(int(t.sum()) == 20 for t in totals)  # 10 tokens x top-2, forward only
    assert handle.moe_stats.summary()["tokens_per_expert_max"] <= 20


def test_selective_policy_keeps_hastens_attention_and_recomputes_its_lora_projection():
    """Issue 21: selective checkpointing recomputed hasten's own attention (its fastest path),
    contrary to the docs; it keeps the attention ops' outputs now. The fused LoRA op's output is
    recomputed: OLMo clamps its q/k/v projections in place, which stopped a kept output."""
    import hasten.attention.varlen  # noqa: F401  (defines hasten_host::per_sequence_attention)

    for op in (torch.ops.hasten.varlen_attention.default, torch.ops.hasten_host.per_sequence_attention.default):
        assert selective_policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    assert selective_policy(None, torch.ops.hasten.lora_linear.default) == CheckpointPolicy.PREFER_RECOMPUTE


def attention_calls_under_selective(device: str, dtype: torch.dtype, heads=(4, 2, 2), head_dim=8,
                                    lengths=(4, 5)) -> tuple[list, list, list]:
    """A checkpointed function around hasten's attention op under selective checkpointing: the op's
    forwards seen during backward, and the gradients of q, k, v beside those of the same function
    without checkpointing (the GPU twin runs this on the cuDNN op)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from hasten.ops.attention import varlen_attention

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    leaves = [torch.randn(total, h, head_dim, generator=gen).to(device, dtype) for h in heads]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def layer(a, b, c):  # sin: an op before attention that selective recomputes
        return (varlen_attention(a.sin(), b, c, cu, max(lengths)) * 2).float().sum()

    def grads(checkpointed):
        inputs = [t.detach().clone().requires_grad_() for t in leaves]
        context = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        loss = (checkpoint(layer, *inputs, use_reentrant=False, context_fn=context) if checkpointed
                else layer(*inputs))
        counter = Count()
        with counter:
            loss.backward()
        return counter.calls, [t.grad for t in inputs]

    calls, selective = grads(True)
    _, plain = grads(False)
    return [f for f in calls if f == torch.ops.hasten.varlen_attention.default], selective, plain


def test_selective_checkpointing_does_not_recompute_hastens_attention():
    """A checkpointed function with selective checkpointing: hasten's attention op runs once in the
    forward and its recompute reuses the kept output (the op's backward runs, its forward does not),
    with the gradients of running it without checkpointing."""
    forwards, selective, plain = attention_calls_under_selective("cpu", torch.float32)
    assert forwards == [], "hasten's attention ran again in the recompute"
    for got, want in zip(selective, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
