"""The next batch moves to the GPU on a copy stream while the current step computes.

    batches = NextBatchPrefetcher(host_batches, device, tensors_of=lambda item: item[2])
    for epoch, consumed, host_batch, device_batch in batches: ...

When item n is handed out, item n+1's copy is already queued on the copy stream. The device
buffers are allocated in compute-stream order and the copy stream waits for compute up to that
point (the allocator may hand out memory that queued compute work still reads), then copies from
pinned memory; the compute stream waits on the copy's event before the batch is used. No
record_stream: each buffer belongs to the compute stream from its allocation on. On the CPU (or
without CUDA) items pass through with a plain move.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from hasten.packing.meta import map_batch_tensors, move_batch


class NextBatchPrefetcher:
    def __init__(self, items: Iterator, device: torch.device, batch_of: Callable = lambda item: item) -> None:
        self.items = iter(items)
        self.device = device
        self.batch_of = batch_of
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: tuple | None = None  # (item, device batch, copy-done event)
        self.copies = 0

    def __iter__(self) -> "NextBatchPrefetcher":
        return self

    def _start(self, item) -> tuple:
        batch = self.batch_of(item)
        if self.stream is None:
            return item, move_batch(batch, self.device), None
        compute = torch.cuda.current_stream(self.device)
        device_batch = map_batch_tensors(batch, lambda t: torch.empty_like(t, device=self.device))
        allocated = torch.cuda.Event()
        allocated.record(compute)
        self.stream.wait_event(allocated)
        copied: set[int] = set()  # keys may share one tensor (cu_seq_lens_q is cu_seq_lens_k)
        with torch.cuda.stream(self.stream):
            for name, host in batch.items():
                if isinstance(host, torch.Tensor) and id(host) not in copied:
                    copied.add(id(host))
                    device_batch[name].copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.copies += 1
        return item, device_batch, done

    def __next__(self):
        current = self._pending if self._pending is not None else self._start(next(self.items))
        try:
            self._pending = self._start(next(self.items))
        except StopIteration:
            self._pending = None
        item, device_batch, done = current
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return item, device_batch
