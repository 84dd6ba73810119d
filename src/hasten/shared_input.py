"""Sibling projections that one module feeds the same tensor, computed together by the first one
called: what hasten's LoRA groups (lora/peft_layers.py) and full fine-tuning's linear groups
(dense/linear_group.py) share.

The names only nominate a group; each call still checks that the members are asked, with that very
tensor, unchanged since (its version counter), for what was computed. A member called with another
tensor while outputs wait means this parent does not feed its members one tensor (cross attention,
layers reusing another layer's K/V, a tensor changed in place between the calls): the group turns
off for good, said once, and its members run one by one; the waiting outputs are dropped, never
returned.
"""

from __future__ import annotations

import torch

from hasten.observability import record_fallback

# Sibling projection names whose parent's forward passes them one tensor in the model families
# hasten patches (attention's q/k/v, a gated MLP's gate/up).
SHARED_INPUT_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class WaitingOutputs:
    """The outputs computed for the members not yet called, and the tensor they were computed for."""

    def __init__(self, names: list[str], fallback: str):
        self.names = names  # the members' qualified names, for the notice
        self.fallback = fallback  # the key the group's turning off is counted under
        self.waiting: dict[int, torch.Tensor] = {}  # member index -> its output for waiting_for
        self.waiting_for: torch.Tensor | None = None
        self.waiting_version = 0
        self.off = False

    def keep(self, index: int, x: torch.Tensor, outputs) -> torch.Tensor:
        """Keep every member's output but `index`'s for calls with x; returns `index`'s."""
        self.waiting = {i: y for i, y in enumerate(outputs) if i != index}
        self.waiting_for, self.waiting_version = (x, x._version) if self.waiting else (None, 0)
        return outputs[index]

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """The waiting output of member `index` for x, or None (nothing waits for this call)."""
        if self.waiting_for is None:
            return None
        if x is self.waiting_for and index in self.waiting and x._version == self.waiting_version:
            y = self.waiting.pop(index)
            if not self.waiting:
                self.waiting_for = None
            return y
        self.off = True
        unused = ", ".join(self.names[i] for i in sorted(self.waiting))
        self.waiting, self.waiting_for = {}, None
        record_fallback(self.fallback, f"{self.names[index]} was called with another input (or one changed in place) "
                        f"while the output computed for {unused} from its siblings' input waited: this module does "
                        f"not feed {', '.join(self.names)} one tensor; they run one by one from now on")
        return None
