"""Fused dense-path kernels plugged into transformers models: norms, gated MLPs, rotary embedding.

The installers are imported on first use (they load hasten's op modules); `hasten.dense.spec`,
which the model table imports, loads nothing."""

__all__ = ["install_fused_mlp", "install_fused_norms", "install_fused_rope"]


def __getattr__(name: str):
    if name in __all__:
        from hasten.dense import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'hasten.dense' has no attribute {name!r}")
