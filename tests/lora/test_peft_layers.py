"""PEFT's LoRA layers on hasten::lora_linear (CPU, float32): a tiny Llama with LoRA on every
projection gives PEFT's own loss and every adapter gradient (noise: float32 rounding), with and
without dropout; merged, disabled and multi-adapter states and a DoRA layer run PEFT's own forward;
undo restores PEFT's forward; save and load of the adapters are PEFT's."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.lora import install_fused_lora, lora_layers  # noqa: E402
from hasten.lora.peft_layers import ROUTER_ADAPTER_REASON, router_adapters  # noqa: E402
from hasten.observability import fallback_counts  # noqa: E402
from tests.tiny_models import MODELS, packed_batch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(dropout=0.0, **extra):
    torch.manual_seed(0)
    model = peft.get_peft_model(MODELS["llama"](), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                  target_modules=TARGETS, **extra))
    with torch.no_grad():  # PEFT starts lora_B at zero: random values make the update visible
        for layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_(std=0.3)
    return model


def _loss_and_grads(model, seed=0):
    batch = packed_batch()
    torch.manual_seed(seed)  # the same dropout masks for both runs
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fused_layers_give_peft_loss_and_gradients(dropout):
    model = _peft_model(dropout)
    want_loss, want = _loss_and_grads(model)
    undo, count, grouped, refused = install_fused_lora(model)
    assert count == 2 * len(TARGETS) and not refused
    assert grouped == 2 * 5  # per layer q/k/v and gate/up: one op each (with dropout, one by one per call)
    got_loss, got = _loss_and_grads(model)
    if dropout == 0.0:
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    else:  # the masks are drawn on x (PEFT: on x cast to the adapter dtype): equal in distribution only
        assert abs(float(got_loss) - float(want_loss)) < 0.5
    undo()
    assert all("forward" not in layer.__dict__ for layer in lora_layers(model))
    again_loss, _ = _loss_and_grads(model)
    torch.testing.assert_close(again_loss, want_loss)


def test_the_first_layers_input_under_a_frozen_embedding_gets_no_input_gradient():
    """The first layer's q/k/v group reads the normed embedding, which needs no gradient in a LoRA
    job (frozen embedding, PEFT without input gradients): its backward is asked for no d x (the
    three base GEMMs of it skipped); every later group needs it. The loss and gradients are those
    of test_fused_layers_give_peft_loss_and_gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = _peft_model()
    install_fused_lora(model)
    asked = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("lora_linear_group_backward"):
                asked.append(args[7] if len(args) > 7 else True)
            return func(*args, **(kwargs or {}))

    model.zero_grad(set_to_none=True)
    loss = model(**packed_batch()).loss
    with Record():
        loss.backward()
    assert sorted(asked) == [False] + [True] * 3  # layers 1 to 0 backwards: q/k/v and gate/up each
    assert asked[-1] is False  # the last group the backward reaches: layer 0's q/k/v


def test_groups_off_give_the_same_loss_and_gradients_as_groups_on():
    model = _peft_model()
    undo, _, grouped, _ = install_fused_lora(model)
    grouped_loss, grouped_grads = _loss_and_grads(model)
    undo()
    _, _, none, _ = install_fused_lora(model, groups=False)
    assert grouped == 10 and none == 0
    loss, grads = _loss_and_grads(model)
    torch.testing.assert_close(grouped_loss, loss, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grouped_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)


class _TwoInputs(torch.nn.Module):
    """A parent whose q/k/v-named projections do not all read one tensor (cross-attention-like):
    k and v read `memory`, q reads x."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 6, bias=False) for _ in range(3))

    def forward(self, x, memory):
        return self.q_proj(x).sum() + self.k_proj(memory).sum() * 2 + self.v_proj(memory).sum() * 3


def test_a_group_fed_two_tensors_turns_off_and_stays_correct():
    torch.manual_seed(0)
    model = peft.get_peft_model(_TwoInputs(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "k_proj",
                                                                                                 "v_proj"]))
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_()
    reference = copy.deepcopy(model)
    _, _, grouped, _ = install_fused_lora(model)
    assert grouped == 3
    x, memory = torch.randn(5, 8), torch.randn(5, 8)
    for _ in range(2):  # the first call finds out and turns the group off; the second runs one by one
        torch.testing.assert_close(model(x, memory), reference(x, memory), rtol=1e-5, atol=1e-5)
    assert fallback_counts().get("lora_group_off") == 1


def test_states_peft_computes_otherwise_run_peft():
    model = _peft_model()
    reference = copy.deepcopy(model)
    install_fused_lora(model)
    batch = packed_batch()
    with torch.no_grad():
        for context in ("disabled", "merged"):
            if context == "disabled":
                with model.disable_adapter(), reference.disable_adapter():
                    torch.testing.assert_close(model(**batch).logits, reference(**batch).logits)
            else:
                model.merge_adapter()
                reference.merge_adapter()
                torch.testing.assert_close(model(**batch).logits, reference(**batch).logits)
                model.unmerge_adapter()
                reference.unmerge_adapter()
        torch.testing.assert_close(model(**batch).logits, reference(**batch).logits, rtol=1e-5, atol=1e-5)


def test_dora_and_lora_bias_are_left_to_peft_and_said():
    model = _peft_model(use_dora=True)
    undo, count, _grouped, refused = install_fused_lora(model)
    assert count == 0 and any("variant" in reason for reason in refused)
    assert fallback_counts().get("lora_not_fused") == 1


@pytest.mark.parametrize("model_type,targets,router", [
    ("phimoe", "all-linear", "mlp.router"), ("dbrx", "all-linear", "ffn.router.layer"),
    ("hunyuan_v1_moe", "all-linear", "mlp.gate.wg"),
    ("deepseek_v2", ["q_proj", "gate"], "mlp.gate"),  # a router that is no Linear: PEFT's ParamWrapper
])
def test_lora_on_moe_routers_leaves_every_layer_to_peft_and_says_why(model_type, targets, router):
    """Where an MoE router carries adapters, no projection is fused: hasten's bf16 low-rank update
    moved the router adapters' gradients 5-8x past bf16 noise on the GPU (top-k routing amplifies
    it); PEFT's float32 update does not. The report names the cause and the way out."""
    from tests import model_zoo as zoo

    model = peft.get_peft_model(zoo.build(zoo.ENTRIES[model_type]), peft.LoraConfig(r=4, target_modules=targets))
    assert any(name.endswith(router) for name in router_adapters(model)), router_adapters(model)
    undo, count, _grouped, refused = install_fused_lora(model)
    assert count == 0 and refused == [f"{len(lora_layers(model))} LoRA layers: {ROUTER_ADAPTER_REASON}"]
    assert fallback_counts().get("lora_not_fused") == 1
    undo()


