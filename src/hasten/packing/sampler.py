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
        # Under data parallelism every rank builds the same batch list, trimmed so that all ranks
        # get as many, and takes batch rank of every group of world_size (see _balanced_for_ranks).
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Select the epoch's shuffle; `skip` drops its first batches (resuming mid-epoch)."""
        self.epoch = epoch
        self.skip = skip

    def batches(self) -> list[list[int]]:
        """This rank's batches of the epoch."""
        return self._epoch_batches()[self.rank::self.world_size]

    def all_batches(self) -> list[list[int]]:
        """Every rank's batches of the epoch, in step order (the same list on every rank)."""
        return self._epoch_batches()

    def _epoch_batches(self) -> list[list[int]]:
        """Every rank's batches of the epoch; under data parallelism in groups of world_size (one
        step: batch r of each group goes to rank r)."""
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
            batches = self._balanced_for_ranks(batches[:usable], gen)
        return batches

    # Per-token cost of the linear layers in units of one token pair of attention: about hidden
    # size x layers x 6 flops against 2 x heads x head dim x layers x 3.5; for 0.5-8B models the
    # ratio is a few thousand. The grouping only needs the order of batch costs roughly right.
    LINEAR_COST_PER_TOKEN = 4096

    def batch_cost(self, batch: list[int]) -> int:
        """Relative compute of one packed batch: attention grows with each sample's length squared."""
        lengths = [min(self.lengths[i], self.max_tokens) for i in batch]
        return sum(n * n for n in lengths) + self.LINEAR_COST_PER_TOKEN * sum(lengths)

    def rank_imbalance(self) -> float:
        """Over this epoch: the sum over steps of the costliest rank's batch cost, over the sum of
        the mean batch cost (1.0: every rank does the same work at every step). Any rank may call it."""
        if self.world_size == 1:
            return 1.0
        costs = [self.batch_cost(b) for b in self._epoch_batches()]
        steps = [costs[g: g + self.world_size] for g in range(0, len(costs), self.world_size)]
        slowest = sum(max(step) for step in steps)
        mean = sum(costs) / self.world_size
        return slowest / mean if mean else 1.0

    def _balanced_for_ranks(self, batches: list[list[int]], gen: torch.Generator) -> list[list[int]]:
        """Order batches so that each run of world_size batches (one per rank, same step) costs alike.

        Batches with equal token counts differ several-fold in attention work (one 8k-token sample
        against a hundred short ones), and every rank waits for the slowest at each collective:
        on 2 H200s FSDP2 ran at the pace of the costlier batch of each pair (1.38x one GPU).
        Batches sorted by cost are cut into groups of world_size; the groups are shuffled (in
        their original order when not shuffling), so the data order stays random across steps.
        """
        ranked = sorted(range(len(batches)), key=lambda b: self.batch_cost(batches[b]))
        groups = [ranked[g: g + self.world_size] for g in range(0, len(ranked), self.world_size)]
        if self.shuffle:
            groups = [groups[p] for p in torch.randperm(len(groups), generator=gen).tolist()]
        else:
            groups.sort(key=min)
        return [batches[b] for group in groups for b in group]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches()[self.skip:])

    def __len__(self) -> int:
        return max(0, len(self.batches()) - self.skip)
