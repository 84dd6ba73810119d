"""Fused MoE experts (one-kernel grouping, grouped GEMMs, fused SwiGLU, deterministic combine) and
routers. The submodules that reach hasten's ops load on first use: the model table reads
hasten.moe.spec before anything loads."""

__all__ = ["MoeLoadStats", "fused_experts_forward", "unsupported_reason"]


def __getattr__(name: str):
    if name in __all__:
        from hasten.moe import experts

        return getattr(experts, name)
    raise AttributeError(f"module 'hasten.moe' has no attribute {name!r}")
