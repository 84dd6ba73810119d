"""Put hasten's varlen stateful functions (stateful/varlen.py) into a hybrid model's modeling files.

The table entry of a hybrid model type (`ArchSpec.stateful`) names its stateful layer classes and
the module-level functions each one's forward calls once per call (`StatefulSpec`). accelerate()
replaces those functions in the modeling module (`modeling_qwen3_next.causal_conv1d_fn`, ...) with
hasten's packed forms, which defer to the model's own function unless the call carries the batch's
LinearMeta. The module attribute is shared by every model of that file in the process, so the
replacement is counted: the last model's undo() restores the original.
"""

from __future__ import annotations

import inspect
import sys
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType

from torch import nn

from hasten.stateful.varlen import REPLACEMENTS


@dataclass(frozen=True)
class StatefulSpec:
    """A hybrid model type's layers that carry state along the sequence.

    layers  (class-name suffix, the modeling file's functions its forward calls once per call):
            ("GatedDeltaNet", ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")): Gated DeltaNet
            (a short convolution over q/k/v, then the chunked gated delta rule);
            ("ShortConv", ("causal_conv1d_fn",)): LFM2's gated short convolution."""

    layers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def functions_of(self, module: nn.Module) -> tuple[str, ...] | None:
        name = type(module).__name__
        return next((functions for suffix, functions in self.layers if name.endswith(suffix)), None)


def stateful_modules(model: nn.Module, spec: StatefulSpec) -> list[tuple[nn.Module, tuple[str, ...]]]:
    return [(module, functions) for module in model.modules()
            if (functions := spec.functions_of(module)) is not None]


def unsupported(model: nn.Module, spec: StatefulSpec, layer_count: int | None) -> str | None:
    """Why hasten's varlen functions cannot take this model's stateful layers (None: they can).
    layer_count: how many layers the config marks as stateful (None: the config has no layer_types)."""
    found = stateful_modules(model, spec)
    if not found:
        return f"none of its modules is one of the table's stateful layers ({', '.join(s for s, _ in spec.layers)})"
    if layer_count is not None and len(found) != layer_count:
        return (f"its config marks {layer_count} stateful layers but {len(found)} modules match the table's "
                f"({', '.join(s for s, _ in spec.layers)})")
    for module, functions in found:
        if not _passes_keywords(module):
            from transformers import __version__

            return (f"{type(module).__name__}.forward takes no keyword arguments beyond its own in transformers "
                    f"{__version__}, so the batch's sample boundaries cannot reach its {', '.join(functions)}; "
                    "a newer transformers passes them along (5.24 does)")
        modeling = sys.modules.get(type(module).__module__)
        missing = [name for name in functions if name not in REPLACEMENTS or not callable(getattr(modeling, name, None))]
        if missing:
            return f"{type(module).__name__}'s modeling file has no {', '.join(missing)} hasten can replace"
    return None


def _passes_keywords(module: nn.Module) -> bool:
    """Whether the layer's forward takes **kwargs: the only road by which the packing hook's
    LinearMeta reaches the functions it calls (transformers 5.17's Lfm2ShortConv takes a fixed list
    and forwards only seq_idx). Necessary, not sufficient: the hook still counts the calls."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return True  # no signature to read: the hook's count decides
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class _Replacements:
    """Module attribute -> (original, users): one replacement per modeling file and function."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: dict[tuple[str, str], tuple[object, int]] = {}

    def acquire(self, modeling: ModuleType, name: str) -> None:
        key = (modeling.__name__, name)
        with self._lock:
            original, users = self._users.get(key, (None, 0))
            if users == 0:
                original = getattr(modeling, name)
                setattr(modeling, name, REPLACEMENTS[name](original))
            self._users[key] = (original, users + 1)

    def release(self, modeling: ModuleType, name: str) -> None:
        key = (modeling.__name__, name)
        with self._lock:
            original, users = self._users[key]
            if users == 1:
                setattr(modeling, name, original)
                del self._users[key]
            else:
                self._users[key] = (original, users - 1)

    def active(self, modeling: ModuleType, name: str) -> bool:
        return (modeling.__name__, name) in self._users


REPLACED = _Replacements()
# installs whose model was dropped without undo(): released at the next install or undo, never from
# the garbage collector (a collection inside another model's checkpointed backward must not swap
# a function between a layer's forward and its recompute)
_DROPPED: list["_Install"] = []


class _Install:
    def __init__(self, targets: list[tuple[ModuleType, str]]) -> None:
        self.targets, self.released = targets, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            for modeling, name in self.targets:
                REPLACED.release(modeling, name)


def release_dropped() -> None:
    """Release the replacements of models dropped without undo()."""
    while _DROPPED:
        _DROPPED.pop().release()


def install(model: nn.Module, layers: list[tuple[nn.Module, tuple[str, ...]]]):
    """Replace the functions the model's stateful layers (`stateful_modules`) call; returns the undo."""
    release_dropped()
    targets = sorted({(sys.modules[type(module).__module__], name) for module, functions in layers
                      for name in functions}, key=lambda pair: (pair[0].__name__, pair[1]))
    for modeling, name in targets:
        REPLACED.acquire(modeling, name)
    record = _Install(targets)
    weakref.finalize(model, _DROPPED.append, record)

    def undo() -> None:
        record.release()
        release_dropped()

    return undo