def test_moe_projections_without_router_adapters_are_fused():
    """The usual MoE LoRA (attention and shared-expert projections, the routers left alone; a
    shared expert's sigmoid gate is no router) keeps hasten's fused projections."""
    from tests import model_zoo as zoo

    for targets in (["q_proj", "k_proj", "v_proj", "o_proj"], "all-linear"):
        model = peft.get_peft_model(zoo.build(zoo.ENTRIES["qwen2_moe"]), peft.LoraConfig(r=4, target_modules=targets))
        assert router_adapters(model) == []
        undo, count, _grouped, refused = install_fused_lora(model)
        assert count == len(lora_layers(model)) > 0 and refused == [], refused
        undo()


def test_accelerate_reports_the_lora_layers_and_undo_restores_them(tmp_path):
    model = _peft_model()
    handle = hasten.accelerate(model.get_base_model(), Config())
    assert any(item.startswith("fused LoRA projections (14 layers") for item in handle.active), handle.report()
    model.save_pretrained(tmp_path)  # PEFT's own save: the adapters, untouched
    state = peft.PeftModel.from_pretrained(MODELS["llama"](), tmp_path).state_dict()
    assert any("lora_A" in key for key in state)
    handle.undo()
    assert all("forward" not in layer.__dict__ for layer in lora_layers(model))
    off = hasten.accelerate(_peft_model().get_base_model(), Config.from_dict({"kernels": {"fused_lora": False}}))
    assert any("kernels.fused_lora is false" in item for item in off.inactive)
    off.undo()


def test_accelerate_runs_gate_up_and_the_activation_as_one_op_with_peft_gradients(monkeypatch):
    """With hasten's MLP kernel, the fused LoRA groups and HASTEN_LORA_GATED=1 (experimental; without
    it the MLP calls the projections and the activation one by one), each layer's gate/up pair and
    its SwiGLU run as one hasten::lora_gated_group (one backward for the activation and both adapters): the loss
    and every adapter gradient are PEFT's (float32 rounding; use_cache off: with transformers'
    default cache its packed path attends across samples) and those of the separate calls. A hook on
    up_proj (someone watching its output) sends that layer back to the separate calls, which run it."""
    import hasten.dense.patch as dense_patch
    import hasten.lora.peft_layers as peft_layers

    model = _peft_model()
    batch = packed_batch() | {"use_cache": False}

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    want_loss, want = loss_and_grads()
    calls = []
    real = peft_layers.lora_gated_group
    monkeypatch.setattr(peft_layers, "lora_gated_group", lambda *a: calls.append(a[-1]) or real(*a))
    handle = hasten.accelerate(model.get_base_model(), Config())
    loss_and_grads()
    assert calls == []  # off by default
    monkeypatch.setenv("HASTEN_LORA_GATED", "1")
    got_loss, got = loss_and_grads()
    assert calls == ["silu", "silu"], handle.report()  # the two decoder layers
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    with monkeypatch.context() as separate:
        separate.setattr(dense_patch, "gated_group_act", lambda *args: None)
        separate_loss, separate_grads = loss_and_grads()
    torch.testing.assert_close(got_loss, separate_loss, rtol=1e-6, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], separate_grads[name], rtol=1e-6, atol=1e-9, msg=name)
    seen = []
    up_proj = model.get_base_model().model.layers[0].mlp.up_proj
    hook = up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls.clear()
    hooked_loss, _ = loss_and_grads()
    assert calls == ["silu"] and len(seen) == 1  # layer 0 one by one (its hook ran), layer 1 fused
    assert fallback_counts().get("lora_gated_hooked") == 1  # said, and counted
    torch.testing.assert_close(hooked_loss, want_loss, rtol=1e-5, atol=1e-6)
    hook.remove()
    handle.undo()
