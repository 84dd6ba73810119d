"""The AdamW step captured in a CUDA graph (`training.cuda_graphs: optimizer`).

fused AdamW is a few multi-tensor kernel launches per step, plus Python that groups the tensors
every step; captured once, a step is one `graph.replay()`. What the graph needs, and how each
piece of the training step keeps working:

- Gradients are static buffers: `zero_grad` zeroes them in place and never drops them (as
  `zero_grad(set_to_none=False)`), so every backward, gradient accumulation included, writes
  into the tensors the graph reads. Before each replay every captured gradient is checked to
  still be the tensor the graph reads: one replaced by another tensor is copied into it, and a
  step where one is None runs eagerly (AdamW skips such a parameter; a graph cannot).
- The learning rate is a device tensor inside the graph, filled from `param_groups[i]["lr"]`
  before each replay. `param_groups` keep a float lr (and capturable False) outside the moment
  of capture, so the LR scheduler, the metrics and the checkpoints see exactly what the eager
  optimizer shows, and a checkpoint of either optimizer resumes in the other.
- The first `warmup_steps` steps (after construction and after every `load_state_dict`) run
  eagerly on a side stream, which creates the optimizer state and loads the kernels; the next
  step is captured (on that side stream) and replayed. Capturing does not run the work, so the
  capturing step replays once right after.
- `load_state_dict` replaces the state tensors the graph points at: the graph is dropped and
  captured again after the warm-up steps. A change of any other hyperparameter of a group
  (betas, weight decay, eps...), of its parameters, or a parameter that had no gradient at
  capture time getting one, also drops the graph and captures again.
- A parameter that gets no gradient in some step still has its zeroed gradient, so AdamW
  updates it (its moments decay, weight decay applies), as with `zero_grad(set_to_none=False)`
  in plain PyTorch; the eager optimizer with set_to_none=True would skip it. Parameters of
  transformer language models get a gradient every step.

Numerics: the same fused kernel as `torch.optim.AdamW(fused=True)` on the same tensors; the one
difference is the learning rate, read from a float32 tensor in the graph where the eager step
passes a double, which can move a parameter by one ulp of float32 (measured in
tests/gpu/test_cuda_graphs_cuda.py; bit-identical when the rates are float32 numbers).

Fallbacks (warned once, counted under `cuda_graph_optimizer`): no CUDA device, parameters on
several devices, FSDP2 (DTensor parameters), and a capture that fails: the eager fused step runs
instead, with the same results as `cuda_graphs: false`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch

from hasten.observability import logger, record_fallback

FALLBACK = "cuda_graph_optimizer"
# param_group keys that the graph does not bake in (lr is read from a tensor) or that hasten flips
_LIVE_KEYS = ("params", "lr", "initial_lr", "capturable")


def _raw_adamw_step():
    """torch's AdamW.step without its wrappers (the profiler and hook wrapper torch adds to the
    class, and the grad-mode one): GraphedAdamW.step has its own, and calling super().step()
    would run the step hooks twice."""
    return inspect.unwrap(torch.optim.AdamW.step)


def _one_cuda_device(devices: set[torch.device]) -> torch.device | None:
    """The CUDA device every parameter is on, or None (CPU, several devices, no parameters)."""
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return next(iter(devices))
    return None


def _hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _LIVE_KEYS}


class GraphedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused) whose step is captured in a CUDA graph after `warmup_steps` eager
    steps; see the module docstring. `captures`, `replays` and `eager_steps` count what ran;
    `disabled_reason` says why it runs eagerly for good (None while graphs are on)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, *, warmup_steps: int = 2, **kwargs) -> None:
        if isinstance(lr, torch.Tensor):
            raise TypeError("GraphedAdamW takes the learning rate as a float (the graph reads it from its own tensor)")
        for key in ("capturable", "foreach", "differentiable"):
            if kwargs.get(key):
                raise ValueError(f"GraphedAdamW does not take {key}=True: it runs the fused kernel and manages capture")
        kwargs.pop("fused", None)
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        devices = {p.device for g in groups for p in g["params"]}
        device = _one_cuda_device(devices)
        super().__init__(params, lr=lr, fused=device is not None, **kwargs)
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1 (the eager steps that create the state); got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.captures = self.replays = self.eager_steps = 0
        self.disabled_reason: str | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, the gradient the graph reads)
        self._uncaptured: list[torch.Tensor] = []  # parameters without a gradient at capture time
        self._snapshot: list[tuple[list[torch.Tensor], dict]] = []
        self._lr_tensors: list[torch.Tensor] = []
        self._since_reset = 0  # eager steps since construction or the last load_state_dict
        self._device = device
        self._stream = torch.cuda.Stream(device) if device is not None else None
        if device is None:
            where = ", ".join(sorted(str(d) for d in devices)) or "no parameters"
            self._disable(f"the parameters are on {where}, not on one CUDA device")

    # --- public optimizer API ------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def step(self, closure=None):
        if closure is not None or self.disabled_reason is not None:
            return self._eager_step(closure)
        if self._graph is not None and not self._still_valid():
            self._graph = None
        if self._graph is None:
            if self._since_reset < self.warmup_steps or not self._ready_to_capture():
                self._warmup_step()
                return None
            if not self._capture():
                return self._eager_step(None)
        if not self._gradients_in_place():
            return self._eager_step(None)
        for group, lr in zip(self.param_groups, self._lr_tensors):
            lr.fill_(group["lr"])  # a kernel argument, no host sync
        self._graph.replay()
        self.replays += 1
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place (the graph reads them at fixed addresses); once graphs are
        off for good, `set_to_none` is honoured as in torch."""
        super().zero_grad(set_to_none=set_to_none if self.disabled_reason is not None else False)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            # a checkpoint of another optimizer (eager, CPU) brings its own flags: this one runs fused
            group["capturable"] = False
            if self.disabled_reason is None:
                group["fused"], group["foreach"] = True, None
                for p in group["params"]:
                    state = self.state.get(p)
                    step = state.get("step") if state else None
                    if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                        state["step"] = step.to(device=p.device, dtype=torch.float32)
        self._graph = None  # it points at the state tensors just replaced
        self._since_reset = 0

    # --- internals -----------------------------------------------------------------------------

    def _run_step(self, closure=None):
        with torch.no_grad():
            return _raw_adamw_step()(self, closure)

    def _eager_step(self, closure):
        self.eager_steps += 1
        return self._run_step(closure)

    def _warmup_step(self) -> None:
        """One eager step on the side stream that capture uses (state and kernels are set up there)."""
        main = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            self._run_step()
        main.wait_stream(self._stream)
        # state tensors created on the side stream are used on the main stream from now on
        for state in self.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.is_cuda:
                    value.record_stream(main)
        self._since_reset += 1
        self.eager_steps += 1

    def _ready_to_capture(self) -> bool:
        with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return bool(with_grad) and all(len(self.state.get(p, ())) > 0 for p in with_grad)

    def _capture(self) -> bool:
        params = [p for g in self.param_groups for p in g["params"]]
        captured = [(p, p.grad) for p in params if p.grad is not None]
        if len(self._lr_tensors) != len(self.param_groups):
            self._lr_tensors = [torch.zeros((), dtype=torch.float32, device=self._device) for _ in self.param_groups]
        saved = [(g["lr"], g["capturable"]) for g in self.param_groups]
        graph = torch.cuda.CUDAGraph()
        try:
            for group, lr in zip(self.param_groups, self._lr_tensors):
                lr.fill_(group["lr"])
                group["lr"], group["capturable"] = lr, True  # torch refuses capture unless capturable
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self._run_step()
        except Exception as exc:  # noqa: BLE001 - any failure: say it once, run eagerly from now on
            self._disable(f"capturing the optimizer step failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
            return False
        finally:
            for group, (lr, capturable) in zip(self.param_groups, saved):
                group["lr"], group["capturable"] = lr, capturable
        self._graph = graph
        self._captured = captured
        self._uncaptured = [p for p in params if p.grad is None]
        self._snapshot = [(list(g["params"]), _hyperparameters(g)) for g in self.param_groups]
        self.captures += 1
        logger.info("hasten: optimizer step captured in a CUDA graph (%d parameters%s)", len(captured),
                    " again" if self.captures > 1 else "")
        return True

    def _still_valid(self) -> bool:
        if len(self._snapshot) != len(self.param_groups):
            return False
        for group, (params, hyper) in zip(self.param_groups, self._snapshot):
            now = group["params"]
            if len(now) != len(params) or any(a is not b for a, b in zip(now, params)):
                return False
            if _hyperparameters(group) != hyper:
                return False
        return all(p.grad is None for p in self._uncaptured)

    def _gradients_in_place(self) -> bool:
        for p, static in self._captured:
            grad = p.grad
            if grad is static:
                continue
            if grad is None:
                record_fallback(FALLBACK, "a parameter had no gradient at an optimizer step (set to None after the "
                                          "CUDA graph was captured): that step ran eagerly, which skips it")
                return False
            if grad.shape != static.shape or grad.dtype != static.dtype or grad.stride() != static.stride():
                record_fallback(FALLBACK, "a parameter's gradient was replaced by a tensor of another layout after "
                                          "the CUDA graph was captured: that step ran eagerly")
                return False
            static.copy_(grad)  # a replaced gradient (e.g. assigned by other code): the graph reads `static`
            p.grad = static
        return True

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self._graph = None
        record_fallback(FALLBACK, f"training.cuda_graphs optimizer: {reason}; the optimizer step runs eagerly "
                                  "(fused AdamW, same results)")


def build_adamw(params: Iterable, *, lr: float, weight_decay: float, device: torch.device,
                cuda_graphs: str = "false", distributed: str = "none") -> torch.optim.Optimizer:
    """The training loop's AdamW: fused on CUDA; with `cuda_graphs` "optimizer" (or "step") a GraphedAdamW
    where the step can be captured, else (said once, counted) exactly the eager optimizer."""
    params = list(params)
    fused = device.type == "cuda"
    if cuda_graphs in ("optimizer", "step"):
        reason = None
        if device.type != "cuda":
            reason = f"this run trains on {device.type}, and CUDA graphs need a CUDA GPU"
        elif distributed == "fsdp2":
            reason = "FSDP2 shards the parameters as DTensors, whose optimizer step is not captured"
        elif any(p.device != params[0].device for p in params):
            reason = "the trainable parameters are on several devices"
        if reason is None:
            return GraphedAdamW(params, lr=lr, weight_decay=weight_decay)
        record_fallback(FALLBACK, f"training.cuda_graphs {cuda_graphs}: {reason}; the optimizer step runs eagerly "
                                  "(same results as cuda_graphs: false)")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def optimizer_graph_summary(optimizer) -> dict | None:
    """For summary.json: whether the step ran from a CUDA graph, and how often (None: no GraphedAdamW)."""
    if not isinstance(optimizer, GraphedAdamW):
        return None
    return {"captured": optimizer.captured, "captures": optimizer.captures, "replays": optimizer.replays,
            "eager_steps": optimizer.eager_steps, "disabled_reason": optimizer.disabled_reason}
