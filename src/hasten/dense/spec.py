"""What a model type's dense pieces compute, declared per type (integrations/architectures.py).

The patch code (dense/patch.py) reads these and never guesses a layout from a class name alone;
before a class is patched its own forward is still run against the kernel on random inputs
(`*_mismatch`), so an entry that is wrong about a model leaves the piece to transformers with the
reason instead of training it wrong.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NormSpec:
    """The decoder's norms.

    kind         "rms": x * rsqrt(mean(x^2) + eps) * (weight + weight_offset), hasten::rms_norm;
                 "layer": mean-centred, weight without bias (Cohere), torch's fused layer_norm;
                 "torch": nn.LayerNorm already (StarCoder2): one torch kernel, nothing to patch;
                 "own": a norm of no form hasten's kernels take (NanoChat's RMSNorm without weight):
                 the model's own code runs, which the entry's model_code names.
    class_suffix the module classes that are these norms (e.g. "RMSNorm", "LayerNorm")
    weight_offset 1.0 where the weight is stored as an offset from one (Gemma: `1 + weight`)
    eps_attribute where the module keeps its epsilon ("variance_epsilon"; Gemma: "eps")
    placement    "pre" (before attention and MLP), "pre_post" (also after each: Gemma 2/3),
                 "post" (after each only: OLMo 2/3, GLM-4 adds post norms to pre): the model's own
                 decoder layer applies them; a fused residual add must follow it
    qk_norm      q and k normed per head (or over the projection) by modules of the same class
    """

    kind: str = "rms"
    class_suffix: str = "RMSNorm"
    weight_offset: float = 0.0
    eps_attribute: str = "variance_epsilon"
    placement: str = "pre"
    qk_norm: bool = False

    @property
    def fused(self) -> bool:
        """Whether hasten's norm kernel takes this norm ("torch" and "own" stay the model's code)."""
        return self.kind not in ("torch", "own")


@dataclass(frozen=True)
class MlpSpec:
    """The decoder's MLP.

    kind  "swiglu": down(silu(gate) * up); "geglu_tanh": down(gelu_tanh(gate) * up) (Gemma);
          "ungated": one up projection, the model's own activation, a down projection (StarCoder2's
                     GELU, Nemotron's and Arcee's ReLU^2, Apertus's xIELU): no gate, nothing to fuse
          "own": a gated MLP of no form hasten's kernels take (BitNet's RMSNorm between the gated
                 product and down_proj): the model's own code runs, which the entry's model_code names
    fused_gate_up  one `gate_up_proj` whose output is [gate | up] along the last dimension
                   (Phi-3, GLM-4) instead of gate_proj and up_proj
    projections    the module names of (gate, up, down): LFM2 calls them (w1, w3, w2)
    fixed_activation  the MLP's own code applies the gate's activation (LFM2's F.silu) and the
                   config names none; the probe still runs the module against the kernel
    """

    kind: str = "swiglu"
    fused_gate_up: bool = False
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    fixed_activation: bool = False

    @property
    def fused(self) -> bool:
        """Whether hasten's gated kernels take this MLP ("ungated" and "own" stay the model's code)."""
        return self.kind in ("swiglu", "geglu_tanh")


@dataclass(frozen=True)
class RotarySpec:
    """The modeling module's `apply_rotary_pos_emb(q, k, cos, sin)`.

    interleaved    pairs (2j, 2j+1) rotate (GLM, Cohere: x[..., ::2], x[..., 1::2]); otherwise the
                   halves (j, j + R/2) (Llama's rotate_half)
    cos_first_half the function re-interleaves cos and sin from their first half (GLM-4:
                   `cos[..., :R/2].repeat_interleave(2)`); hasten does the same on the small cos
    partial        the rotated width R is below head_dim (`partial_rotary_factor`: Phi-3, GLM-4);
                   the rest of each head passes through. R is read from cos at every call.
    single_tensor  the function rotates one tensor, `apply_rotary_pos_emb(x, cos, sin)` (Gemma 4)
    half_width_cos cos and sin carry one value per frequency (R/2) for both halves (gpt-oss's
                   `_apply_rotary_emb`: x1 * cos - x2 * sin, x2 * cos + x1 * sin); hasten repeats
                   them to R
    own            the model's rotary code stays (not patched): its attention rotates through
                   something other than one `apply_rotary_pos_emb` hasten covers (DeepSeek: the
                   rotary part of each head only, through a complex-number function (V2) or a
                   de-interleaving one chosen per config (V3's rope_interleave)); `note` says what
    note           what the model's own code does around it (no-rotary layers, two bases)
    """

    interleaved: bool = False
    cos_first_half: bool = False
    partial: bool = False
    single_tensor: bool = False
    half_width_cos: bool = False
    own: bool = False
    note: str = ""


@dataclass(frozen=True)
class LogitSpec:
    """What the LM head's logits go through before the loss, which the fused loss applies.

    softcap_key  config key of tanh softcapping, cap * tanh(logits / cap) (Gemma 2/3)
    scale_key    config key of a logit scale (Cohere `logit_scale` multiplies, Granite
                 `logits_scaling` divides: `scale_divides`)
    scale_where_forward_names  the scale applies only where the source of the model class's
                 forward names `scale_key`: a multimodal wrapper whose text config carries the
                 key while its head, release by release, may or may not apply it (Aya Vision:
                 lm_head alone up to transformers 5.24, times the text config's logit_scale from
                 5.25 on)
    """

    softcap_key: str | None = None
    scale_key: str | None = None
    scale_divides: bool = False
    scale_where_forward_names: bool = False

    def accounted_keys(self) -> set[str]:
        """The logit-transform config keys this spec accounts for (applied, where
        `scale_where_forward_names`, where the head's code applies it)."""
        return {key for key in (self.softcap_key, self.scale_key) if key}

    def scale(self, config, forward_source: str | None = None) -> float:
        """The factor the logits are multiplied by (1.0: none); `forward_source`: the source of the
        model class's forward, read where `scale_where_forward_names`."""
        if self.scale_key is None:
            return 1.0
        if self.scale_where_forward_names and self.scale_key not in (forward_source or ""):
            return 1.0
        value = getattr(config, self.scale_key, None)
        if value is None:
            return 1.0
        return 1.0 / float(value) if self.scale_divides else float(value)

    def softcap(self, config) -> float | None:
        value = getattr(config, self.softcap_key, None) if self.softcap_key else None
        return float(value) if value else None
