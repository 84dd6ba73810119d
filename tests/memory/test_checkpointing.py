"""Activation checkpointing policies give the loss and gradients of keeping everything."""

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


def test_selective_policy_saves_matmuls_and_recomputes_elementwise():
    assert selective_policy(None, torch.ops.aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE


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
