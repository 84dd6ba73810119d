import numpy as np
import pytest
import torch

from hasten.packing import IGNORE_INDEX, PackingCollator, PackingError
from hasten.ops.packing import varlen_meta_raw
from tests.reference import varlen_meta_reference


def _random_samples(gen, n, max_len, vocab=1000):
    return [{"input_ids": torch.randint(0, vocab, (int(torch.randint(1, max_len + 1, (1,), generator=gen)),),
                                        generator=gen).tolist()} for _ in range(n)]


def _check_batch_invariants(batch, samples_by_content):
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    cu = batch["cu_seq_lens_q"]
    assert batch["cu_seq_lens_k"] is cu and cu.dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == int(cu.diff().max())
    # The collator's metadata equals what the op derives from its position_ids.
    ref_cu, ref_seq_idx, _, _ = varlen_meta_reference(pos)
    assert torch.equal(cu, ref_cu) and torch.equal(batch["seq_idx"], ref_seq_idx)
    flat_ids, flat_labels = ids.reshape(-1), labels.reshape(-1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert flat_labels[s] == IGNORE_INDEX  # nothing predicted across a boundary
        seg = flat_ids[s:e].tolist()
        if tuple(seg) in samples_by_content:
            assert flat_labels[s + 1:e].tolist() == seg[1:]
        else:  # a padding segment
            assert torch.all(flat_labels[s:e] == IGNORE_INDEX)


def test_single_row_keeps_order_and_marks_boundaries():
    samples = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10]}]
    batch = PackingCollator(max_tokens=16)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, -100, 10]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 4, 6]
    assert batch["max_length_q"] == 3 and batch["num_samples"] == 3
    assert batch["seq_idx"].tolist() == [0, 0, 0, 1, 2, 2]


def test_given_labels_are_kept_except_the_first():
    batch = PackingCollator(max_tokens=8)([{"input_ids": [1, 2, 3], "labels": [-100, -100, 3]},
                                           {"input_ids": np.array([4, 5]), "labels": torch.tensor([4, 5])}])
    assert batch["labels"].tolist() == [[-100, -100, 3, -100, 5]]


def test_samples_are_never_written():
    """The packed tensors are copies: marking boundaries in the labels leaves the caller's arrays alone."""
    ids_np, ids_torch = np.array([4, 5, 6]), torch.tensor([7, 8])
    samples = [{"input_ids": ids_np}, {"input_ids": ids_torch}, {"input_ids": [9, 10], "labels": np.array([9, 10])}]
    batch = PackingCollator(max_tokens=8)(samples)
    assert batch["labels"].tolist() == [[-100, 5, 6, -100, 8, -100, 10]]
    batch["input_ids"].fill_(0)
    assert ids_np.tolist() == [4, 5, 6] and ids_torch.tolist() == [7, 8]
    assert samples[2]["labels"].tolist() == [9, 10]


@pytest.mark.parametrize("seed", range(5))
def test_random_samples_multi_row(seed):
    gen = torch.Generator().manual_seed(seed)
    samples = _random_samples(gen, 40, 120)
    collator = PackingCollator(max_tokens=256)
    batch = collator(samples)
    rows, row_len = batch["input_ids"].shape
    assert row_len <= 256 and rows >= 1
    _check_batch_invariants(batch, {tuple(s["input_ids"]) for s in samples})
    # every sample appears exactly once
    cu = batch["cu_seq_lens_q"].tolist()
    flat = batch["input_ids"].reshape(-1)
    packed = sorted(tuple(flat[s:e].tolist()) for s, e in zip(cu[:-1], cu[1:]) if tuple(flat[s:e].tolist())
                    in {tuple(x["input_ids"]) for x in samples})
    assert packed == sorted(tuple(s["input_ids"]) for s in samples)
    total = sum(len(s["input_ids"]) for s in samples)
    assert collator.stats.tokens == total and collator.stats.slots == rows * row_len
    assert collator.stats.efficiency > 0.9  # first-fit decreasing leaves little padding here


