"""What a model type's MoE router computes (the model table's `router` entry, ArchSpec.router), for
hasten::moe_route (hasten.moe.router installs it). No torch or op import: the table is read
before anything loads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterSpec:
    """What a model type's router computes from its hidden states (one table entry)."""

    scoring: str  # "softmax" | "sigmoid" | "topk_softmax" (the softmax of the k chosen logits)
    # the logits: "input" F.linear(h, W) in h's dtype; "float32" F.linear(h.float(), W.float());
    # "input_bias" F.linear(h, W, b)
    logits: str = "input"
    # renormalise the k weights: True, False, or the router's attribute that says (norm_topk_prob)
    renormalize: bool | str = False
    renorm_epsilon: float = 0.0
    scale_attribute: str = ""  # the router's attribute the weights are multiplied by; "": 1
    # group-limited top-k: "" none; "deepseek_v2" (topk_method "group_limited_greedy": group score
    # max, others 0.0), "deepseek_v3" (always: group score the top-2 sum, others -inf); the group
    # counts from the router's num_group / topk_group
    groups: str = ""
    bias_attribute: str = ""  # the router's selection-only bias (e_score_correction_bias); "": none
    weights_dtype: str = "logits"  # "logits": cast to the logits' dtype; "float32": left in float32
    # the router flattens its input to (tokens, hidden) itself (Qwen's, Mixtral's, DeepSeek's
    # reshape); False: it takes its input's shape as it comes (gpt-oss's, whose block flattens first)
    flattens_input: bool = True

    def describe(self) -> str:
        parts = [{"softmax": "softmax", "sigmoid": "sigmoid",
                  "topk_softmax": "top-k on the logits, softmax of the k"}[self.scoring]]
        if self.bias_attribute:
            parts.append(f"selection bias ({self.bias_attribute})")
        if self.groups:
            parts.append("group-limited top-k")
        if self.renormalize:
            parts.append("renormalised" if self.renormalize is True else f"renormalised where {self.renormalize}")
        if self.scale_attribute:
            parts.append(f"times {self.scale_attribute}")
        return ", ".join(parts)


# Qwen2/3-MoE, OLMoE, FlexOlmo, Qwen3-Next: softmax in float32, sorted top-k, renormalised where
# norm_topk_prob, cast to the logits' dtype
SOFTMAX_TOPK = RouterSpec("softmax", renormalize="norm_topk_prob")
# Qwen3-VL-MoE, Qwen3.5-MoE: the same, always renormalised
SOFTMAX_TOPK_RENORM = RouterSpec("softmax", renormalize=True)
# Mixtral: always renormalised, weights left in float32
MIXTRAL = RouterSpec("softmax", renormalize=True, weights_dtype="float32")
# DeepSeek-V2: float32 logits, softmax, greedy or group-limited (max, others 0.0) top-k, times
# routed_scaling_factor, no renormalisation (norm_topk_prob is not read), float32 weights
DEEPSEEK_V2 = RouterSpec("softmax", logits="float32", scale_attribute="routed_scaling_factor", groups="deepseek_v2",
                         weights_dtype="float32")
# DeepSeek-V3, GLM-4-MoE, dots1 and their kin: float32 logits, sigmoid, the correction bias in
# the choice, top-2-sum groups (others -inf), gathered scores / (sum + 1e-20) where
# norm_topk_prob, times routed_scaling_factor, float32 weights
DEEPSEEK_V3 = RouterSpec("sigmoid", logits="float32", renormalize="norm_topk_prob", renorm_epsilon=1e-20,
                         scale_attribute="routed_scaling_factor", groups="deepseek_v3",
                         bias_attribute="e_score_correction_bias", weights_dtype="float32")
# gpt-oss: logits with the router's bias, top-k on them, softmax of the k in the logits' dtype
GPT_OSS = RouterSpec("topk_softmax", logits="input_bias", flattens_input=False)


# The names an MoE block (a module with an `experts` child) gives the child that routes tokens among
# its experts (top-k): a Linear or router module (Mixtral's, Qwen3-MoE's and DeepSeek's `gate`,
# gpt-oss's, Aria's and Llama 4's `router`) or a module around one (DBRX's router.layer, Hunyuan's
# gate.wg, LongCat's router.classifier). A shared expert's sigmoid gate (Qwen2-MoE's
# shared_expert_gate) selects nothing and is not among them. LoRA's router check and the fused
# routers both find routers by it.
ROUTER_NAMES = frozenset({"gate", "router"})
