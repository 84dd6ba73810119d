"""Activation offload per decoder layer, on the C++ engine (csrc/offload/offload_engine.h).

What a decoder layer saves for backward goes, through `saved_tensors_hooks` scoped to that
layer, to pinned host memory on a device-to-host copy stream while the next layers compute.
In backward, when layer i starts (the gradient of its output arrives), layer i's activations
are already on their way back and layer i-1's start coming into the second buffer (double
buffer); with one buffer only layer i is fetched then. A layer's restored activations are freed
as soon as autograd frees the saved tensors that use them.

Per layer the plan says:
  keep               nothing changes
  offload            saved activations go to the host and come back ahead of use
  recompute          the layer is checkpointed (transformers' own switch): only its input is kept
  recompute_offload  the layer is checkpointed and that input goes to the host too, coming back
                     double-buffered ahead of the layer's recompute (full checkpointing with
                     offload: per layer the device then holds nothing between forward and backward)

Not offloaded, whatever the plan: parameters and other leaf tensors (views of them too), tensor
subclasses (DTensor), tensors under `min_bytes`, and anything saved outside decoder layers.
Views and aliases of one storage are copied once.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hasten.memory.host_pool import HostPoolStats
from hasten.observability import record_fallback
from hasten.ops._lib import load

logger = logging.getLogger("hasten")

# Device-to-host copies a forward lets run behind the host, in layers' worth of bytes: beyond it the
# host waits for the oldest (see OffloadEngine.bound_in_flight). A host ahead of the device by more
# layers would hold their device copies at the loss, where the step's memory peaks.
D2H_LAYERS_IN_FLIGHT = 2
PLAN_CHOICES = ("keep", "offload", "recompute", "recompute_offload")
RECOMPUTED = ("recompute", "recompute_offload")
TO_HOST = ("offload", "recompute_offload")
DEFAULT_MIN_BYTES = 1 << 20


class OffloadError(RuntimeError):
    """Offload cannot run as configured (the message says why and what to change)."""


@dataclass(frozen=True)
class OffloadStats:
    bytes_offloaded: int
    bytes_fetched: int
    bytes_prefetched: int
    d2h_bytes_in_flight: int
    device_bytes_held: int
    host_bytes_held: int
    fetches: int
    exposed_fetches: int
    exposed_wait_ms: float
    tickets: int


class OffloadEngine:
    """Python face of torch.classes.hasten.OffloadEngine: copies tensors' storages to pooled host
    memory and back on copy streams (synchronously for CPU tensors)."""

    def __init__(self, max_cached_host_bytes: int = 64 << 30) -> None:
        load()
        self._engine = torch.classes.hasten.OffloadEngine(int(max_cached_host_bytes))

    def offload(self, tensor: torch.Tensor) -> int:
        return self._engine.offload(tensor)

    def prefetch(self, ticket: int) -> None:
        self._engine.prefetch(ticket)

    def fetch(self, ticket: int) -> torch.Tensor:
        """The restored storage as uint8 [nbytes], ready for use on the current stream."""
        return self._engine.fetch(ticket)

    def release(self, ticket: int) -> None:
        self._engine.release(ticket)

    def poll(self) -> int:
        return self._engine.poll()

    def bound_in_flight(self, max_bytes: int) -> int:
        """Waits (host) for the oldest device-to-host copies until at most `max_bytes` are in
        flight; returns how many it waited for (0 on the CPU, where copies are synchronous)."""
        return self._engine.bound_in_flight(int(max_bytes))

    def synchronize(self) -> None:
        self._engine.synchronize()

    def stats(self) -> OffloadStats:
        values = self._engine.stats()
        return OffloadStats(*values[:8], exposed_wait_ms=values[8] / 1000.0, tickets=values[9])

    def reset_counters(self) -> None:
        self._engine.reset_counters()

    def set_host_limit(self, limit_bytes: int | None) -> None:
        """The host pool's page-locked bytes (in use + cached) stay under `limit_bytes` where
        freeing cached blocks can keep them so (None: no limit)."""
        self._engine.set_host_limit(-1 if limit_bytes is None else int(limit_bytes))

    def trim_host_pool(self) -> int:
        """Frees the host pool's cached blocks; returns the bytes freed."""
        return self._engine.trim_host_pool()

    def host_pool_stats(self) -> HostPoolStats:
        return HostPoolStats.from_values(self._engine.host_pool_stats())

    def copy_engine_count(self, device_index: int) -> int:
        """Asynchronous copy engines of a CUDA device; -1 where unknown (CPU build)."""
        return self._engine.copy_engine_count(int(device_index))


