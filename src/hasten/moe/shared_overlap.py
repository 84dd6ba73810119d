"""A MoE block's shared experts on a side CUDA stream, beside its routed experts
(`training.moe.overlap_shared_experts`, off by default until a GPU run measures it).

DeepSeek-V2/V3, GLM-4.5, Qwen2-MoE, Llama 4 and their kin compute out = routed(x) + shared(x), and
their block forward runs the router and the routed experts first, then the shared MLP, all on one
stream: the shared MLP's dense GEMMs wait behind the routed path's memory-bound kernels (the
router's top-k, permute, SwiGLU, combine) and the routed path's GEMMs wait behind them. Here the
shared MLP runs on a side stream that waits only for the block's input, so its GEMMs run while the
main stream works through the routed kernels already queued; the main stream waits for the side
stream before the block adds the two. Autograd runs each op's backward on the stream its forward
ran on and waits where a gradient crosses streams, so the backward overlaps the same way.

Two hooks, no forward replaced (they compose with hasten's fused SwiGLU on the shared MLP and with
transformers' block forward as written):
- a forward pre-hook on the block records an event on the current stream (the block's input is
  ready) and remembers the input and its version;
- a forward pre-hook on the shared module makes the side stream wait for that event and switches
  to it; a forward hook (run even when the forward raises) switches back and makes the main stream
  wait for the side stream.

The shared module goes to the side stream only when its input is the block's input (the same
storage) unmodified since the block began (the same version), on CUDA, outside torch.compile's
tracing; otherwise it runs on the main stream as before, counted as fallback
`moe_shared_overlap`. Memory: the input is marked used on the side stream and the output on the
main stream (`record_stream`), so the caching allocator reuses neither early. The results are
bitwise those of the main stream alone: the same kernels on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hasten.observability import record_fallback

# the shared MLP's attribute on the block, by family: DeepSeek-V2/V3, GLM-4.5, ERNIE-4.5, Hunyuan
# (shared_experts / shared_mlp), Qwen2-MoE and Llama 4 (shared_expert), GraniteMoeShared (shared_mlp)
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
FALLBACK = "moe_shared_overlap"


def shared_expert_blocks(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(block, shared module) for every MoE block of `model` with a shared MLP beside routed experts:
    a module with a child named in SHARED_NAMES and a child named `experts`."""
    pairs = []
    for block in model.modules():
        children = dict(block.named_children())
        if "experts" not in children:
            continue
        shared = next((children[name] for name in SHARED_NAMES if isinstance(children.get(name), nn.Module)), None)
        if shared is not None:
            pairs.append((block, shared))
    return pairs


class _SharedCall:
    """One block and its shared module: what the block's pre-hook saw (its input and that input's
    version, ready once `event` has run on the main stream) and, between the shared module's two
    hooks, the main stream to return to. One event per block, recorded again on every call: the
    side stream's wait takes the record made just before it."""

    def __init__(self) -> None:
        self.event: torch.cuda.Event | None = None
        self.hidden: torch.Tensor | None = None  # None: no block input to start the side stream from
        self.version = 0
        self.main: torch.cuda.Stream | None = None  # set while the shared module runs on the side stream


@dataclass
class SharedExpertOverlap:
    """The side streams (one per device) and the hooks of one model; `undo` removes the hooks."""

    side_streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    overlapped_calls: int = 0  # shared MLP calls that ran on the side stream (tests and benchmarks read it)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.side_streams:
            self.side_streams[device] = torch.cuda.Stream(device=device)
        return self.side_streams[device]

    def install(self, block: nn.Module, shared: nn.Module) -> None:
        call = _SharedCall()

        def block_pre(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")
            call.hidden = None
            if isinstance(hidden, torch.Tensor) and hidden.is_cuda and not torch.compiler.is_compiling():
                if call.event is None:
                    call.event = torch.cuda.Event()
                call.event.record(torch.cuda.current_stream(hidden.device))
                call.hidden, call.version = hidden, hidden._version

        def shared_pre(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()), None)
            hidden, call.hidden = call.hidden, None  # one shared call per block call
            reason = _why_inline(hidden, call.version, x)
            if reason is not None:
                record_fallback(FALLBACK, f"a shared expert ran on the main stream: {reason}")
                return None
            call.main = torch.cuda.current_stream(x.device)
            side = self.side_stream(x.device)
            side.wait_event(call.event)
            x.record_stream(side)  # allocated on the main stream, read on the side stream
            torch.cuda.set_stream(side)
            return None

        def shared_post(module, args, kwargs, output):
            main, call.main = call.main, None
            if main is None:
                return None
            torch.cuda.set_stream(main)
            main.wait_stream(self.side_stream(main.device))
            for tensor in _tensors(output):
                tensor.record_stream(main)  # allocated on the side stream, read on the main stream
            self.overlapped_calls += 1
            return None

        self.handles += [block.register_forward_pre_hook(block_pre, with_kwargs=True),
                         shared.register_forward_pre_hook(shared_pre, with_kwargs=True),
                         shared.register_forward_hook(shared_post, with_kwargs=True, always_call=True)]

    def undo(self) -> None:
        while self.handles:
            self.handles.pop().remove()


def _why_inline(hidden: torch.Tensor | None, version: int, x) -> str | None:
    """None when the shared module, given x, may run on the side stream after its block began with
    `hidden` at `version`; else why not."""
    if hidden is None:
        return "its block's input was not a CUDA tensor seen outside torch.compile's tracing"
    if not isinstance(x, torch.Tensor) or not x.is_cuda:
        return "its input is not a CUDA tensor"
    if x.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr():
        return "its input is not its block's input (computed after the block began)"
    if hidden._version != version or x._version != version:
        return "its block's input was modified in place after the block began"
    return None


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def install_shared_expert_overlap(pairs: list[tuple[nn.Module, nn.Module]]
                                  ) -> tuple[Callable[[], None], SharedExpertOverlap]:
    """Hook each (block, shared module) of `shared_expert_blocks`. Returns (undo, state)."""
    state = SharedExpertOverlap()
    for block, shared in pairs:
        state.install(block, shared)
    return state.undo, state
