"""NextBatchPrefetcher hands out every item, in order, with its batch on the device."""

import torch

from hasten.training.prefetch import NextBatchPrefetcher


def test_items_pass_through_in_order_on_the_cpu():
    shared = torch.arange(3)
    items = [(0, i, {"input_ids": torch.full((4,), i), "cu_q": shared, "cu_k": shared, "max_length": 7})
             for i in range(3)]
    got = list(NextBatchPrefetcher(iter(items), torch.device("cpu"), batch_of=lambda item: item[2]))
    assert [item for item, _ in got] == items
    for (item, batch) in got:
        assert torch.equal(batch["input_ids"], item[2]["input_ids"]) and batch["max_length"] == 7
        assert batch["cu_q"] is batch["cu_k"]  # shared tensors stay shared