class _Ticket:
    """One offloaded storage. Autograd holds it through the _Packed objects of the saved tensors
    that use it; when it frees the last of them, the engine releases the copies."""

    __slots__ = ("engine", "id", "layer", "nbytes", "__weakref__")

    def __init__(self, engine: OffloadEngine, ticket: int, layer: int, nbytes: int) -> None:
        self.engine, self.id, self.layer, self.nbytes = engine, ticket, layer, nbytes

    def __del__(self) -> None:
        try:
            self.engine.release(self.id)
        except Exception:  # interpreter shutdown: the engine may already be gone
            pass


class _Packed:
    """A saved tensor in host memory: its storage's ticket and how to view it."""

    __slots__ = ("ticket", "dtype", "size", "stride", "offset")

    def __init__(self, ticket: _Ticket, tensor: torch.Tensor) -> None:
        self.ticket = ticket
        self.dtype, self.size, self.stride = tensor.dtype, tensor.size(), tensor.stride()
        self.offset = tensor.storage_offset()


def _in_backward() -> bool:
    """True inside the autograd engine (a checkpointed layer's recompute runs its forward there)."""
    return torch._C._current_graph_task_id() != -1


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model, in order (transformers marks them by class)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _first_grad_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


class LayerOffload:
    """Offloads, per the plan, what each decoder layer saves for backward.

    `plan` has one of PLAN_CHOICES per layer. `attach()` installs the module hooks and returns
    nothing; `detach()` removes them. `double_buffer` prefetches layer i-1 while layer i runs its
    backward; if that runs out of device memory, it falls back to one buffer and says so once.
    """

    def __init__(self, layers: Sequence[nn.Module], plan: Sequence[str], *, double_buffer: bool = True,
                 min_bytes: int = DEFAULT_MIN_BYTES, engine: OffloadEngine | None = None) -> None:
        if len(plan) != len(layers):
            raise ValueError(f"the offload plan has {len(plan)} entries for {len(layers)} decoder layers")
        for choice in plan:
            if choice not in PLAN_CHOICES:
                raise ValueError(f"offload plan entries must be one of {PLAN_CHOICES}, got {choice!r}")
        self.layers = list(layers)
        self.plan = list(plan)
        self.double_buffer = double_buffer
        self.min_bytes = min_bytes
        self.engine = engine or OffloadEngine()
        self.fell_back_to_single_buffer: str | None = None
        self.forward_waits = 0  # host waits for device-to-host copies (D2H_LAYERS_IN_FLIGHT), since the last summary
        self.bytes_per_layer = [0] * len(self.layers)  # of the latest forward
        # tickets of each layer of the graph being built or run: weak, autograd owns them
        self._layer_tickets: list[list[weakref.ref]] = [[] for _ in self.layers]
        # storage -> its ticket, to copy aliases once; the storage weak reference tells a live storage
        # from a new one that the allocator placed at a freed one's address
        self._by_storage: dict[tuple[int, int], tuple[StorageWeakRef, weakref.ref]] = {}
        self._contexts: dict[int, torch.autograd.graph.saved_tensors_hooks] = {}
        self._current_layer: int | None = None
        self._layer_begun: int | None = None
        self._prefetched = [False] * len(self.layers)
        self._handles: list = []
        self.layer_observers: list[Callable[[int, str], None]] = []  # (layer, "forward_start" | ...)
        self.host_guard: Callable[[int], None] | None = None  # raises before host memory runs short

    # ---- hooks ------------------------------------------------------------------------------
    def attach(self) -> None:
        if self._handles:
            return
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_forward(index)))
            self._handles.append(layer.register_forward_hook(self._post_forward(index), always_call=True))
        self.apply_recompute()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for index in list(self._contexts):
            self._contexts.pop(index).__exit__(None, None, None)
        for layer in self.layers:
            if "_hasten_inner_checkpoint_func" in layer.__dict__:
                layer._gradient_checkpointing_func = layer.__dict__.pop("_hasten_inner_checkpoint_func")
            if layer.__dict__.pop("_hasten_recompute", False):
                layer.gradient_checkpointing = False
            if layer.__dict__.pop("_hasten_checkpoint_func", False):
                del layer._gradient_checkpointing_func

    def apply_recompute(self) -> None:
        """Turn transformers' per-layer checkpointing on exactly for the layers planned 'recompute' or
        'recompute_offload' (a layer the model itself checkpoints stays checkpointed), and route each
        recomputed layer's checkpoint through `_checkpoint_to_host`, which sends its input to the host
        when the plan says recompute_offload."""
        for index, (layer, choice) in enumerate(zip(self.layers, self.plan, strict=True)):
            wanted = choice in RECOMPUTED
            if wanted and getattr(layer, "_gradient_checkpointing_func", None) is None:
                # what model.gradient_checkpointing_enable() would set, for this layer alone
                layer._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                       use_reentrant=False)
                layer._hasten_checkpoint_func = True
            if wanted or getattr(layer, "_hasten_recompute", False):
                if not (getattr(layer, "gradient_checkpointing", False) and not layer.__dict__.get("_hasten_recompute")):
                    layer.gradient_checkpointing = wanted
                    layer._hasten_recompute = wanted
            if wanted and "_hasten_inner_checkpoint_func" not in layer.__dict__:
                inner = layer._gradient_checkpointing_func
                layer._hasten_inner_checkpoint_func = inner
                layer._gradient_checkpointing_func = functools.partial(self._checkpoint_to_host, index, inner)

    def set_plan(self, plan: Sequence[str]) -> None:
        if len(plan) != len(self.layers) or any(choice not in PLAN_CHOICES for choice in plan):
            raise ValueError(f"a plan needs one of {PLAN_CHOICES} for each of the {len(self.layers)} layers")
        self.plan = list(plan)
        self.apply_recompute()

    def _checkpoint_to_host(self, index: int, inner: Callable, function: Callable, *args, **kwargs):
        """Layer `index`'s checkpoint call (transformers' `_gradient_checkpointing_func`). Under
        recompute_offload the checkpoint runs inside this layer's pack hooks: torch's checkpoint saves
        its inputs (the hidden states, [tokens, hidden]) as saved tensors before it enters its own
        hooks, so exactly those reach `_pack` and go to the host; what the layer saves inside is the
        checkpoint's own business (recomputed). The recompute in backward unpacks them, by then
        prefetched. transformers checkpoints the layer's forward (module hooks outside it) or, in
        older versions, its __call__ (hooks inside): whichever of this and the pre-forward hook runs
        first begins the layer."""
        if self.plan[index] != "recompute_offload" or not torch.is_grad_enabled() or _in_backward():
            return inner(function, *args, **kwargs)
        if self._layer_begun != index:
            self._begin_layer(index)
        self._current_layer = index
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return inner(function, *args, **kwargs)
        finally:
            self._current_layer = None

    def _pre_forward(self, index: int):
        def hook(module, args):
            # no graph to offload from (eval), or a checkpointed layer's recompute inside backward
            if not torch.is_grad_enabled() or _in_backward():
                return
            if self._layer_begun == index:  # begun by _checkpoint_to_host around this call
                return
            self._begin_layer(index)
            if self.plan[index] == "offload":
                self._current_layer = index
                context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                context.__enter__()
                self._contexts[index] = context
        return hook

    def _begin_layer(self, index: int) -> None:
        if index == 0:
            self._start_graph()
        else:
            # releases the device copies of offloads that have completed (without this, nothing
            # polls during the kept layers after the last offloaded one, and the memory would
            # stay held through the peak at the loss), waiting for the oldest beyond the bound
            self._bound_copies(D2H_LAYERS_IN_FLIGHT * max(self.bytes_per_layer, default=0))
        for observer in self.layer_observers:
            observer(index, "forward_start")
        self.bytes_per_layer[index] = 0
        self._layer_begun = index  # until the layer's forward hook

    def _post_forward(self, index: int):
        def hook(module, args, output):
            self._layer_begun = None
            context = self._contexts.pop(index, None)
            if context is not None:
                context.__exit__(None, None, None)
                self._current_layer = None
            if not torch.is_grad_enabled() or _in_backward():
                return
            if index == len(self.layers) - 1:
                self._bound_copies(0)  # every copy done before the LM head and loss, where the peak is
            for observer in self.layer_observers:
                observer(index, "forward_end")
            grad_output = _first_grad_tensor(output)
            if grad_output is not None:
                grad_output.register_hook(self._backward_start(index))
        return hook

    def _bound_copies(self, max_bytes: int) -> None:
        """Bounds the copies behind the host where the checkpointed inputs go to the host (each a
        [tokens, hidden] tensor, copied in a fraction of its layer's forward); the 'offload' plan's
        copies of whole layers' activations are the planner's to time (it counts a copy still
        running at the peak as freeing nothing) and are only polled, as before."""
        if "recompute_offload" in self.plan:
            self.forward_waits += self.engine.bound_in_flight(max_bytes)
        else:
            self.engine.poll()

    def _start_graph(self) -> None:
        self._by_storage.clear()
        self._prefetched = [False] * len(self.layers)
        for tickets in self._layer_tickets:
            tickets[:] = [ref for ref in tickets if ref() is not None]  # an earlier graph may still be alive
        self.engine.poll()

    def _backward_start(self, index: int):
        def hook(grad):
            for observer in self.layer_observers:
                observer(index, "backward_start")
            self._prefetch_layer(index)
            if self.double_buffer:
                self._prefetch_ahead(index)
        return hook

    def _prefetch_ahead(self, index: int) -> None:
        """Prefetch the next offloaded layers below `index` while the restored bytes not yet used
        stay within two layers' worth (the double buffer). Kept layers take no buffer, so across
        them the prefetch reaches further ahead."""
        offloaded = [self.bytes_per_layer[k] for k, choice in enumerate(self.plan) if choice in TO_HOST]
        budget = 2 * max(offloaded, default=0)
        held = self.engine.stats().device_bytes_held
        for k in range(index - 1, -1, -1):
            if self.plan[k] not in TO_HOST or self._prefetched[k]:
                continue
            if held + self.bytes_per_layer[k] > budget:
                break
            if not self._prefetch_layer(k):
                break
            held += self.bytes_per_layer[k]

    def _prefetch_layer(self, index: int) -> bool:
        """Starts the copy back of a layer's activations; False when the device is out of memory
        for it (then double buffering is switched off, once, loudly)."""
        self._prefetched[index] = True
        for ref in self._layer_tickets[index]:
            ticket = ref()
            if ticket is None:
                continue
            try:
                self.engine.prefetch(ticket.id)
            except torch.OutOfMemoryError as exc:
                if not self.double_buffer:
                    raise
                self._fall_back_to_single_buffer(exc)
                return False
        return True

    def _fall_back_to_single_buffer(self, exc: BaseException) -> None:
        self.double_buffer = False
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.fell_back_to_single_buffer = first_line
        logger.warning("hasten: double-buffered activation prefetch ran out of device memory (%s); continuing "
                       "with one buffer: each layer's activations now come back when its backward starts, so "
                       "copies are no longer hidden. Lower training.max_tokens or set "
                       "training.checkpoint.double_buffer: false to silence this.", first_line)
        record_fallback("offload_double_buffer", f"double buffer out of device memory: {first_line}")

    def _keep_on_device(self, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter):
            return True  # subclasses (DTensor, FSDP's) own their storage handling
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf:  # parameters (trainable or frozen), inputs: not activations
            return True
        if tensor.device.type not in ("cuda", "cpu"):
            return True
        return tensor.numel() * tensor.element_size() < self.min_bytes

    def _pack(self, tensor: torch.Tensor):
        index = self._current_layer
        if index is None or self._keep_on_device(tensor):
            return tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() > 2 * tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a small view of a large buffer: copy only the view
            storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device.index if tensor.device.index is not None else -1)
        known = self._by_storage.get(key)
        ticket = known[1]() if known is not None and not known[0].expired() else None
        if ticket is None:
            if self.host_guard is not None:
                self.host_guard(storage.nbytes())
            ticket = _Ticket(self.engine, self.engine.offload(tensor), index, storage.nbytes())
            self._by_storage[key] = (StorageWeakRef(storage), weakref.ref(ticket))
            self._layer_tickets[index].append(weakref.ref(ticket))
            self.bytes_per_layer[index] += ticket.nbytes
        return _Packed(ticket, tensor)

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        restored = self.engine.fetch(packed.ticket.id)
        view = torch.empty(0, dtype=packed.dtype, device=restored.device)
        return view.set_(restored.untyped_storage(), packed.offset, packed.size, packed.stride)


