"""Tiny random models of many transformers model types, each with its family's features switched on
at values where an omission shows, and the parity check every type must pass under hasten.

The check (issue "Never silently wrong"): a packed batch with one-token and long samples through
the hasten-accelerated model gives the loss and every gradient of the unpatched model run one
sample at a time in float32 -- or hasten refuses the batch with a message. Never a silent
difference. `ENTRIES` says which of the two each type must do, and what hasten's attention does
for it, so a contract that starts refusing everything fails too.

Shared by tests/integrations/test_model_parity.py (CPU, float32: the noise is rounding alone) and
tests/gpu/test_model_parity_cuda.py (bf16 with hasten's kernels, against the bf16 noise of the
unpatched model).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from transformers import AutoConfig

import hasten
from hasten.config import Config
from hasten.integrations.support import auto_model_class

VOCAB = 211
WINDOW = 5  # shorter than the long samples below, so a lost window shows
LENGTHS = (7, 1, 19, 12, 1, 33)  # one-token samples, and samples longer than the window
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.08,
            tie_word_embeddings=False, attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SLIDING_3 = ["sliding_attention", "full_attention", "sliding_attention"]
FULL_3 = ["full_attention"] * 3
# a tiny SigLIP tower for the multimodal wrappers (their text-only batches never run it)
GEMMA3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=16)
# Gemma 4's tiny vision tower (its text-only batches never run it)
# Gemma 4's per-layer inputs (PLE) at the tiny vocabulary: its default table, 262,144 x (layers x 256),
# was 201M float32 parameters in a 3-layer test model (about 10 s of every gemma4 test on the CPU)
GEMMA4_PLE = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16, patch_size=16, position_embedding_size=64)
MROPE = dict(rope_type="default", rope_theta=10000.0)
QWEN3_VL_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                       num_position_embeddings=16, deepstack_visual_indexes=[0])
GLM4V_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
# half of each head rotates (Phi-3 and GLM-4 configs set partial_rotary_factor), the rest passes
PARTIAL_HALF = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
# a quarter of each head rotates (Qwen3-Next and Qwen3.5 configs)
PARTIAL_QUARTER = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)
# two Gated DeltaNet layers around a full-attention one, grouped value heads (4 v for 2 q/k); heads of
# 16, fla's smallest tile, the shapes tests/gpu/test_linear_attention_cuda.py's kernel tests use (a cold
# GPU compiles and autotunes fla's kernels once per head shape)
GATED_DELTANET = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_conv_kernel_dim=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
# Qwen4-Exp's text model: Gated DeltaNet, indexed (QSA) attention with blocks of 4 and a budget of 8
# tokens, two hyper-connection streams, PLE (hashed 2- and 3-gram embeddings and a dilated
# convolution) on the first layer; a tiny n-gram vocabulary
QWEN4_EXP_TEXT = dict(GATED_DELTANET, layer_types=["linear_attention", "indexed_attention", "linear_attention"],
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, hc_count=2, hc_lowrank=8, ple_layer_ids=[1],
                      ple_embed_dim=64, heads_per_ngram=2, ngram_vocab_size_base=50,
                      make_ngram_vocab_size_divisible_by=8, indexer_n_heads=2, indexer_kv_heads=1,
                      indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                      rope_parameters=dict(PARTIAL_QUARTER, mrope_section=[1, 1, 0]))
QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      num_position_embeddings=16)
GLM4V_MOE_TEXT = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                      n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, attention_bias=True,
                      rope_parameters=dict(PARTIAL_HALF, mrope_section=[1, 1, 2]))


@dataclass(frozen=True)
class Entry:
    model_type: str
    config: dict[str, Any]
    # what hasten's attention must do: "hasten" (its varlen kernels), "transformers" (a feature
    # hasten does not compute: transformers' attention runs, packed rows kept apart by its mask),
    # "refused" (packed batches raise: layers that carry state along the sequence)
    attention: str
    # config changes that switch the family's feature off: the reference must change by far more
    # than the tolerance, or the test could not see the feature dropped
    feature_off: dict[str, Any] = field(default_factory=dict)
    tensor_feature_off: Callable[[torch.nn.Module], None] | None = None
    notes: str = ""
    attn_implementation: str | None = None  # None: what transformers picks
    # weights set after the model is built and its 1-D parameters moved (e.g. a router the model
    # initialises to zero, which would send every token to the same experts)
    tensor_setup: Callable[[torch.nn.Module], None] | None = None


def _random_routers(model: torch.nn.Module) -> None:
    """AFMoE initialises its router to zero: every token would go to the experts its expert bias
    favours. Random router weights spread the tokens over the experts, as a trained router does."""
    gen = torch.Generator().manual_seed(2)
    for module in model.modules():
        if type(module).__name__.endswith("TokenChoiceRouter"):
            module.gate.weight.normal_(0.0, 0.6, generator=gen)


def _slow_decay(model: torch.nn.Module) -> None:
    """Gated DeltaNet's per-head decay is exp(-A * softplus(...)) per token; transformers draws A up
    to 16, where the state is forgotten within a token or two and a state carried across a packed
    sample's boundary barely shows. A in (0.05, 1) keeps it for tens of tokens, as a trained model's
    slow heads do."""
    gen = torch.Generator().manual_seed(4)
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.05, 1.0, generator=gen).log())


def _slow_kda_decay(model: torch.nn.Module) -> None:
    """Kimi delta attention's decay is exp(-A * softplus(f + dt_bias)) per token and key channel;
    transformers draws A up to 16 and the zoo moves dt_bias by 0.3: a state forgotten fast barely
    shows across a packed sample's boundary. A in (0.05, 1) and softplus(dt_bias) in (0.01, 0.1)
    keep it for tens of tokens, as a trained model's slow channels do."""
    gen = torch.Generator().manual_seed(4)
    for module in model.modules():
        if type(module).__name__.endswith("ForgetGate"):
            module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(0.05, 1.0, generator=gen).log())
            dt = torch.empty(module.dt_bias.shape).uniform_(0.01, 0.1, generator=gen)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


def _random_buffer(name: str, why: str):
    """A tensor_setup setting the router buffer `name` off the zero the model initialises it to, so
    that it changes the expert choice (the 1-D parameters moved in build() do not include buffers)."""

    def setup(model: torch.nn.Module) -> None:
        gen = torch.Generator().manual_seed(3)
        for module in model.modules():
            buffer = module._buffers.get(name)
            if buffer is not None:
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))

    setup.__doc__ = why
    return setup


# the routers' score correction bias (DeepSeek-V3's layout and its kin)
_random_correction_biases = _random_buffer("e_score_correction_bias", "routers' score correction biases off zero")
# LFM2-MoE's router adds an expert bias to its sigmoid scores before the top-k
_random_expert_biases = _random_buffer("expert_bias", "LFM2-MoE's expert biases off zero")


def _kimi_linear_setup(model: torch.nn.Module) -> None:
    """Kimi Linear: a slow KDA decay and the routers' correction biases off zero."""
    _slow_kda_decay(model)
    _random_correction_biases(model)


def _frozen_key_biases(model: torch.nn.Module) -> None:
    """Without rotary a key bias adds the same q . b_k to every score of a query row, which the softmax
    cancels: its gradient is zero but for rounding (about 1e-9 here), which relative errors cannot
    compare. Frozen in the reference and the patched copy alike (OPT, BioGPT: separate k_proj biases)."""
    for name, param in model.named_parameters():
        if name.endswith("k_proj.bias"):
            param.requires_grad_(False)


def _zaya_routing(model: torch.nn.Module) -> None:
    """ZAYA's router (a down projection, then ZayaRouterMLP: RMSNorm, two GELU layers, the logits)
    adds balancing biases (a buffer: zero, and -1 on its skip expert, which top-1 of probabilities
    then never picks) before its top-1. At the zoo's scale every token of a layer goes to one expert:
    the stream's constant offsets (its 1-D biases, moved by 0.3) swamp the tokens and the router's
    small weights see only them. Router weights of gain 3, those offsets at a tenth and the balancing
    biases off zero (the skip expert's too) spread the tokens over the experts and the skip one."""
    gen = torch.Generator().manual_seed(3)
    for module in model.modules():
        name = type(module).__name__
        if name == "ZayaRouter":
            for linear in (module.down_proj, module.router_mlp.fc1, module.router_mlp.fc2, module.router_mlp.out_proj):
                linear.weight.normal_(0.0, 3.0 * linear.in_features ** -0.5, generator=gen)
            module.balancing_biases.copy_(0.1 * torch.randn(module.balancing_biases.shape, generator=gen))
        elif name == "ZayaResidualScaling":
            module.hidden_states_bias.mul_(0.1)
            module.residual_bias.mul_(0.1)
        elif name == "ZayaModel":
            module.input_hidden_states_bias.mul_(0.1)


