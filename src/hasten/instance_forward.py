"""How hasten replaces a module's forward on the instance, and how undo() puts back exactly what was
there.

A module's forward may already be replaced on the instance before hasten comes to it: transformers
>= 5.25 kernelizes what `from_pretrained` loads by default (the `kernels` package binds a hub layer's
forward to each module it has a kernel for, where the hub is reachable); accelerate's hooks
(`device_map` dispatch, offload) wrap it; a user may have done it. hasten's own replacements stack
(a decoder layer's fused residual forward, then `training.compile` over it), and one handle undoes
them last first. So each replacement remembers what the instance held, and its undo restores that:
the instance forward it found, or none (the class's forward runs again). Popping the attribute, as
undo did before, dropped whatever had been there.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# per module: what each hasten replacement found on the instance, oldest first
_FOUND = "_hasten_found_forwards"
_NONE = None  # the instance had no forward of its own: the class's ran


def replace_forward(module: nn.Module, forward: Callable) -> None:
    """Set `module.forward` to `forward` (a bound method or partial), remembering what it replaces."""
    module.__dict__.setdefault(_FOUND, []).append(module.__dict__.get("forward", _NONE))
    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    """Undo the last replace_forward on `module`: the instance forward it found, or none."""
    found = module.__dict__.get(_FOUND)
    if not found:  # never replaced by hasten (or already restored): nothing of hasten's to take off
        return
    previous = found.pop()
    if not found:
        del module.__dict__[_FOUND]
    if previous is _NONE:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


def replaced_by_hasten(module: nn.Module) -> bool:
    """Whether the forward `module` runs now is one of hasten's replacements."""
    return bool(module.__dict__.get(_FOUND))
