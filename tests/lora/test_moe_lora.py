"""LoRA on MoE experts (PEFT's target_parameters) under hasten: PEFT folds each expert's low-rank
update into the expert weights it hands the experts module (a parametrization), and hasten's fused
MoE path (one-kernel grouping, grouped GEMM) reads those weights; the attention projections' LoRA
runs on hasten's fused LoRA op. A packed batch gives PEFT's per-sample loss and every gradient,
the experts' adapters included (CPU, float32)."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import hasten  # noqa: E402
from hasten.config import Config  # noqa: E402
from tests import model_zoo as zoo  # noqa: E402


EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _expert_lora_model(model_type: str, attention_targets: list[str]):
    """A zoo model with PEFT LoRA on `attention_targets` and on its experts (target_parameters),
    lora_B drawn at random (PEFT starts it at zero, which would hide the update); with its
    per-sample reference (loss, gradients) from an untouched copy."""
    torch.manual_seed(0)
    base = zoo.build(zoo.ENTRIES[model_type])
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=attention_targets, target_parameters=EXPERT_TARGETS)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    want_loss, want = zoo.per_sample_reference(copy.deepcopy(model), zoo.samples())
    return model, want_loss, want


def _packed_step_equals(model, want_loss, want) -> dict:
    """Loss and every gradient of a packed batch against the per-sample reference; the gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(**zoo.packed_batch(zoo.samples())).loss
    loss.backward()
    got = zoo.gradients(model)
    assert any("experts" in n and "lora_" in n for n in got)
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=1e-6)
    errors = zoo.relative_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])
    return got


def test_expert_lora_on_the_fused_moe_path_equals_peft_one_sample_at_a_time(expert_gemm):
    model, want_loss, want = _expert_lora_model("qwen3_moe", ["q_proj", "v_proj"])
    handle = hasten.accelerate(model.get_base_model(), Config())
    assert any(item.startswith("fused MoE experts") for item in handle.active), handle.report()
    assert any(item.startswith("fused LoRA projections") for item in handle.active), handle.report()
    got = _packed_step_equals(model, want_loss, want)
    expert_adapters = [n for n in got if "experts" in n and "lora_" in n]
    assert all(float(got[n].abs().sum()) > 0 for n in expert_adapters)
    handle.undo()


def test_expert_lora_runs_split_without_the_merged_expert_stack(monkeypatch):
    """One adapter: hasten runs x W^T + s (x rhs^T) lhs^T on PEFT's factors and never reads the
    merged W + s lhs @ rhs that PEFT's parametrization offers (torch's parametrize computes it once
    when PEFT registers it, a check it drops; a read would compute it again); the same loss and
    gradients as PEFT one sample at a time."""
    from peft.tuners.lora import layer as lora_layer

    model, want_loss, want = _expert_lora_model("qwen3_moe", ["q_proj"])
    handle = hasten.accelerate(model.get_base_model(), Config())
    counts = {"proxies": 0, "merged": 0}
    init, forward = lora_layer._LoraFactorsProxy.__init__, lora_layer._LoraFactorsProxy.forward

    def counting_init(self, *args, **kwargs):
        counts["proxies"] += 1
        init(self, *args, **kwargs)

    def counting_forward(self, weight):
        counts["merged"] += 1
        return forward(self, weight)

    monkeypatch.setattr(lora_layer._LoraFactorsProxy, "__init__", counting_init)
    monkeypatch.setattr(lora_layer._LoraFactorsProxy, "forward", counting_forward)
    _packed_step_equals(model, want_loss, want)
    assert counts["proxies"] > 0 and counts["merged"] == counts["proxies"], counts  # the registration check only
    handle.undo()


@pytest.fixture(params=["per_expert", "grouped_op"])
def expert_gemm(request, monkeypatch):
    """The experts' GEMMs on the CPU: one matmul per expert (the fallback a CPU run takes), or
    hasten::moe_grouped_mm's CPU kernel, which the GPU path calls with the weight's stored layout
    (`transposed`) and whose backward flips it: the wiring the GPU runs, checked here in float32."""
    from hasten.observability import fallback_counts, reset_fallbacks

    reset_fallbacks()
    if request.param == "grouped_op":
        from hasten.moe import experts

        monkeypatch.setattr(experts, "_grouped_mm_usable", lambda x, weight, hastens_op: None)
        monkeypatch.setenv("HASTEN_GROUPED_GEMM", "auto")  # opt into hasten's op (the default calls torch's)
    yield request.param
    ran_per_expert = fallback_counts().get("moe_grouped_gemm", 0) > 0
    assert ran_per_expert == (request.param == "per_expert"), fallback_counts()


def test_expert_lora_on_gpt_oss_transposed_biased_experts_equals_peft(expert_gemm):
    """gpt-oss stores its experts transposed (E, in, out), with biases and a clamped SwiGLU on
    interleaved columns: the split LoRA in the stored layout, the biases per row and the gate on
    hasten's grouped rows give PEFT's loss and every gradient, one sample at a time (the
    biases are frozen here; the zoo's parity case trains them). The gate runs on hasten's clamped
    SwiGLU kernel, admitted by its check against the class's own."""
    model, want_loss, want = _expert_lora_model("gpt_oss", ["q_proj"])
    handle = hasten.accelerate(model.get_base_model(), Config())
    assert any(item.startswith("fused MoE experts") and "fused clamped SwiGLU" in item for item in handle.active), \
        handle.report()
    _packed_step_equals(model, want_loss, want)
    handle.undo()
