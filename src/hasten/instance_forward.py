"""How hasten replaces a module's forward on the instance, and how undo() puts back exactly what was
there.

A module's forward may already be replaced on the instance before hasten comes to it: transformers
>= 5.25 kernelizes what `from_pretrained` loads by default (the `kernels` package binds a hub layer's
forward to each module it has a kernel for, where the hub is reachable); accelerate's hooks
(`device_map` dispatch, offload) wrap it; a user may have done it. hasten's own replacements stack
(a decoder layer's fused residual forward, then `training.compile` over it), and one handle undoes
them last first. So each replacement remembers what the instance held, and its undo restores that:
the instance forward it found, or none (the class's forward runs again). Popping the attribute, as
undo did before, dropped whatever had been there. transformers' later re-kernelization
(`keep_over_kernelize`) and accelerate's hooks (`without_hooked`: such modules are left alone) are
the two cases where what is on the instance changes what hasten may do.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from torch import nn

# per module: what each hasten replacement found on the instance, and what it set, oldest first
_FOUND = "_hasten_found_forwards"
_SET = "_hasten_set_forwards"
_NONE = None  # the instance had no forward of its own: the class's ran


def replace_forward(module: nn.Module, forward: Callable) -> None:
    """Set `module.forward` to `forward` (a bound method or partial), remembering what it replaces."""
    module.__dict__.setdefault(_FOUND, []).append(module.__dict__.get("forward", _NONE))
    module.__dict__.setdefault(_SET, []).append(forward)
    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    """Undo the last replace_forward on `module`: the instance forward it found, or none."""
    found = module.__dict__.get(_FOUND)
    if not found:  # never replaced by hasten (or already restored): nothing of hasten's to take off
        return
    previous = found.pop()
    module.__dict__[_SET].pop()
    if not found:
        del module.__dict__[_FOUND], module.__dict__[_SET]
    if previous is _NONE:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


def reassert_forwards(model: nn.Module) -> None:
    """Put hasten's forwards back on the modules of `model` where someone replaced or removed them
    since (transformers' re-kernelization, below), keeping what they set as the forward undo gives
    back."""
    for module in model.modules():
        ours = module.__dict__.get(_SET)
        if ours and module.__dict__.get("forward") is not ours[-1]:
            module.__dict__[_FOUND][0] = module.__dict__.get("forward", _NONE)
            module.forward = ours[-1]


def keep_over_kernelize(model: nn.Module) -> Callable[[], None]:
    """transformers >= 5.25 kernelizes a model again whenever its kernels mode changes, and
    `model.train()` / `model.eval()` change it (a `from_pretrained` model starts in inference mode;
    the Trainer's first `train()` switches it): the `kernels` package then binds a hub layer's forward
    to each module it has one for, or pops the instance forward where it has none, which took
    hasten's fused RMSNorm off every norm without a word. This wraps the model's `set_use_kernels`
    (where the kernelizing happens) on the instance so that hasten's forwards go back on after it;
    the returned undo removes the wrapper."""
    if not callable(getattr(model, "set_use_kernels", None)) or "set_use_kernels" in model.__dict__:
        return lambda: None

    def set_use_kernels(self, *args, **kwargs):  # bound to the model, so a deepcopy binds to its copy
        result = type(self).set_use_kernels(self, *args, **kwargs)
        reassert_forwards(self)
        return result

    model.set_use_kernels = types.MethodType(set_use_kernels, model)

    def undo() -> None:
        model.__dict__.pop("set_use_kernels", None)

    return undo


HOOKED_REASON = ("accelerate's hooks wrap their forward (a model dispatched by device_map over several devices "
                 "or offloaded): hasten's forward in its place would skip the hooks' moves of weights and inputs; "
                 "load the model on one device (device_map={'': 0}) to have them accelerated")


def hooked(module: nn.Module) -> bool:
    """Whether accelerate's hooks (`dispatch_model`: device_map over several devices, offload) wrap
    `module`'s forward. hasten leaves such modules to transformers."""
    return "_hf_hook" in module.__dict__


def has_call_hooks(module: nn.Module) -> bool:
    """Whether calling `module` runs forward hooks (its own or torch's global ones) that a fused op
    reaching past its call would skip."""
    return bool(module._forward_hooks or module._forward_pre_hooks or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def without_hooked(modules: list[nn.Module]) -> tuple[list[nn.Module], list[str]]:
    """(the modules accelerate's hooks do not wrap, [the reason, with how many were left] or [])."""
    kept, left = [m for m in modules if not hooked(m)], [m for m in modules if hooked(m)]
    return kept, [f"{len(left)} {type(left[0]).__name__} modules: {HOOKED_REASON}"] if left else []
