"""hasten's fused experts against transformers' eager experts on tiny configs of each MoE architecture."""

import pytest
import torch
from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

import hasten
from hasten.config import Config

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01)
MODELS = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                                            num_experts=8, norm_topk_prob=True, **COMMON)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=16,
                                                            shared_expert_intermediate_size=24, num_experts=8,
                                                            **COMMON)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(intermediate_size=16, num_local_experts=6, **COMMON)),
    "olmoe": lambda: OlmoeForCausalLM(OlmoeConfig(intermediate_size=16, num_experts=8, **COMMON)),
}


def _pair(name):
    torch.manual_seed(0)
    reference = MODELS[name]()
    torch.manual_seed(0)
    patched = MODELS[name]()
    reference.set_experts_implementation("eager")
    return reference, patched


@pytest.mark.parametrize("weights_in_gate", [True, False], ids=["weights_in_gate", "weights_in_combine"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_experts_match_eager_outputs_aux_loss_and_gradients(name, weights_in_gate):
    """Both places of the router's weights (training.moe.weights_in_gate): inside the SwiGLU, a
    summing combine, or in the combine; the same outputs and gradients as transformers' experts."""
    reference, patched = _pair(name)
    handle = hasten.accelerate(patched, Config.from_dict(
        {"training": {"packed_sequence": False, "moe": {"weights_in_gate": weights_in_gate}}}))
    assert any("fused MoE experts" in item for item in handle.active), handle.report()
    said = any("router's weights in the SwiGLU" in item for item in handle.active)
    assert said == weights_in_gate, handle.active
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 11), generator=gen)
    want = reference(input_ids=ids, labels=ids)
    got = patched(input_ids=ids, labels=ids)
    assert torch.allclose(got.logits, want.logits, atol=1e-5, rtol=1e-4)
    assert torch.allclose(got.aux_loss, want.aux_loss, atol=1e-6)  # the router's load-balancing loss is kept
    got.loss.backward()
    want.loss.backward()
    for (pname, p), (_, q) in zip(reference.named_parameters(), patched.named_parameters()):
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            assert torch.allclose(q.grad, p.grad, atol=1e-5, rtol=1e-4), pname
    # same parameters, same state dict: checkpoints stay loadable by transformers
    assert patched.state_dict().keys() == reference.state_dict().keys()


def test_load_stats_accumulate_without_per_layer_reads():
    _, model = _pair("qwen3_moe")
    handle = hasten.accelerate(model)
    ids = torch.randint(0, 97, (1, 13))
    model(input_ids=ids)
    model(input_ids=ids)
    summary = handle.moe_stats.summary()
    # 2 forwards x 13 tokens x top-2 = 52 slots per layer
    assert summary["tokens_per_expert_max"] >= 52 / 8 and summary["tokens_per_expert_min"] >= 0
    assert summary["imbalance_max"] >= 1.0
    assert handle.moe_stats.summary() is None  # reset after reading


def test_undo_and_switch_off():
    _, model = _pair("mixtral")
    handle = hasten.accelerate(model)
    assert model.config._experts_implementation == "hasten_fused"
    assert all(m._hasten_weights_in_gate for m in model.modules() if hasattr(m, "_hasten_gate"))
    handle.undo()
    assert model.config._experts_implementation != "hasten_fused"
    assert not any(hasattr(m, "_hasten_weights_in_gate") for m in model.modules())
    handle = hasten.accelerate(model, Config.from_dict({"training": {"moe": {"fused_grouping": False}}}))
    assert model.config._experts_implementation != "hasten_fused"
    assert any("fused_grouping is false" in item for item in handle.inactive)


def test_dense_model_reports_fused_grouping_inactive():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    handle = hasten.accelerate(model)
    assert any("no MoE experts" in item for item in handle.inactive)


def test_per_expert_fallback_op_is_the_eager_loop():
    """The per-expert matmul as torch.compile runs it (one opaque op, hasten_host::per_expert_matmul):
    schema, fake and autograd consistent, and output and gradients those of the eager loop, with an
    expert that gets no rows and rows past the valid slots."""
    from hasten.moe.experts import _per_expert_matmul, _per_expert_matmul_op

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, 3, 3, 7, 9], dtype=torch.int32)  # expert 1 empty; rows 9, 10 dropped
    torch.library.opcheck(_per_expert_matmul_op, (x, weight, offsets))
    upstream = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    got = _per_expert_matmul_op(x, weight, offsets)
    want = _per_expert_matmul(x, weight, offsets)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, (x, weight), upstream), torch.autograd.grad(want, (x, weight), upstream)):
        torch.testing.assert_close(g, w)


# gpt-oss's clamped SwiGLU: hasten's kernel only where the class's own _apply_gate is that formula
def _gpt_oss_model(**config):
    from tests import model_zoo as zoo

    return zoo.build(zoo.ENTRIES["gpt_oss"], **config)


def test_gpt_oss_experts_take_the_fused_clamped_gate_after_a_check():
    from hasten.moe.experts import clamped_gate_mismatch

    model = _gpt_oss_model()
    experts = model.model.layers[0].mlp.experts
    assert clamped_gate_mismatch(experts) is None
    with torch.no_grad():  # the check takes gradients all the same
        assert clamped_gate_mismatch(experts) is None
    handle = hasten.accelerate(model, Config())
    assert all(layer.mlp.experts._hasten_gate == "clamped_swiglu" for layer in model.model.layers)
    assert any("fused clamped SwiGLU (gpt-oss" in item for item in handle.active), handle.report()
    handle.undo()
    assert "_hasten_gate" not in experts.__dict__