def measure_link_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> dict[str, float]:
    """Pinned host<->device copy bandwidth in GB/s, each way, timed with CUDA events."""
    if device.type != "cuda":
        raise OffloadError("the host<->device link is measured on a CUDA device")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        result[name] = nbytes * repeats / (start.elapsed_time(end) / 1000.0) / 1e9
    return result


def _marker(device: torch.device):
    """A point in time on the device's stream (a CUDA event), or on the host clock on the CPU."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    import time

    return time.perf_counter()


def _elapsed(start, end) -> float:
    """Seconds between two _marker()s; 0 when either is missing. Synchronizes on CUDA (once, when
    planning)."""
    if start is None or end is None:
        return 0.0
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def available_host_bytes() -> int | None:
    """The host's MemAvailable in bytes (None where /proc/meminfo cannot tell)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def processes_on_this_host() -> int:
    """Processes of this job that share the host's memory: torchrun's LOCAL_WORLD_SIZE (1 without
    torchrun, or where it is not a positive integer)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def host_share_bytes(fraction: float, processes: int | None = None) -> int | None:
    """This process's share of the host memory activation offload may hold: `fraction` of
    MemAvailable, divided among the processes on this host (None where MemAvailable is unknown).
    Why divided: each rank of a torchrun job reads the same MemAvailable before any of them pins a
    block, so eight ranks at 80% each would promise 6.4 times what the host has."""
    available = available_host_bytes()
    processes = processes_on_this_host() if processes is None else processes
    return int(available * fraction / processes) if available else None


class OffloadManager:
    """training.checkpoint.offload on one model.

      all   every decoder layer but the last `keep_last` offloads what it saves
      auto  the first forward runs as 'all' and is measured (per-layer bytes and forward time,
            the link's bandwidth, the step's peak); from the second forward on, the planner's
            choice of keep / offload / recompute per layer (hasten.memory.planner)

    `checkpointed` (training.checkpoint.activations: full): every layer is recomputed, and what
    goes to the host is each checkpoint's input (recompute_offload); 'auto' then chooses per layer
    between that and keeping the input on the device (recompute), the planner's offload / keep.

    `summary()` gives the per-logging-step metrics (counters since the previous call).
    """

    def __init__(self, model: nn.Module, mode: str, *, double_buffer: bool = True,
                 max_memory_gib: float | None = None, keep_last: int = 1,
                 min_bytes: int = DEFAULT_MIN_BYTES, host_fraction: float = 0.8,
                 checkpointed: bool = False) -> None:
        if mode not in ("all", "auto"):
            raise ValueError(f"offload mode must be 'all' or 'auto', got {mode!r}")
        layers = decoder_layers(model)
        if not layers:
            raise OffloadError(f"{type(model).__name__} has no transformers decoder layers "
                               "(GradientCheckpointingLayer) to offload")
        self.mode = mode
        self.budget_bytes = int(max_memory_gib * 2**30) if max_memory_gib else None
        keep = min(max(keep_last, 0), len(layers))
        self.checkpointed = checkpointed
        to_host, stay = ("recompute_offload", "recompute") if checkpointed else ("offload", "keep")
        calibration = [to_host] * (len(layers) - keep) + [stay] * keep
        self.offload = LayerOffload(layers, calibration, double_buffer=double_buffer, min_bytes=min_bytes)
        self.calibration_choices = list(calibration)
        self._to_host, self._stay = to_host, stay
        self.kept_for_host: list[int] = []  # layers keep_on_device() keeps off the host (the preflight's split)
        self.plan = None  # hasten.memory.planner.Plan once 'auto' has planned
        self.bandwidth: dict[str, float] | None = None
        # read once: the limit and its refusal name the same share
        self.host_fraction, self.host_processes = host_fraction, processes_on_this_host()
        self.host_limit_bytes = host_share_bytes(host_fraction, self.host_processes)
        # the pool's cached blocks count against the same limit: batches vary in length, and
        # blocks of an earlier step's sizes are freed before new ones would pass it
        self.offload.engine.set_host_limit(self.host_limit_bytes)
        self._forwards = 0
        # (bytes allocated, where, restored bytes held, device-to-host bytes in flight)
        self._boundary_max: tuple[int, str, int, int] = (0, "", 0, 0)
        self._timing: dict[int, list] = {}
        self._calibration_peak: int | None = None
        self._head_end = None
        self._device: torch.device | None = None
        self.offload.layer_observers.append(self._observe)
        self.offload.host_guard = self._check_host_memory
        self.offload.attach()

    def detach(self) -> None:
        self.offload.detach()

    @property
    def host_layers(self) -> int:
        """The decoder layers whose saved tensors (under full checkpointing: checkpointed inputs)
        go to the host in the plan running now."""
        return sum(choice == self._to_host for choice in self.offload.plan)

    def keep_on_device(self, layers: int) -> None:
        """The last `layers` of the layers that go to the host keep what they save on the device
        instead: the memory preflight's split when the host cannot hold every layer's share
        (hasten.memory.preflight.MemoryForecast.host_layers_kept). The highest layers stay, their
        backward coming first. 'auto' keeps them there in every plan it makes."""
        going = [i for i, choice in enumerate(self.calibration_choices) if choice == self._to_host]
        if layers <= 0:
            return
        if layers > len(going):
            raise ValueError(f"{layers} layers to keep on the device, but only {len(going)} go to the host")
        for index in going[len(going) - layers:]:
            self.calibration_choices[index] = self._stay
            self.kept_for_host.append(index)
        if self.plan is not None:
            for index in self.kept_for_host:
                self.plan.choices[index] = self._stay
        self.offload.set_plan(self.plan.choices if self.plan is not None else self.calibration_choices)

    def restart_calibration(self) -> None:
        """Forget the forwards seen so far (the memory preflight's probe steps, of other sizes than
        training's): 'auto' measures and plans on the run's own first forwards, and the host pool
        gives back the probes' page-locked blocks (sizes the run's batches do not take)."""
        self.offload.engine.trim_host_pool()
        self._forwards = 0
        self._timing.clear()
        self._calibration_peak = self._head_end = None
        if self.mode == "auto":
            self.plan = None
            self.offload.set_plan(self.calibration_choices)
        self.offload.engine.reset_counters()
        self.offload.forward_waits = 0
        self._boundary_max = (0, "", 0, 0)

    # ---- observation and planning -----------------------------------------------------------
    # forward 1 runs the calibration plan and fills the host pool (first-touch page-locking is
    # slow and would distort timings); forward 2 is timed; forward 3 runs the plan.
    _TIMED_FORWARD = 2
    _PLAN_AT_FORWARD = 3

    def _observe(self, index: int, event: str) -> None:
        self._note_memory(index, event)
        last = len(self.offload.layers) - 1
        if index == 0 and event == "forward_start":
            self._forwards += 1
            if self.mode == "auto" and self._forwards == self._PLAN_AT_FORWARD and self.plan is None:
                self._make_plan()
        if self.mode != "auto" or self._forwards != self._TIMED_FORWARD:
            return
        device = self._layer_device(index)
        if event in ("forward_start", "forward_end"):
            self._timing.setdefault(index, [None, None])[0 if event == "forward_start" else 1] = _marker(device)
        if event == "backward_start" and index == last:
            self._head_end = _marker(device)
        if event == "backward_start" and index == 0 and device.type == "cuda":
            self._calibration_peak = torch.cuda.max_memory_allocated(device)

    def _note_memory(self, index: int, event: str) -> None:
        """The most device memory allocated at a layer boundary since the last summary, and where
        (a host-side counter: no sync). It tells which part of the step holds the peak: the loss
        (after the last forward), or a layer's backward, and what the device held there."""
        device = self._layer_device(index)
        if device.type != "cuda":
            return
        allocated = torch.cuda.memory_allocated(device)
        if allocated > self._boundary_max[0]:
            stats = self.offload.engine.stats()
            self._boundary_max = (allocated, f"layer {index} {event}", stats.device_bytes_held,
                                  stats.d2h_bytes_in_flight)

    def _layer_device(self, index: int) -> torch.device:
        if self._device is None:
            param = next(self.offload.layers[index].parameters(), None)
            self._device = param.device if param is not None else torch.device("cpu")
        return self._device

    def _forward_seconds(self) -> tuple[list[float], float]:
        seconds = [_elapsed(*self._timing.get(i, (None, None))) for i in range(len(self.offload.layers))]
        last_end = self._timing.get(len(self.offload.layers) - 1, (None, None))[1]
        return seconds, _elapsed(last_end, self._head_end)

    def _make_plan(self) -> None:
        from hasten.memory.planner import LayerMeasure, plan_layers, simulate

        device = self._device or torch.device("cpu")
        if device.type == "cuda":
            self.bandwidth = measure_link_bandwidth(device)
            bandwidth_bps = min(self.bandwidth.values()) * 1e9
        else:
            bandwidth_bps = 10e9  # the CPU path copies synchronously; a nominal figure keeps the plan defined
        forward_s, head_s = self._forward_seconds()
        measures = [LayerMeasure(b, f) for b, f in zip(self.offload.bytes_per_layer, forward_s, strict=True)]
        keep_all_peak = None
        if self._calibration_peak is not None:
            as_planned = ([{"recompute": "keep", "recompute_offload": "offload"}[c] for c in self.calibration_choices]
                          if self.checkpointed else self.calibration_choices)  # in the planner's terms
            calibration = simulate(measures, as_planned, bandwidth_bps, head_s,
                                   self.offload.double_buffer)
            keep_all_peak = self._calibration_peak + calibration.saved_at_peak
        self.plan = plan_layers(measures, bandwidth_bps, head_s=head_s, double_buffer=self.offload.double_buffer,
                                keep_all_peak_bytes=keep_all_peak, budget_bytes=self.budget_bytes,
                                may_recompute=not self.checkpointed)
        if self.checkpointed:  # the planner's keep / offload of a checkpoint's input
            self.plan.choices = [{"keep": "recompute", "offload": "recompute_offload"}[c] for c in self.plan.choices]
        for index in self.kept_for_host:  # the preflight's split: the host cannot hold these
            self.plan.choices[index] = self._stay
        self.offload.set_plan(self.plan.choices)
        logger.warning("hasten: activation offload plan: %s (link %s; predicted extra step time %.1f ms%s)",
                       self.plan.summary(),
                       ", ".join(f"{k} {v:.1f} GB/s" for k, v in (self.bandwidth or {}).items()) or "CPU",
                       self.plan.predicted_extra_s * 1000,
                       "" if self.plan.predicted_peak_bytes is None
                       else f"; predicted peak {self.plan.predicted_peak_bytes / 2**30:.1f} GiB")
        for note in self.plan.notes:
            logger.warning("hasten: %s", note)
            record_fallback("offload_budget", note)

    def _check_host_memory(self, nbytes: int) -> None:
        if self.host_limit_bytes is None:
            return
        held = self.offload.engine.stats().host_bytes_held
        if held + nbytes > self.host_limit_bytes:
            shared = f", shared by the {self.host_processes} processes on this host" if self.host_processes > 1 else ""
            raise OffloadError(
                f"activation offload needs more host memory than this machine can spare: {(held + nbytes) / 2**30:.1f}"
                f" GiB would be held, the limit is {self.host_limit_bytes / 2**30:.1f} GiB "
                f"({100 * self.host_fraction:.0f}% of what was available at start{shared}). Lower training.max_tokens, give training.checkpoint.max_memory_gib with "
                "offload: auto (the planner then recomputes instead), or set training.checkpoint.offload: none.")

    # ---- metrics ------------------------------------------------------------------------------
    def summary(self) -> dict:
        stats = self.offload.engine.stats()
        self.offload.engine.reset_counters()
        row = {"gib_offloaded": stats.bytes_offloaded / 2**30, "gib_fetched": stats.bytes_fetched / 2**30,
               "fetches": stats.fetches, "exposed_fetches": stats.exposed_fetches,
               "exposed_wait_ms": stats.exposed_wait_ms, "double_buffer": self.offload.double_buffer,
               "forward_waits": self.offload.forward_waits,
               "host_pool_gib": self.offload.engine.host_pool_stats().allocated_bytes / 2**30,
               "plan": self.plan.summary() if self.plan else
               ("calibrating" if self.mode == "auto" else self._static_plan_summary())}
        if self.offload.fell_back_to_single_buffer:
            row["single_buffer_reason"] = self.offload.fell_back_to_single_buffer
        self.offload.forward_waits = 0
        if self._boundary_max[1]:
            allocated, where, held, in_flight = self._boundary_max
            row["boundary_max"] = {"gib": allocated / 2**30, "at": where, "restored_gib": held / 2**30,
                                   "d2h_in_flight_gib": in_flight / 2**30}
            self._boundary_max = (0, "", 0, 0)
        return row

    def _static_plan_summary(self) -> str:
        if self.checkpointed:
            return (f"{self.offload.plan.count('recompute_offload')} recompute_offload (checkpointed input on the "
                    f"host) of {len(self.offload.plan)} layers")
        return f"{self.offload.plan.count('offload')} offload of {len(self.offload.plan)} layers"
