import pytest
import torch

from hasten.ops.packing import varlen_meta_raw
from hasten.packing.meta import PackedMeta
from tests.reference import random_packed_position_ids, varlen_meta_reference


def _check(position_ids: torch.Tensor) -> None:
    cu_padded, seq_idx, stats = varlen_meta_raw(position_ids)
    ref_cu, ref_seq_idx, ref_n, ref_max = varlen_meta_reference(position_ids)
    total = position_ids.numel()
    assert cu_padded.dtype == seq_idx.dtype == stats.dtype == torch.int32
    assert cu_padded.shape == (total + 1,) and seq_idx.shape == (total,)
    assert stats.tolist() == [ref_n, ref_max]
    assert torch.equal(cu_padded[: ref_n + 1].cpu(), ref_cu)
    assert torch.all(cu_padded[ref_n + 1:].cpu() == total)  # the tail repeats T
    assert torch.equal(seq_idx.cpu(), ref_seq_idx)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,row_len,max_sample", [(1, 1, 1), (1, 37, 5), (3, 1000, 300), (2, 4097, 2048),
                                                     (1, 9000, 1), (4, 33, 40)])
def test_matches_reference_on_random_packs(dtype, rows, row_len, max_sample):
    gen = torch.Generator().manual_seed(rows * 7919 + row_len)
    for random_offsets in (False, True):
        _check(random_packed_position_ids(gen, rows, row_len, max_sample, dtype, random_offsets))


def test_empty_input():
    _check(torch.zeros(0, dtype=torch.long))
    _check(torch.zeros(1, 0, dtype=torch.long))


def test_every_row_starts_a_sequence_even_if_positions_continue():
    pos = torch.tensor([[0, 1, 2], [3, 4, 5]])  # row 2 continues row 1's positions: still two sequences
    cu, seq_idx, stats = varlen_meta_raw(pos)
    assert stats.tolist() == [2, 3]
    assert cu[:3].tolist() == [0, 3, 6]


def test_packed_meta_reads_back_once_and_trims():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    meta = PackedMeta.from_position_ids(pos)
    assert meta.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert meta.max_seqlen == 4 and meta.num_seqs == 3
    assert meta.seq_idx.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]


def test_rejects_float_and_scalar_inputs_with_clear_messages():
    with pytest.raises(RuntimeError, match="position_ids.*must be Long or Int"):
        varlen_meta_raw(torch.zeros(4))
    with pytest.raises(RuntimeError, match="at least one dimension"):
        varlen_meta_raw(torch.tensor(3))
