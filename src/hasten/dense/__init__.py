"""Fused dense-path kernels plugged into transformers models: norms, gated MLPs, rotary embedding."""

from hasten.dense.patch import install_fused_mlp, install_fused_norms, install_fused_rms_norm, install_fused_rope

__all__ = ["install_fused_mlp", "install_fused_norms", "install_fused_rms_norm", "install_fused_rope"]