def _zero_sinks(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            module.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink


def _zero_biases(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.data.zero_()  # the biases' values gone, their parameters (and gradients) kept


# DeepSeek-V3.2's shape of MLA, its MoE and its indexer (index_topk 512: above every sample of the CPU and GPU
# harnesses, whose longest is 301, so packed rows are never refused and every key is kept)
_DSA_SHAPE = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, head_dim=8,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                  routed_scaling_factor=2.5, num_key_value_heads=4, index_topk=512, index_head_dim=16,
                  index_n_heads=2)

ENTRIES: dict[str, Entry] = {e.model_type: e for e in [
    Entry("llama", dict(attention_bias=True), "hasten"),
    Entry("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "hasten",
          feature_off=dict(use_sliding_window=False)),
    Entry("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "hasten",
          feature_off=dict(use_sliding_window=False)),
    Entry("mistral", dict(sliding_window=WINDOW), "hasten", feature_off=dict(sliding_window=None)),
    Entry("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                            mlp_only_layers=[0], use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1), "hasten", feature_off=dict(use_sliding_window=False)),
    Entry("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1), "hasten", feature_off=dict(use_sliding_window=False),
          notes="transformers 5.24 gives its window to the mask only"),
    Entry("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW), "hasten",
          feature_off=dict(sliding_window=None)),
    Entry("olmoe", dict(num_experts=4, num_experts_per_tok=2), "hasten"),
    # MoE families whose routers are the models' own (hasten groups the ids they return)
    Entry("glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                           n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                           rope_parameters=PARTIAL_HALF), "hasten", feature_off=dict(routed_scaling_factor=1.0),
          tensor_setup=_random_correction_biases),
    Entry("dots1", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                        n_shared_experts=1, routed_scaling_factor=2.5), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    Entry("solar_open", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                             n_group=2, topk_group=1, routed_scaling_factor=2.5), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    # its experts are intermediate_size wide (it has no moe_intermediate_size); half of each head rotates
    Entry("minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                             rope_parameters=PARTIAL_HALF), "hasten",
          feature_off=dict(rope_parameters=dict(PARTIAL_HALF, partial_rotary_factor=1.0)),
          tensor_setup=_random_correction_biases),
    # windows of 5 on layers 0 and 2 (with rotary), layer 1 full attention without rotary
    Entry("afmoe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1,
                        num_shared_experts=1, route_scale=2.5, sliding_window=WINDOW, layer_types=SLIDING_3,
                        mup_enabled=True, attention_bias=True), "hasten",
          feature_off=dict(sliding_window=512), tensor_setup=_random_routers),
    Entry("ernie4_5_moe", dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_layer_start_index=1,
                               moe_num_shared_experts=1), "hasten"),
    Entry("hunyuan_v1_moe", dict(num_experts=4, moe_topk=2, moe_intermediate_size=16), "hasten"),
    Entry("flex_olmo", dict(num_experts=4, num_experts_per_tok=2), "hasten"),
    # Mellum: windows of 5 on layers 0 and 2, another rotary base on the full layer, a dense first layer
    Entry("mellum", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         sliding_window=WINDOW, layer_types=SLIDING_3, mlp_layer_types=["dense", "sparse", "sparse"],
                         rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=500000.0),
                                              sliding_attention=dict(rope_type="default", rope_theta=10000.0))),
          "hasten", feature_off=dict(layer_types=FULL_3)),
    # Kolibri-1: windows of 5 on layers 0 and 2 (rotary there), the full layer NoPE, pre and post norms,
    # top-k on logits + a correction bias, sigmoid weights, a shared expert
    Entry("kolibri1", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           shared_expert_intermediate_size=32, sliding_window=WINDOW, layer_types=SLIDING_3), "hasten",
          feature_off=dict(sliding_window=4096), tensor_setup=_random_correction_biases),
    # Flint: windows of 5 on layers 0 and 2 (rotary there), the full layer NoPE, random sinks on every
    # layer, a dense first layer, an ungated shared expert
    Entry("flint", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=32, mlp_only_layers=[0], sliding_window=WINDOW,
                        layer_types=SLIDING_3), "hasten", tensor_feature_off=_zero_sinks),
    # ZAYA1: its CCA projection convolves q/k over the last tokens and takes half of each value head from
    # the previous token (state along the sequence, no varlen form in hasten): packed batches refused.
    # Top-1 (the config allows no other) over 4 experts and the skip expert (its weight zeroed, expert 0's
    # id); a window of 5 on the hybrid_sliding layers, half of each head rotating, two rotary bases
    Entry("zaya", dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16, router_hidden_size=32,
                       sliding_window=WINDOW, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                       lm_head_bias=True), "refused", tensor_setup=_zaya_routing),
    # Hy3: sigmoid router with a correction bias and router_scaling_factor, a shared expert, a dense first layer
    Entry("hy_v3", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                        router_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"]), "hasten",
          feature_off=dict(router_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    # windows of 5 with sinks and twice the K/V heads on layers 0 and 2; value heads of 8 (query/key 16)
    # scaled by 0.7; half of each head rotates, another base per layer type; group-limited router
    Entry("mimo_v2_flash", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=2,
                                topk_group=1, routed_scaling_factor=2.5, v_head_dim=8, attention_value_scale=0.7,
                                sliding_window=WINDOW, layer_types=SLIDING_3,
                                mlp_layer_types=["dense", "sparse", "sparse"],
                                rope_parameters=dict(full_attention=dict(PARTIAL_HALF, rope_theta=500000.0),
                                                     sliding_attention=PARTIAL_HALF)), "hasten",
          tensor_feature_off=_zero_sinks, tensor_setup=_random_correction_biases),
    # windows of 5 on layers 0 and 2 (full rotary there), half of each head rotating on the full layer,
    # per-element softplus output gates, 2 query heads on the middle layer, a router softcap
    Entry("laguna", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, moe_routed_scaling_factor=2.5,
                         moe_router_logit_softcapping=1.0, gating="per-element",
                         num_attention_heads_per_layer=[4, 2, 4], sliding_window=WINDOW, layer_types=SLIDING_3,
                         mlp_layer_types=["dense", "sparse", "sparse"],
                         rope_parameters=dict(full_attention=dict(PARTIAL_HALF, rope_theta=500000.0),
                                              sliding_attention=dict(PARTIAL_HALF, partial_rotary_factor=1.0))),
          "hasten", feature_off=dict(layer_types=FULL_3)),
    # windows of 5 on layers 0 and 2 and random sinks on every layer; the middle layer without rotary
    # (base 0), the last with another base; Granite's multipliers, a shared expert
    Entry("granitemoe_swa", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                 shared_intermediate_size=32, embedding_multiplier=3.0, residual_multiplier=0.5,
                                 attention_multiplier=0.3, logits_scaling=4.0, sliding_window=WINDOW,
                                 layer_types=SLIDING_3, layer_rope_theta=[10000.0, 0, 500000.0]), "hasten",
          tensor_feature_off=_zero_sinks),
    Entry("phimoe", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, input_jitter_noise=0.0,
                         router_jitter_noise=0.0, lm_head_bias=True, attention_bias=True), "hasten",
          feature_off=dict(sliding_window=None)),
    # chunks of 5 positions on the first two layers (rotary), the third without rotary and with
    # temperature tuning (inert below floor_scale: test_contract.py refuses the longer rows)
    Entry("llama4_text", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=96,
                              attention_chunk_size=WINDOW, interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0],
                              use_qk_norm=True, attn_temperature_tuning=True), "hasten",
          feature_off=dict(attention_chunk_size=8192)),
    # Qwen's VL wrappers on text-only packed batches, mrope sections of 2/3/3 frequencies, tiny towers
    Entry("qwen2_vl", dict(text_config=dict(rope_parameters=dict(MROPE, mrope_section=[2, 3, 3])),
                           vision_config=dict(depth=1, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2,
                                              patch_size=14)), "hasten"),
    Entry("qwen2_5_vl", dict(text_config=dict(rope_parameters=dict(MROPE, mrope_section=[2, 3, 3])),
                             vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                out_hidden_size=64, patch_size=14, window_size=28,
                                                fullatt_block_indexes=[0])), "hasten"),
    Entry("qwen3_vl", dict(text_config=dict(rope_parameters=dict(MROPE, mrope_section=[2, 3, 3], mrope_interleaved=True)),
                           vision_config=QWEN3_VL_VISION), "hasten"),
    # Mistral 3's wrapper: Mistral's text model with a window of 5, a tiny Pixtral tower (gelu MLP)
    Entry("mistral3", dict(text_config=dict(model_type="mistral", sliding_window=WINDOW),
                           vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                              image_size=32, patch_size=16)), "hasten",
          feature_off=dict(text_config=dict(model_type="mistral", sliding_window=None)),
          notes="Mistral3ForConditionalGeneration; a packed batch with images is refused"),
    # Qwen3-VL-MoE's wrapper on text-only packed batches: mrope sections of 2/3/3 frequencies, a tiny
    # vision tower (never run by text batches), experts on every layer
    Entry("qwen3_vl_moe", dict(text_config=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                decoder_sparse_step=1,
                                                rope_parameters=dict(MROPE, mrope_section=[2, 3, 3],
                                                                     mrope_interleaved=True)),
                               vision_config=QWEN3_VL_VISION), "hasten",
          notes="Qwen3VLMoeForConditionalGeneration; a packed batch with images is refused"),
    # GLM-4.1V / GLM-4.5V wrappers: half of each head rotates (mrope sections of 1/1/2 frequencies
    # over the 4 rotated ones), tiny vision towers (never run by text batches)
    Entry("glm4v", dict(text_config=dict(rope_parameters=dict(PARTIAL_HALF, mrope_section=[1, 1, 2])),
                        vision_config=GLM4V_VISION), "hasten",
          feature_off=dict(text_config=dict(rope_parameters=dict(PARTIAL_HALF, partial_rotary_factor=1.0,
                                                                 mrope_section=[2, 3, 3])))),
    Entry("glm4v_moe", dict(text_config=GLM4V_MOE_TEXT, vision_config=GLM4V_VISION), "hasten",
          feature_off=dict(text_config=dict(GLM4V_MOE_TEXT, routed_scaling_factor=1.0)),
          tensor_setup=_random_correction_biases),
    Entry("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.5,
                             attention_multiplier=0.3, logits_scaling=4.0), "hasten",
          feature_off=dict(logits_scaling=1.0)),
    Entry("granitemoeshared", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                   shared_intermediate_size=32, embedding_multiplier=3.0, residual_multiplier=0.5,
                                   attention_multiplier=0.3, logits_scaling=4.0), "hasten",
          feature_off=dict(logits_scaling=1.0)),
    # the experts' size is intermediate_size; a dense first layer with full attention and forced
    # rotary, a sliding layer (rotary), a full layer without rotary; shared experts averaged in
    Entry("cohere2_moe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=16, num_shared_experts=1,
                              prefix_dense_intermediate_size=96, mlp_layer_types=["dense", "sparse", "sparse"],
                              sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention",
                                                                  "full_attention"],
                              logit_scale=0.5), "hasten", feature_off=dict(logit_scale=1.0)),
    # rotary on the sliding layers only (the full one is NoPE); sigmoid group-limited router
    Entry("exaone_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                             first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                             sliding_window=WINDOW, layer_types=SLIDING_3), "hasten",
          feature_off=dict(sliding_window=4096), tensor_setup=_random_correction_biases),
    Entry("gemma3_text", dict(sliding_window=WINDOW, layer_types=SLIDING_3, query_pre_attn_scalar=24,
                              final_logit_softcapping=2.0), "hasten", feature_off=dict(final_logit_softcapping=None)),
    # the multimodal wrapper, on text-only packed batches: its text model is gemma3_text's
    Entry("gemma3", dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3, query_pre_attn_scalar=24),
                         vision_config=GEMMA3_VISION), "hasten",
          feature_off=dict(text_config=dict(sliding_window=WINDOW, layer_types=FULL_3, query_pre_attn_scalar=24),
                           vision_config=GEMMA3_VISION),
          notes="Gemma3ForConditionalGeneration; a packed batch with images is refused (tests/integrations/"
                "test_contract.py)"),
    Entry("phi3", dict(sliding_window=WINDOW, rope_parameters=PARTIAL_HALF), "hasten",
          feature_off=dict(sliding_window=None)),
    Entry("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                          logits_scaling=4.0), "hasten", feature_off=dict(logits_scaling=1.0)),
    Entry("olmo2", dict(), "hasten"),
    Entry("glm4", dict(rope_parameters=PARTIAL_HALF), "hasten"),
    Entry("cohere", dict(logit_scale=0.5, use_qk_norm=True), "hasten", feature_off=dict(logit_scale=1.0)),
    Entry("starcoder2", dict(sliding_window=WINDOW, use_bias=True, residual_dropout=0.0, embedding_dropout=0.0),
          "hasten", feature_off=dict(sliding_window=None)),
    Entry("smollm3", dict(no_rope_layer_interval=2), "hasten"),
    # older dense decoders (nn.LayerNorm with bias, ungated GELU MLPs): a quarter or half of each head
    # rotates, attention and MLP in parallel, biases on; num_key_value_heads=4: GPT-NeoX has no GQA
    Entry("gpt_neox", dict(rope_parameters=PARTIAL_QUARTER, num_key_value_heads=4, use_parallel_residual=True,
                           attention_bias=True, hidden_act="gelu", hidden_dropout=0.0), "hasten",
          feature_off=dict(rope_parameters=dict(PARTIAL_QUARTER, partial_rotary_factor=1.0))),
    Entry("phi", dict(rope_parameters=PARTIAL_HALF, qk_layernorm=True, hidden_act="gelu_new", resid_pdrop=0.0,
                      embd_pdrop=0.0), "hasten",
          feature_off=dict(rope_parameters=dict(PARTIAL_HALF, partial_rotary_factor=1.0))),
    # StableLM-2-12B's layout: parallel residual, per-head q/k LayerNorms, q/k/v biases, a quarter of each
    # head rotates; its decoder layer hands the attention position_ids only (metadata derived per layer)
    Entry("stablelm", dict(rope_parameters=PARTIAL_QUARTER, use_qkv_bias=True, qk_layernorm=True,
                           use_parallel_residual=True, hidden_dropout=0.0), "hasten",
          feature_off=dict(rope_parameters=dict(PARTIAL_QUARTER, partial_rotary_factor=1.0))),
    Entry("gemma", dict(hidden_act="gelu_pytorch_tanh"), "hasten"),
    # Gemma 4 unified: gemma4_text's case without PLE or MoE, keys as values on the full layer, a double-wide
    # MLP on the KV-shared last layer; use_bidirectional_attention left at its default "vision" (text causal)
    Entry("gemma4_unified_text", dict(sliding_window=WINDOW, layer_types=SLIDING_3, final_logit_softcapping=2.0,
                                      num_kv_shared_layers=1, global_head_dim=32, attention_k_eq_v=True,
                                      use_double_wide_mlp=True), "hasten",
          feature_off=dict(final_logit_softcapping=None)),
    # its wrapper (Gemma4UnifiedForConditionalGeneration) on text-only packed batches, a tiny encoder-free
    # vision embedder (never run by text batches); its head applies the text config's final softcap
    Entry("gemma4_unified", dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3,
                                                  final_logit_softcapping=2.0, num_kv_shared_layers=1,
                                                  global_head_dim=32),
                                 vision_config=dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=64,
                                                    mm_posemb_size=16, output_proj_dims=64)), "hasten",
          feature_off=dict(text_config=dict(sliding_window=512, layer_types=SLIDING_3, final_logit_softcapping=2.0,
                                            num_kv_shared_layers=1, global_head_dim=32),
                           vision_config=dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=16,
                                              output_proj_dims=64)),
          notes="Gemma4UnifiedForConditionalGeneration; a packed batch with media is refused. Off: windows past the "
                "samples (the softcap alone moves this draw's gradients by 0.9%)"),
    # JetMoE: 4 experts, 2 per token, in the MoA (query heads: 2 experts x 2 heads of 16) and the MLP; random
    # output biases on both. Off: one expert per token (2 query heads)
    Entry("jetmoe", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16), "hasten",
          feature_off=dict(num_experts_per_tok=1)),
    # DBRX: q/k/v clamped at 0.3 (well inside their spread), 2 K/V heads, 2 of 4 experts renormalised; d_model
    # given itself (the config mirrors it into ffn_config before hidden_size is mapped); its attention reads
    # attn_config.rope_theta, which published configs carry and the config class does not default. Off: a
    # clamp at 1e4 (transformers 5.24's DBRX attention fails on clip_qkv=None: torch.clamp of two Nones)
    Entry("dbrx", dict(d_model=64, attn_config=dict(kv_n_heads=2, clip_qkv=0.3, rope_theta=10000.0),
                       ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)), "hasten",
          feature_off=dict(attn_config=dict(kv_n_heads=2, clip_qkv=1e4, rope_theta=10000.0))),
    # EXAONE 3.x and IQuest-Coder: LlamaForCausalLM under their own model types, biases on q/k/v/o (the
    # bias the feature that shows)
    Entry("exaone", dict(attention_bias=True), "hasten", tensor_feature_off=_zero_biases,
          notes="LlamaForCausalLM's classes under model_type exaone"),
    Entry("iquestcoder", dict(attention_bias=True, mlp_bias=True), "hasten", tensor_feature_off=_zero_biases,
          notes="LlamaForCausalLM's classes under model_type iquestcoder"),
    # Sarvam-30B: glm4_moe's case with full rotary, q/k norms and qkv biases
    Entry("sarvam_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, attention_bias=True), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases,
          notes="Glm4MoeForCausalLM's classes under model_type sarvam_moe"),
    # Param2: sarvam_moe's case under its own model type (transformers 5.25), partial rotary to show it
    Entry("param2moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1,
                            routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                            partial_rotary_factor=0.5), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases,
          notes="Glm4MoeForCausalLM's classes under model_type param2moe"),
    # MiniCPM 5 MoE (transformers 5.25): gated attention, float32 router with groups and a correction bias,
    # a shared expert, a dense first layer
    Entry("minicpm5_moe", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                               mlp_layer_types=["dense", "sparse", "sparse"], n_shared_experts=1, n_group=2,
                               topk_group=1, routed_scaling_factor=2.5), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    # Sarvam-105B: deepseek_v3's case with a plain query projection (q_lora_rank None, as published)
    Entry("sarvam_mla", dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                             v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                             moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5, rope_interleave=True, num_key_value_heads=4, head_dim=8),
          "hasten", feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases,
          notes="DeepseekV3ForCausalLM's classes under model_type sarvam_mla"),
    # BitNet: sub-norms on the attention output and the gated product, ReLU² gate (the MLP the model's own),
    # q/k/v/o biases; unquantised nn.Linear projections (from_config: no quantization config)
    Entry("bitnet", dict(hidden_act="relu2", attention_bias=True), "hasten", feature_off=dict(hidden_act="silu")),
    # Kimi Linear: two Kimi delta attention layers (2 heads of 64, slow per-channel decay) around an MLA
    # layer without rotary (q/k heads of 16 + 8, value heads of 8, a low-rank query, projection biases);
    # a dense first layer, then the sigmoid group-limited router, a shared expert
    # (heads of 64, not 16: at 16, fla 0.6.0's TileLang backward of the varlen KDA chunk failed to
    # compile on the H200, 'Get different layout for s_dv_pre', at 5a4a550; the model has 128)
    Entry("kimi_linear", dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                              linear_conv_kernel_dim=4, linear_head_dim=64, linear_num_heads=2, kv_lora_rank=16,
                              q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                              num_key_value_heads=4, head_dim=8, attention_bias=True, num_local_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1, n_group=2,
                              topk_group=1, routed_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"]),
          "hasten", feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_kimi_linear_setup),
    # LLaVA-style wrappers on text-only packed batches (their tiny towers never run): the text model's
    # features on (projection biases; windows of 5 on Mistral, Qwen2, Qwen3 text)
    Entry("llava", dict(text_config=dict(attention_bias=True),
                        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=2, image_size=32,
                                           patch_size=16)), "hasten",
          notes="LlavaForConditionalGeneration (Llama text); a packed batch with images is refused"),
    Entry("llava_next", dict(text_config=dict(model_type="mistral", sliding_window=WINDOW),
                             vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, image_size=32,
                                                patch_size=16), image_grid_pinpoints=[[32, 32]]), "hasten",
          feature_off=dict(text_config=dict(model_type="mistral", sliding_window=None)),
          notes="LlavaNextForConditionalGeneration (Mistral text, as llava-v1.6-mistral); images refused packed"),
    Entry("llava_onevision", dict(text_config=dict(use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1),
                                  vision_config=dict(GEMMA3_VISION, model_type="siglip_vision_model"),
                                  image_grid_pinpoints=[[32, 32]]), "hasten",
          feature_off=dict(text_config=dict(use_sliding_window=False)),
          notes="LlavaOnevisionForConditionalGeneration (Qwen2 text); images and videos refused packed"),
    Entry("internvl", dict(text_config=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                           vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=[32, 32], patch_size=[16, 16])),
          "hasten", feature_off=dict(text_config=dict(use_sliding_window=False)),
          notes="InternVLForConditionalGeneration (Qwen2 text, as InternVL3); images refused packed"),
    Entry("idefics3", dict(text_config=dict(attention_bias=True),
                           vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=16)), "hasten",
          notes="Idefics3ForConditionalGeneration (Llama text; config.use_cache on, its default); images refused "
                "packed"),
    Entry("smolvlm", dict(text_config=dict(attention_bias=True),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=16)), "hasten",
          notes="SmolVLMForConditionalGeneration (Llama text); images refused packed"),
    Entry("lighton_ocr", dict(text_config=dict(model_type="qwen3", use_sliding_window=True, sliding_window=WINDOW,
                                               max_window_layers=1),
                              vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                                                 image_size=32, patch_size=16)), "hasten",
          feature_off=dict(text_config=dict(model_type="qwen3", use_sliding_window=False)),
          notes="LightOnOcrForConditionalGeneration (Qwen3 text); images refused packed"),
    # helper-i anchor
    # GPT-2-era decoders: dropouts off (their configs default them on), ungated MLPs, all heads K/V heads
    # (num_key_value_heads=4: none has GQA; GPTBigCode's multi_query gives one K/V head). GPT-2: the query
    # scale divided by layer_idx + 1 on; its learned positions restart per packed sample
    Entry("gpt2", dict(n_inner=96, num_key_value_heads=4, activation_function="gelu_new", resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0, scale_attn_by_inverse_layer_idx=True,
                       reorder_and_upcast_attn=True), "hasten",
          feature_off=dict(scale_attn_by_inverse_layer_idx=False)),
    # GPTBigCode: multi-query attention (one K/V head for 4 query heads); off: the query scale
    # (multi_query off changes c_attn's shape)
    Entry("gpt_bigcode", dict(n_inner=96, num_key_value_heads=4, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                              attn_pdrop=0.0), "hasten", feature_off=dict(scale_attn_weights=False)),
    # GPT-J and CodeGen: half of each head rotates (rotary_dim 8 of 16), interleaved pairs; off: all of it
    Entry("gptj", dict(n_inner=96, num_key_value_heads=4, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0), "hasten", feature_off=dict(rotary_dim=16)),
    Entry("codegen", dict(n_inner=96, num_key_value_heads=4, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0), "hasten", feature_off=dict(rotary_dim=16)),
    # OPT: learned positions (offset 2) from position_ids, biases, project_in/out (word_embed_proj_dim 32);
    # off: the position embeddings zeroed (positions counted along the packed row would show)
    Entry("opt", dict(ffn_dim=96, num_key_value_heads=4, word_embed_proj_dim=32, dropout=0.0, layerdrop=0.0),
          "hasten", tensor_setup=_frozen_key_biases,
          tensor_feature_off=lambda model: model.model.decoder.embed_positions.weight.data.zero_()),
    # BioGPT: learned positions (offset 2), the embedding scale sqrt(hidden); off: no embedding scale
    Entry("biogpt", dict(num_key_value_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         activation_dropout=0.0, layerdrop=0.0, scale_embedding=True), "hasten", tensor_setup=_frozen_key_biases,
          feature_off=dict(scale_embedding=False)),
    # Gemma 3n text: windows shorter than the samples, a small final softcap, the Gaussian top-k sparsity on
    # the first layer's MLP, the last (sliding) layer reusing the first layer's K/V, AltUp with 4 streams,
    # Laurel and per-layer inputs (1-D parameters moved off zero: AltUp's output scale feeds the per-layer path)
    Entry("gemma3n_text", dict(sliding_window=WINDOW, layer_types=SLIDING_3, final_logit_softcapping=2.0,
                               num_kv_shared_layers=1, activation_sparsity_pattern=[0.95, 0.0, 0.0],
                               vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8,
                               altup_num_inputs=4), "hasten",
          feature_off=dict(activation_sparsity_pattern=[0.0, 0.0, 0.0]),
          notes="Gemma3nForCausalLM; the config refuses final_logit_softcapping=None (off: the sparsity)"),
    # helper-j anchor
    # Apertus 1.5 text: apertus's case (llama3 scaling from 8 positions, q/k norms, xIELU) with an input
    # vocabulary of 260 and the LM head pruned to the first 211 ids (the samples' ids lie below)
    Entry("apertus1p5_text", dict(vocab_size=260, output_vocab_size=VOCAB,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0,
                                                       original_max_position_embeddings=8, low_freq_factor=1.0,
                                                       high_freq_factor=4.0)), "hasten",
          feature_off=dict(rope_parameters=dict(rope_type="default", rope_theta=12000000.0)),
          notes="the pruned head cannot be switched off at the same gradient shapes; the llama3 scaling is"),
    # Cohere Compass text: windows of 5 on layers 0 and 2 with mrope (sections 2/3/3), the full layer
    # NoPE (its rope_parameters None), logit scale 0.5
    Entry("cohere_compass_text", dict(sliding_window=WINDOW, layer_types=SLIDING_3, logit_scale=0.5,
                                      rope_parameters=dict(sliding_attention=dict(MROPE, mrope_section=[2, 3, 3]),
                                                           full_attention=None)), "hasten",
          feature_off=dict(sliding_window=4096)),
    # Aria text: 4 experts of 16 (stored transposed), top-2 renormalised over the chosen logits, two shared
    # experts (a SwiGLU MLP of 32), projection biases
    Entry("aria_text", dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=2, intermediate_size=16,
                            attention_bias=True), "hasten", feature_off=dict(moe_topk=1)),
    # Inkling / Inkling2 text: short causal convolutions on k, v and both residual branches of every layer
    # (state along the sequence; no varlen form in hasten) and a relative position bias from the hidden
    # states (position_bias, a score term hasten's attention does not compute), with positions counted
    # along the row: packed batches refused. Windows of 5 on layers 0 and 2 (hybrid_sliding)
    Entry("inkling_text", dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                               sliding_window_size=WINDOW, d_rel=4, rel_extent=8,
                               layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
                               mlp_layer_types=["dense", "sparse", "sparse"], moe_intermediate_size=16,
                               n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, conv_kernel_size=3,
                               sconv_kernel_size=3), "refused"),
    Entry("inkling2_text", dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                                sliding_window_size=WINDOW, d_rel=4, rel_extent=8, unpadded_vocab_size=VOCAB,
                                layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], moe_intermediate_size=16,
                                n_routed_experts=4, num_experts_per_tok=2, conv_kernel_size=3,
                                n_layers_per_attn_res_block=2, log_scaling_n_floor=8), "refused"),
    # Aya Vision and Command A Vision (Cohere 2 text): Cohere 2's case (windows of 5 on the sliding layers,
    # NoPE on the full one) with logit_scale 0.5 in the text config, which the wrappers' heads do not apply
    # (their forward is lm_head alone): a loss that applied it would fail the parity
    Entry("aya_vision", dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3, logit_scale=0.5),
                             vision_config=dict(GEMMA3_VISION, model_type="siglip_vision_model")), "hasten",
          feature_off=dict(text_config=dict(sliding_window=WINDOW, layer_types=FULL_3, logit_scale=0.5),
                           vision_config=dict(GEMMA3_VISION, model_type="siglip_vision_model")),
          notes="AyaVisionForConditionalGeneration; a packed batch with images is refused"),
    Entry("cohere2_vision", dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3, logit_scale=0.5),
                                 vision_config=dict(GEMMA3_VISION, model_type="siglip_vision_model"),
                                 alignment_intermediate_size=64), "hasten",
          feature_off=dict(text_config=dict(sliding_window=WINDOW, layer_types=FULL_3, logit_scale=0.5),
                           vision_config=dict(GEMMA3_VISION, model_type="siglip_vision_model"),
                           alignment_intermediate_size=64),
          notes="Cohere2VisionForConditionalGeneration; a packed batch with images is refused"),
    # Kimi K2.5: deepseek_v3's case as its text model, a tiny MoonViT tower (never run by text batches)
    Entry("kimi_k25", dict(text_config=dict(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=24,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4,
                                            n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                            first_k_dense_replace=1, n_group=2, topk_group=1,
                                            routed_scaling_factor=2.5, rope_interleave=True, num_key_value_heads=4,
                                            head_dim=8),
                           vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, patch_size=14, pos_emb_height=4,
                                              pos_emb_width=4),
                           projection_hidden_size=32), "hasten",
          feature_off=dict(text_config=dict(model_type="deepseek_v3", kv_lora_rank=16, q_lora_rank=24,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4,
                                            n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                            first_k_dense_replace=1, n_group=2, topk_group=1,
                                            routed_scaling_factor=1.0, rope_interleave=True, num_key_value_heads=4,
                                            head_dim=8)),
          tensor_setup=_random_correction_biases,
          notes="Kimi_K25ForConditionalGeneration; a packed batch with images or videos is refused"),
    # LLaVA-OneVision-1.5 (transformers 5.25): a Qwen3 text model with windows on the layers layer_types
    # marks, a tiny vision tower (text-only batches never run it)
    Entry("llava_onevision1_5", dict(text_config=dict(model_type="qwen3", sliding_window=WINDOW, layer_types=SLIDING_3,
                                                      use_sliding_window=True),
                                     vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                        out_hidden_size=64, patch_size=14)), "hasten",
          feature_off=dict(text_config=dict(model_type="qwen3", sliding_window=WINDOW, layer_types=FULL_3,
                                            use_sliding_window=True)),
          notes="LlavaOnevision15ForConditionalGeneration; a packed batch with images or videos is refused"),
    # Ovis2.5 (transformers 5.25): the same Qwen3 text case, a tiny vision tower
    Entry("ovis2_5", dict(text_config=dict(model_type="qwen3", sliding_window=WINDOW, layer_types=SLIDING_3,
                                           use_sliding_window=True),
                          vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, vocab_size=32, image_size=64)), "hasten",
          feature_off=dict(text_config=dict(model_type="qwen3", sliding_window=WINDOW, layer_types=FULL_3,
                                            use_sliding_window=True)),
          notes="Ovis2_5ForConditionalGeneration; a packed batch with images or videos is refused"),
    # EXAONE 4.5: exaone4's case (windows of 5, NoPE on the full layer), a tiny windowed vision tower
    Entry("exaone4_5", dict(text_config=dict(model_type="exaone4", sliding_window=WINDOW, layer_types=SLIDING_3),
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                               num_key_value_heads=2, out_hidden_size=64, patch_size=14,
                                               fullatt_block_indexes=[0])), "hasten",
          feature_off=dict(text_config=dict(model_type="exaone4", sliding_window=WINDOW, layer_types=FULL_3)),
          notes="Exaone4_5_ForConditionalGeneration; a packed batch with images or videos is refused"),
    # GLM-4.6V: glm4v's case (GLM-4.1V's text model, mrope on half of each head)
    Entry("glm46v", dict(text_config=dict(rope_parameters=dict(PARTIAL_HALF, mrope_section=[1, 1, 2])),
                         vision_config=GLM4V_VISION), "hasten",
          feature_off=dict(text_config=dict(rope_parameters=dict(PARTIAL_HALF, partial_rotary_factor=1.0,
                                                                 mrope_section=[2, 3, 3]))),
          notes="Glm46VForConditionalGeneration; a packed batch with images or videos is refused"),
    # LFM2-VL: lfm2's case (short convolutions of width 3 around an attention layer), a tiny SigLIP 2 tower
    Entry("lfm2_vl", dict(text_config=dict(model_type="lfm2", layer_types=["conv", "full_attention", "conv"],
                                           norm_eps=1e-5, conv_L_cache=3),
                          vision_config=dict(model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_patches=16,
                                             patch_size=16),
                          projector_hidden_size=64), "hasten",
          feature_off=dict(text_config=dict(model_type="lfm2", layer_types=["conv", "full_attention", "conv"],
                                            norm_eps=1e-5, conv_L_cache=1)),
          notes="Lfm2VlForConditionalGeneration; a packed batch with images is refused"),
    # helper-k anchor
    # LongCat-Flash: 2 decoder layers (4 MLA sublayers: q/k heads of 16 + 8, value heads of 8), 4 SwiGLU
    # experts and 2 zero-computation (identity) experts, 2 per token, softmax router with a correction bias
    # and routed scaling 2.5; head_dim is the rotary width (qk_rope_head_dim), as deepseek_v3's case
    Entry("longcat_flash", dict(num_hidden_layers=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                qk_nope_head_dim=16, v_head_dim=8, num_key_value_heads=4, head_dim=8,
                                n_routed_experts=4, zero_expert_num=2, moe_topk=2, expert_ffn_hidden_size=16,
                                routed_scaling_factor=2.5), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    # DiffLlama: two attention calls per layer, the learned lambda (its 1-D factors moved by build()). Off: the
    # first lambda factor zeroed (lambda_1 = exp(0) = 1)
    Entry("diffllama", dict(), "hasten",
          tensor_feature_off=lambda model: [m.lambda_q1.data.zero_() for m in model.modules()
                                            if isinstance(getattr(m, "lambda_q1", None), torch.Tensor)]),
    # HunYuanOCR's wrapper on text-only packed batches: q/k norms after the rotary, xdrope over 4 axes
    # (2 frequencies each), the NTK-alpha base (off: alpha 1, the plain base), q/k/v/o biases, a tiny tower
    Entry("hunyuan_vl", dict(text_config=dict(attention_bias=True,
                                              rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, alpha=10.0,
                                                                   factor=1.0, mrope_section=[2, 2, 2, 2])),
                             vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, out_hidden_size=64, text_hidden_size=64,
                                                patch_size=16)), "hasten",
          feature_off=dict(text_config=dict(attention_bias=True,
                                            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                 mrope_section=[2, 2, 2, 2]))),
          notes="HunYuanVLForConditionalGeneration; a packed batch with images is refused"),
    # Granite 4 Vision's wrapper: granite's multipliers and logits_scaling 4 in the text config (off: 1), a
    # tiny CLIP tower with one deepstack and four spatial Q-Former projectors (never run by text batches)
    Entry("granite4_vision", dict(text_config=dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                   attention_multiplier=0.3, logits_scaling=4.0, attention_bias=True),
                                  vision_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=2, image_size=32, patch_size=8),
                                  qformer_config=dict(intermediate_size=64), deepstack_layer_map=[[0, 1]],
                                  downsample_rate="1/2", spatial_target_layers=[0, 1, 2, 2]), "hasten",
          feature_off=dict(text_config=dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                            attention_multiplier=0.3, logits_scaling=1.0, attention_bias=True)),
          notes="Granite4VisionForConditionalGeneration; a packed batch with images is refused"),
    # Step 3.7's wrapper: windows of 5 on layers 0 and 2 with 2 heads (4 on the full layer), half of each
    # sliding head rotating at base 10000, the full layer's whole head at 500, query scale 1/sqrt(24), a
    # dense first layer, 4 experts (2 per token) with routed scaling 2.5 and a shared expert. Off: windows of 512
    Entry("step3p7", dict(text_config=dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           share_expert_dim=32, sliding_window=WINDOW, layer_types=SLIDING_3,
                                           mlp_layer_types=["dense", "sparse", "sparse"],
                                           num_sliding_attention_heads=2, query_pre_attn_scalar=24,
                                           moe_router_scaling_factor=2.5, rope_theta=[10000.0, 500.0, 10000.0],
                                           partial_rotary_factors=[0.5, 1.0, 0.5]),
                          vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14, mlp_ratio=2.0)),
          "hasten",
          feature_off=dict(text_config=dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            share_expert_dim=32, sliding_window=512, layer_types=SLIDING_3,
                                            mlp_layer_types=["dense", "sparse", "sparse"],
                                            num_sliding_attention_heads=2, query_pre_attn_scalar=24,
                                            moe_router_scaling_factor=2.5, rope_theta=[10000.0, 500.0, 10000.0],
                                            partial_rotary_factors=[0.5, 1.0, 0.5])),
          tensor_setup=_random_correction_biases,
          notes="Step3p7ForConditionalGeneration; a packed batch with images is refused"),
    # ERNIE 4.5 VL MoE's wrapper: 3-D rotary sections of 2/2/4 frequencies, biases on, a dense first layer,
    # 4 text experts (2 per token, size 16) beside 4 vision experts (size 8), a shared expert, random
    # correction biases (a 2-D parameter the build leaves at zero). Off: the projection biases zeroed
    Entry("ernie4_5_vl_moe", dict(text_config=dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=[16, 8],
                                                   moe_num_shared_experts=1, use_bias=True,
                                                   mlp_layer_types=["dense", "sparse", "sparse"],
                                                   rope_parameters=dict(MROPE, mrope_section=[2, 2, 4])),
                                  vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                     patch_size=14)), "hasten",
          tensor_setup=lambda model: [m.e_score_correction_bias.data.copy_(
              0.1 * torch.randn(m.e_score_correction_bias.shape, generator=torch.Generator().manual_seed(3)))
              for m in model.modules() if type(m).__name__.endswith("MoeStatics")],
          tensor_feature_off=_zero_biases,
          notes="Ernie4_5_VLMoeForConditionalGeneration; a packed batch with images or videos is refused"),
    # Mistral 4: MLA as deepseek_v3's case (q/k heads of 8 + 8: the rotated half, value heads of 8, interleaved) with
    # yarn from 8 positions (mscale^2 in the query scale), Llama 4's query scale stepping every 8 positions
    # at the published beta 0.1 (off: beta 0), a dense first layer, 4 experts (2 per token) in 2 groups, a
    # shared expert, routed scaling 2.5
    *[Entry("mistral4", dict(mla, rope_parameters=dict(rope, llama_4_scaling_beta=0.1)), "hasten",
            feature_off=dict(mla, rope_parameters=dict(rope, llama_4_scaling_beta=0.0)))
      for mla, rope in [(dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                              n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                              first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                              rope_interleave=True, num_key_value_heads=4),
                         dict(rope_type="yarn", rope_theta=10000.0, factor=64.0, original_max_position_embeddings=8,
                              beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0))]],
    # helper-l anchor
    Entry("olmo3", dict(sliding_window=WINDOW, layer_types=SLIDING_3), "hasten",
          feature_off=dict(layer_types=FULL_3)),
    Entry("cohere2", dict(sliding_window=WINDOW, layer_types=SLIDING_3, logit_scale=0.5), "hasten",
          feature_off=dict(logit_scale=1.0)),
    Entry("ministral", dict(sliding_window=WINDOW, layer_types=SLIDING_3), "hasten",
          feature_off=dict(layer_types=FULL_3)),
    Entry("exaone4", dict(sliding_window=WINDOW, layer_types=SLIDING_3), "hasten",
          feature_off=dict(layer_types=FULL_3)),
    Entry("hunyuan_v1_dense", dict(), "hasten"),
    Entry("helium", dict(), "hasten"),
    # Jais-2: nn.LayerNorm with bias, the ungated ReLU² MLP, biases on q/k/v/o and the MLP
    Entry("jais2", dict(hidden_act="relu2", attention_bias=True, mlp_bias=True), "hasten",
          feature_off=dict(hidden_act="relu")),
    # NanoChat: weightless RMSNorms, the flipped-sign rotary (the model's own), ReLU², a final softcap of 2
    Entry("nanochat", dict(hidden_act="relu2", final_logit_softcapping=2.0, attention_bias=True), "hasten",
          feature_off=dict(final_logit_softcapping=None)),
    # HRM-Text: stacks of 3 layers, 2 H cycles of 3 L cycles (24 layer passes), the last L cycle of the first
    # H cycle and the last 2 of the second with gradients, the rest under no_grad; embedding scale 1 / 0.08
    Entry("hrm_text", dict(H_cycles=2, L_cycles=3, L_bp_cycles=[2]), "hasten", feature_off=dict(H_cycles=1)),
    # yarn rotary from 8 positions, Llama 4's query scale stepping every 8 positions at the published
    # beta 0.1 (off: gradients move by 0.16), a window of 5 on every layer
    Entry("ministral3", dict(sliding_window=WINDOW,
                             rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=64.0,
                                                  original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                                                  mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)),
          "hasten", feature_off=dict(rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=64.0,
                                                          original_max_position_embeddings=8, beta_fast=32.0,
                                                          beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
                                                          llama_4_scaling_beta=0.0))),
    # windows of 5 on layers 0 and 2, the full layer without rotary, two rotary bases; random sinks
    Entry("granite_swa", dict(sliding_window=WINDOW, layer_types=SLIDING_3, layer_rope_theta=[10000.0, 0, 500.0],
                              embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3,
                              logits_scaling=4.0), "hasten", tensor_feature_off=_zero_sinks),
    Entry("hyperclovax", dict(use_post_norm=True, embedding_multiplier=3.0, residual_multiplier=0.5,
                              attention_multiplier=0.3, logits_scaling=0.25), "hasten",
          feature_off=dict(logits_scaling=1.0)),
    # multi-head latent attention as deepseek_v3's case, dense SwiGLU MLPs
    Entry("youtu", dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                        rope_interleave=True, num_key_value_heads=4, head_dim=8), "hasten",
          feature_off=dict(rope_interleave=False)),
    # global_head_dim 32: the published 512 is past every packed kernel's 256 (per-sequence attention on the GPU);
    # the per-layer inputs at the tiny vocabulary (GEMMA4_PLE; the default table is 262,144 x 768)
    Entry("gemma4_text", dict(sliding_window=WINDOW, layer_types=SLIDING_3, final_logit_softcapping=2.0,
                              num_kv_shared_layers=1, global_head_dim=32, **GEMMA4_PLE), "hasten",
          feature_off=dict(final_logit_softcapping=None)),
    # Gemma 4's wrapper (Gemma4ForConditionalGeneration) on text-only packed batches: gemma4_text's case
    # inside; its head applies the text config's final softcap, as Gemma4ForCausalLM's does
    Entry("gemma4", dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3, final_logit_softcapping=2.0,
                                          num_kv_shared_layers=1, global_head_dim=32, **GEMMA4_PLE),
                         vision_config=GEMMA4_VISION), "hasten",
          feature_off=dict(text_config=dict(sliding_window=WINDOW, layer_types=SLIDING_3, final_logit_softcapping=None,
                                            num_kv_shared_layers=1, global_head_dim=32, **GEMMA4_PLE),
                           vision_config=GEMMA4_VISION),
          notes="Gemma4ForConditionalGeneration; a packed batch with images is refused"),
    Entry("seed_oss", dict(attention_bias=True, residual_dropout=0.0), "hasten"),
    # qkv_bias and bias together (the config refuses them apart): q/k/v/o and the MLP with biases
    Entry("internlm3", dict(attention_bias=True, mlp_bias=True), "hasten", tensor_feature_off=_zero_biases,
          notes="LlamaForCausalLM's classes under model_type internlm3"),
    # the published llama3 rotary scaling, its original length below the tiny max_position_embeddings
    Entry("cwm", dict(sliding_window=WINDOW, layer_types=SLIDING_3, mlp_bias=True,
                      rope_parameters=dict(rope_type="llama3", rope_theta=1_000_000.0, factor=16.0,
                                           high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=256)), "hasten",
          feature_off=dict(layer_types=FULL_3)),
    Entry("vaultgemma", dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0, sliding_window=WINDOW,
                             layer_types=SLIDING_3, query_pre_attn_scalar=24), "hasten",
          feature_off=dict(attn_logit_softcapping=None), attn_implementation="eager",
          notes="the reference runs eager (VaultGemma declares no sdpa support: sdpa would drop the softcap)"),
    Entry("ernie4_5", dict(use_bias=True), "hasten"),
    Entry("glm", dict(rope_parameters=PARTIAL_HALF), "hasten"),
    Entry("gemma2", dict(attn_logit_softcapping=1.0, final_logit_softcapping=2.0, sliding_window=WINDOW,
                         query_pre_attn_scalar=24), "hasten", feature_off=dict(attn_logit_softcapping=None),
          attn_implementation="eager", notes="the reference runs eager: transformers 5.17 picks sdpa for it, which "
          "drops the softcap"),
    # swiglu_limit 0.8 (the model's 7.0): about a fifth of the test's gate and up values clamp, so the
    # fused clamped gate's bounds show
    Entry("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, swiglu_limit=0.8,
                          layer_types=SLIDING_3, rope_parameters=dict(rope_type="default", rope_theta=10000.0)), "hasten",
          tensor_feature_off=_zero_sinks),
    # multi-head latent attention: q/k heads of 16 + 8 (without and with rotary), value heads of 8
    Entry("deepseek_v3", dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                              moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
                              routed_scaling_factor=2.5, rope_interleave=True, num_key_value_heads=4, head_dim=8),
          "hasten", feature_off=dict(routed_scaling_factor=1.0),
          tensor_setup=_random_correction_biases),
    Entry("glm4_moe_lite", dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                                first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                rope_interleave=True, num_key_value_heads=4, head_dim=8), "hasten",
          feature_off=dict(routed_scaling_factor=1.0),
          tensor_setup=_random_correction_biases),
    Entry("deepseek_v2", dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=8, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
                              moe_intermediate_size=16, first_k_dense_replace=1, n_group=2, topk_group=1,
                              topk_method="group_limited_greedy", routed_scaling_factor=2.5, num_key_value_heads=4,
                              head_dim=8), "hasten", feature_off=dict(routed_scaling_factor=1.0)),
    # DeepSeek sparse attention (DSA): an indexer keeps each query's index_topk keys. hasten merges the
    # selection into its packed mask as the model does under eager/sdpa, and packs rows only while no
    # sample is longer than index_topk (512 here: every key kept, in the row and alone); tests/integrations/test_contract.py holds the merge itself at index_topk 4 on padded batches
    Entry("deepseek_v32", dict(_DSA_SHAPE, first_k_dense_replace=1, n_group=2, topk_group=1), "transformers",
          feature_off=dict(routed_scaling_factor=1.0)),
    Entry("glm_moe_dsa", dict(_DSA_SHAPE, first_k_dense_replace=1, n_group=2, topk_group=1), "transformers",
          feature_off=dict(routed_scaling_factor=1.0)),
    Entry("axk2", dict(_DSA_SHAPE, mlp_layer_types=["dense", "sparse", "sparse"], gated_norm_rank=4), "transformers"),
    Entry("hy_v4", dict(_DSA_SHAPE), "transformers"),
    # dots3's text model: a heterogeneous config (transformers 5.24+: head sizes per layer, the global
    # read raises), DSA on its 'indexed_attention' layers, a window on the last
    Entry("dots3_note_text", dict(_DSA_SHAPE, first_k_dense_replace=1, sliding_window=WINDOW), "transformers"),
    # MiniCPM3: MLA as deepseek_v2's case (q/k heads of 16 + 8, value heads of 8) with a low-rank query
    # and projection biases, scale_emb 3, residual branches scaled by 1.4 / sqrt(3), the final hidden
    # states divided by logits_scaling = 64 / 16 = 4
    Entry("minicpm3", dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                           num_key_value_heads=4, attention_bias=True, scale_emb=3.0, scale_depth=1.4,
                           dim_model_base=16), "hasten", feature_off=dict(dim_model_base=None)),
    # A.X-K1: deepseek_v3's case (MLA, sigmoid group-limited router, a shared expert, a dense first layer)
    # with the RMSNorm on the MoE block's output
    Entry("axk1", dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                       n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                       mlp_layer_types=["dense", "sparse", "sparse"], n_group=2, topk_group=1,
                       routed_scaling_factor=2.5, rope_interleave=True, num_key_value_heads=4, head_dim=8), "hasten",
          feature_off=dict(routed_scaling_factor=1.0), tensor_setup=_random_correction_biases),
    # ungated MLPs (one up_proj, the activation the model's own), biases on where the config has them
    Entry("arcee", dict(hidden_act="relu2", mlp_bias=True, attention_bias=True), "hasten",
          feature_off=dict(hidden_act="relu")),
    # llama3 rotary scaling from 8 positions (shorter than the long samples), q/k norms, xIELU
    Entry("apertus", dict(rope_parameters=dict(rope_type="llama3", rope_theta=12000000.0, factor=8.0,
                                               original_max_position_embeddings=8, low_freq_factor=1.0,
                                               high_freq_factor=4.0)), "hasten",
          feature_off=dict(rope_parameters=dict(rope_type="default", rope_theta=12000000.0))),
    Entry("nemotron", dict(rope_parameters=PARTIAL_HALF, hidden_act="relu2", mlp_bias=True, attention_bias=True,
                           norm_eps=1e-5), "hasten",
          feature_off=dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0))),
    # q, k and v clamped at 0.3, well inside their spread at this initializer_range
    Entry("olmo", dict(clip_qkv=0.3, attention_bias=True), "hasten", feature_off=dict(clip_qkv=None)),
    # hybrids (issue 19): Gated DeltaNet or short-convolution layers between attention layers, each
    # packed sample from a zero state (hasten.stateful); the convolution's width is the feature that
    # carries a sample's tokens into the next sample's first ones
    Entry("qwen3_next", dict(GATED_DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                             shared_expert_intermediate_size=32, rope_parameters=PARTIAL_QUARTER), "hasten",
          feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_slow_decay),
    Entry("qwen3_5_text", dict(GATED_DELTANET, rope_parameters=dict(PARTIAL_QUARTER, mrope_section=[1, 1, 0])),
          "hasten", feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_slow_decay),
    Entry("qwen3_5_moe_text", dict(GATED_DELTANET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   shared_expert_intermediate_size=32,
                                   rope_parameters=dict(PARTIAL_QUARTER, mrope_section=[1, 1, 0])),
          "hasten", feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_slow_decay),
    # Qwen3.5's wrappers (published checkpoints) on text-only packed batches
    Entry("qwen3_5", dict(text_config=dict(GATED_DELTANET, rope_parameters=dict(PARTIAL_QUARTER,
                                                                              mrope_section=[1, 1, 0])),
                          vision_config=QWEN3_5_VISION), "hasten",
          feature_off=dict(text_config=dict(GATED_DELTANET, linear_conv_kernel_dim=1)), tensor_setup=_slow_decay),
    Entry("qwen3_5_moe", dict(text_config=dict(GATED_DELTANET, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                               rope_parameters=dict(PARTIAL_QUARTER, mrope_section=[1, 1, 0])),
                              vision_config=QWEN3_5_VISION), "hasten",
          feature_off=dict(text_config=dict(GATED_DELTANET, linear_conv_kernel_dim=1, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=32)), tensor_setup=_slow_decay),
    Entry("olmo_hybrid", dict(GATED_DELTANET, num_key_value_heads=4), "hasten",
          feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_slow_decay),
    Entry("lfm2", dict(layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5, conv_L_cache=3), "hasten",
          feature_off=dict(conv_L_cache=1)),
    # LFM2-MoE: LFM2's short convolutions and attention, a dense first layer (w1, w3, w2), then
    # sigmoid-routed experts with an expert bias, normalised top-k and a routed scaling of 2.5
    Entry("lfm2_moe", dict(layer_types=["conv", "full_attention", "conv"], norm_eps=1e-5, conv_L_cache=3,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1,
                           use_expert_bias=True, routed_scaling_factor=2.5), "hasten",
          feature_off=dict(conv_L_cache=1), tensor_setup=_random_expert_biases),
    # LFM3: LFM2's short convolutions, a window of 5 on the sliding layer (default rotary), a full layer
    # with 'proportional' rotary (half of each head's frequencies zero), sandwich norms, attention
    # biases and the per-head sigmoid output gate
    Entry("lfm3", dict(layer_types=["sliding_attention", "conv", "full_attention"], norm_eps=1e-5, conv_L_cache=3,
                       sliding_window=WINDOW, attention_bias=True, use_sandwich_norm=True, use_attention_gate=True,
                       rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                            full_attention=dict(rope_type="proportional", rope_theta=1000000.0,
                                                                partial_rotary_factor=0.5))), "hasten",
          feature_off=dict(conv_L_cache=1)),
    # Lara-Mini: Gated DeltaNet, a window of 5 on the sliding layer (rotary), a full layer without
    # rotary; MoE with an ungated shared expert on every layer
    Entry("lara_mini", dict(GATED_DELTANET, layer_types=["linear_attention", "sliding_attention", "full_attention"],
                            sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32), "hasten",
          feature_off=dict(linear_conv_kernel_dim=1), tensor_setup=_slow_decay),
    # Qwen4-Exp: Gated DeltaNet layers (the functions hasten replaces) but also a sparse indexed
    # attention (QSA: a top-k block selection read from the 4-D mask), hashed n-gram per-layer
    # embeddings (PLE) that segment on EOS, not on the packed boundaries, and PLE's own dilated
    # depthwise convolution (nn.Conv1d, no causal_conv1d_fn): refused
    Entry("qwen4_exp_text", dict(QWEN4_EXP_TEXT), "refused"),
    Entry("qwen4_exp", dict(text_config=QWEN4_EXP_TEXT, vision_config=QWEN3_5_VISION), "refused",
          notes="the wrapper's config built as its causal LM (Qwen4ExpForCausalLM); as "
                "Qwen4ExpForConditionalGeneration, packed batches are refused the same way"),
    Entry("granitemoehybrid", dict(layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
                                   num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=4,
                                   mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=8), "refused"),
]}


