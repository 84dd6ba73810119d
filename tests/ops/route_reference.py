"""The routers hasten::moe_route stands in for, written as the models write them (transformers'
Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3 / GLM-4-MoE, gpt-oss), after the logits: the
reference of the op's CPU and GPU tests. Each returns (weights (T, k), ids (T, k)) and the
op's arguments for the same routing."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def qwen3(logits, top_k, renormalize):
    probs = F.softmax(logits, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def deepseek_v2(logits, top_k, num_groups, top_groups, scale):
    scores = logits.softmax(dim=-1)
    if num_groups > 1:
        group_scores = scores.view(-1, num_groups, logits.shape[1] // num_groups).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, logits.shape[1] // num_groups).reshape(
            -1, logits.shape[1])
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scale, ids


def deepseek_v3(logits, top_k, num_groups, top_groups, bias, renormalize, scale):
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, num_groups, logits.shape[1] // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, logits.shape[1] // num_groups).reshape(
        -1, logits.shape[1])
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def gpt_oss(logits, top_k):
    values, ids = torch.topk(logits, top_k, dim=-1)
    return F.softmax(values, dim=1, dtype=values.dtype), ids


# name -> (reference(logits, extra), the op's arguments after logits), extra: the selection bias
def recipes(experts: int, top_k: int, bias: torch.Tensor | None):
    groups = 4 if experts % 4 == 0 and experts // 4 * 2 >= top_k and experts // 4 >= 2 else 1
    cases = {
        "qwen3_renorm": (lambda x: qwen3(x, top_k, True), (top_k, "softmax", True, 0.0, 1.0, 1, 1, "max", 0.0, None)),
        "qwen3_plain": (lambda x: qwen3(x, top_k, False), (top_k, "softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),
        "deepseek_v2_greedy": (lambda x: deepseek_v2(x, top_k, 1, 1, 16.0),
                               (top_k, "softmax", False, 0.0, 16.0, 1, 1, "max", 0.0, None)),
        "gpt_oss": (lambda x: gpt_oss(x, top_k), (top_k, "topk_softmax", False, 0.0, 1.0, 1, 1, "max", 0.0, None)),
    }
    if groups > 1:
        cases["deepseek_v2_groups"] = (lambda x: deepseek_v2(x, top_k, groups, 2, 16.0),
                                       (top_k, "softmax", False, 0.0, 16.0, groups, 2, "max", 0.0, None))
        cases["deepseek_v3"] = (lambda x: deepseek_v3(x, top_k, groups, 2, bias.to(x.dtype), True, 2.5),
                                (top_k, "sigmoid", True, 1e-20, 2.5, groups, 2, "top2_sum", float("-inf"), bias))
    return cases


def by_expert(weights: torch.Tensor, ids: torch.Tensor, experts: int) -> torch.Tensor:
    """(T, E) with each token's weight at its chosen experts and 0 elsewhere: a comparison that
    does not depend on the order of the k choices (unsorted top-k in the models)."""
    return torch.zeros(ids.shape[0], experts, dtype=weights.dtype, device=weights.device).scatter_(1, ids, weights)