def test_overlong_truncated_or_dropped_and_counted():
    samples = [{"input_ids": list(range(10))}, {"input_ids": [1, 2]}]
    trunc = PackingCollator(max_tokens=4, overlong="truncate")
    batch = trunc(samples)
    assert batch["num_samples"] == 2 and trunc.stats.overlong_truncated == 1
    assert sorted(batch["cu_seq_lens_q"].diff().tolist()) == [2, 2, 4]  # [0..3], [1,2] + its pad segment
    drop = PackingCollator(max_tokens=4, overlong="drop")
    batch = drop(samples)
    assert batch["num_samples"] == 1 and drop.stats.overlong_dropped == 1
    assert batch["input_ids"].tolist() == [[1, 2]]


def test_empty_samples_dropped_and_counted_and_all_empty_batch():
    collator = PackingCollator(max_tokens=8)
    batch = collator([{"input_ids": []}, {"input_ids": [3]}])
    assert batch["num_samples"] == 1 and collator.stats.empty_dropped == 1
    batch = collator([{"input_ids": []}])
    assert batch["num_samples"] == 0 and batch["input_ids"].shape == (0, 0)
    assert batch["cu_seq_lens_q"].tolist() == [0]


@pytest.mark.parametrize("sample,message", [
    ({"labels": [1]}, r"sample 1: has no `input_ids`"),
    ({"input_ids": "hello"}, r"sample 1: `input_ids` must be a list of token ids"),
    ({"input_ids": [1, 2.5]}, r"sample 1: `input_ids`\[1\] is 2.5"),
    ({"input_ids": [3, None]}, r"sample 1: `input_ids`\[1\] is None"),
    ({"input_ids": [True, False]}, r"sample 1: `input_ids`\[0\] is True"),
    ({"input_ids": [[1, 2], [3, 4]]}, r"sample 1: `input_ids`\[0\] is \[1, 2\]"),
    ({"input_ids": [1, [2, 3]]}, r"sample 1: `input_ids`\[1\] is \[2, 3\]"),
    ({"input_ids": ["7"]}, r"sample 1: `input_ids`\[0\] is '7'"),
    ({"input_ids": [2**70]}, r"sample 1: `input_ids` holds token ids outside the int64 range"),
    ({"input_ids": [1, 2], "labels": [1, 0.5]}, r"sample 1: `labels`\[1\] is 0.5"),
    ({"input_ids": np.array([1.0, 2.0])}, r"sample 1: `input_ids` must be a 1-D integer array"),
    ({"input_ids": [1, 2], "labels": [1]}, r"sample 1: `labels` has 1 tokens but `input_ids` has 2"),
    ({"input_ids": torch.zeros(2, 2, dtype=torch.long)}, r"sample 1: `input_ids` must be a 1-D integer tensor"),
    ({"input_ids": [-1]}, r"sample 1: `input_ids` holds a negative token id"),
    ([1, 2], r"sample 1: expected a mapping"),
])
def test_malformed_input_names_the_sample(sample, message):
    with pytest.raises(PackingError, match=message):
        PackingCollator(max_tokens=8)([{"input_ids": [1]}, sample])


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        PackingCollator(max_tokens=0)
    with pytest.raises(ValueError, match="overlong"):
        PackingCollator(max_tokens=4, overlong="wrap")


def test_metadata_matches_the_op_on_the_collators_position_ids():
    gen = torch.Generator().manual_seed(3)
    batch = PackingCollator(max_tokens=300)(_random_samples(gen, 30, 80))
    cu_padded, seq_idx, stats = varlen_meta_raw(batch["position_ids"])
    n = stats[0].item()
    assert torch.equal(cu_padded[: n + 1], batch["cu_seq_lens_q"])
    assert torch.equal(seq_idx, batch["seq_idx"]) and stats[1].item() == batch["max_length_q"]


def test_move_batch_keeps_shared_tensors_shared_and_ints_on_host():
    from hasten.packing import move_batch

    batch = move_batch(PackingCollator(max_tokens=8)([{"input_ids": [1, 2]}, {"input_ids": [3]}]), "cpu")
    assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"]
    assert isinstance(batch["max_length_q"], int) and batch["num_samples"] == 2
