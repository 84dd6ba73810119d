"""benchmarks/attention_backends.py's length classes (CPU): the grouping that minimises the rows
cuDNN's ragged kernels launch over, against every assignment of a few samples, and the per-class
batches it packs."""

import itertools
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from attention_backends import class_batches, length_classes  # noqa: E402


def _rows(groups, lengths):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_length_classes_launch_over_the_fewest_rows_any_grouping_can():
    rng = random.Random(0)
    for _ in range(150):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 7))]
        classes = rng.randint(1, 4)
        groups = length_classes(lengths, classes)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert 1 <= len(groups) <= classes
        best = min(sum(len(members) * max(lengths[i] for i in members)
                       for members in ([i for i, a in enumerate(labels) if a == c] for c in range(classes)) if members)
                   for labels in itertools.product(range(classes), repeat=len(lengths)))
        assert _rows(groups, lengths) == best


def test_one_class_is_the_whole_batch_and_classes_never_exceed_the_samples():
    assert length_classes([5, 1, 3], 1) == [[1, 2, 0]]  # ascending length
    assert length_classes([7], 3) == [[0]]
    assert _rows(length_classes([4, 4], 5), [4, 4]) == 8


def test_class_batches_pack_each_classs_samples_rows_with_their_offsets():
    lengths = [3, 1, 4, 2]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    rows = torch.arange(sum(lengths), dtype=torch.float32).view(-1, 1)
    (packed_a,), cu_a, longest_a = class_batches([[1, 3]], cu, [rows])[0]
    assert packed_a.view(-1).tolist() == [3, 8, 9]  # sample 1 (row 3), then sample 3 (rows 8, 9)
    assert cu_a.tolist() == [0, 1, 3] and longest_a == 2
