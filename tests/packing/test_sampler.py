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
