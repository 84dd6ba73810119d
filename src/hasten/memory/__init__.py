"""Activation memory: checkpointing policies (offload to host memory is not built yet)."""

from hasten.memory.checkpointing import POLICIES, apply_activation_checkpointing, selective_policy

__all__ = ["POLICIES", "apply_activation_checkpointing", "selective_policy"]
