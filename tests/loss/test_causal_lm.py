"""The fused-loss training forward gives transformers' loss and gradients, returns no logits,
and leaves inference and unsupported cases to transformers' own forward."""

import pytest
import torch

import hasten
from hasten.config import Config
from hasten.observability import fallback_counts
from tests.tiny_models import MODELS, packed_batch


def _run(name, fused, **batch_extra):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"fused_cross_entropy": fused}}))
    out = model(**packed_batch(), **batch_extra)
    out.loss.backward()
    return model, handle, out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_forward_matches_transformers_loss_and_gradients(name):
    _, _, want, want_grads = _run(name, fused=False)
    _, handle, got, grads = _run(name, fused=True)
    assert any(item.startswith("fused cross-entropy") for item in handle.active)
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-4, atol=1e-6, msg=key)


def test_num_items_in_batch_is_honoured():
    _, _, want, _ = _run("qwen3", fused=False, num_items_in_batch=torch.tensor(100))
    _, _, got, _ = _run("qwen3", fused=True, num_items_in_batch=torch.tensor(100))
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


def test_eval_and_no_labels_keep_transformers_forward():
    model, handle, _, _ = _run("qwen3", fused=True)
    batch = packed_batch()
    with torch.no_grad():
        assert model(**batch).logits is not None  # no grad: transformers' forward, logits as usual
    model.eval()
    assert model(input_ids=batch["input_ids"]).logits is not None
    handle.undo()
    assert "forward" not in model.__dict__


def test_router_aux_loss_falls_back_loudly():
    torch.manual_seed(0)
    model = MODELS["qwen3_moe"]().train()
    hasten.accelerate(model, Config())
    out = model(**packed_batch(), output_router_logits=True)
    assert out.logits is not None and out.aux_loss is not None
    assert fallback_counts().get("fused_cross_entropy") == 1


def test_wrapped_lm_head_is_refused_with_the_reason():
    torch.manual_seed(0)
    model = MODELS["llama"]()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    handle = hasten.accelerate(model, Config())
    assert any("not a plain nn.Linear" in item for item in handle.inactive)
    assert fallback_counts().get("fused_cross_entropy") == 1


def test_an_lm_head_with_its_own_forward_is_refused():
    """An nn.Linear subclass that computes more than x @ W^T + b (Dory's head scales its logits by a
    learned vector) would be silently wrong under the fused loss, which reads the weight."""

    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    torch.manual_seed(0)
    model = MODELS["llama"]()
    head = ScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    handle = hasten.accelerate(model, Config())
    assert any("with a forward of its own" in item for item in handle.inactive)
    assert model(**packed_batch()).logits is not None  # transformers' own forward: the head's scale applied
    assert fallback_counts().get("fused_cross_entropy") == 1
