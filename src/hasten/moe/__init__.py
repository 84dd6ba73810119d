"""Fused MoE experts: one-kernel grouping, grouped GEMMs, fused SwiGLU, deterministic combine."""

from hasten.moe.experts import MoeLoadStats, fused_experts_forward, unsupported_reason

__all__ = ["MoeLoadStats", "fused_experts_forward", "unsupported_reason"]
