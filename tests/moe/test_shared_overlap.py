"""training.moe.overlap_shared_experts (hasten.moe.shared_overlap) on the CPU: which blocks it finds,
when a shared expert must stay on the main stream, that the hooks change nothing they do not own
and come off with undo, and how accelerate() and the config treat the switch. The side stream
itself runs in tests/gpu/test_moe_cuda.py."""

from __future__ import annotations

import pytest
import torch

import hasten
from hasten.config import Config, ConfigError, validate
from hasten.moe.shared_overlap import _why_inline, install_shared_expert_overlap, shared_expert_blocks
from hasten.observability import fallback_counts, reset_fallbacks
from tests import model_zoo as zoo


@pytest.mark.parametrize("model_type,shared", [("deepseek_v2", "shared_experts"), ("qwen2_moe", "shared_expert"),
                                               ("llama4_text", "shared_expert")])
def test_finds_each_moe_block_with_shared_experts(model_type, shared):
    model = zoo.build(zoo.ENTRIES[model_type])
    pairs = shared_expert_blocks(model)
    assert pairs and all(getattr(block, shared) is module for block, module in pairs)
    moe_layers = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, shared)]
    assert [block for block, _ in pairs] == moe_layers


def test_no_shared_experts_no_blocks():
    assert shared_expert_blocks(zoo.build(zoo.ENTRIES["qwen3_moe"])) == []


def test_why_inline_names_each_reason():
    hidden = torch.randn(4, 8)
    assert "not a CUDA tensor seen" in _why_inline(None, 0, hidden)
    assert "input is not a CUDA tensor" in _why_inline(hidden, hidden._version, hidden)  # the CPU: no side stream


def test_hooks_leave_the_cpu_model_as_it_was_count_the_fallback_and_come_off():
    """On the CPU every shared expert runs where it always did (counted, said once); the output and
    gradients are bitwise the model's own, and undo removes every hook."""
    model = zoo.build(zoo.ENTRIES["deepseek_v2"])
    batch = zoo.packed_batch(zoo.samples())

    def run():
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out.loss.detach(), zoo.gradients(model)

    want = run()
    hooks_before = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()}
    reset_fallbacks()
    pairs = shared_expert_blocks(model)
    undo, state = install_shared_expert_overlap(pairs)
    count = len(pairs)
    assert count > 0
    got = run()
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    assert fallback_counts().get("moe_shared_overlap") == count and state.overlapped_calls == 0
    undo()
    assert {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()} == hooks_before


def test_accelerate_says_why_it_is_inactive_on_the_cpu_and_on_models_without_shared_experts():
    config = Config()
    config.training.moe.overlap_shared_experts = True
    handle = hasten.accelerate(zoo.build(zoo.ENTRIES["deepseek_v2"]), config)
    assert any("overlap_shared_experts (the model is not on a CUDA GPU" in line for line in handle.inactive)
    assert handle.shared_overlap is None
    handle.undo()
    handle = hasten.accelerate(zoo.build(zoo.ENTRIES["qwen3_moe"]), config)
    assert any("overlap_shared_experts (this model has no MoE block" in line for line in handle.inactive)
    handle.undo()


def test_compile_refuses_the_switch():
    config = Config()
    config.training.compile = True
    config.training.moe.overlap_shared_experts = True
    with pytest.raises(ConfigError, match="overlap_shared_experts"):
        validate(config)