def test_gpt_oss_gate_up_biases_go_inside_the_clamped_kernel_after_a_check_or_apart_with_a_warning(monkeypatch):
    """The experts' gate_up biases are added inside the clamped kernel where clamped_bias_mismatch
    finds it equal to adding them apart (float32 and the weights' dtype, on the module's device);
    where it does not, they are added apart, counted and warned once per class. The packed loss and
    every gradient are those of the biases added apart, in float32."""
    from hasten.moe import experts as experts_module
    from hasten.observability import fallback_counts
    from tests import model_zoo as zoo

    model = _gpt_oss_model()
    experts = model.model.layers[0].mlp.experts
    assert experts.has_bias and experts_module.clamped_bias_mismatch(experts) is None
    batch = zoo.samples(seed=3)

    def loss_and_grads():
        handle, loss, grads = zoo.packed_run(model, batch)
        fused = [layer.mlp.experts.__dict__.get("_hasten_fused_bias") for layer in model.model.layers]
        report = handle.report()
        handle.undo()
        return loss, grads, fused, report

    loss, grads, fused, report = loss_and_grads()
    assert fused == [True] * len(model.model.layers) and "gate_up's inside the clamped kernel" in report
    assert "_hasten_fused_bias" not in experts.__dict__  # undo
    monkeypatch.setattr(experts_module, "clamped_bias_mismatch", lambda m: "a kernel that differs (test)")
    before = fallback_counts().get("moe_clamped_gate_bias", 0)
    apart_loss, apart_grads, apart, _ = loss_and_grads()
    assert apart == [False] * len(model.model.layers)
    assert fallback_counts().get("moe_clamped_gate_bias", 0) == before + 1  # once per class, counted
    torch.testing.assert_close(loss, apart_loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], apart_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_gate_that_is_not_gpt_oss_formula_keeps_its_own_and_says_why(monkeypatch):
    """A look-alike (alpha and limit, another formula: no + 1 on up) is refused by the check and runs
    its own _apply_gate, named in the report."""
    from hasten.moe.experts import clamped_gate_mismatch

    model = _gpt_oss_model()
    cls = type(model.model.layers[0].mlp.experts)

    def without_the_shift(self, gate_up):
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return up * (gate * torch.sigmoid(gate * self.alpha))

    monkeypatch.setattr(cls, "_apply_gate", without_the_shift)
    reason = clamped_gate_mismatch(model.model.layers[0].mlp.experts)
    assert reason is not None and "something other than gpt-oss's clamped SwiGLU" in reason
    from hasten.observability import fallback_counts

    before = fallback_counts().get("moe_clamped_gate", 0)
    handle = hasten.accelerate(model, Config())
    assert fallback_counts().get("moe_clamped_gate", 0) == before + 1  # once per class, counted
    assert all(layer.mlp.experts._hasten_gate == "own" for layer in model.model.layers)
    assert any(item.startswith("fused clamped SwiGLU (") for item in handle.inactive), handle.report()
    assert any("the model's own gated activation" in item for item in handle.active), handle.report()
    handle.undo()


def test_experts_without_alpha_and_limit_are_not_checked_as_gpt_oss():
    from hasten.moe.experts import clamped_gate_mismatch

    model = _gpt_oss_model()
    experts = model.model.layers[0].mlp.experts
    experts.alpha = None
    assert "no numeric alpha and limit" in clamped_gate_mismatch(experts)


def test_expert_biases_as_a_one_hot_gemm_equal_gathering_them():
    """gpt-oss's expert biases are added as y + one_hot(row's expert) @ bias: output and every
    gradient equal the gather bias[row] it replaced (float64; rows sorted by expert, one expert
    without rows, a token count off any block size)."""
    from hasten.moe.experts import _add_expert_bias, _row_expert_one_hot
    from hasten.ops import moe as moe_ops

    gen = torch.Generator().manual_seed(0)
    experts, top_k, tokens, out = 5, 2, 13, 7
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=gen)  # the last expert gets no row
    g = moe_ops.group(ids, experts)
    rows = tokens * top_k
    sorted_ids = ids.flatten().sort().values
    y = torch.randn(rows, out, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(experts, out, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(rows, out, generator=gen, dtype=torch.float64)

    one_hot = _row_expert_one_hot(g, rows, torch.float64)
    assert torch.equal(one_hot.argmax(dim=1), sorted_ids) and torch.equal(one_hot.sum(dim=1), torch.ones(rows, dtype=torch.float64))
    got = _add_expert_bias(y, bias, one_hot)
    got.backward(grad)
    got_grads = (y.grad.clone(), bias.grad.clone())
    y.grad = bias.grad = None
    want = y + bias[sorted_ids]
    want.backward(grad)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_grads[0], y.grad, rtol=0, atol=0)
    torch.testing.assert_close(got_grads[1], bias.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_grads[1][experts - 1], torch.zeros(out, dtype=torch.float64))
