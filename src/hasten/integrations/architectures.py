"""hasten's model table: what each transformers model type computes, piece by piece.

One entry per `config.model_type`. accelerate() reads the entry and patches each piece the entry
declares, after checking the model's own code against the kernel (dense/patch.py's probes); a
model type outside the table gets hasten's attention where the contract allows it and nothing
else, with one notice. Adding a model type is an entry here and its case in tests/model_zoo.py
(which the CPU and GPU parity tests run), never a patch function of its own.

What the model's own code computes around hasten's pieces (embedding scale, residual and
attention multipliers, the query scale, q/k norms as modules, parallel attention and MLP, layers
without rotary) stays the model's: hasten replaces the norm, MLP, rotary and loss functions, not
the decoder layer. The entry names them in `model_code` so the report can say what runs where.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hasten.dense.spec import LogitSpec, MlpSpec, NormSpec, RotarySpec
from hasten.moe.spec import (DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, MIXTRAL, SOFTMAX_TOPK, SOFTMAX_TOPK_RENORM,
                               RouterSpec)
from hasten.stateful.patch import StatefulSpec


@dataclass(frozen=True)
class ArchSpec:
    """What hasten knows about one transformers model type."""

    family: str  # "dense" | "moe"
    norm: NormSpec = field(default_factory=NormSpec)
    mlp: MlpSpec = field(default_factory=MlpSpec)
    rotary: RotarySpec = field(default_factory=RotarySpec)
    logits: LogitSpec = field(default_factory=LogitSpec)
    # attention features the model's config can switch on and what hasten's attention does with
    # them (its varlen kernels compute windows and the query scale; a softcap sends the attention
    # back to transformers' own code, with hasten's packed mask)
    attention: tuple[str, ...] = ()
    model_code: tuple[str, ...] = ()  # computed by the model's own code around hasten's pieces
    # a multimodal wrapper: what its vision side does under hasten (its tower and projector run
    # as transformers wrote them; a packed batch with image tokens is refused, since image tokens
    # attend to each other both ways); empty for a text model
    vision: str = ""
    # an MoE entry whose experts stay transformers' (what they compute that hasten's fused path
    # does not yet); empty: the fused MoE path is expected to take them (its probe still decides)
    experts: str = ""
    # an MoE block whose experts are not transformers' experts interface, fused at the level of the
    # block (hasten.moe.blocks): "llama4"; empty: none
    moe_block: str = ""
    # what the MoE routers compute after their logits, for hasten::moe_route
    # (training.moe.fused_router; each router class is checked against it first); None: the
    # routers stay the model's. Given only where the type's GPU parity with it ran (the hybrid MoE
    # types' with flash-linear-attention carried: 6e828bd)
    router: RouterSpec | None = None
    # a hybrid model's layers that carry state along the sequence (linear attention, short
    # convolutions), computed per packed sample by hasten.stateful; None: the model has none, and
    # a model with such layers but no entry here has packed batches refused
    stateful: StatefulSpec | None = None
    # the model's attention modules call transformers' attention interface although its class leaves
    # `_supports_attention_backend` off (which would refuse packed batches): why that is safe, and
    # what reaches the attention call (StableLM: position_ids only); empty: the class's mark decides
    attention_interface: str = ""
    # with `attention_interface`: the model's layers pass its attention every keyword argument (the batch's
    # packing metadata included, built once per batch), not position_ids alone (BioGPT; StableLM: False)
    attention_kwargs_reach: bool = False
    notes: str = ""


_LLAMA = ArchSpec("dense")
_GEMMA_NORM = NormSpec(weight_offset=1.0, eps_attribute="eps")
_GEMMA_MLP = MlpSpec(kind="geglu_tanh")
_SOFTCAP = LogitSpec(softcap_key="final_logit_softcapping")
_WINDOWS = "a sliding window where the config sets one"
_LAYER_WINDOWS = "sliding windows on the layers `layer_types` marks"

_GEMMA3_TEXT = ArchSpec("dense", norm=NormSpec(weight_offset=1.0, eps_attribute="eps", placement="pre_post",
                                              qk_norm=True),
                        mlp=_GEMMA_MLP, logits=_SOFTCAP,
                        rotary=RotarySpec(note="two rotary bases (local and global layers), chosen per layer by the "
                                               "model"),
                        attention=(_LAYER_WINDOWS, "the query scale query_pre_attn_scalar"),
                        model_code=("embedding scale sqrt(hidden)",))

_GEMMA4_TEXT = ArchSpec("dense", norm=NormSpec(eps_attribute="eps", placement="pre_post", qk_norm=True),
                        mlp=_GEMMA_MLP, logits=_SOFTCAP,
                        rotary=RotarySpec(single_tensor=True, note="rotary on (B, L, heads, D) before the head "
                                          "transpose; a partial 'proportional' rotary on global layers"),
                        attention=(_LAYER_WINDOWS,),
                        model_code=("embedding scale sqrt(hidden)", "per-layer input embeddings",
                                    "K/V shared across the last layers", "a value norm without weight"))

_GEMMA4_UNIFIED_TEXT = dataclasses.replace(
    _GEMMA4_TEXT,
    attention=(_LAYER_WINDOWS, "use_bidirectional_attention 'vision' (its default): text tokens causal, only "
               "image/video tokens (none in a text model) attend both ways"),
    model_code=("embedding scale sqrt(hidden)", "K/V shared across the last layers (num_kv_shared_layers)",
                "a value norm without weight", "keys as values on full-attention layers (attention_k_eq_v)",
                "layer_scalar on each layer's output"))

_MLA = ("multi-head latent attention: value heads (v_head_dim) smaller than the query/key heads "
        "(qk_nope_head_dim + qk_rope_head_dim), zero-padded to their size for the varlen kernels and sliced back")
_DEEPSEEK_ROTARY = RotarySpec(own=True, note="on the rope part of each query/key head (qk_rope_head_dim) inside the "
                                             "model's attention (V2: complex rotation; V3: rope_interleave)")
_DEEPSEEK_CODE = ("low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) projections with their "
                  "RMSNorms", "shared experts", "dense first layers (first_k_dense_replace)")

# Qwen's vision-language wrappers: their text model on text-only packed batches
_MROPE = RotarySpec(note="multimodal rotary (mrope): the model builds cos/sin from its t/h/w position sections; for "
                         "text they are the token positions")
_QWEN_VL_VISION = ("text-only packed batches on hasten's attention; a packed batch with images or videos "
                   "(pixel_values, pixel_values_videos) is refused: image tokens attend to each other both ways and "
                   "carry their own positions. Images train padded (training.packed_sequence: false)")
# a wrapper whose image tokens attend to each other both ways (LLaVA, Mistral 3, Aya Vision...)
_IMAGES_VISION = ("text-only packed batches on hasten's attention; a packed batch with images (pixel_values) is "
                  "refused: image tokens attend to each other both ways. Images train padded "
                  "(training.packed_sequence: false)")

# Llama 4's text model: chunked attention on its layers with rotary, none on the others (with
# attention temperature tuning there); its MoE computes every expert on every token
_LLAMA4_TEXT = ArchSpec("moe", norm=NormSpec(eps_attribute="eps"),
                        rotary=RotarySpec(own=True, note="a complex rotation (freqs_cis) on the layers with rotary "
                                          "(no_rope_layers marks those without)"),
                        attention=("chunked attention (attention_chunk_size) on the layers with rotary: each packed "
                                   "sample cut into chunks counted from its own first token",
                                   "attention temperature tuning on the layers without rotary: packed rows of up "
                                   "to floor_scale - 1 tokens (longer rows with several samples are refused)"),
                        model_code=("q/k L2 norms without weight (use_qk_norm)", "the router's sigmoid top-k "
                                    "scores", "a shared expert on every MoE layer"),
                        moe_block="llama4",
                        notes="its own MoE block runs every expert on every token, the router's scores scaling "
                              "the inputs (zero for unchosen experts); hasten's block runs the chosen ones only")

# Hybrid models (issue 19): Gated DeltaNet layers (a short convolution over q/k/v, then the chunked
# gated delta rule) or LFM2's short convolutions, between full-attention layers; each packed sample
# starts them from a zero state (hasten.stateful: flash-linear-attention's varlen kernels on CUDA)
_GATED_DELTANET = StatefulSpec(layers=(("GatedDeltaNet", ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")),))
_SHORT_CONV = StatefulSpec(layers=(("ShortConv", ("causal_conv1d_fn",)),))
_GDN_CODE = ("the Gated DeltaNet layers' projections, gates and gated RMSNorm (the model's own code around the "
             "varlen convolution and delta rule)",)
_QWEN3_NEXT = ArchSpec("moe", router=SOFTMAX_TOPK,
                       norm=dataclasses.replace(_GEMMA_NORM, qk_norm=True), rotary=RotarySpec(partial=True),
                       attention=("the attention output gate (sigmoid), in the model's own attention module",),
                       model_code=_GDN_CODE + ("the shared expert and its sigmoid gate",),
                       stateful=_GATED_DELTANET)

# Aya Vision and Command A Vision: Cohere 2's text model (LayerNorm without bias, attention and MLP in
# parallel on one norm, interleaved rotary, windows on the layers layer_types marks, NoPE on the
# others), a SigLIP tower; the text config's logit_scale, which Cohere2ForCausalLM applies, these
# wrappers' heads applied in no release up to transformers 5.24; Aya Vision's does from 5.25 on
# (Command A Vision's not yet): applied where the wrapper's forward names it
_AYA_VISION = ArchSpec("dense", norm=NormSpec(kind="layer", class_suffix="LayerNorm"),
                       rotary=RotarySpec(interleaved=True),
                       logits=LogitSpec(scale_key="logit_scale", scale_where_forward_names=True),
                       attention=(_LAYER_WINDOWS,),
                       model_code=("attention and MLP in parallel on one norm",
                                   "the SigLIP vision tower, its pixel-shuffle downsampling and SwiGLU projector"),
                       vision=_IMAGES_VISION,
                       notes="the wrapper's logits: lm_head(hidden), times the text config's logit_scale where "
                             "its forward applies it (Aya Vision from transformers 5.25 on)")

# GLM-4-MoE's classes (modeling_glm4_moe) under another model type: Sarvam-30B, Param2
_GLM4_MOE_CLASSES = ArchSpec("moe", router=DEEPSEEK_V3, norm=NormSpec(qk_norm=True), rotary=RotarySpec(partial=True),
                             attention=("qkv bias (attention_bias, the checkpoints' use_qkv_bias) where set",),
                             model_code=("sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                         "shared experts", "dense first layers (first_k_dense_replace)"),
                             notes="Glm4MoeForCausalLM's classes (modeling_glm4_moe); partial_rotary_factor 1.0 "
                                   "unless the config sets it (the rotary width is read from cos at every call)")

# A vision-language wrapper around a Qwen3 text model (AutoModel of its text_config: q/k RMSNorms per
# head, SwiGLU, rotary halves, one-dimensional text positions), its vision tower on image/video
# batches only: LLaVA-OneVision-1.5, Ovis2.5 (transformers 5.25)
_QWEN3_TEXT_VL = ArchSpec("dense", norm=NormSpec(qk_norm=True),
                          attention=(_LAYER_WINDOWS, "qkv bias where the text config sets it"),
                          model_code=("the vision tower and its merger or visual-vocabulary projector "
                                      "(image/video batches only)",),
                          vision=_QWEN_VL_VISION,
                          notes="the text model is the checkpoint's text_config type (Qwen3): its pieces run on "
                                "hasten's kernels where they pass the probes")

ARCHITECTURES: dict[str, ArchSpec] = {
    # --- dense: Llama-style pre-norm decoders ------------------------------------------------
    "llama": _LLAMA,
    "qwen2": ArchSpec("dense", attention=(_WINDOWS, "qkv bias")),
    "qwen3": ArchSpec("dense", norm=NormSpec(qk_norm=True), attention=(_WINDOWS,)),
    "mistral": ArchSpec("dense", attention=(_WINDOWS,)),
    "ministral": ArchSpec("dense", attention=(_LAYER_WINDOWS,)),
    "smollm3": ArchSpec("dense", rotary=RotarySpec(note="layers without rotary (no_rope_layers) skip it in the "
                                                        "model's own attention")),
    "hunyuan_v1_dense": ArchSpec("dense", norm=NormSpec(qk_norm=True)),
    "helium": ArchSpec("dense", rotary=RotarySpec(interleaved=True, cos_first_half=True)),
    "seed_oss": ArchSpec("dense", attention=("qkv bias",)),
    "ernie4_5": ArchSpec("dense", rotary=RotarySpec(interleaved=True, cos_first_half=True)),
    # InternLM3 runs on Llama's classes (LlamaForCausalLM); its config ties qkv_bias and bias
    # (attention_bias, mlp_bias) together: biases on q/k/v/o and on the MLP's three projections,
    # which stay the model's Linear layers around hasten's silu_mul
    "internlm3": ArchSpec("dense", attention=("projection biases",),
                          notes="Llama's classes; attention_bias and mlp_bias set together"),
    # CWM: Llama with sliding windows on the layers layer_types marks (every fourth layer full in
    # the published config) and llama3 rotary scaling in the model's own rotary embedding
    "cwm": ArchSpec("dense", attention=(_LAYER_WINDOWS,)),
    "granite": ArchSpec("dense", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                        attention=("the query scale attention_multiplier",),
                        model_code=("embedding_multiplier", "residual_multiplier")),
    # --- Qwen's vision-language models (Qwen2ForConditionalGeneration and after), text packed ---
    "qwen2_vl": ArchSpec("dense", rotary=_MROPE, attention=("qkv bias",), model_code=("the vision tower and its merger",),
                         vision=_QWEN_VL_VISION),
    "qwen2_5_vl": ArchSpec("dense", rotary=_MROPE, attention=("qkv bias",),
                           model_code=("the windowed vision tower and its merger",), vision=_QWEN_VL_VISION),
    "qwen3_vl": ArchSpec("dense", norm=NormSpec(qk_norm=True), rotary=_MROPE,
                         model_code=("the vision tower, its merger and the deepstack features it adds to the first "
                                     "text layers (image batches only)",), vision=_QWEN_VL_VISION),
    # --- other vision-language wrappers, text packed --------------------------------------
    # GLM-4.1V (Glm4vForConditionalGeneration): GLM-4's text decoder (norms after attention and
    # MLP beside the pre-norms, one gate_up_proj, q/k/v biases) with mrope on interleaved pairs:
    # its rotary embedding re-interleaves cos/sin itself (repeat_interleave(2)), so the module's
    # apply_rotary_pos_emb takes them whole (no first-half re-interleave), on the rotated part only
    "glm4v": ArchSpec("dense", norm=NormSpec(placement="pre_post"), mlp=MlpSpec(fused_gate_up=True),
                      rotary=RotarySpec(interleaved=True, partial=True, note=_MROPE.note),
                      attention=("qkv bias",), model_code=("the vision tower and its merger",),
                      vision=_QWEN_VL_VISION, notes="post-attention and post-MLP norms beside the pre-norms"),
    # GLM-4.5V (Glm4vMoeForConditionalGeneration): GLM-4-MoE's text decoder (pre-norms only, halves
    # rotary on part of each head, without q/k norms) with mrope; the router is the model's own
    "glm4v_moe": ArchSpec("moe", router=DEEPSEEK_V3, rotary=RotarySpec(partial=True, note=_MROPE.note),
                          attention=("qkv bias (attention_bias)",),
                          model_code=("sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                      "shared experts", "dense first layers (first_k_dense_replace)",
                                      "the vision tower and its merger"),
                          vision=_QWEN_VL_VISION),
    # Mistral 3 (Mistral-Small-3.x, Mistral3ForConditionalGeneration): Mistral's text model, a Pixtral tower
    "mistral3": ArchSpec("dense", attention=(_WINDOWS,), model_code=("the Pixtral vision tower, its patch merger and "
                                                                     "projector",),
                         vision=_IMAGES_VISION),
    # --- post-norm decoders (norms after attention and MLP) ---------------------------------
    "olmo2": ArchSpec("dense", norm=NormSpec(placement="post", qk_norm=True),
                      notes="q/k norms over the whole projection, before the head split"),
    "olmo3": ArchSpec("dense", norm=NormSpec(placement="post", qk_norm=True), attention=(_LAYER_WINDOWS,)),
    "exaone4": ArchSpec("dense", norm=NormSpec(placement="post", qk_norm=True), attention=(_LAYER_WINDOWS,)),
    # --- fused gate/up projections, partial rotary -------------------------------------------
    "phi3": ArchSpec("dense", mlp=MlpSpec(fused_gate_up=True), rotary=RotarySpec(partial=True),
                     attention=(_WINDOWS,), model_code=("fused qkv_proj",)),
    "glm": ArchSpec("dense", mlp=MlpSpec(fused_gate_up=True),
                    rotary=RotarySpec(interleaved=True, cos_first_half=True, partial=True)),
    "glm4": ArchSpec("dense", norm=NormSpec(placement="pre_post"), mlp=MlpSpec(fused_gate_up=True),
                     rotary=RotarySpec(interleaved=True, cos_first_half=True, partial=True),
                     notes="post-attention and post-MLP norms beside the pre-norms"),
    # --- Gemma: weight + 1 norms, GeGLU, final softcap ----------------------------------------
    "gemma": ArchSpec("dense", norm=_GEMMA_NORM, mlp=_GEMMA_MLP, model_code=("embedding scale sqrt(hidden)",)),
    "gemma2": ArchSpec("dense", norm=NormSpec(weight_offset=1.0, eps_attribute="eps", placement="pre_post"),
                       mlp=_GEMMA_MLP, logits=_SOFTCAP,
                       attention=("attention logit softcapping (cuDNN's score modifier in hasten's op; "
                                  "flash-attn >= 2.6; else one sequence at a time)", _LAYER_WINDOWS,
                                  "the query scale query_pre_attn_scalar"),
                       model_code=("embedding scale sqrt(hidden)",)),
    # VaultGemma: Gemma 2 without its post-attention and post-MLP norms (pre-norms only), the rest
    # Gemma 2's: attention logit softcapping, windows on alternate layers, final softcap
    "vaultgemma": ArchSpec("dense", norm=_GEMMA_NORM, mlp=_GEMMA_MLP, logits=_SOFTCAP,
                           attention=("attention logit softcapping (cuDNN's score modifier in hasten's op; "
                                      "flash-attn >= 2.6; else one sequence at a time)", _LAYER_WINDOWS,
                                      "the query scale query_pre_attn_scalar"),
                           model_code=("embedding scale sqrt(hidden)",)),
    "gemma3_text": _GEMMA3_TEXT,
    # Gemma 3's multimodal wrapper (Gemma3ForConditionalGeneration): the text model of gemma3_text
    # inside; its head applies no final softcap (Gemma3ForCausalLM does), so none is declared and a
    # text config that sets one keeps transformers' loss
    "gemma3": dataclasses.replace(
        _GEMMA3_TEXT, logits=LogitSpec(),
        model_code=("embedding scale sqrt(hidden)", "the SigLIP vision tower and its projector"),
        vision=("text-only packed batches on hasten's attention; a packed batch with images (pixel_values, or image "
                "tokens in token_type_ids) is refused: image tokens attend to each other both ways. Images train "
                "padded (training.packed_sequence: false)")),
    "gemma4_text": _GEMMA4_TEXT,
    # Gemma 4's multimodal wrapper (Gemma4ForConditionalGeneration): the text model of gemma4_text
    # inside; its head applies the text config's final softcap (as Gemma4ForCausalLM does, unlike
    # Gemma 3's wrapper), so the softcap stays declared
    "gemma4": dataclasses.replace(
        _GEMMA4_TEXT,
        model_code=_GEMMA4_TEXT.model_code + ("the vision tower (and audio tower where configured) with their "
                                              "embedders",),
        vision=("text-only packed batches on hasten's attention; a packed batch with images or videos "
                "(pixel_values, pixel_values_videos) is refused: image tokens attend to each other both ways. "
                "Images train padded (training.packed_sequence: false)")),
    # Gemma 4 "unified" (Gemma4UnifiedForCausalLM): gemma4_text's decoder (pre and post norms,
    # q/k norms per head, GeGLU, windows on the layers layer_types marks, K/V shared across the last
    # layers, a partial 'proportional' rotary on global layers) without per-layer input embeddings or
    # MoE; use_bidirectional_attention defaults to "vision", which leaves text tokens causal
    "gemma4_unified_text": _GEMMA4_UNIFIED_TEXT,
    # Gemma 4 unified's multimodal wrapper (Gemma4UnifiedForConditionalGeneration): the text model
    # above inside, no vision or audio tower (raw patches and waveform frames projected by small
    # embedders); its head applies the text config's final softcap, as gemma4's wrapper does
    "gemma4_unified": dataclasses.replace(
        _GEMMA4_UNIFIED_TEXT,
        attention=(_LAYER_WINDOWS, "use_bidirectional_attention 'vision' (its default): text tokens causal; image "
                   "and video tokens attend to their own block both ways (packed media batches refused)"),
        model_code=_GEMMA4_UNIFIED_TEXT.model_code + (
            "the encoder-free vision and audio embedders (LayerNorms, a patch projection, factorized 2-D "
            "position embeddings, an RMSNorm and a projection)",),
        vision=("text-only packed batches on hasten's attention; a packed batch with images, videos or audio "
                "(pixel_values, pixel_values_videos, input_features, mm_encoder_outputs, or media tokens marked in "
                "mm_token_type_ids) is refused: image tokens attend to each other both ways. Media train padded "
                "(training.packed_sequence: false)")),
    # JetMoE: a mixture of attention heads (MoA) and of MLP experts, both routed top-k (softmax over
    # the k logits). Each token's query heads are its k routed experts' query projections
    # (num_key_value_heads heads each) and one kv_proj's K/V is repeated k times: the attention call
    # is plain multi-head attention over k * num_key_value_heads heads, which hasten's varlen attention
    # computes; the experts' projections and output biases around it are the model's own
    "jetmoe": ArchSpec("moe",
                       attention=("mixture of attention heads: query heads from the top-k routed experts' query "
                                  "projections, K/V (one kv_proj) repeated for each; plain multi-head attention at "
                                  "the call",),
                       model_code=("the MoA router, its experts' query and output projections (JetMoeParallelExperts) "
                                   "and the output bias", "the MLP router (softmax over the top-k logits)",
                                   "the MLP experts and their output bias"),
                       experts="JetMoeMoE's experts are JetMoeParallelExperts (weights (E, out, in), a per-expert "
                               "loop over the routed rows, [gate | up] chunked, a bias added after the combine), "
                               "not transformers' experts interface",
                       notes="the decoder norms are built with eps 1e-6 whatever rms_norm_eps says (the final norm "
                             "reads it); hasten's RMSNorm reads each module's own"),
    # DBRX: nn.LayerNorm without bias (torch's kernel), one Wqkv projection clamped to +-clip_qkv before
    # the split, GQA, full rotary; a softmax router over all experts with the top-k weights
    # renormalised by their p-norm, experts stored as stacked 2-D w1 / v1 / w2 parameters
    "dbrx": ArchSpec("moe", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                     attention=("qkv clipping (clip_qkv) before the attention call",),
                     model_code=("fused Wqkv projection, q/k/v clamped to +-clip_qkv",
                                 "router: softmax over all experts, top-k, weights divided by their p-norm "
                                 "(moe_normalize_expert_weights)",
                                 "the router's input jitter in training where moe_jitter_eps is set"),
                     experts="DbrxExperts holds w1, v1, w2 as (E * ffn_hidden_size, hidden) parameters and loops "
                             "over the hit experts itself: not transformers' experts interface"),
    # --- Cohere: LayerNorm without bias, interleaved rotary, parallel blocks, logit scale -----
    "cohere": ArchSpec("dense", norm=NormSpec(kind="layer", class_suffix="LayerNorm"),
                       rotary=RotarySpec(interleaved=True), logits=LogitSpec(scale_key="logit_scale"),
                       model_code=("attention and MLP in parallel on one norm",
                                   "q/k LayerNorms over (heads, head_dim) where use_qk_norm is set")),
    "cohere2": ArchSpec("dense", norm=NormSpec(kind="layer", class_suffix="LayerNorm"),
                        rotary=RotarySpec(interleaved=True), logits=LogitSpec(scale_key="logit_scale"),
                        attention=(_LAYER_WINDOWS,), model_code=("attention and MLP in parallel on one norm",)),
    # --- older dense decoders: nn.LayerNorm with bias (torch's own kernel), partial rotary,
    # parallel attention/MLP residuals, ungated GELU MLPs; hasten's gains are its varlen attention
    # on packed batches and the fused loss ---------------------------------------------------------
    # GPT-NeoX (Pythia, GPT-NeoX-20B): one query_key_value projection laid out [q|k|v] per head, the
    # rotary on the first rotary_pct of each head inside apply_rotary_pos_emb, attention and MLP in
    # parallel on two norms (use_parallel_residual)
    "gpt_neox": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                         rotary=RotarySpec(partial=True), attention=("projection biases (attention_bias)",),
                         model_code=("fused query_key_value projection, [q | k | v] per head",
                                     "attention and MLP in parallel on their own norms (use_parallel_residual)",
                                     "the ungated MLP dense_4h_to_h(act(dense_h_to_4h(x))) with biases")),
    # Phi-1/1.5/2: attention and MLP in parallel on one norm, q/k/v/dense biases, the rotary on the first
    # partial_rotary_factor of each head (the model's attention slices it off and passes it alone to
    # apply_rotary_pos_emb), optional per-head q/k LayerNorms with bias, an LM head bias
    "phi": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                    rotary=RotarySpec(note="the model's attention passes the rotated part of each head "
                                           "(partial_rotary_factor) alone and concatenates the rest back"),
                    attention=("projection biases",),
                    model_code=("attention and MLP in parallel on one norm",
                                "q/k LayerNorms with bias per head where qk_layernorm is set",
                                "the ungated MLP fc2(act(fc1(x))) with biases"),
                    notes="the LM head has a bias, which hasten's fused loss adds"),
    # StableLM (StableLM-2, StableLM-3B-4E1T): gated SwiGLU MLP, q/k/v biases (use_qkv_bias), the rotary on
    # the first partial_rotary_factor of each head (sliced off by the model's attention), per-head q/k
    # LayerNorms (qk_layernorm) and attention and MLP in parallel on one norm (use_parallel_residual) in
    # StableLM-2-12B; its class leaves `_supports_attention_backend` off because its decoder layer passes
    # the attention only position_ids
    "stablelm": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                         rotary=RotarySpec(note="the model's attention passes the rotated part of each head "
                                                "(partial_rotary_factor) alone and concatenates the rest back"),
                         attention=("qkv bias (use_qkv_bias)",),
                         model_code=("q/k LayerNorms per head (StableLmLayerNormPerHead) where qk_layernorm is set",
                                     "attention and MLP in parallel on one norm where use_parallel_residual is set"),
                         attention_interface=(
                             "StableLmAttention calls transformers' attention interface with position_ids, but its "
                             "decoder layer passes it no other keyword arguments: hasten's attention derives the "
                             "packing metadata from position_ids in every layer (one host read-back per layer)")),
    # --- StarCoder2: nn.LayerNorm with bias, ungated GELU MLP with biases ---------------------
    "starcoder2": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                           mlp=MlpSpec(kind="ungated"), attention=(_WINDOWS, "projection biases")),
    # --- ungated MLPs on one up_proj (no gate: nothing for hasten's gated kernels), the
    # activation the model's own (ReLU^2: Nemotron, Arcee; xIELU with learned alphas: Apertus) ---
    "arcee": ArchSpec("dense", mlp=MlpSpec(kind="ungated"), attention=("projection biases",),
                      model_code=("the ungated MLP down_proj(relu(up_proj(x))^2), mlp_bias where set",)),
    "apertus": ArchSpec("dense", norm=NormSpec(qk_norm=True), mlp=MlpSpec(kind="ungated"),
                        model_code=("the ungated MLP down_proj(xielu(up_proj(x))) with the activation's learned "
                                    "alpha_p, alpha_n",),
                        notes="pre-norms named attention_layernorm and feedforward_layernorm; q/k RMSNorms per head "
                              "before the rotary; llama3 rotary scaling in the model's rotary module (cos/sin)"),
    # Nemotron: LayerNorm1P is nn.LayerNorm computing F.layer_norm(x, weight + 1, bias) in one torch
    # kernel (a bias, so not hasten's bias-free LayerNorm path); half of each head rotates
    "nemotron": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm1P"),
                         mlp=MlpSpec(kind="ungated"), rotary=RotarySpec(partial=True),
                         attention=("projection biases",),
                         model_code=("LayerNorm1P: F.layer_norm with weight + 1 and a bias",
                                     "the ungated MLP down_proj(relu(up_proj(x))^2), mlp_bias where set")),
    # OLMo (1): LayerNorm without weight or bias (F.layer_norm in float32, eps 1e-5 fixed): one torch
    # kernel with nothing to fuse in; clip_qkv clamps q, k, v in the model's attention before the call
    "olmo": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                     attention=("qkv clipping (clip_qkv) before the attention call", "projection biases"),
                     model_code=("OlmoLayerNorm: F.layer_norm without weight or bias, in float32",
                                 "q/k/v clamped to +-clip_qkv")),
    # Ministral 3 (Ministral3ForCausalLM; the text model of Mistral3ForConditionalGeneration in the
    # published checkpoints): Mistral's layout (a window on every layer where sliding_window is set),
    # yarn rotary, and Llama 4's position-dependent query scale 1 + beta * log(1 + floor(pos / orig_max))
    # applied in the model's own attention from position_ids (per packed sample: the collator's)
    "ministral3": ArchSpec("dense", attention=(_WINDOWS,),
                           model_code=("the query scale 1 + llama_4_scaling_beta * log(1 + floor(position / "
                                       "original_max_position_embeddings)), from each sample's own positions",),
                           notes="yarn rotary scaling in the model's rotary module (cos/sin)"),
    # Granite with sliding windows on the layers layer_types marks, a learnable sink logit per head
    # (its eager attention's sigmoid(lse - sink) output scale is gpt-oss's extra softmax denominator
    # term, passed as s_aux), a rotary base per layer (layer_rope_theta, 0: no rotary on that layer)
    "granite_swa": ArchSpec("dense", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                            rotary=RotarySpec(note="a rotary base per layer (layer_rope_theta); layers with base 0 "
                                                   "skip rotary in the model's own attention"),
                            attention=(_LAYER_WINDOWS, "attention sinks (a logit per head in the softmax "
                                       "denominator)", "the query scale attention_multiplier"),
                            model_code=("embedding_multiplier", "residual_multiplier")),
    # HyperCLOVA X: Granite's muP multipliers with extra RMSNorms after attention and MLP
    # (use_post_norm: "Peri-LN"), and logits_scaling MULTIPLYING the logits (Granite divides)
    "hyperclovax": ArchSpec("dense", norm=NormSpec(placement="pre_post"),
                            logits=LogitSpec(scale_key="logits_scaling"),
                            attention=("the query scale attention_multiplier",),
                            model_code=("embedding_multiplier", "residual_multiplier"),
                            notes="post-attention and post-MLP norms (post_norm1/2) beside the pre-norms where "
                                  "use_post_norm; logits_scaling multiplies the logits"),
    # Youtu-LLM: a dense Llama decoder (SwiGLU MLP) with DeepSeek-V3's multi-head latent attention
    "youtu": ArchSpec("dense", rotary=_DEEPSEEK_ROTARY, attention=(_MLA,),
                      model_code=("low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) projections "
                                  "with their RMSNorms",)),
    # Jais-2: Llama's attention and rotary with nn.LayerNorm pre-norms (with bias) and Nemotron's ungated
    # MLP (ReLU² in the published config), biases on q/k/v/o and on the MLP's two projections
    "jais2": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                      attention=("projection biases (attention_bias)",),
                      model_code=("nn.LayerNorm with bias (pre-norms and the final norm)",
                                  "the ungated MLP down_proj(act(up_proj(x))) (ReLU² in the published config), "
                                  "mlp_bias where set")),
    # NanoChat (karpathy/nanochat): weightless RMSNorms (after the embedding, before attention and MLP, on
    # q/k after the rotary, final), rotate_half with flipped signs (a rotation by -theta, which hasten's
    # rotary kernel does not take), an ungated ReLU² MLP (fc1, fc2), the final logit softcap
    "nanochat": ArchSpec("dense", norm=NormSpec(kind="own", class_suffix="RMSNorm", qk_norm=True),
                         mlp=MlpSpec(kind="ungated"),
                         rotary=RotarySpec(own=True, note="rotate_half with flipped signs, cat(x2, -x1): a rotation by "
                                                          "-theta"),
                         logits=_SOFTCAP,
                         model_code=("weightless RMSNorms in float32 (NanoChatRMSNorm: no weight for hasten's kernel) "
                                     "after the embedding, before attention and MLP, on q/k per head after the "
                                     "rotary, and final",
                                     "the ungated MLP fc2(act(fc1(x))) (ReLU² in the published config)")),
    # HRM-Text: two stacks of Llama layers (L and H) run in nested cycles, H_cycles x (L_cycles + 1) stack
    # passes over the whole sequence; the states between passes are per token (nothing carried along the
    # sequence but attention), so packed samples stay apart as in any decoder. Weightless RMSNorms, MHA
    # with a per-element sigmoid output gate, an embedding scale
    "hrm_text": ArchSpec("dense", norm=NormSpec(kind="own", class_suffix="RMSNorm"),
                         attention=("the per-element sigmoid output gate (gate_proj), in the model's own attention "
                                    "module",),
                         model_code=("the H/L cycle recurrence (per-token states; the earlier L cycles under no_grad, "
                                     "L_bp_cycles)", "embedding_scale",
                                     "weightless RMSNorms in float32 (HrmTextRMSNorm: no weight for hasten's kernel), "
                                     "before attention and MLP and after each stack"),
                         notes="prefix-LM (prefix_lm: the tokens token_type_ids mark attend to each other both "
                               "ways) is a mask overlay hasten's varlen attention does not compute: a batch that "
                               "marks any token is refused under it; hasten.PackingCollator emits no "
                               "token_type_ids, so packed samples train causally, as the model computes without "
                               "them"),
    # --- MoE -----------------------------------------------------------------------------------
    "qwen3_moe": ArchSpec("moe", router=SOFTMAX_TOPK, norm=NormSpec(qk_norm=True), attention=(_WINDOWS,)),
    "qwen2_moe": ArchSpec("moe", router=SOFTMAX_TOPK,
                          attention=(_WINDOWS, "qkv bias"), notes="the shared expert is a SwiGLU MLP"),
    "mixtral": ArchSpec("moe", router=MIXTRAL, attention=(_WINDOWS,)),
    "olmoe": ArchSpec("moe", router=SOFTMAX_TOPK, norm=NormSpec(qk_norm=True)),
    # the routers below are the models' own (sigmoid scores with a correction bias, group-limited
    # top-k, routed scaling, shared experts: all in transformers' code); hasten's grouping kernel
    # takes the top-k ids and weights they return, and the experts are the standard SwiGLU stack
    "glm4_moe": ArchSpec("moe", router=DEEPSEEK_V3, norm=NormSpec(qk_norm=True), rotary=RotarySpec(partial=True),
                         model_code=("sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                     "shared experts", "dense first layers (first_k_dense_replace)")),
    "dots1": ArchSpec("moe", router=DEEPSEEK_V3, norm=NormSpec(qk_norm=True),
                      model_code=("sigmoid router with a correction bias, routed scaling", "shared experts",
                                  "dense first layers (first_k_dense_replace)")),
    "ernie4_5_moe": ArchSpec("moe", rotary=RotarySpec(interleaved=True, cos_first_half=True),
                             model_code=("shared experts", "dense first layers (moe_layer_start_index)")),
    "hunyuan_v1_moe": ArchSpec("moe", norm=NormSpec(qk_norm=True), model_code=("shared expert",)),
    "flex_olmo": ArchSpec("moe", router=SOFTMAX_TOPK, norm=NormSpec(placement="post", qk_norm=True),
                          notes="OLMo-2-style post-norms, q/k norms over the whole projection"),
    "gpt_oss": ArchSpec("moe", router=GPT_OSS, rotary=RotarySpec(half_width_cos=True),
                        attention=(_LAYER_WINDOWS, "attention sinks (a logit per head in the softmax denominator)",
                                   "qkv bias"),
                        model_code=("router with a bias, top-k before its softmax",
                                    "the clamped SwiGLU (alpha, limit) on interleaved gate/up columns: its experts' "
                                    "own _apply_gate, on hasten's grouped rows, with the expert biases")),
    # DeepSeek-V2/V3: multi-head latent attention (queries from a low-rank projection or a plain one,
    # keys and values expanded from a compressed latent; q/k heads of nope + rope size, value heads
    # smaller), the rotary on the rope part only; the router is the model's own (V2: softmax,
    # greedy or group-limited top-k; V3: sigmoid with a correction bias, group-limited top-k)
    "deepseek_v2": ArchSpec("moe", router=DEEPSEEK_V2,
                            rotary=_DEEPSEEK_ROTARY, attention=(_MLA,), model_code=_DEEPSEEK_CODE + (
        "softmax router, greedy or group-limited top-k (topk_method), routed scaling",)),
    "deepseek_v3": ArchSpec("moe", router=DEEPSEEK_V3,
                            rotary=_DEEPSEEK_ROTARY, attention=(_MLA,), model_code=_DEEPSEEK_CODE + (
        "sigmoid router with a correction bias, group-limited top-k, routed scaling",)),
    # GLM-4.7-Flash: DeepSeek-V3's layout (MLA, the same router) under GLM's names
    "glm4_moe_lite": ArchSpec("moe", router=DEEPSEEK_V3,
                              rotary=_DEEPSEEK_ROTARY, attention=(_MLA,), model_code=_DEEPSEEK_CODE + (
        "sigmoid router with a correction bias, group-limited top-k, routed scaling",)),
    # MiniCPM3: a dense Llama decoder with DeepSeek-V2's multi-head latent attention (an optional
    # low-rank query, keys and values from a compressed latent, value heads smaller), rotated by the
    # standard apply_rotary_pos_emb on the rope part of each head; muP-style scale_emb on the
    # embeddings, scale_depth / sqrt(layers) on each residual branch, and the final hidden states
    # divided by logits_scaling (hidden_size / dim_model_base, a config property) before the LM head
    "minicpm3": ArchSpec("dense", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                         rotary=RotarySpec(note="on the rope part of each query/key head (qk_rope_head_dim), which "
                                                "the model's attention passes alone (the key's one shared rope head "
                                                "too): halves, rotate_half"),
                         attention=(_MLA, "projection biases (attention_bias)"),
                         model_code=("embedding scale scale_emb",
                                     "residual branches scaled by scale_depth / sqrt(num_hidden_layers)",
                                     "low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) "
                                     "projections with their RMSNorms"),
                         notes="the model divides the final hidden states by logits_scaling before its bias-free LM "
                               "head: the fused loss's logit scale 1 / logits_scaling (one rounding of the scaled "
                               "hidden state apart in bf16)"),
    # A.X-K1 (SK Telecom): DeepSeek-V3's layout (MLA with a low-rank query, the sigmoid group-limited
    # router, a shared expert, dense layers where mlp_layer_types says) plus an RMSNorm on the MoE
    # block's output (post_mlp_layernorm, inside the block, after the shared expert is added)
    "axk1": ArchSpec("moe", router=DEEPSEEK_V3, rotary=_DEEPSEEK_ROTARY, attention=(_MLA,), model_code=(
        "low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) projections with their RMSNorms",
        "sigmoid router with a correction bias, group-limited top-k, routed scaling", "shared experts",
        "dense layers (mlp_layer_types; legacy first_k_dense_replace / moe_layer_freq)",
        "the MoE block's output RMSNorm (post_mlp_layernorm), applied by the block after the shared experts"),
        notes="the post-MoE norm is an RMSNorm module of the model's class: on hasten's kernel like the others"),
    "phimoe": ArchSpec("moe", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                       attention=(_WINDOWS, "qkv bias"),
                       model_code=("the sparsemixer top-2 router (with its jitter where the config sets one)",
                                   "the LM head bias")),
    "llama4_text": _LLAMA4_TEXT,
    # Solar Open: Llama's attention (no q/k norms) with GLM-4-MoE's MoE block on every layer
    "solar_open": ArchSpec("moe", router=DEEPSEEK_V3,
                           model_code=("sigmoid router with a correction bias, group-limited top-k, "
                                       "routed scaling", "shared experts")),
    # MiniMax-M2: q/k RMSNorms over the whole projection (all heads at once, before the head split),
    # half of each head rotates (its checkpoints' rotary_dim), a sigmoid router with a correction bias
    "minimax_m2": ArchSpec("moe", norm=NormSpec(qk_norm=True), rotary=RotarySpec(partial=True),
                           model_code=("sigmoid router with a correction bias, top-k scores renormalised",
                                       "the router's input jitter (router_jitter_noise) where the config sets one"),
                           notes="q/k norms over the whole projection, before the head split"),
    # AFMoE (Arcee Trinity): norms before and after attention and MLP, q/k norms per head, rotary on
    # the sliding-window layers only (the full-attention layers have none), a sigmoid gate on the
    # attention output; sigmoid router with an expert bias, normalised top-k, route_scale
    "afmoe": ArchSpec("moe", norm=NormSpec(placement="pre_post", qk_norm=True),
                      rotary=RotarySpec(note="only on the sliding-window layers: the model's own attention skips it "
                                             "on the full-attention layers"),
                      attention=(_LAYER_WINDOWS,),
                      model_code=("the attention output gated by sigmoid(gate_proj(x))",
                                  "embedding scale sqrt(hidden) (mup_enabled)",
                                  "sigmoid router with an expert bias, normalised top-k, route_scale",
                                  "shared experts", "dense first layers (num_dense_layers)"),
                      notes="post-attention and post-MLP norms beside the pre-norms; its RMSNorm multiplies the "
                            "weight before the cast to the input dtype (Gemma's order): the same in float32, one "
                            "bf16 rounding apart from hasten's kernel (Llama's order) in bf16"),
    # Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration): its text model on text-only packed batches
    "qwen3_vl_moe": ArchSpec("moe", router=SOFTMAX_TOPK_RENORM, norm=NormSpec(qk_norm=True), rotary=_MROPE,
                             model_code=("the vision tower, its merger and the deepstack features it adds to the first "
                                         "text layers (image batches only)",),
                             vision=_QWEN_VL_VISION),
    "granitemoe": ArchSpec("moe", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                           attention=("the query scale attention_multiplier",),
                           model_code=("embedding_multiplier", "residual_multiplier")),
    # Granite MoE with a shared expert beside the routed ones on every layer (shared_intermediate_size)
    "granitemoeshared": ArchSpec("moe", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                                 attention=("the query scale attention_multiplier",),
                                 model_code=("embedding_multiplier", "residual_multiplier",
                                             "the shared expert (shared_mlp: one input_linear [gate | up], SiLU, "
                                             "output_linear), added to the routed experts' output")),
    # Cohere 2 with MoE layers: Cohere's bias-free LayerNorm (transformers builds RMSNorms instead
    # where the config sets rms_norm_eps: those stay transformers' and the report says so), one norm
    # for attention and MLP in parallel, interleaved rotary on the sliding-window layers only
    "cohere2_moe": ArchSpec("moe", norm=NormSpec(kind="layer", class_suffix="LayerNorm"),
                            rotary=RotarySpec(interleaved=True, note="on the sliding-window layers (and the dense "
                                              "prefix layers where prefix_dense_sliding_window_pattern is 1) only: "
                                              "the model's attention decides"),
                            logits=LogitSpec(scale_key="logit_scale"), attention=(_LAYER_WINDOWS,),
                            model_code=("attention and MLP in parallel on one norm",
                                        "router: top-k of the logits, then softmax over the k (or sigmoid, "
                                        "expert_selection_fn)",
                                        "shared experts (a SwiGLU MLP), averaged or summed with the routed output",
                                        "dense prefix layers (mlp_layer_types)"),
                            notes="the shared experts and dense prefix MLPs are SwiGLU MLPs on hasten's kernel"),
    # K-EXAONE: pre-norm decoder (unlike exaone4's post-norms), q/k RMSNorm per head, rotary only
    # on the sliding-window layers (global layers NoPE)
    "exaone_moe": ArchSpec("moe", router=DEEPSEEK_V3, norm=NormSpec(qk_norm=True),
                           rotary=RotarySpec(note="on the sliding-window layers only (global layers without rotary "
                                             "where a sliding window is set): the model's attention decides"),
                           attention=(_LAYER_WINDOWS,),
                           model_code=("sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                       "shared experts", "dense first layers (first_k_dense_replace / "
                                       "mlp_layer_types)"),
                           notes="the shared experts and dense first-layer MLPs are SwiGLU MLPs on hasten's kernel"),
    # Hy3 (Tencent HunYuan V3): pre-norm decoder with q/k RMSNorms per head and full rotary; a sigmoid
    # router with a correction bias (on the MoE block), renormalised top-k times router_scaling_factor,
    # a SwiGLU shared expert added (in float32 where enable_moe_fp32_combine), dense first layers
    "hy_v3": ArchSpec("moe", norm=NormSpec(qk_norm=True),
                      model_code=("sigmoid router with a correction bias, renormalised top-k, router_scaling_factor",
                                  "shared experts, added to the routed output in float32 (enable_moe_fp32_combine)",
                                  "dense first layers (mlp_layer_types)"),
                      notes="the shared experts and dense first-layer MLPs are SwiGLU MLPs on hasten's kernel"),
    # MiMo-V2-Flash: sliding-window layers with attention sinks (and twice the K/V heads) between
    # full-attention layers without; value heads (v_head_dim) smaller than the query/key heads, scaled
    # by attention_value_scale; partial rotary with a base per layer type; DeepSeek-V3's router
    "mimo_v2_flash": ArchSpec("moe", router=DEEPSEEK_V3,
                              rotary=RotarySpec(partial=True, note="a rotary base and width per layer type "
                                                                   "(rope_parameters by layer type), chosen "
                                                                   "per layer by the model"),
                              attention=(_LAYER_WINDOWS, "attention sinks on the sliding-window layers (a logit per "
                                         "head in the softmax denominator)",
                                         "value heads (v_head_dim) smaller than the query/key heads, zero-padded to "
                                         "their size for the varlen kernels and sliced back"),
                              model_code=("values scaled by attention_value_scale before the attention call",
                                          "sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                          "dense first layers (mlp_layer_types)"),
                              notes="its eager attention subtracts the row max before the softmax with sinks: the "
                                    "same softmax"),
    # Laguna (poolside): q/k RMSNorms per head, partial rotary with a base and width per layer type,
    # sliding windows on the layers layer_types marks, a softplus gate on the attention output (per
    # head or per element), query heads per layer; sigmoid router (optional logit softcap) with a
    # correction bias, routed scaling, a SwiGLU shared expert, dense first layers
    "laguna": ArchSpec("moe", norm=NormSpec(qk_norm=True),
                       rotary=RotarySpec(partial=True, note="a rotary base and width per layer type (rope_parameters "
                                                            "by layer type), chosen per layer by the model"),
                       attention=(_LAYER_WINDOWS,),
                       model_code=("the attention output gated by softplus(g_proj(x)), per head or per element "
                                   "(gating)", "query heads per layer (num_attention_heads_per_layer)",
                                   "sigmoid router with a correction bias and an optional logit softcap "
                                   "(moe_router_logit_softcapping), renormalised top-k",
                                   "moe_routed_scaling_factor on the routed output", "shared experts",
                                   "dense first layers (mlp_layer_types)"),
                       notes="the shared experts and dense first-layer MLPs are SwiGLU MLPs on hasten's kernel"),
    # Granite MoE with sliding windows and attention sinks on every layer: its eager attention
    # scales the output by sigmoid(logsumexp(scores) - sink), which is the sink logit in the
    # softmax denominator (gpt-oss's sinks); a rotary base per layer (0: no rotary on that layer),
    # Granite's multipliers and logit scaling, an optional shared expert
    "granitemoe_swa": ArchSpec("moe", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                               rotary=RotarySpec(note="a rotary base per layer (layer_rope_theta), none on layers "
                                                      "with base 0: the model passes no cos/sin there"),
                               attention=(_LAYER_WINDOWS, "attention sinks on every layer (the model's output scale "
                                          "sigmoid(logsumexp - sink): a logit per head in the softmax denominator)",
                                          "the query scale attention_multiplier"),
                               model_code=("embedding_multiplier", "residual_multiplier",
                                           "router: softmax over the top-k logits",
                                           "the shared expert (shared_mlp: one input_linear [gate | up], SiLU, "
                                           "output_linear) where shared_intermediate_size is set")),
    # Mellum (JetBrains Mellum2): Qwen3-MoE's layer (q/k RMSNorms per head, softmax router, normalised
    # top-k) with sliding windows on the layers layer_types marks, a rotary base per layer type (full
    # rotary on every layer), dense SwiGLU layers where mlp_layer_types says "dense"
    "mellum": ArchSpec("moe", router=SOFTMAX_TOPK, norm=NormSpec(qk_norm=True),
                       rotary=RotarySpec(note="a rotary base per layer type (rope_parameters by layer type), chosen "
                                              "per layer by the model"),
                       attention=(_LAYER_WINDOWS,),
                       model_code=("softmax router, normalised top-k (norm_topk_prob)",
                                   "dense layers (mlp_layer_types)"),
                       notes="the dense layers' MLPs are SwiGLU MLPs on hasten's kernel; the checkpoints' "
                             "multi-token prediction layer (mtp.*) is not built (ignored at load)"),
    # Kolibri-1 (Aleph Alpha): GLM-4's layer (norms after attention and MLP beside the pre-norms), q/k
    # RMSNorms per head, rotary on the sliding-window layers only (full layers NoPE); a router that
    # picks the top-k of logits + correction bias and weights by the sigmoid of the chosen logits,
    # renormalised; a SwiGLU shared expert added in full on every layer
    "kolibri1": ArchSpec("moe", norm=NormSpec(placement="pre_post", qk_norm=True),
                         rotary=RotarySpec(note="on the sliding-window layers only (global layers without rotary "
                                                "where a sliding window is set): the model's attention decides"),
                         attention=(_LAYER_WINDOWS,),
                         model_code=("router in float32: top-k of the logits plus a correction bias, the sigmoid of "
                                     "the chosen logits, renormalised (norm_topk_prob)",
                                     "a shared expert on every layer, added in full"),
                         notes="post-attention and post-MLP norms beside the pre-norms; the shared experts are SwiGLU "
                               "MLPs on hasten's kernel"),
    # Flint (RecursiveSI): Qwen3-MoE's attention (q/k RMSNorms per head) with a learned sink logit per
    # head on every layer, sliding windows on the layers layer_types marks, rotary on those only (full
    # layers NoPE); a float32 sigmoid router without a bias, renormalised top-k; an ungated SwiGLU
    # shared expert added in full; dense first layers (mlp_only_layers)
    "flint": ArchSpec("moe", norm=NormSpec(qk_norm=True),
                      rotary=RotarySpec(note="only on the sliding-window layers: the model's own attention skips it "
                                             "on the full-attention layers"),
                      attention=(_LAYER_WINDOWS, "attention sinks on every layer (a logit per head in the softmax "
                                 "denominator)"),
                      model_code=("sigmoid router in float32 (no bias), renormalised top-k (norm_topk_prob)",
                                  "a shared expert added in full (no gate)", "dense first layers (mlp_only_layers)"),
                      notes="the shared experts and dense first-layer MLPs are SwiGLU MLPs on hasten's kernel; its "
                            "RMSNorm multiplies the weight in float32 before the cast to the input dtype (Gemma's "
                            "order): the same in float32, one bf16 rounding apart from hasten's kernel (Llama's "
                            "order) in bf16; its eager attention (the reference: no sdpa) computes the scores and "
                            "softmax in float32 under autocast too"),
    # --- hybrids: linear attention or short convolutions between attention layers (issue 19) ------
    # Qwen3-Next: Gated DeltaNet on three of four layers, gated full attention with partial rotary
    # and (1 + weight) q/k norms on the fourth, MoE with a gated shared expert on every layer
    "qwen3_next": _QWEN3_NEXT,
    # Qwen3.5's text models: Qwen3-Next's layout, dense or MoE, with the multimodal rotary (mrope:
    # for text its sections read the token positions)
    "qwen3_5_text": dataclasses.replace(_QWEN3_NEXT, family="dense", router=None,
                                        rotary=dataclasses.replace(_MROPE, partial=True),
                                        model_code=_GDN_CODE),
    "qwen3_5_moe_text": dataclasses.replace(_QWEN3_NEXT, router=SOFTMAX_TOPK_RENORM,
                                            rotary=dataclasses.replace(_MROPE, partial=True)),
    # Qwen3.5's published checkpoints (Qwen3_5ForConditionalGeneration): the text model above on
    # text-only packed batches, the vision tower as transformers wrote it
    "qwen3_5": dataclasses.replace(_QWEN3_NEXT, family="dense", router=None,
                                   rotary=dataclasses.replace(_MROPE, partial=True),
                                   model_code=_GDN_CODE + ("the vision tower and its merger (image batches only)",),
                                   vision=_QWEN_VL_VISION),
    "qwen3_5_moe": dataclasses.replace(_QWEN3_NEXT, router=SOFTMAX_TOPK_RENORM,
                                       rotary=dataclasses.replace(_MROPE, partial=True),
                                       model_code=_QWEN3_NEXT.model_code + ("the vision tower and its merger (image "
                                                                            "batches only)",),
                                       vision=_QWEN_VL_VISION),
    # OLMo hybrid: Gated DeltaNet layers (pre-norm) between OLMo 2-style attention layers (post-norms,
    # q/k norms over the whole projection)
    "olmo_hybrid": ArchSpec("dense", norm=NormSpec(placement="post", qk_norm=True),
                            model_code=_GDN_CODE + ("pre-norms on the linear-attention layers, post-norms on the "
                                                    "attention layers",),
                            stateful=_GATED_DELTANET),
    # LFM2: gated short convolutions (in_proj -> B * x -> depthwise causal conv -> C * ...) on most
    # layers, attention with q/k norms on the others; its MLP (w1, w3, w2) computes SwiGLU
    "lfm2": ArchSpec("dense", norm=NormSpec(qk_norm=True),
                     mlp=MlpSpec(projections=("w1", "w3", "w2"), fixed_activation=True),
                     model_code=("the short convolutions' projections and gates (the model's own code around the "
                                 "varlen convolution)",),
                     stateful=_SHORT_CONV),
    # LFM2-MoE: LFM2's short convolutions and attention (q/k norms), dense SwiGLU MLPs (w1, w3, w2)
    # on the first num_dense_layers, then experts behind a sigmoid router with an expert bias
    "lfm2_moe": ArchSpec("moe", norm=NormSpec(qk_norm=True),
                         mlp=MlpSpec(projections=("w1", "w3", "w2"), fixed_activation=True),
                         model_code=("the short convolutions' projections and gates (the model's own code around the "
                                     "varlen convolution)",
                                     "sigmoid router with an expert bias (use_expert_bias), normalised top-k, "
                                     "routed_scaling_factor", "dense first layers (num_dense_layers)"),
                         stateful=_SHORT_CONV),
    # LFM3: LFM2's short convolutions with sliding-window and full attention layers (q/k norms per
    # head, a per-head sigmoid output gate), norms after the operator and the MLP too (sandwich)
    "lfm3": ArchSpec("dense", norm=NormSpec(placement="pre_post", qk_norm=True),
                     mlp=MlpSpec(projections=("w1", "w3", "w2"), fixed_activation=True),
                     rotary=RotarySpec(note="one rotary embedding per layer type, chosen by the model: the config's "
                                            "sliding_attention base on the sliding layers, a 'proportional' one on "
                                            "the full layers (zero frequencies past partial_rotary_factor: the whole "
                                            "head rotates by cos 1, sin 0 there); cos/sin in float32"),
                     attention=(_LAYER_WINDOWS, "the per-head sigmoid output gate (g_proj, use_attention_gate), in "
                                "the model's own attention module", "projection biases (attention_bias)"),
                     model_code=("the short convolutions' projections and gates (the model's own code around the "
                                 "varlen convolution)",),
                     stateful=_SHORT_CONV,
                     notes="post-operator and post-FFN norms beside the pre-norms where use_sandwich_norm is set"),
    # Lara-Mini: Gated DeltaNet layers between sliding-window attention layers (rotary) and full
    # attention layers without rotary; MoE with an ungated shared expert on every layer
    "lara_mini": ArchSpec("moe", norm=NormSpec(qk_norm=True),
                          rotary=RotarySpec(note="only on the sliding-window layers: the full-attention layers get "
                                                 "no position embeddings (NoPE), the model's own decision"),
                          attention=(_LAYER_WINDOWS,),
                          model_code=_GDN_CODE + ("the router (logits in float32, softmax top-k, normalised)",
                                                  "the shared expert, added in full (no gate)"),
                          stateful=_GATED_DELTANET,
                          notes="its RMSNorm multiplies the weight in float32 before the cast to the input dtype "
                                "(Gemma's order): the same in float32, one bf16 rounding apart from hasten's kernel "
                                "(Llama's order) in bf16"),
    # EXAONE 3.0/3.5 (LG AI Research): LlamaForCausalLM's classes under model_type exaone (the
    # checkpoints' transformer.h.* names renamed at load): Llama's pre-norm decoder, SwiGLU, full rotary
    "exaone": ArchSpec("dense", attention=("projection biases (attention_bias) where set",),
                       notes="LlamaForCausalLM's classes (modeling_llama) under model_type exaone"),
    # IQuest-Coder-V1: LlamaForCausalLM's classes under model_type iquestcoder; its config refuses the
    # original code's clip_qkv and sliding windows (no released checkpoint sets them), so Llama exactly
    "iquestcoder": ArchSpec("dense", attention=("projection biases (attention_bias) where set",),
                            notes="LlamaForCausalLM's classes (modeling_llama) under model_type iquestcoder; head_dim "
                                  "a config value (128)"),
    # Sarvam-30B and Param2 (Param2-17B-A2.4B, transformers 5.25): Glm4MoeForCausalLM's classes under
    # their own model types (q/k RMSNorms per head, the sigmoid group-limited router with a correction
    # bias, shared experts, dense first layers) with full rotary by default
    "sarvam_moe": _GLM4_MOE_CLASSES,
    "param2moe": _GLM4_MOE_CLASSES,
    # MiniCPM 5 MoE (transformers 5.25): Llama's attention with the query projection doubled into a
    # query and a per-channel output gate (q_gate_proj; the output times sigmoid(gate) before o_proj), GQA,
    # Llama's rotary halves; DeepSeek-V3's MoE block with its router computed in float32 (sigmoid, a
    # correction bias, group-limited top-k, routed scaling), shared experts; dense layers where
    # mlp_layer_types says
    "minicpm5_moe": ArchSpec("moe",
                             attention=("the attention output gated per channel by sigmoid(gate) from q_gate_proj, "
                                        "in the model's own attention module",),
                             model_code=("the router in float32: sigmoid with a correction bias, group-limited "
                                         "top-k, routed scaling", "shared experts",
                                         "dense layers where mlp_layer_types says"),
                             notes="MiniCPM5MoeForCausalLM (modeling_minicpm5_moe): DeepseekV3's model and MoE "
                                   "classes around Llama's gated attention"),
    # Sarvam-105B: DeepseekV3ForCausalLM's classes (multi-head latent attention, here with a plain query
    # projection: q_lora_rank None, the sigmoid group-limited router, shared experts, dense first layers)
    "sarvam_mla": ArchSpec("moe", router=DEEPSEEK_V3,
                           rotary=_DEEPSEEK_ROTARY, attention=(_MLA,), model_code=_DEEPSEEK_CODE + (
        "sigmoid router with a correction bias, group-limited top-k, routed scaling",),
        notes="DeepseekV3ForCausalLM's classes (modeling_deepseek_v3) under model_type sarvam_mla"),
    # BitNet b1.58: Llama's decoder with an RMSNorm on the attention output before o_proj (attn_sub_norm)
    # and a gated ReLU² MLP with an RMSNorm before down_proj (ffn_sub_norm); the checkpoints' projections
    # are ternary BitLinear / AutoBitLinear layers (weights and activations quantised in their own forward)
    "bitnet": ArchSpec("dense", mlp=MlpSpec(kind="own"), attention=("projection biases (attention_bias) where set",),
                       model_code=("the MLP down_proj(ffn_sub_norm(relu2(gate_proj(x)) * up_proj(x))): a norm "
                                   "between the gated product and down_proj, which hasten's gated kernels do not take",
                                   "the projections: BitLinear / AutoBitLinear where the checkpoint's quantization "
                                   "config converts them (activation and weight quantisation in their own forward)"),
                       notes="the sub-norms (attn_sub_norm, ffn_sub_norm) are RMSNorm modules of the model's class: "
                             "on hasten's kernel like the pre-norms; the attention output is normed before o_proj "
                             "by the model's own attention module; a quantised LM head (not plain nn.Linear) keeps "
                             "transformers' loss"),
    # Kimi Linear: Kimi Delta Attention layers (a short convolution over q/k/v, then the gated delta rule
    # with a decay per key channel, chunk_kimi_delta_attention) between multi-head latent attention
    # layers without rotary (NoPE); DeepSeek-V3's router and experts, shared experts, dense first layers
    "kimi_linear": ArchSpec("moe", router=DEEPSEEK_V3,
                            rotary=RotarySpec(own=True, note="none: its latent attention rotates nothing (NoPE); the "
                                                             "qk_rope_head_dim part of each key head is one shared, "
                                                             "unrotated head"),
                            attention=(_MLA, "projection biases (attention_bias) where set"),
                            model_code=("the Kimi delta attention layers' projections, forget gate (a decay per key "
                                        "channel from A_log and dt_bias), beta gate and gated RMSNorm (the model's own "
                                        "code around the varlen convolution and delta rule)",
                                        "low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) "
                                        "projections with their RMSNorms",
                                        "sigmoid router with a correction bias, group-limited top-k, routed scaling",
                                        "shared experts", "dense first layers (mlp_layer_types)"),
                            stateful=StatefulSpec(layers=(("DeltaAttention", ("causal_conv1d_fn",
                                                                              "chunk_kimi_delta_attention")),))),
    # --- LLaVA-style and other vision-language wrappers on a registered text model, text packed ---
    # Each builds its text model with AutoModel.from_config(text_config) and puts its own lm_head on the
    # text model's last hidden states (no logit scale or softcap: the loss takes the head's logits as
    # they are); image features are scattered into the embeddings at image tokens only when
    # pixel_values come, and nothing else touches a text-only batch. The text model's type is the
    # checkpoint's (Llama, Mistral, Qwen2, Qwen3 in the published ones): the entry declares their
    # common pieces (RMSNorm, SwiGLU gate/up/down, rotate_half rotary), and each class is still run
    # against hasten's kernel at accelerate(), so a text model of another form keeps its own code
    # LLaVA 1.5 (LlavaForConditionalGeneration): a CLIP tower, a two-layer GELU projector; Llama text
    "llava": ArchSpec("dense", attention=(_WINDOWS, "projection biases where the text config sets them"),
                      model_code=("the CLIP vision tower and its projector (image batches only)",),
                      vision=_IMAGES_VISION,
                      notes="the text model is the checkpoint's text_config type (Llama; Mistral, Qwen2 in "
                            "others): its pieces run on hasten's kernels where they pass the probes"),
    # LLaVA-NeXT (LlavaNextForConditionalGeneration): LLaVA with any-resolution tiles and an image_newline
    # vector (image batches only); Llama or Mistral text (llava-v1.6-mistral: a sliding window)
    "llava_next": ArchSpec("dense", attention=(_WINDOWS, "projection biases where the text config sets them"),
                           model_code=("the CLIP vision tower, its projector, any-resolution tiling and "
                                       "image_newline (image batches only)",),
                           vision=_IMAGES_VISION,
                           notes="the text model is the checkpoint's text_config type (Llama, Mistral)"),
    # LLaVA-OneVision (LlavaOnevisionForConditionalGeneration): a SigLIP tower, any-resolution tiles and
    # pooled video frames (image/video batches only); Qwen2 text (q/k/v biases, windows where set)
    "llava_onevision": ArchSpec("dense", attention=(_WINDOWS, "qkv bias"),
                                model_code=("the SigLIP vision tower, its projector, any-resolution tiling, "
                                            "image_newline and video pooling (image/video batches only)",),
                                vision=_IMAGES_VISION.replace("images (pixel_values)",
                                                             "images or videos (pixel_values, pixel_values_videos)"),
                                notes="the text model is the checkpoint's text_config type (Qwen2)"),
    # InternVL 3 / 3.5 (InternVLForConditionalGeneration): InternViT, pixel shuffle and an MLP projector;
    # Qwen2 (InternVL3) or Qwen3 (InternVL3.5) text
    "internvl": ArchSpec("dense", attention=(_WINDOWS, "qkv bias (Qwen2 text)"),
                         model_code=("the InternViT vision tower, pixel shuffle and the projector (image batches "
                                     "only)",), vision=_IMAGES_VISION,
                         notes="the text model is the checkpoint's text_config type (Qwen2; Qwen3, whose q/k "
                               "RMSNorms per head are patched with its other norms; InternVL3.5-GPT-OSS's gpt_oss "
                               "text is untested here)"),
    # Idefics3 (Idefics3ForConditionalGeneration): a SigLIP-style tower, pixel-shuffle connector and an
    # inputs merger (image batches only); Llama text. Its model makes a DynamicCache where
    # config.use_cache is on (its default): the cache only stores the layer's own keys and values
    "idefics3": ArchSpec("dense", attention=(_WINDOWS, "projection biases where the text config sets them"),
                         model_code=("the vision tower, its pixel-shuffle connector and the inputs merger (image "
                                     "batches only)",), vision=_IMAGES_VISION,
                         notes="the text model is the checkpoint's text_config type (Llama)"),
    # SmolVLM / SmolVLM2 (SmolVLMForConditionalGeneration): Idefics3's layout, Llama text (SmolLM2)
    "smolvlm": ArchSpec("dense", attention=(_WINDOWS, "projection biases where the text config sets them"),
                        model_code=("the vision tower, its pixel-shuffle connector and the image merge (image "
                                    "batches only)",), vision=_IMAGES_VISION,
                        notes="the text model is the checkpoint's text_config type (Llama)"),
    # LightOnOCR (LightOnOcrForConditionalGeneration): a Pixtral tower, an RMSNorm and patch-merger
    # projector (image batches only, not patched: hasten patches the text model); Qwen3 text
    "lighton_ocr": ArchSpec("dense", norm=NormSpec(qk_norm=True), attention=(_WINDOWS,),
                            model_code=("the Pixtral vision tower and its projector (RMSNorm, patch merger, two "
                                        "linears; image batches only)",), vision=_IMAGES_VISION,
                            notes="the text model is the checkpoint's text_config type (Qwen3: q/k norms per head)"),
    # helper-i anchor
    # --- GPT-2-era decoders: nn.LayerNorm with bias (torch's own kernel), ungated MLPs with biases,
    # learned absolute positions or GPT-J's sinusoid rotary inside the attention; hasten's gains are its
    # varlen attention on packed batches and the fused loss --------------------------------------------
    # GPT-2: learned absolute positions (wpe) read from position_ids (per packed sample: the collator's),
    # one Conv1D c_attn; the query scale (scale_attn_weights, scale_attn_by_inverse_layer_idx) reaches
    # the attention call as `scaling`
    "gpt2": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                     rotary=RotarySpec(own=True, note="none: learned absolute position embeddings (wpe) indexed by "
                                                      "position_ids, which restart at each packed sample"),
                     attention=("the query scale: 1/sqrt(head_dim) where scale_attn_weights, divided by layer_idx + 1 "
                                "where scale_attn_by_inverse_layer_idx (passed as `scaling`)", "projection biases"),
                     model_code=("learned absolute position embeddings (wpe)", "Conv1D c_attn / c_proj projections",
                                 "the ungated MLP c_proj(act(c_fc(x))) with biases"),
                     notes="reorder_and_upcast_attn only changes transformers' eager path (float32 scores, the same "
                           "softmax); hasten's varlen kernels compute the scores in float32 too"),
    # GPTBigCode (SantaCoder, StarCoder 1): GPT-2's layout with multi-query attention (multi_query: one
    # K/V head), learned absolute positions from position_ids
    "gpt_bigcode": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"),
                            mlp=MlpSpec(kind="ungated"),
                            rotary=RotarySpec(own=True, note="none: learned absolute position embeddings (wpe) "
                                                             "indexed by position_ids, which restart at each packed "
                                                             "sample"),
                            attention=("multi-query attention (multi_query: one K/V head)",
                                       "the query scale 1/sqrt(head_dim) where scale_attn_weights", "projection biases"),
                            model_code=("learned absolute position embeddings (wpe)", "fused c_attn projection",
                                        "the ungated MLP c_proj(act(c_fc(x))) with biases")),
    # GPT-J: attention and MLP in parallel on one norm, rotary on interleaved pairs (rotate_every_two) of
    # the first rotary_dim of each head from a sinusoid table indexed by position_ids; its
    # apply_rotary_pos_emb(x, sin, cos) takes sin first and half-width tables, so the rotary stays its own
    "gptj": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                     rotary=RotarySpec(own=True, note="interleaved pairs on the first rotary_dim of each head, in the "
                                                      "model's attention (apply_rotary_pos_emb(x, sin, cos) on "
                                                      "half-width sin/cos from a table indexed by position_ids)"),
                     model_code=("attention and MLP in parallel on one norm",
                                 "the ungated MLP fc_out(act(fc_in(x))) with biases"),
                     notes="the LM head has a bias, which hasten's fused loss adds"),
    # CodeGen: GPT-J's layer with one qkv_proj laid out over 4 model-parallel shards [q | v | k] each,
    # the rotary (interleaved pairs, rotary_dim) in float32 in the model's attention
    "codegen": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                        rotary=RotarySpec(own=True, note="interleaved pairs on the first rotary_dim of each head, in "
                                                         "the model's attention (apply_rotary_pos_emb(x, sin, cos) on "
                                                         "half-width float32 sin/cos indexed by position_ids)"),
                        model_code=("fused qkv_proj over 4 model-parallel shards, [q | v | k] per shard",
                                    "attention and MLP in parallel on one norm",
                                    "the ungated MLP fc_out(act(fc_in(x))) with biases"),
                        notes="the LM head has a bias, which hasten's fused loss adds"),
    # OPT: learned absolute positions with an offset of 2, read from position_ids when the batch has them
    # (from the attention_mask's cumsum only without); the query scaled before the call (scaling=1.0);
    # pre-norm or post-norm (do_layer_norm_before: OPT-350m's post), project_in/out where
    # word_embed_proj_dim differs from hidden_size
    "opt": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                    rotary=RotarySpec(own=True, note="none: learned absolute position embeddings (offset 2) indexed "
                                                     "by position_ids, which restart at each packed sample"),
                    attention=("projection biases (enable_bias)",),
                    model_code=("learned absolute position embeddings (offset 2)",
                                "the query scaled by 1/sqrt(head_dim) after q_proj, before the attention call",
                                "norms before or after attention and MLP (do_layer_norm_before)",
                                "project_in / project_out where word_embed_proj_dim is set",
                                "the ungated MLP fc2(act(fc1(x))) with biases")),
    # BioGPT: pre-norm GPT-2-style decoder, learned absolute positions (offset 2) from position_ids, the
    # embedding scaled by sqrt(hidden) (scale_embedding); its class leaves `_supports_attention_backend`
    # off although its attention calls transformers' attention interface with every keyword argument
    "biogpt": ArchSpec("dense", norm=NormSpec(kind="torch", class_suffix="LayerNorm"), mlp=MlpSpec(kind="ungated"),
                       rotary=RotarySpec(own=True, note="none: learned absolute position embeddings (offset 2) "
                                                        "indexed by position_ids, which restart at each packed "
                                                        "sample"),
                       attention=("projection biases",),
                       model_code=("embedding scale sqrt(hidden) where scale_embedding is set",
                                   "learned absolute position embeddings (offset 2)",
                                   "the ungated MLP fc2(act(fc1(x))) with biases"),
                       attention_interface=(
                           "BioGptAttention calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS) and its "
                           "model and decoder layers pass it position_ids and every other keyword argument (the "
                           "batch's packing metadata included), as the models that set the mark do"),
                       attention_kwargs_reach=True),
    # Gemma 3n's text model (Gemma3nForCausalLM): pre and post norms (RMSNorm, weight without the + 1,
    # eps), q/k norms per head, windows on the layers layer_types marks, Gemma 4's single-tensor rotary,
    # K/V shared across the last layers, final softcap; around them AltUp (altup_num_inputs residual
    # streams predicted and corrected per token), Laurel (a low-rank residual branch), per-layer input
    # embeddings, and a GeGLU MLP with a Gaussian top-k cut-off on the first layers' gate
    # (activation_sparsity_pattern): not hasten's GeGLU kernel there, so the MLP stays the model's own
    "gemma3n_text": ArchSpec("dense", norm=NormSpec(eps_attribute="eps", placement="pre_post", qk_norm=True),
                             mlp=MlpSpec(kind="own"), logits=_SOFTCAP,
                             rotary=RotarySpec(single_tensor=True, note="rotary on (B, L, heads, D) before the head "
                                               "transpose; two rotary bases (local and global layers), chosen per "
                                               "layer by the model"),
                             attention=(_LAYER_WINDOWS, "the query scale 1 (the q/k norms in its place)"),
                             model_code=("embedding scale sqrt(hidden)",
                                         "per-layer input embeddings (embed_tokens_per_layer, "
                                         "per_layer_model_projection, each layer's gate and projection)",
                                         "AltUp: altup_num_inputs residual streams, magnitude-matched projections, "
                                         "per-token router, prediction and correction coefficients",
                                         "Laurel: a low-rank residual branch with its RMSNorm",
                                         "the GeGLU MLP with its Gaussian top-k activation sparsity (per token, "
                                         "from the gate's mean and std) on the layers activation_sparsity_pattern "
                                         "marks",
                                         "K/V shared across the last layers (num_kv_shared_layers)",
                                         "a value norm without weight (with_scale=False)"),
                             notes="the MLP stays the model's on every layer: the sparse layers' gate is cut off "
                                   "before the GELU, which hasten's GeGLU kernel does not compute; a K/V-sharing "
                                   "layer reads the packed row's K/V of the last earlier layer of its type and "
                                   "attends with the same packed boundaries and its own window"),
    # helper-j anchor
    # Apertus 1.5's text model (Apertus1p5TextForCausalLM): Apertus's decoder unchanged (q/k RMSNorms per
    # head, ungated xIELU MLP, llama3 rotary scaling) with a vocabulary extended by visual and audio codes
    # and an LM head optionally pruned to its text prefix (output_vocab_size rows): the fused loss reads
    # the head's own weight, so its width is the head's, as transformers' loss (vocab_size=out_features)
    "apertus1p5_text": ArchSpec("dense", norm=NormSpec(qk_norm=True), mlp=MlpSpec(kind="ungated"),
                                model_code=("the ungated MLP down_proj(xielu(up_proj(x))) with the activation's "
                                            "learned alpha_p, alpha_n",),
                                notes="Apertus's classes; pre-norms named attention_layernorm and "
                                      "feedforward_layernorm; q/k RMSNorms per head before the rotary; the LM head "
                                      "may be narrower than the input vocabulary (output_vocab_size): labels must "
                                      "lie below its width, as in transformers"),
    # Cohere Compass's text model (CohereCompassForCausalLM, North): Cohere 2's layer (LayerNorm without
    # bias, attention and MLP in parallel on one norm, windows on the layers layer_types marks, logit
    # scale) but Qwen3-VL's text rotary: rotate_half halves (not Cohere's interleaved pairs), mrope
    # sections interleaved along the frequencies, a rotary per layer type (None: that type NoPE)
    "cohere_compass_text": ArchSpec("dense", norm=NormSpec(kind="layer", class_suffix="LayerNorm"),
                                    rotary=RotarySpec(note="multimodal rotary (mrope, sections interleaved along "
                                                           "the frequencies) with a base per layer type "
                                                           "(rope_parameters by layer type; a type without one gets "
                                                           "no rotary): the model builds cos/sin, for text from the "
                                                           "token positions"),
                                    logits=LogitSpec(scale_key="logit_scale"),
                                    attention=(_LAYER_WINDOWS,),
                                    model_code=("attention and MLP in parallel on one norm",
                                                "the deepstack visual features its text model adds to the first "
                                                "layers (image batches of the wrapper only)")),
    # Aria's text model (AriaTextForCausalLM): Llama's attention (optional projection biases) and pre-norms,
    # MoE on every layer: a router picking the top-k logits and weighting by their softmax, experts stored
    # transposed ((E, in, out): is_transposed) with SiLU always, shared experts (a SwiGLU MLP of
    # moe_num_shared_experts * intermediate_size) added in full
    "aria_text": ArchSpec("moe", attention=("projection biases (attention_bias)",),
                          model_code=("router: top-k of the logits, softmax over the k chosen",
                                      "the shared experts, added in full (no gate)"),
                          notes="the shared experts are a SwiGLU MLP on hasten's kernel where hidden_act is silu; "
                                "the routed experts' weights are (E, in, out), which the fused path reads as "
                                "stored"),
    # Aya Vision (AyaVisionForConditionalGeneration) and Command A Vision
    # (Cohere2VisionForConditionalGeneration): see _AYA_VISION
    "aya_vision": _AYA_VISION,
    "cohere2_vision": _AYA_VISION,
    # Kimi K2.5 (Kimi_K25ForConditionalGeneration): DeepSeek-V3's text model (MLA, sigmoid group-limited
    # router with a correction bias, shared experts, dense first layers), a MoonViT tower; image and
    # video placeholder ids are embedded as id 0 (the same packed or not)
    "kimi_k25": ArchSpec("moe", router=DEEPSEEK_V3, rotary=_DEEPSEEK_ROTARY, attention=(_MLA,),
                         model_code=_DEEPSEEK_CODE + ("sigmoid router with a correction bias, group-limited top-k, "
                                                      "routed scaling",
                                                      "the MoonViT vision tower and its patch-merging projector"),
                         vision=_QWEN_VL_VISION),
    # EXAONE 4.5 (Exaone4_5_ForConditionalGeneration): EXAONE 4's text model (norms after attention and
    # MLP, q/k norms per head, windows on the layers layer_types marks, NoPE on the full layers where
    # a window is set), a Qwen2.5-VL-style windowed tower; text positions are the token positions (1-D)
    # LLaVA-OneVision-1.5 (a windowed tower and merger), Ovis2.5 (EXAONE 4.5's wrapper, a SigLIP-style
    # tower and a visual-vocabulary projector), transformers 5.25
    "llava_onevision1_5": _QWEN3_TEXT_VL,
    "ovis2_5": _QWEN3_TEXT_VL,
    "exaone4_5": ArchSpec("dense", norm=NormSpec(placement="post", qk_norm=True), attention=(_LAYER_WINDOWS,),
                          model_code=("the windowed vision tower and its merger",), vision=_QWEN_VL_VISION),
    # GLM-4.6V (Glm46VForConditionalGeneration): GLM-4.1V's text model (glm4v_text: glm4v's entry), mrope
    "glm46v": ArchSpec("dense", norm=NormSpec(placement="pre_post"), mlp=MlpSpec(fused_gate_up=True),
                       rotary=RotarySpec(interleaved=True, partial=True, note=_MROPE.note),
                       attention=("qkv bias",), model_code=("the vision tower and its merger",),
                       vision=_QWEN_VL_VISION, notes="post-attention and post-MLP norms beside the pre-norms"),
    # LFM2-VL (Lfm2VlForConditionalGeneration): LFM2's text model (short convolutions between attention
    # layers, q/k norms, SwiGLU w1/w3/w2), a SigLIP 2 tower; the wrapper passes its keyword arguments down
    # to the text model's layers, so hasten.stateful's packing metadata reaches the convolutions
    "lfm2_vl": ArchSpec("dense", norm=NormSpec(qk_norm=True),
                        mlp=MlpSpec(projections=("w1", "w3", "w2"), fixed_activation=True),
                        model_code=("the short convolutions' projections and gates (the model's own code around "
                                    "the varlen convolution)",
                                    "the SigLIP 2 vision tower, its pixel-unshuffle and projector"),
                        stateful=_SHORT_CONV,
                        vision=("text-only packed batches on hasten's attention and varlen convolutions; a packed "
                                "batch with images (pixel_values) is refused: image tokens attend to each other "
                                "both ways. Images train padded (training.packed_sequence: false)")),
    # helper-k anchor
    # LongCat-Flash (Meituan): each decoder layer holds two attention sublayers (DeepSeek-V3's MLA with a
    # low-rank query and LoRA scales on the normed latents, interleaved rotary on the rope part) and two
    # dense SwiGLU MLPs, plus a shortcut MoE on the first sublayer's post-attention norm, added at the end;
    # its experts include zero-computation (identity) experts, outside transformers' experts interface
    "longcat_flash": ArchSpec("moe", rotary=dataclasses.replace(_DEEPSEEK_ROTARY, note=(
                                  "interleaved pairs on the rope part of each query/key head (qk_rope_head_dim), "
                                  "through the model's own apply_rotary_pos_emb_interleave")),
                              attention=(_MLA,),
                              model_code=("low-rank query (q_lora_rank) and compressed key/value (kv_lora_rank) "
                                          "projections with their RMSNorms, scaled by sqrt(hidden / rank) "
                                          "(mla_scale_q_lora, mla_scale_kv_lora)",
                                          "two attention and two MLP sublayers per decoder layer, the shortcut MoE "
                                          "added to the second sublayer's output",
                                          "router: softmax scores, top-k of scores plus a correction bias, "
                                          "routed_scaling_factor",
                                          "the experts with their zero-computation (identity) experts"),
                              experts="LongcatFlashExperts routes tokens to zero_expert_num identity experts beside "
                                      "the SwiGLU ones (ids past n_routed_experts: the input times its weight) "
                                      "and loops over the hit experts itself: not transformers' experts interface",
                              notes="the dense sublayer MLPs (mlps) are SwiGLU MLPs on hasten's kernel; the "
                                    "checkpoints' multi-token prediction layer (mtp.*) is not built"),
    # DiffLlama: Llama's layer with differential attention, (softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V,
    # computed by its module as two plain attention calls on the same q/k (one per half of the value
    # heads), then the learned lambda, a weightless RMSNorm (nn.RMSNorm) per head pair and (1 - lambda_init)
    "diffllama": ArchSpec("dense",
                          attention=("differential attention: two plain attention calls on the same queries and "
                                     "keys (value heads split in halves), each on hasten's varlen kernels",),
                          model_code=("the differential combination: the second call's output times the learned "
                                      "lambda (lambda_q1/k1/q2/k2, lambda_init) subtracted from the first's",
                                      "the weightless per-head-pair RMSNorm (torch's nn.RMSNorm, groupnorm) and the "
                                      "(1 - lambda_init) scale")),
    # HunYuanOCR (HunYuanVLForConditionalGeneration): HunYuan-Dense's text decoder (pre-norm RMSNorm, SwiGLU,
    # q/k RMSNorms per head after the rotary) with xdrope (mrope: sections of the rotary over 4 axes; for
    # text all axes are the token positions, the standard rotary) and NTK-alpha rotary scaling (the
    # checkpoints' "dynamic" with a fixed alpha: static frequencies); a plain LM head
    "hunyuan_vl": ArchSpec("dense", norm=NormSpec(qk_norm=True),
                           rotary=RotarySpec(note="multimodal rotary (xdrope/mrope over the axes mrope_section "
                                                  "lists, NTK-alpha base): the model builds cos/sin, for text from "
                                                  "the token positions"),
                           attention=("projection biases (attention_bias)",),
                           model_code=("q/k RMSNorms per head applied after the rotary, as HunYuan-Dense",
                                       "the vision tower and its patch merger"),
                           vision=("text-only packed batches on hasten's attention; a packed batch with images "
                                   "(pixel_values) is refused: the image tokens' rotary positions (width, height, "
                                   "image index) are built over the whole row. Images train padded "
                                   "(training.packed_sequence: false)"),
                           notes="hunyuan_vl_text has no causal-LM class of its own: only the wrapper is keyed"),
    # Granite 4 Vision (Granite4VisionForConditionalGeneration): Granite's text decoder (embedding, residual and
    # attention multipliers; logits divided by the text config's logits_scaling in the wrapper's forward) with
    # deepstack visual features added to chosen layers (image batches only), a CLIP tower and window Q-Formers
    "granite4_vision": ArchSpec("dense", logits=LogitSpec(scale_key="logits_scaling", scale_divides=True),
                                attention=("the query scale attention_multiplier", "projection biases "
                                           "(attention_bias)"),
                                model_code=("embedding_multiplier", "residual_multiplier",
                                            "the CLIP vision tower, its window Q-Former projectors and the deepstack "
                                            "features they add to the layers deepstack_layer_map names (image "
                                            "batches only)"),
                                vision=("text-only packed batches on hasten's attention; a packed batch with images "
                                        "(pixel_values) is refused. Images train padded "
                                        "(training.packed_sequence: false)"),
                                notes="granite4_vision_text has no causal-LM class of its own: only the wrapper is "
                                      "keyed; the fused loss divides by text_config.logits_scaling, as the "
                                      "wrapper's forward does"),
    # Step 3.7 (Step3p7ForConditionalGeneration; text model step3p5): Gemma-style norms (weight + 1, float32),
    # q/k norms per head before a partial rotary (a base and fraction per layer type), windows on the layers
    # layer_types marks (their own head count), query scale query_pre_attn_scalar, a sigmoid output gate per
    # head; MoE with a sigmoid router (correction bias, renormalised top-k, routed scaling) and a shared
    # expert. Its MLPs and experts clamp the gate and up product where swiglu_limits(_shared) set a bound
    # (published: layers 43-44), which hasten's kernels do not and a probe on random inputs might not see
    "step3p7": ArchSpec("moe", norm=dataclasses.replace(_GEMMA_NORM, qk_norm=True), mlp=MlpSpec(kind="own"),
                        rotary=RotarySpec(partial=True, note="a base and a rotated fraction per layer type, "
                                          "built by the model"),
                        attention=(_LAYER_WINDOWS, "the query scale query_pre_attn_scalar",
                                   "the sliding layers' own head count (num_sliding_attention_heads)",
                                   "projection biases (attention_bias)"),
                        model_code=("the attention output gated per head by sigmoid(g_proj(x))",
                                    "sigmoid router with a correction bias, top-k scores renormalised, "
                                    "moe_router_scaling_factor",
                                    "the dense and shared-expert SwiGLU MLPs with their optional clamps "
                                    "(swiglu_limits_shared)", "dense first layers (mlp_layer_types)",
                                    "the vision tower and its projector"),
                        experts="Step3p7Experts clamps gate and up to +-swiglu_limits[layer] where set and loops "
                                "over the hit experts itself (not transformers' experts interface); a probe on "
                                "random inputs could pass a bound it never reaches",
                        vision=("text-only packed batches on hasten's attention; a packed batch with images "
                                "(pixel_values) is refused. Images train padded (training.packed_sequence: false)"),
                        notes="step3p5 has no causal-LM class of its own: only the wrapper is keyed; "
                              "use_bidirectional_attention (off in the published config) is refused by the "
                              "contract; the checkpoints' multi-token prediction layers are not built"),
    # ERNIE 4.5 VL MoE (Ernie4_5_VLMoeForConditionalGeneration): ERNIE 4.5's decoder (RMSNorm, SwiGLU, biases
    # where use_bias) with a 3-D rotary on interleaved pairs (its rotary module re-interleaves cos/sin itself,
    # so the module's apply_rotary_pos_emb takes them whole, as glm4v's) and modality-isolated MoE: text tokens
    # go to the text experts, image/video tokens (moe_mm_token_type_ids) to the vision experts, both
    # transformers' experts interface; a softmax router with a correction bias, renormalised top-k
    "ernie4_5_vl_moe": ArchSpec("moe", rotary=RotarySpec(interleaved=True, note="3-D rotary (h/w/t frequency "
                                                         "sections): the model builds cos/sin, for text from the "
                                                         "token positions"),
                                attention=("projection biases (use_bias)",),
                                model_code=("softmax router in float32 with a correction bias (moe_statics), top-k "
                                            "renormalised (moe_norm_min)",
                                            "text and vision experts chosen per token by moe_mm_token_type_ids",
                                            "shared experts", "dense layers (mlp_layer_types)",
                                            "the vision tower and its variable-resolution resampler"),
                                vision=_QWEN_VL_VISION,
                                notes="ernie4_5_vl_moe_text has no causal-LM class of its own: only the wrapper is "
                                      "keyed; a text-only batch runs the text experts alone"),
    # Mistral 4 (Mistral4ForCausalLM): DeepSeek-V3's layout (multi-head latent attention with a low-rank query,
    # the rotary on the rope part of each head, interleaved where rope_interleave) with yarn rotary, the yarn
    # mscale^2 in the query scale, Llama 4's position-dependent query scale 1 + beta * log(1 + floor(pos /
    # orig_max)) from position_ids (per packed sample: the collator's), and a softmax router (group-limited
    # top-k, renormalised, routed scaling) over transformers' experts interface plus shared experts
    "mistral4": ArchSpec("moe", rotary=_DEEPSEEK_ROTARY, attention=(_MLA, "the query scale qk_head_dim^-0.5 times "
                                                                   "the yarn mscale^2 (mscale_all_dim)"),
                         model_code=_DEEPSEEK_CODE + (
                             "softmax router, group-limited top-k, renormalised (norm_topk_prob), routed scaling",
                             "the query scale 1 + llama_4_scaling_beta * log(1 + floor(position / "
                             "original_max_position_embeddings)), from each sample's own positions"),
                         notes="yarn rotary scaling in the model's rotary module (cos/sin) on the rope part of each "
                               "head (partial_rotary_factor = qk_rope_head_dim / head_dim)"),
    # helper-l anchor
}


def model_type_of(config) -> str:
    """The model type the table is keyed by: the config's own. A multimodal wrapper (`gemma3`,
    `gemma4`) is its own type, in the table only with an entry of its own that says what its
    vision side does (`vision`), even though its text model's classes are those of an entry."""
    return str(getattr(config, "model_type", None) or "?")


def spec_for(config) -> ArchSpec | None:
    return ARCHITECTURES.get(model_type_of(config))
