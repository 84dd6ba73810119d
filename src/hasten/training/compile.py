"""`training.compile`: each decoder layer's forward through torch.compile, with a loud fallback.

What is compiled is the layer's `forward` (transformers' checkpointing wrapper included, so an
activation checkpoint is traced inside the graph) as one graph (`fullgraph=True`) with dynamic
shapes: the token count, the number of packed sequences and the longest sequence (`max_length_q`,
a host int) are symbolic, so batches of other sizes reuse the graph. The module's hooks (FSDP2's,
hasten's model-level packing hook) stay outside and run eagerly. The layers of a model run the
same code, and dynamo guards on a layer's structure, not its identity, so they share the graph.

A layer that fails to compile: torch's compile errors (`TorchDynamoException`) are raised before
the graph runs, so nothing of that call has run yet; the call runs eagerly, every layer goes back
to eager for the rest of the run, and the reason is recorded once (fallback `torch_compile`). An
error of the layer itself (a batch hasten refuses) raises again in eager, as it would without
compile.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hasten.instance_forward import replace_forward, restore_forward, without_hooked
from hasten.observability import record_fallback


# torch._dynamo.config's switch for a checkpointed region's side effects (torch >= 2.9; absent: left alone)
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _layer_forward(layer: nn.Module, *args, **kwargs):
    # the class's forward, looked up when traced: FSDP2's subclass of the layer, if any, included
    return type(layer).forward(layer, *args, **kwargs)


class CompiledLayers:
    """The decoder layers of one model with compiled forwards; `undo()` restores them."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = layers
        self.failure: str | None = None  # why compiling failed (the layers then run eagerly)
        # An activation checkpoint traced inside the graph refuses any Python side effect in the
        # layer (eager checkpointing replays it in the recompute; a graph cannot). transformers 5.25
        # has one in every layer: the `kernels` package's class wrapper (use_kernelized_func, on
        # Llama's and Qwen's attention, among others) sets and resets a context variable around each
        # forward to route hub-kernel functions. Set and reset, it leaves nothing behind, so its replay
        # is not needed: dynamo may skip it while these layers are compiled. (A layer's side effect
        # that did matter would then happen once, not twice as under eager recompute; the compiled
        # run is checked against the eager one in tests/training/test_train_compile.py.)
        self._skip_before = getattr(torch._dynamo.config, _SKIP_REPLAY, None)
        if self._skip_before is not None:
            setattr(torch._dynamo.config, _SKIP_REPLAY, True)
        self._compiled = torch.compile(_layer_forward, fullgraph=True, dynamic=True)
        for layer in layers:
            replace_forward(layer, functools.partial(self._forward, layer))

    def _forward(self, layer: nn.Module, *args, **kwargs):
        if self.failure is None:
            try:
                return self._compiled(layer, *args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as exc:
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                self.failure = f"{type(exc).__name__}: {first_line}"
                record_fallback("torch_compile", f"training.compile: {type(layer).__name__} did not compile "
                                f"({self.failure}); every decoder layer runs eagerly from here on (correct, without "
                                "the compiled graph's speed). TORCH_LOGS=graph_breaks shows where the trace stopped")
        return _layer_forward(layer, *args, **kwargs)

    def undo(self) -> None:
        for layer in self.layers:
            restore_forward(layer)
        if self._skip_before is not None:
            setattr(torch._dynamo.config, _SKIP_REPLAY, self._skip_before)


def compile_decoder_layers(model: nn.Module) -> CompiledLayers:
    """Compile the forward of every decoder layer of `model` (transformers marks them by class)."""
    from hasten.memory.offload import decoder_layers

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers (transformers' GradientCheckpointingLayer) "
                         "to compile")
    layers, hooked = without_hooked(layers)
    if hooked:
        record_fallback("torch_compile", f"training.compile: {hooked[0]}; those layers run eagerly")
    return CompiledLayers(layers)
