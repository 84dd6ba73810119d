"""Llama 4's MoE block on hasten's grouping path (hasten.moe.blocks), CPU float32: the output and
every gradient (experts, router, shared expert, input) of the block's own forward, which runs
every expert on every token, from the chosen experts alone; top-1 and top-2, 1 and 13 tokens; a
block that computes otherwise, or carries LoRA on its experts, keeps its own forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hasten.moe.blocks import install_llama4_blocks, llama4_block_forward
from tests import model_zoo as zoo


def _block(top_k: int):
    model = zoo.build(zoo.ENTRIES["llama4_text"], num_experts_per_tok=top_k)
    block = next(m for m in model.modules() if type(m).__name__ == "Llama4TextMoe")
    with torch.no_grad():  # the zoo's init leaves gate_up_proj at zero for some versions: random experts
        block.experts.gate_up_proj.normal_(std=0.2, generator=torch.Generator().manual_seed(2))
        block.experts.down_proj.normal_(std=0.2, generator=torch.Generator().manual_seed(3))
    return model, block


def _run(block, forward, x):
    block.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out, logits = forward(block, leaf)
    (out.square().sum() + logits.sum()).backward()
    return out.detach(), leaf.grad, {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("tokens", [1, 13])
def test_the_chosen_experts_give_the_blocks_output_and_gradients(top_k, tokens):
    _, block = _block(top_k)
    x = torch.randn(tokens, block.hidden_dim, generator=torch.Generator().manual_seed(tokens))
    want = _run(block, type(block).forward, x)
    got = _run(block, llama4_block_forward, x)
    # float32, other summation order (the dense block sums over all experts, zeros included)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys() and {"experts.gate_up_proj", "router.weight"} <= set(want[2])
    for name in want[2]:  # absolute error against each gradient's own scale: the router's reaches 3e2,
        scale = float(want[2][name].abs().max())  # and float32 rounding of its sums leaves ~1e-7 of that
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=max(1e-5, 1e-6 * scale), msg=name)


def test_install_checks_the_block_and_undo_restores_it():
    model, block = _block(1)
    undo, count, refused, _ = install_llama4_blocks(model)
    assert count == 1 and not refused and "forward" in block.__dict__
    undo()
    assert "forward" not in block.__dict__
    block.experts.act_fn = nn.GELU()  # the fused SwiGLU would compute another activation
    _, count, refused, _ = install_llama4_blocks(model)
    assert count == 0 and "not SiLU" in refused[0]
    model, block = _block(1)
    base = type(block)
    # a Llama4TextMoe whose forward computes otherwise (twice the output): found by the check
    block.__class__ = type("Llama4TextMoe", (base,), {"forward": lambda self, x: (2 * base.forward(self, x)[0],
                                                                                  base.forward(self, x)[1])})
    _, count, refused, _ = install_llama4_blocks(model)
    assert count == 0 and "computes something other than" in refused[0]
