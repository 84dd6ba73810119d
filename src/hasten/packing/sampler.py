"""TokenBudgetBatchSampler: batches of sample indices that fill one packed row each."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


class TokenBudgetBatchSampler:
    """Yield lists of sample indices whose lengths sum to at most `max_tokens`.

    Each epoch shuffles the samples (seeded), packs each window of `window` samples
    first-fit by decreasing length, and shuffles the resulting batches, so
    batches are nearly full and `PackingCollator` makes one row with no padding.
    A sample longer than `max_tokens` gets a batch of its own (the collator
    truncates or drops it). Empty samples are kept so the collator counts them.
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int, *, shuffle: bool = True, seed: int = 0,
                 window: int = 2048, rank: int = 0, world_size: int = 1) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.lengths = [int(n) for n in lengths]
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.window = window
        self.epoch = 0
        self.skip = 0
        # Under data parallelism every rank builds the same batch list and takes every
        # world_size-th batch from `rank`, trimmed so that all ranks get as many.
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's shuffle; `skip` drops its first batches (resuming mid-epoch)."""
        self.epoch = epoch
        self.skip = skip

    def batches(self) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=gen).tolist() if self.shuffle else list(
            range(len(self.lengths)))
        batches: list[list[int]] = []
        for w in range(0, len(order), self.window):
            chunk = sorted(order[w: w + self.window], key=lambda i: -self.lengths[i])
            bins: list[list[int]] = []
            free: list[int] = []
            for i in chunk:
                need = min(self.lengths[i], self.max_tokens)
                for b, space in enumerate(free):
                    if need <= space:
                        bins[b].append(i)
                        free[b] -= need
                        break
                else:
                    bins.append([i])
                    free.append(self.max_tokens - need)
            batches += bins
        if self.shuffle:
            perm = torch.randperm(len(batches), generator=gen).tolist()
            batches = [batches[p] for p in perm]
        if self.world_size > 1:
            usable = len(batches) - len(batches) % self.world_size
            batches = batches[self.rank:usable:self.world_size]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.skip:])

    def __len__(self) -> int:
        return max(0, len(self.batches()) - self.skip)
