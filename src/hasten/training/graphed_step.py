"""Each micro-batch's forward, loss and backward replayed from a CUDA graph (`training.cuda_graphs:
step`), one graph per batch shape, the optimizer step in GraphedAdamW's own graph.

Why: a small model's step is bound by the host issuing its kernels (the embedded default job:
10.2 ms a step with the GPU idle most of it, H100 d9f8509); a replay issues the whole micro-batch
in one call. What makes it possible: hasten's packed step syncs nothing, and the packing metadata
is host ints and device tensors built once per batch.

Shapes. A graph replays fixed shapes and host values, so batches are padded on the host, before
their copy to the GPU, to a few buckets (`pad_packed_batch`):
  tokens     T -> a multiple of max_tokens / 8 (at least 64), at most max_tokens: a padding segment,
             its own sequence (attended only to itself, labels -100: no loss, zero gradient), as
             PackingCollator already pads rows;
  sequences  N (with the padding segment) -> a power of two >= 8: empty sequences at the end of
             cu_seqlens (its last boundary repeated), as the cuDNN op pads its own batch;
  longest    max_length -> a power of two >= 64 (an upper bound; the cuDNN op keys its graphs on
             that power of two anyway).
Every real token computes what it computes unpadded (the padding is a sequence of its own, no
token attends across a boundary); the loss is the mean over the same label tokens. Matrix
products over more rows may pick other kernels: bf16 noise, not a change of what is computed.
A batch of several rows (samples that did not fit one row) keeps its shape and gets a graph of its
own shape.

Per bucket: the first batch runs eagerly on the capture's side stream (cuDNN plans, kernels
loaded, allocations seen), the second is captured (forward, `loss / accumulation`, backward; the
gradients accumulate in place into the tensors GraphedAdamW keeps) and replayed, later ones copy
into the graph's static inputs and replay. All graphs share one memory pool (they never run at
once). Up to `max_graphs` shapes get a graph; a batch of another shape runs eagerly (counted).

Before each replay every captured gradient must still be the tensor the graph adds into; if one
was replaced or dropped, the graphs are dropped and the run goes on eagerly (said once). A capture
that fails (a host sync inside the model, for one) does the same; the micro-batch then runs
eagerly, so no batch is lost or counted twice.

Settings that cannot combine (padded batches, activation offload, MLP tiles, compile, metadata
read back per layer, LoRA dropout) are refused by the config's validation (exit 2). At the start of
a run (said once, counted under `cuda_graph_step`, named in the handle's inactive list; the run
is then the eager one): the CPU, torchrun, a model type outside VERIFIED_MODEL_TYPES, dropout in
the model, HASTEN_VERIFY, an optimizer step that is not captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hasten.integrations.architectures import model_type_of
from hasten.observability import logger, record_fallback
from hasten.packing.collator import IGNORE_INDEX
from hasten.packing.meta import CU_K, CU_Q, MAX_K, MAX_Q, map_batch_tensors, verify_enabled

FALLBACK = "cuda_graph_step"
MAX_GRAPHS = 32
MIN_SEQUENCES = 8
MIN_LONGEST = 64


def _power_of_two(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def token_step(max_tokens: int) -> int:
    """The token buckets' spacing: max_tokens / 8 rounded up to a multiple of 64."""
    return max(64, -(-(max_tokens // 8) // 64) * 64)


def token_bucket(tokens: int, max_tokens: int) -> int:
    """The padded token count: a multiple of token_step(max_tokens), capped at max_tokens (never
    below `tokens`)."""
    step = token_step(max_tokens)
    return max(tokens, min(-(-tokens // step) * step, max_tokens))


def pad_packed_batch(batch: dict, tokens: int, pad_token_id: int) -> dict:
    """A one-row packed host batch (PackingCollator's keys) padded to `tokens` tokens, its
    cu_seqlens to a power of two >= 8 sequences and its max_length to a power of two >= 64.
    The original batch is not written."""
    ids = batch["input_ids"]
    length = ids.shape[-1]
    pad = tokens - length
    cu = batch[CU_Q].numpy().astype(np.int64)
    longest = int(batch[MAX_Q])
    if pad < 0 or ids.dim() != 2 or ids.shape[0] != 1 or int(cu[-1]) != length:
        raise ValueError(f"pad_packed_batch: a one-row packed batch of at most {tokens} tokens, got input_ids "
                         f"{tuple(ids.shape)} with cu_seqlens ending at {int(cu[-1])}")
    if pad:
        cu = np.append(cu, length + pad)
        longest = max(longest, pad)
    sequences = _power_of_two(len(cu) - 1, MIN_SEQUENCES)
    cu = np.concatenate([cu, np.full(sequences + 1 - len(cu), cu[-1], dtype=np.int64)])
    last_sequence = int(batch["seq_idx"][-1]) + 1 if length else 0

    def extend(tensor: torch.Tensor, fill) -> torch.Tensor:
        tail = torch.as_tensor(fill, dtype=tensor.dtype).view(1, -1) if tensor.dim() == 2 else \
            torch.as_tensor(fill, dtype=tensor.dtype)
        return torch.cat([tensor, tail], dim=-1)

    padded = dict(batch)
    padded["input_ids"] = extend(ids, np.full(pad, pad_token_id))
    padded["labels"] = extend(batch["labels"], np.full(pad, IGNORE_INDEX))
    padded["position_ids"] = extend(batch["position_ids"], np.arange(pad))
    padded["seq_idx"] = extend(batch["seq_idx"], np.full(pad, last_sequence))
    cu_seqlens = torch.from_numpy(cu.astype(np.int32))
    padded[CU_Q] = padded[CU_K] = cu_seqlens
    padded[MAX_Q] = padded[MAX_K] = _power_of_two(longest, MIN_LONGEST)
    if ids.is_pinned():
        padded = map_batch_tensors(padded, torch.Tensor.pin_memory)
    return padded


def shape_key(batch: dict) -> tuple:
    """What a graph bakes in: every tensor's shape and dtype and every host value but the sample
    count (which no forward reads)."""
    return tuple(sorted((name, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
                        for name, v in batch.items() if name != "num_samples"))


# Model types whose packed batches, padded as above, were shown to train as unpadded: the loss and
# every gradient of a padded batch against the batch itself (tests/training/test_graphed_step.py,
# float32 on the CPU) and each replay against the same padded batch run eagerly plus `hasten
# train` against eager (tests/gpu/test_cuda_graphs_cuda.py, bf16 on the GPU). A type joins when
# both ran for it; others (hybrid layers that read cu_seqlens back, chunked attention, MoE routing
# of the padding tokens) run eagerly, said once.
VERIFIED_MODEL_TYPES = frozenset({"qwen3"})


def refusal(*, device: torch.device, distributed: bool, model: torch.nn.Module, optimizer_captured: bool) -> str | None:
    """Why this run's micro-batches cannot replay from graphs, or None. (Settings that cannot
    combine with step graphs are refused by the config's validation before the run starts.)"""
    if device.type != "cuda":
        return f"this run trains on {device.type}, and CUDA graphs need a CUDA GPU"
    if distributed:
        return "under torchrun the gradients' all-reduce runs inside the backward, which is not captured"
    model_type = model_type_of(getattr(model, "config", None))
    if model_type not in VERIFIED_MODEL_TYPES:
        return (f"model type '{model_type}': padded packed batches are verified to train as unpadded only for "
                f"{', '.join(sorted(VERIFIED_MODEL_TYPES))} (tests/training/test_graphed_step.py, "
                "tests/gpu/test_cuda_graphs_cuda.py)")
    dropout = next((name for name, m in model.named_modules()
                    if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0), None)
    if dropout is None:
        config = getattr(model, "config", None)
        dropout = next((key for key in ("attention_dropout", "hidden_dropout", "dropout")
                        if isinstance(getattr(config, key, None), (int, float)) and getattr(config, key) > 0), None)
    if dropout is not None:
        return f"dropout is on ({dropout}): its random masks are not replayed from a graph"
    if verify_enabled():
        return "HASTEN_VERIFY reads the metadata back in every attention call (a host sync)"
    if not optimizer_captured:
        return "the optimizer step is not captured (the graphs need its gradients to stay in place)"
    return None


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph | None = None
    static: dict | None = None  # the graph's input batch
    loss: torch.Tensor | None = None  # its output, overwritten by each replay


class StepGraphs:
    """Replays each micro-batch's forward and backward from a CUDA graph of its shape (see the
    module docstring). `forward_backward(batch)` returns the detached `loss / accumulation`."""

    def __init__(self, model: torch.nn.Module, params: list[torch.Tensor], *, max_tokens: int, pad_token_id: int,
                 accumulation: int, device: torch.device, max_graphs: int = MAX_GRAPHS) -> None:
        self.model, self.params = model, params
        self.max_tokens, self.pad_token_id, self.accumulation = max_tokens, pad_token_id, accumulation
        self.device, self.max_graphs = device, max_graphs
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.entries: dict[tuple, _Entry] = {}
        self.grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, the gradient the graphs add into)
        self.captures = self.replays = self.eager = 0
        self.disabled_reason: str | None = None
        self._over_limit_said = False

    # --- host side, before the copy to the GPU --------------------------------------------------

    def pad(self, batch: dict) -> dict:
        """The host batch padded to its bucket (a batch of several rows or without packing
        metadata as it is)."""
        ids = batch.get("input_ids")
        if self.disabled_reason is not None or CU_Q not in batch or ids is None or ids.dim() != 2 or ids.shape[0] != 1:
            return batch
        return pad_packed_batch(batch, token_bucket(ids.shape[-1], self.max_tokens), self.pad_token_id)

    # --- the micro-batch ------------------------------------------------------------------------

    def forward_backward(self, batch: dict) -> torch.Tensor:
        if self.disabled_reason is not None:
            return self._eager(batch)
        key = shape_key(batch)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= self.max_graphs:
                if not self._over_limit_said:
                    self._over_limit_said = True
                    record_fallback(FALLBACK, f"training.cuda_graphs step: more than {self.max_graphs} batch shapes; "
                                              "batches of further shapes run eagerly (same results)")
                return self._eager(batch)
            self.entries[key] = _Entry()
            return self._on_side_stream(lambda: self._eager(batch))  # the bucket's warm-up
        if not self._gradients_in_place():
            return self._eager(batch)
        if entry.graph is None and not self._capture(entry, batch):
            return self._eager(batch)
        copied: set[int] = set()
        for name, value in batch.items():
            if isinstance(value, torch.Tensor) and id(value) not in copied:
                copied.add(id(value))
                entry.static[name].copy_(value, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.loss

    def summary(self) -> dict:
        return {"graphs": sum(e.graph is not None for e in self.entries.values()), "shapes": len(self.entries),
                "captures": self.captures, "replays": self.replays, "eager_micro_batches": self.eager,
                "disabled_reason": self.disabled_reason}

    # --- internals -----------------------------------------------------------------------------

    def _eager(self, batch: dict) -> torch.Tensor:
        self.eager += 1
        loss = self.model(**batch).loss / self.accumulation
        loss.backward()
        return loss.detach()

    def _on_side_stream(self, work):
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            result = work()
        main.wait_stream(self.stream)
        return result

    def _capture(self, entry: _Entry, batch: dict) -> bool:
        static = map_batch_tensors(batch, lambda t: t.clone())
        graph = torch.cuda.CUDAGraph()
        main = torch.cuda.current_stream(self.device)
        without_grad = [p for p in self.params if p.grad is None]
        self.stream.wait_stream(main)
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                loss = self.model(**static).loss / self.accumulation
                loss.backward()
        except Exception as exc:  # noqa: BLE001 - any failure: say it once, run eagerly from now on
            main.wait_stream(self.stream)
            self._drop_gradients_made_in_capture(without_grad)
            self._disable(f"capturing a micro-batch failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")
            return False
        main.wait_stream(self.stream)
        if self._drop_gradients_made_in_capture(without_grad):
            # its replays would write that gradient, not add to it: accumulation would lose micro-batches
            self._disable("a parameter got its first gradient inside a capture (its graph would overwrite the "
                          "gradient instead of adding to it)")
            return False
        entry.graph, entry.static, entry.loss = graph, static, loss.detach()
        # what the graphs add into (the bucket's eager warm-up made them); a parameter without one
        # gets none from the graph either (unused), and one that gains or swaps it turns graphs off
        self.grads = [(p, p.grad) for p in self.params]
        self.captures += 1
        if self.captures == 1:
            logger.info("hasten: training.cuda_graphs step: micro-batches replay from CUDA graphs, one per batch "
                        "shape (tokens padded to multiples of %d)", token_step(self.max_tokens))
        return True

    @staticmethod
    def _drop_gradients_made_in_capture(without_grad: list[torch.Tensor]) -> bool:
        """Gradients that backward created during a capture were never written (a capture runs
        nothing): set them back to None. Whether there were any."""
        made = [p for p in without_grad if p.grad is not None]
        for p in made:
            p.grad = None
        return bool(made)

    def _gradients_in_place(self) -> bool:
        if any(p.grad is not g for p, g in self.grads):
            self._disable("a parameter's gradient was replaced or set to None after the graphs were captured (they "
                          "add into the captured tensors)")
            return False
        return True

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        self.entries.clear()
        record_fallback(FALLBACK, f"training.cuda_graphs step: {reason}; micro-batches run eagerly from here on "
                                  "(same results)")

