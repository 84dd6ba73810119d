"""MoE blocks whose experts do not go through transformers' experts interface, on hasten's
grouping path at the level of the block.

Llama 4 (`Llama4TextMoe`): its router keeps the top-k logits and gives s = sigmoid(logit) for the
chosen experts and 0 for the others, (T, E); the block then runs every expert on every token, on
the input scaled by the expert's score, and sums: out = shared(x) + sum_e expert_e(s_e x), each
expert a SwiGLU without biases on weights gate_up_proj (E, H, 2I) = [gate | up] and down_proj
(E, I, H). An expert of a zero-scaled input gives 0 (silu(0) * 0 = 0), and a zero score carries no
gradient to the router (the sigmoid of -inf), so the chosen experts alone compute the same output
and the same gradients, with k / E of the work:

  ids, s = topk(scores, k)                              (T, k): the chosen experts and their scores
  x (T, H) --permute, each slot's row scaled by s--> (S, H) --grouped GEMM gate_up--> (S, 2I)
           --swiglu--> (S, I) --grouped GEMM down--> (S, H) --combine, unweighted sum--> (T, H)

(A chosen expert whose score rounds to 0 may be swapped by topk for an unchosen one at 0: both
add 0 and carry no gradient.) `install_llama4_blocks` checks the fused forward against the
block's own on random tokens, once per model, before patching; LoRA on the expert weights (a
PEFT parametrization) and activations other than SiLU are left to the block's own forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn.utils import parametrize

from hasten.instance_forward import replace_forward, restore_forward, without_hooked
from hasten.moe.experts import MoeLoadStats, grouped_linear
from hasten.ops import moe as moe_ops


def llama4_block_forward(self, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward on the grouping path: hidden (..., H) -> ((T, H), router logits (T, E))."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden)  # (T, E): sigmoid of the top-k logits, 0 elsewhere
    scores, ids = router_scores.topk(self.top_k, dim=-1)  # (T, k)
    g = moe_ops.group(ids.to(torch.int32), self.num_experts)
    stats: MoeLoadStats | None = getattr(self, "_hasten_moe_stats", None)
    if stats is not None:
        stats.add(self, g.counts)
    experts = self.experts
    rows = moe_ops.permute(hidden, g, slot_scale=scores.reshape(-1).to(hidden.dtype))  # (S, H), s * x
    gate_up = grouped_linear(rows, experts.gate_up_proj.transpose(-2, -1), g)  # stored (E, H, 2I)
    routed = grouped_linear(moe_ops.swiglu(gate_up), experts.down_proj.transpose(-2, -1), g)  # stored (E, I, H)
    out = self.shared_expert(hidden)
    return out + moe_ops.combine(routed, None, g), router_logits


def llama4_block_refusal(block: nn.Module) -> str | None:
    """Why this block stays on its own forward; None when the fused one computes what it does."""
    experts = getattr(block, "experts", None)
    if not all(isinstance(getattr(experts, name, None), torch.Tensor) for name in ("gate_up_proj", "down_proj")):
        return f"{type(block).__name__}'s experts do not hold gate_up_proj / down_proj tensors"
    if any(parametrize.is_parametrized(experts, name) for name in ("gate_up_proj", "down_proj")):
        return "its expert weights are parametrized (LoRA on the experts: PEFT's target_parameters)"
    act = type(getattr(experts, "act_fn", None)).__name__
    if act not in ("SiLU", "SiLUActivation"):  # torch's, or transformers' ACT2FN["silu"]; the probe checks it
        return f"its experts' activation is {act}, not SiLU"
    if not all(hasattr(block, name) for name in ("router", "shared_expert", "top_k", "num_experts", "hidden_dim")):
        return f"{type(block).__name__} lacks Llama 4's router, shared_expert, top_k, num_experts or hidden_dim"
    return None


@torch.no_grad()
def llama4_block_mismatch(block: nn.Module) -> str | None:
    """The fused forward against the block's own on 7 random tokens (eval mode: no dropout)."""
    weight = block.experts.gate_up_proj
    x = torch.randn(7, block.hidden_dim, generator=torch.Generator(device=weight.device).manual_seed(0),
                    device=weight.device).to(weight.dtype)
    was_training = block.training
    block.eval()
    try:
        want, want_logits = type(block).forward(block, x)
        got, got_logits = llama4_block_forward(block, x)
    except Exception as exc:  # noqa: BLE001 - any failure keeps the block's own forward, with the reason
        return f"{type(block).__name__} could not be checked ({type(exc).__name__}: {exc})"
    finally:
        block.train(was_training)
    tolerance = 1e-4 if weight.dtype == torch.float32 else 3e-2
    error = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
    if not (error <= tolerance and torch.equal(got_logits, want_logits)):
        return (f"{type(block).__name__} computes something other than shared(x) + sum over the top-k experts of "
                f"expert(score * x) (relative difference {error:.1e} on random tokens)")
    return None


def install_llama4_blocks(model: nn.Module):
    """Patch every Llama 4 MoE block of `model`. Returns (undo, number patched, reasons, stats)."""
    blocks, hooked = without_hooked([m for m in model.modules() if type(m).__name__ == "Llama4TextMoe"])
    reasons = {*hooked, *(reason for block in blocks if (reason := llama4_block_refusal(block)) is not None)}
    if not reasons and blocks and (mismatch := llama4_block_mismatch(blocks[0])) is not None:
        reasons.add(mismatch)
    stats = MoeLoadStats()
    if reasons or not blocks:
        return (lambda: None), 0, sorted(reasons), stats
    for block in blocks:
        replace_forward(block, types.MethodType(llama4_block_forward, block))
        block._hasten_moe_stats = stats
        stats.track(block, block.num_experts, block.experts.gate_up_proj.device)

    def undo() -> None:
        stats.untrack()
        for block in blocks:
            restore_forward(block)
            block.__dict__.pop("_hasten_moe_stats", None)

    return undo, len(blocks), [], stats
