"""Packed training of hybrid models: varlen forms of the layers that carry state along the
sequence (short causal convolutions, the gated delta rule, Kimi delta attention), from
flash-linear-attention on CUDA."""

from hasten.stateful.patch import StatefulSpec
from hasten.stateful.varlen import LinearMeta, fla_problem

__all__ = ["LinearMeta", "StatefulSpec", "fla_problem"]
