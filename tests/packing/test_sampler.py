import torch

from hasten.packing import PackingCollator, TokenBudgetBatchSampler


def test_batches_respect_budget_and_cover_every_sample_once():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 500, (300,), generator=gen).tolist() + [0, 0, 900]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=512, seed=1)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert sum(min(lengths[i], 512) for i in b) <= 512
    fill = sum(min(n, 512) for n in lengths) / (512 * len(batches))
    assert fill > 0.9


def test_epochs_reshuffle_deterministically():
    lengths = list(range(1, 200))
    a = TokenBudgetBatchSampler(lengths, 256, seed=3)
    b = TokenBudgetBatchSampler(lengths, 256, seed=3)
    assert a.batches() == b.batches()
    first = a.batches()
    a.set_epoch(1)
    assert a.batches() != first


def test_each_batch_packs_to_one_row_without_padding():
    gen = torch.Generator().manual_seed(5)
    samples = [{"input_ids": torch.randint(0, 9, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 300, (100,), generator=gen)]
    collator = PackingCollator(max_tokens=1024)
    for b in TokenBudgetBatchSampler([len(s["input_ids"]) for s in samples], 1024, seed=0):
        batch = collator([samples[i] for i in b])
        assert batch["input_ids"].shape[0] == 1
    assert collator.stats.efficiency == 1.0


def _long_tailed_lengths(seed: int, count: int = 600) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    short = torch.randint(1, 200, (count,), generator=gen)
    long = torch.randint(1500, 4000, (count // 10,), generator=gen)
    return torch.cat([short, long])[torch.randperm(count + count // 10, generator=gen)].tolist()


def test_ranks_split_every_batch_once_with_equal_counts():
    lengths = _long_tailed_lengths(0)
    single = TokenBudgetBatchSampler(lengths, 4096, seed=2).batches()
    for world_size in (2, 3, 4):
        per_rank = [TokenBudgetBatchSampler(lengths, 4096, seed=2, rank=r, world_size=world_size).batches()
                    for r in range(world_size)]
        assert len({len(b) for b in per_rank}) == 1
        taken = sorted(sorted(b) for rank_batches in per_rank for b in rank_batches)
        usable = len(single) - len(single) % world_size
        assert len(taken) == usable
        # the same batches as one process builds, less the trimmed remainder
        assert all(b in [sorted(s) for s in single] for b in taken)


def test_ranks_get_batches_of_similar_cost_at_each_step():
    lengths = _long_tailed_lengths(1)
    ranks = [TokenBudgetBatchSampler(lengths, 4096, seed=5, rank=r, world_size=2) for r in range(2)]
    pairs = list(zip(ranks[0].batches(), ranks[1].batches()))
    cost = ranks[0].batch_cost
    slowest = sum(max(cost(a), cost(b)) for a, b in pairs)
    mean = sum(cost(a) + cost(b) for a, b in pairs) / 2
    # an unbalanced split (every other batch of the shuffled list) for comparison
    plain = TokenBudgetBatchSampler(lengths, 4096, seed=5).batches()
    plain_pairs = list(zip(plain[0::2], plain[1::2]))
    plain_slowest = sum(max(cost(a), cost(b)) for a, b in plain_pairs)
    plain_mean = sum(cost(a) + cost(b) for a, b in plain_pairs) / 2
    assert slowest / mean < 1.03
    assert plain_slowest / plain_mean > slowest / mean
    # the step order is still shuffled, and resuming with skip continues the same sequence
    assert [cost(b) for b, _ in pairs] != sorted(cost(b) for b, _ in pairs)
    ranks[0].set_epoch(0, skip=3)
    assert list(ranks[0]) == [a for a, _ in pairs][3:]


def test_rank_imbalance_reports_the_balanced_split():
    lengths = _long_tailed_lengths(1)
    sampler = TokenBudgetBatchSampler(lengths, 4096, seed=5, rank=1, world_size=2)
    assert TokenBudgetBatchSampler(lengths, 4096, seed=5).rank_imbalance() == 1.0
    assert 1.0 <= sampler.rank_imbalance() < 1.03
    # one sample far longer than the rest cannot be matched by any other batch
    skewed = [4000] + [50] * 400
    assert TokenBudgetBatchSampler(skewed, 4096, seed=0, rank=0, world_size=2).rank_imbalance() > 1.1