def build(entry: Entry, auto_class=None, **override) -> torch.nn.Module:
    """The entry's tiny model in float32, seeded; 1-D parameters (norm weights, biases, sinks) are
    moved off their initial 0 or 1 so that an offset or a missing bias shows. auto_class: the
    transformers auto class to build it with (default: what `hasten train` loads it with)."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if entry.model_type not in CONFIG_MAPPING:  # e.g. gemma4_text before transformers 5.2x
        pytest.skip(f"transformers {__version__} has no model type '{entry.model_type}'")
    # a copy: a config class may change the lists it is given in place (transformers 5.25's Gemma 4
    # sets the last of its `layer_types` to full attention), which would change SLIDING_3 for every
    # entry built after it in the process
    values = copy.deepcopy({**entry.config, **override})
    if "text_config" in values:  # a multimodal wrapper: the shared tiny shape is its text model's
        values["text_config"] = {**BASE, **values["text_config"]}
        values.setdefault("tie_word_embeddings", False)
    else:
        values = {**BASE, **values}
    config = AutoConfig.for_model(entry.model_type, **values)
    if not type(config).__module__.startswith("transformers."):
        # flash-linear-attention registers its own classes under some of transformers' names
        # (`bitnet`) when imported: in a process that imported it (the hybrid types' tests), the
        # auto classes then build fla's model, which is not the one this entry describes
        pytest.skip(f"'{entry.model_type}' resolves to {type(config).__module__}.{type(config).__name__} in this "
                    "process (registered over transformers' by a library imported earlier); the zoo tests "
                    "transformers' own model")
    torch.manual_seed(0)
    extra = {"attn_implementation": entry.attn_implementation} if entry.attn_implementation else {}
    model = (auto_class or auto_model_class(config)).from_config(config, dtype=torch.float32, **extra)  # VL wrappers too
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
        if entry.tensor_setup is not None:
            entry.tensor_setup(model)
    return model.train()


def samples(seed: int = 0, lengths=LENGTHS) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (n,), generator=gen).tolist()} for n in lengths]


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def per_sample_reference(model: torch.nn.Module, batch_samples: list[dict], device=None, dtype=None):
    """Loss (mean over every predicted token of every sample) and gradients of `model` run one
    sample at a time, unpatched: what a packed batch must reproduce."""
    model.zero_grad(set_to_none=True)
    total, targets = 0.0, 0
    for sample in batch_samples:
        ids = torch.tensor([sample["input_ids"]], device=device)
        if ids.shape[1] < 2:
            continue  # nothing to predict; its presence in a pack must change nothing either
        out = model(input_ids=ids, labels=ids, use_cache=False)
        total = total + out.loss.float() * (ids.shape[1] - 1)
        targets += ids.shape[1] - 1
    loss = total / targets
    loss.backward()
    return loss.detach(), gradients(model)


def packed_batch(batch_samples: list[dict], device=None) -> dict:
    """All samples in one packed row (none truncated)."""
    batch = hasten.PackingCollator(max_tokens=sum(len(s["input_ids"]) for s in batch_samples))(batch_samples)
    assert batch["input_ids"].shape[0] == 1
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def packed_run(model: torch.nn.Module, batch_samples: list[dict], config: Config | None = None, device=None):
    """(handle, loss, gradients) of the hasten-accelerated model on one packed row."""
    handle = hasten.accelerate(model, config or Config())
    try:
        model.zero_grad(set_to_none=True)
        loss = model(**packed_batch(batch_samples, device)).loss
        loss.backward()
    except BaseException:  # a refused batch: the patches (some on the modeling module) undone
        handle.undo()
        raise
    return handle, loss.detach().float(), gradients(model)


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(got) == set(want), f"gradients for different parameters: {sorted(set(got) ^ set(want))}"
    return {n: float((got[n].double() - want[n].double()).norm() / want[n].double().norm().clamp_min(1e-12))
            for n in want}


def padded_batch(batch_samples: list[dict], device=None) -> dict:
    """One sample per row, right-padded, with an attention_mask and -100 labels on padding."""
    width = max(len(s["input_ids"]) for s in batch_samples)
    ids = torch.zeros(len(batch_samples), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, sample in enumerate(batch_samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.tensor(sample["input_ids"])
        labels[row, :n] = ids[row, :n]
        mask[row, :n] = 1
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)}


def clone(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def cast_as_loaded(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """model.to(dtype) as from_pretrained(dtype=...) leaves a checkpoint: the parameters and buffers
    its class keeps in float32 stay float32 (`_keep_in_fp32_modules_strict` under bf16 and fp16,
    `_keep_in_fp32_modules` under fp16 only, matched as transformers matches them: a regular
    expression searched in the name). These are what users train: DeepSeek-V3's and GLM-4.5's
    router weight and correction bias, Flint's sinks, Kimi Linear's dt_bias. Casting them with the
    rest would test a model nobody loads, and would break classes that compute with them in float32
    (Inkling2's router takes F.linear of float32 states and its weight)."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    model.to(dtype)
    if names:
        keep = re.compile("|".join(f"(?:{name.replace('*', '.*')})" for name in sorted(names)))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and keep.search(name):
                tensor.data = tensor.data.float()
    return model
