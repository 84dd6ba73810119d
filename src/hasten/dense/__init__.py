"""Fused dense-path kernels plugged into transformers models: RMSNorm, SwiGLU MLP, rotary embedding."""

from hasten.dense.patch import install_fused_mlp, install_fused_rms_norm, install_fused_rope

__all__ = ["install_fused_mlp", "install_fused_rms_norm", "install_fused_rope"]
