"""Loss paths that never materialise the (tokens, vocab) logits."""

from hasten.loss.causal_lm import FusedLossUnsupported, install_fused_cross_entropy

__all__ = ["FusedLossUnsupported", "install_fused_cross_entropy"]
