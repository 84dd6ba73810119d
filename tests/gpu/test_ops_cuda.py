"""CUDA hasten ops equal the CPU reference ops on fresh random inputs."""

import pytest
import torch

from hasten.ops import has_cuda_kernel, op_names
from hasten.ops.packing import varlen_meta_raw
from tests.reference import random_packed_position_ids


def test_every_op_has_a_cuda_kernel():
    names = op_names()
    assert {"varlen_meta", "moe_group", "moe_permute", "moe_combine", "swiglu"} <= set(names)
    # the cuDNN attention ops are built only where the cudnn-frontend headers are (docs/design.md)
    optional = {"varlen_attention", "varlen_attention_backward"}
    assert [op for op in names if not has_cuda_kernel(op) and op not in optional] == []


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rows,row_len,max_sample", [(1, 1, 1), (1, 4095, 7), (1, 4096, 300), (1, 4097, 2048),
                                                     (3, 5000, 1), (2, 16384, 2048), (1, 1_000_003, 4000),
                                                     (8, 777, 100)])
def test_varlen_meta_cuda_equals_cpu(dtype, rows, row_len, max_sample):
    gen = torch.Generator().manual_seed(rows + row_len)
    for random_offsets in (False, True):
        pos = random_packed_position_ids(gen, rows, row_len, max_sample, dtype, random_offsets)
        cpu = varlen_meta_raw(pos)
        # poison: outputs are fresh allocations, so fill the caching allocator's blocks with garbage first
        torch.full((pos.numel() * 2 + 64,), -7, dtype=torch.int32, device="cuda")
        cuda = varlen_meta_raw(pos.cuda())
        for a, b in zip(cpu, cuda):
            assert torch.equal(a, b.cpu())


def test_varlen_meta_cuda_empty_and_on_side_stream():
    for pos in (torch.zeros(0, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)):
        cu, seq_idx, stats = varlen_meta_raw(pos.cuda())
        assert cu.tolist() == [0] and seq_idx.numel() == 0 and stats.tolist() == [0, 0]
    stream = torch.cuda.Stream()
    pos = random_packed_position_ids(torch.Generator().manual_seed(9), 1, 20000, 500).cuda()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = varlen_meta_raw(pos)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out[0].cpu(), varlen_meta_raw(pos.cpu())[0])


def test_opcheck_cuda():
    pos = random_packed_position_ids(torch.Generator().manual_seed(1), 2, 300, 50).cuda()
    torch.library.opcheck(torch.ops.hasten.varlen_meta.default, (pos,))
