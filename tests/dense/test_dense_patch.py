"""Fused RMSNorm, SwiGLU and RoPE inside transformers models: same loss and gradients as the
unfused model, switchable per kernel, undone cleanly."""

import gc
import sys

import pytest
import torch
from transformers import Qwen3ForCausalLM

import hasten
from hasten.config import Config
from tests.tiny_models import MODELS, packed_batch

ALL_OFF = {"rms_norm": False, "swiglu": False, "rope": False}
ALL_ON = {"rms_norm": True, "swiglu": True, "rope": True}


def _run(name, kernels):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": kernels}))
    loss = model(**packed_batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return model, handle, loss.detach(), grads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fused_kernels_match_the_unfused_model(name):
    _, _, want_loss, want = _run(name, ALL_OFF)
    model, handle, loss, grads = _run(name, ALL_ON)
    fused = [item for item in handle.active if item.startswith("fused kernels")]
    assert fused and "RMSNorm" in fused[0] and "RoPE" in fused[0]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for key in want:
        torch.testing.assert_close(grads[key], want[key], rtol=1e-4, atol=1e-5, msg=key)
    handle.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_each_kernel_switches_alone():
    for key in ALL_OFF:
        only = dict(ALL_OFF, **{key: True})
        _, handle, _, _ = _run("qwen3", only)
        (fused,) = [item for item in handle.active if item.startswith("fused kernels")]
        expected = {"rms_norm": "RMSNorm", "swiglu": "SwiGLU", "rope": "RoPE"}[key]
        assert expected in fused and all(other not in fused for other in {"RMSNorm", "SwiGLU", "RoPE"} - {expected})
        handle.undo()


def _collect_dropped_models():
    """Models of earlier tests dropped without undo(): collected, their RoPE patches released."""
    from hasten.dense.patch import release_dropped_rope_patches

    gc.collect()
    release_dropped_rope_patches()


def test_rope_patch_is_shared_and_restored_with_the_last_model():
    _collect_dropped_models()
    modeling = sys.modules[Qwen3ForCausalLM.__module__]
    original = modeling.apply_rotary_pos_emb
    assert original.__module__ == modeling.__name__
    _, first, _, _ = _run("qwen3", ALL_ON)
    _, second, _, _ = _run("qwen3", ALL_ON)
    assert modeling.apply_rotary_pos_emb is not original
    first.undo()
    assert modeling.apply_rotary_pos_emb is not original  # the second model still uses it
    second.undo()
    assert modeling.apply_rotary_pos_emb is original


def test_rope_patch_of_a_dropped_model_is_restored_at_the_next_install_not_by_the_collector():
    """A model dropped without undo() releases its RoPE patch at the next accelerate() (or undo),
    not when the garbage collector runs: a collection in the middle of another model's backward
    would swap the function between a checkpointed layer's forward and its recompute."""
    _collect_dropped_models()
    modeling = sys.modules[Qwen3ForCausalLM.__module__]
    original = modeling.apply_rotary_pos_emb
    model, handle, _, _ = _run("qwen3", ALL_ON)
    assert modeling.apply_rotary_pos_emb is not original
    del model, handle
    gc.collect()
    assert modeling.apply_rotary_pos_emb is not original  # not from the collector
    _, other, _, _ = _run("llama", ALL_ON)  # the next install releases it
    assert modeling.apply_rotary_pos_emb is original
    other.undo()


def test_a_collection_during_a_checkpointed_backward_changes_nothing():
    """An unpatched model trained with checkpointing while a patched model of its family is
    collected between its forward and its recompute: the recompute runs the function the forward
    ran (before, the collector restored transformers' function and the recompute raised)."""
    _collect_dropped_models()
    dropped, handle, _, _ = _run("qwen3", ALL_ON)
    torch.manual_seed(0)
    model = MODELS["qwen3"]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    loss = model(**packed_batch(), use_cache=False).loss
    del dropped, handle
    gc.collect()
    loss.backward()  # the recompute: no CheckpointError
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    _collect_dropped_models()


def test_mixed_dtypes_fall_back_to_transformers_norm():
    torch.manual_seed(0)
    model = MODELS["llama"]()
    hasten.accelerate(model, Config.from_dict({"kernels": ALL_ON}))
    norm = model.model.norm
    x = torch.randn(2, 3, 32, dtype=torch.float64)
    out = norm(x)
    assert out.dtype == torch.float64
    assert hasten.observability.fallback_counts().get("fused_rms_norm") == 1


def test_each_configuration_of_a_norm_class_is_checked_not_only_the_first():
    """A class can serve several roles (a per-instance flag, another shape): checking its first
    module alone would vouch for the others. Here one instance of a norm class doubles its output;
    it must stay the model's while its siblings take the kernel."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hasten.dense.patch import install_fused_norms

    class FlaggedRMSNorm(LlamaRMSNorm):
        def __init__(self, hidden, eps, doubled):
            super().__init__(hidden, eps=eps)
            self.doubled = doubled

        def forward(self, hidden_states):
            out = super().forward(hidden_states)
            return out * 2 if self.doubled else out

    model = MODELS["llama"]()
    norms = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, LlamaRMSNorm)]
    for i, (parent, name, child) in enumerate(norms):
        flagged = FlaggedRMSNorm(child.weight.shape[0], child.variance_epsilon, doubled=(i == len(norms) - 1))
        flagged.weight.data.copy_(child.weight.data)
        setattr(parent, name, flagged)
    undo, count, refused = install_fused_norms(model)
    doubled = norms[-1][0].get_submodule(norms[-1][1])
    assert count == len(norms) - 1 and "forward" not in vars(doubled), (count, refused)
    assert any("FlaggedRMSNorm computes something other than" in reason for reason in refused), refused
    undo()


def test_a_norm_class_keeping_its_epsilon_under_the_other_name_is_patched_with_its_own():
    """transformers renames where a norm class keeps its epsilon (5.25: Llama 4's, Gemma 3n's and
    Gemma 4's RMSNorm went from `eps` to `variance_epsilon`). Each class is read under its own name,
    one class of a model following a rename and another not, and the result is the model's: a
    small-magnitude row shows the epsilon, and a wrong one fails the class's check."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hasten.dense.patch import install_fused_norms
    from hasten.dense.spec import NormSpec

    class OldNameRMSNorm(torch.nn.Module):  # the same formula, its epsilon as `eps`
        def __init__(self, hidden, eps):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden))
            self.eps = eps

        def forward(self, hidden_states):
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states.float() * torch.rsqrt(variance + self.eps)).to(hidden_states.dtype)

    torch.manual_seed(0)
    model = MODELS["llama"]()
    norms = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, LlamaRMSNorm)]
    for parent, name, child in norms[::2]:  # every other norm renamed: both names in one model
        renamed = OldNameRMSNorm(child.weight.shape[0], 0.5)  # large: an epsilon read wrong shows
        renamed.weight.data.copy_(child.weight.data + torch.randn_like(child.weight) * 0.1)
        setattr(parent, name, renamed)
    x = torch.randn(3, 7, norms[0][2].weight.shape[0]) * 1e-1
    modules = [parent.get_submodule(name) for parent, name, _ in norms]
    want = [m(x) for m in modules]
    for spec in (NormSpec(), NormSpec(eps_attribute="eps")):  # the table's name either way
        undo, count, refused = install_fused_norms(model, spec)
        assert count == len(norms) and not refused, (count, refused)
        for module, expected in zip(modules, want):
            torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-6)
        undo()
