"""hasten.moe.router (training.moe.fused_router): a router takes hasten::moe_route only where its
class's own forward computes the table's recipe; everything else keeps the model's forward, with
the reason. The model types' parity with it on: tests/integrations/test_model_parity.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from transformers import DeepseekV3Config, GptOssConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from hasten.moe.router import install_fused_routers, mismatch
from hasten.moe.spec import DEEPSEEK_V3, GPT_OSS, SOFTMAX_TOPK
from hasten.observability import fallback_counts, reset_fallbacks


def _qwen3(norm_topk_prob=True, cls=Qwen3MoeTopKRouter):
    torch.manual_seed(0)
    router = cls(Qwen3MoeConfig(hidden_size=32, num_experts=12, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob))
    torch.nn.init.normal_(router.weight, std=0.5)
    return router


class _NeverRenormalises(Qwen3MoeTopKRouter):
    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        weights, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, weights.to(logits.dtype), ids


class _DoesNotFlatten(Qwen3MoeTopKRouter):
    def forward(self, hidden_states):
        logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), ids


class _IgnoresTheBias(DeepseekV3TopkRouter):
    def forward(self, hidden_states):
        saved = self.e_score_correction_bias.clone()
        self.e_score_correction_bias.zero_()
        try:
            return super().forward(hidden_states)
        finally:
            self.e_score_correction_bias.copy_(saved)


class _SoftmaxThenTopk(GptOssTopKRouter):
    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight, self.bias)
        weights, ids = torch.topk(F.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, weights, ids


def _deepseek_v3(cls=DeepseekV3TopkRouter):
    torch.manual_seed(0)
    router = cls(DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                  norm_topk_prob=True, routed_scaling_factor=2.5))
    torch.nn.init.normal_(router.weight, std=0.5)
    return router  # its correction bias zeros, as a fresh model's: the check gives it random values


def _gpt_oss(cls=GptOssTopKRouter):
    torch.manual_seed(0)
    router = cls(GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2))
    torch.nn.init.normal_(router.weight, std=0.5)
    torch.nn.init.normal_(router.bias, std=0.5)
    return router


def test_the_models_own_routers_pass_and_their_fused_forward_equals_theirs():
    for router, spec in ((_qwen3(), SOFTMAX_TOPK), (_deepseek_v3(), DEEPSEEK_V3), (_gpt_oss(), GPT_OSS)):
        assert mismatch(router, spec) is None
        # (T, H) as the blocks hand it over, and (B, L, H) where the router flattens it itself
        shapes = [(10,), (2, 5)] if spec.flattens_input else [(10,)]
        hiddens = [torch.randn(*leading, router.weight.shape[1]) for leading in shapes]
        wants = [router(h) for h in hiddens]
        undo, count, reasons = install_fused_routers([router], spec)
        assert (count, reasons) == (1, [])
        for hidden, want in zip(hiddens, wants):
            got = router(hidden)
            assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
            assert torch.equal(got[0], want[0]) and torch.equal(got[2].sort(-1).values, want[2].sort(-1).values)
            torch.testing.assert_close(got[1].gather(1, got[2].argsort(-1)), want[1].gather(1, want[2].argsort(-1)))
        undo()
        assert "forward" not in router.__dict__


def test_a_router_that_does_not_flatten_runs_its_own_forward_on_another_shape():
    """gpt-oss's router takes (T, H) from its block; on a (B, L, H) input its own forward takes the
    softmax over dim 1 as written, so that input goes to it, counted."""
    router = _gpt_oss()
    hidden = torch.randn(2, 5, 32)
    want = router(hidden)
    undo, count, _ = install_fused_routers([router], GPT_OSS)
    reset_fallbacks()
    got = router(hidden)
    assert fallback_counts().get("moe_router_shape") == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    undo()


def test_a_class_that_computes_otherwise_keeps_its_forward_and_says_why():
    for router, spec, why in ((_qwen3(cls=_NeverRenormalises), SOFTMAX_TOPK, "something other"),
                              (_qwen3(cls=_DoesNotFlatten), SOFTMAX_TOPK, "outputs of shapes"),
                              (_deepseek_v3(_IgnoresTheBias), DEEPSEEK_V3, "other experts"),
                              (_gpt_oss(_SoftmaxThenTopk), GPT_OSS, "something other")):
        undo, count, reasons = install_fused_routers([router], spec)
        assert count == 0 and "forward" not in router.__dict__
        assert len(reasons) == 1 and type(router).__name__ in reasons[0] and why in reasons[0], reasons


def test_layers_with_other_settings_are_checked_apart():
    """A class that always renormalises equals the recipe where norm_topk_prob is on, not where it
    is off: each setting is its own check, so one layer's pass does not vouch for the other."""
    class AlwaysRenormalises(Qwen3MoeTopKRouter):
        def forward(self, hidden_states):
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            weights, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
            return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), ids

    on, off = _qwen3(True, AlwaysRenormalises), _qwen3(False, AlwaysRenormalises)
    undo, count, reasons = install_fused_routers([on, off], SOFTMAX_TOPK)
    assert count == 1 and "forward" in on.__dict__ and "forward" not in off.__dict__, reasons
    undo()


def test_adapters_hooks_and_an_instance_forward_are_refused():
    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    parametrized, hooked, replaced = _qwen3(), _qwen3(), _qwen3()
    parametrize.register_parametrization(parametrized, "weight", Double())
    hooked.__dict__["_hf_hook"] = object()
    replaced.forward = lambda hidden_states: None
    undo, count, reasons = install_fused_routers([parametrized, hooked, replaced], SOFTMAX_TOPK)
    assert count == 0 and len(reasons) == 3, reasons
    assert any("parametrizations" in r for r in reasons) and any("accelerate's hooks" in r for r in reasons)
    assert any("already replaced" in r for r in reasons)


def test_missing_attributes_are_refused_by_name():
    router = _qwen3()
    del router.norm_topk_prob
    _undo, count, reasons = install_fused_routers([router], SOFTMAX_TOPK)
    assert count == 0 and "norm_topk_prob" in reasons[0]


def test_under_autocast_the_models_own_forward_runs_and_is_counted():
    router = _qwen3()
    undo, count, _ = install_fused_routers([router], SOFTMAX_TOPK)
    hidden = torch.randn(7, 32)
    reset_fallbacks()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(hidden)
        want = Qwen3MoeTopKRouter.forward(router, hidden)
    assert fallback_counts().get("moe_router_autocast") == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    undo()
