"""MoE ops and the fused experts on the GPU."""

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import hasten
from hasten.config import Config
from hasten.integrations.transformers import registered
from hasten.observability import count_host_syncs, fallback_counts
from hasten.ops import moe as moe_ops
from tests.ops.test_moe_ops import check_grouping
from tests.reference import grouped_mm_reference


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 1), (3, 8, 128), (16384, 8, 128), (5000, 2, 512),
                                                  (777, 4, 60), (100_000, 6, 64)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_group_cuda_equals_reference(tokens, top_k, experts, dtype):
    gen = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(dtype)
    check_grouping(ids, experts, "cuda")
    skewed = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.9, experts - 1, ids)
    check_grouping(skewed, experts, "cuda")


def test_group_cuda_empty():
    counts, offsets, permutation, inverse = torch.ops.hasten.moe_group(torch.zeros(0, 4, dtype=torch.long,
                                                                                   device="cuda"), 8)
    assert counts.tolist() == [0] * 8 and offsets.tolist() == [0] * 9 and permutation.numel() == 0


def test_group_cuda_out_of_range_ids_are_dropped_last():
    """Documented GPU behaviour: invalid ids are not counted, sort after every expert and add nothing."""
    ids = torch.tensor([[0, 7], [-1, 1], [1, 9]], device="cuda")
    counts, offsets, permutation, inverse = torch.ops.hasten.moe_group(ids, 4)
    assert counts.tolist() == [1, 2, 0, 0] and offsets.tolist() == [0, 1, 3, 3, 3]
    assert permutation.tolist() == [0, 3, 4, 1, 2, 5]
    x = torch.randn(3, 16, device="cuda")
    g = moe_ops.Grouping(counts, offsets, permutation, inverse, 2)
    rows = moe_ops.permute(x, g)
    assert torch.equal(rows[:3], x) and torch.all(rows[3:] == 0)  # the valid slots 0, 3, 4: tokens 0, 1, 2
    scaled = moe_ops.permute(x, g, torch.arange(1.0, 7.0, device="cuda"))
    assert torch.equal(scaled[:3], x * torch.tensor([[1.0], [4.0], [5.0]], device="cuda"))
    assert torch.all(scaled[3:] == 0)
    out = moe_ops.combine(rows, torch.ones(3, 2, device="cuda"), g)
    assert torch.allclose(out, torch.stack([x[0], x[1], x[2]]))  # each token's one valid slot
    # an expert bias goes to valid rows only: the experts of slots 0, 3, 4 are 0, 1, 1
    bias = torch.randn(4, 16, device="cuda")
    out = moe_ops.combine(rows, torch.ones(3, 2, device="cuda"), g, bias)
    assert torch.allclose(out, torch.stack([x[0] + bias[0], x[1] + bias[1], x[2] + bias[1]]))
    grad_w = torch.ops.hasten.moe_combine_weight_grad(torch.ones(3, 16, device="cuda"), rows, inverse, offsets, 2, bias)
    assert grad_w[0, 1] == 0 and grad_w[1, 0] == 0 and grad_w[2, 1] == 0  # the dropped slots (ids 7, -1, 9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 40, 7])
@pytest.mark.parametrize("tokens,top_k", [(300, 4), (301, 3)])  # 903 slots: off the permute's 4 rows per block
def test_permute_combine_swiglu_cuda_equal_cpu(dtype, hidden, tokens, top_k):
    gen = torch.Generator().manual_seed(hidden + tokens)
    experts = 16
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    g_cpu, g_gpu = moe_ops.group(ids, experts), moe_ops.group(ids.cuda(), experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen).to(dtype)
    scale = torch.rand(tokens * top_k, generator=gen).to(dtype)
    bias = (torch.randn(experts, hidden, generator=gen) * 3).to(dtype)
    ops = torch.ops.hasten
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    pairs = [
        (ops.moe_permute(x, g_cpu.permutation, g_cpu.offsets, top_k, scale),
         ops.moe_permute(x.cuda(), g_gpu.permutation, g_gpu.offsets, top_k, scale.cuda())),
        (ops.moe_combine(y, g_cpu.inverse, g_cpu.offsets, top_k, w),
         ops.moe_combine(y.cuda(), g_gpu.inverse, g_gpu.offsets, top_k, w.cuda())),
        (ops.moe_combine_weight_grad(x, y, g_cpu.inverse, g_cpu.offsets, top_k),
         ops.moe_combine_weight_grad(x.cuda(), y.cuda(), g_gpu.inverse, g_gpu.offsets, top_k)),
        # with an expert bias per row's expert (gpt-oss's down_proj bias), large enough to show
        (ops.moe_combine(y, g_cpu.inverse, g_cpu.offsets, top_k, w, bias),
         ops.moe_combine(y.cuda(), g_gpu.inverse, g_gpu.offsets, top_k, w.cuda(), bias.cuda())),
        (ops.moe_combine_weight_grad(x, y, g_cpu.inverse, g_cpu.offsets, top_k, bias),
         ops.moe_combine_weight_grad(x.cuda(), y.cuda(), g_gpu.inverse, g_gpu.offsets, top_k, bias.cuda())),
    ]
    gate_up = (torch.randn(513, 2 * hidden, generator=gen) * 3).to(dtype)
    grad = torch.randn(513, hidden, generator=gen).to(dtype)
    pairs.append((ops.swiglu(gate_up), ops.swiglu(gate_up.cuda())))
    pairs.append((ops.swiglu_backward(grad, gate_up), ops.swiglu_backward(grad.cuda(), gate_up.cuda())))
    for i, (cpu, gpu) in enumerate(pairs):
        rel = ((gpu.cpu().double() - cpu.double()).norm() / cpu.double().norm().clamp_min(1e-12)).item()
        assert rel <= tol, f"op {i}: relative difference {rel:.2e}"


def _routing(kind, tokens, top_k, experts, gen):
    """Expert ids (tokens, top_k): uniform; skewed (segments of tokens, each preferring a few experts,
    so that a bucket's parts cover different stretches of tokens); dropped (one slot in 7 routed
    nowhere, the last bucket)."""
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    if kind == "skewed":
        segment = torch.arange(tokens) // max(1, tokens // 61)
        favourite = (segment * 7919) % experts
        ids = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.7, favourite[:, None], ids)
    if kind == "dropped":
        ids.view(-1)[::7] = -1
    return ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "dropped", "any_permutation"])
@pytest.mark.parametrize("tokens,top_k,experts,hidden", [(1, 1, 1, 8), (3, 8, 128, 2048), (16384, 8, 128, 2048),
                                                         (5000, 2, 512, 40), (777, 4, 60, 7), (20000, 6, 64, 2048),
                                                         (4099, 4, 32, 2880), (70_000, 1, 2, 24)])
def test_permute_cuda_moves_every_row_once_bitwise(dtype, routing, tokens, top_k, experts, hidden):
    """The permute's blocks take each bucket in parts (part-major, for L2): every sorted row must be
    written exactly once, from its slot's token (scaled where asked), and a dropped slot's row with
    zeros, whatever the permutation (any_permutation: a shuffled one, not a grouping's order), at
    sizes off the parts' and rows' multiples; bitwise against an indexing reference."""
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    ids = _routing("uniform" if routing == "any_permutation" else routing, tokens, top_k, experts, gen)
    g = moe_ops.group(ids.cuda(), experts)
    permutation, offsets = g.permutation, g.offsets
    if routing == "any_permutation":
        permutation = torch.randperm(tokens * top_k, generator=gen).to(torch.int32).cuda()
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).cuda()
    scale = torch.rand(tokens * top_k, generator=gen).to(dtype).cuda()
    valid = (torch.arange(tokens * top_k, device="cuda") < offsets[-1])[:, None]
    source = x[permutation.long() // top_k]
    want = torch.where(valid, source, torch.zeros_like(source))
    want_scaled = torch.where(valid, (source.float() * scale[permutation.long(), None].float()).to(dtype),
                              torch.zeros_like(source))
    for scaled in (False, True):
        poison = torch.full_like(want, float("nan"))  # freed, then the caching allocator hands the block
        del poison  # to the op's output: a row no block writes stays NaN and fails the comparison
        out = torch.ops.hasten.moe_permute(x, permutation, offsets, top_k, scale if scaled else None)
        assert torch.equal(out, want_scaled if scaled else want)


def _w3_block(hidden=512, experts=32, inter=256, seed=0):
    config = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=8,
                            moe_intermediate_size=inter, norm_topk_prob=True)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(config)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
    return block.to(torch.bfloat16), config


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(1, 1), (3, 7), (257, 2880), (70_000, 12), (5, 4)])
@pytest.mark.parametrize("offset", [0, 1])  # 1: a view one element off the 16-byte grid (element path)
def test_clamped_swiglu_cuda_equals_cpu_forward_and_backward(dtype, rows, inner, offset):
    """gpt-oss's clamped SwiGLU: the CUDA kernel against the CPU reference (float math both), both
    clamps in play and values on the bounds; rows past the grid's 65,535 loop."""
    from tests.ops.test_moe_ops import clamped_swiglu_reference

    gen = torch.Generator().manual_seed(rows + inner)
    flat = torch.randn(rows * 2 * inner + offset, generator=gen) * 2
    gate_up = flat[offset:].view(rows, 2 * inner)
    gate_up[0, 0], gate_up[0, 1] = 0.8, -0.8
    gate_up = gate_up.to(dtype)
    grad = (torch.randn(rows, inner, generator=gen)).to(dtype)
    cuda_flat = torch.empty(rows * 2 * inner + offset, dtype=dtype, device="cuda")
    cuda_gate_up = cuda_flat[offset:].view(rows, 2 * inner).copy_(gate_up)
    act = torch.ops.hasten.clamped_swiglu(cuda_gate_up, 1.702, 0.8)
    back = torch.ops.hasten.clamped_swiglu_backward(grad.cuda(), cuda_gate_up, 1.702, 0.8)
    want_act = torch.ops.hasten.clamped_swiglu(gate_up, 1.702, 0.8)
    want_back = torch.ops.hasten.clamped_swiglu_backward(grad, gate_up, 1.702, 0.8)
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert torch.allclose(act.cpu().float(), want_act.float(), **tolerance)
    assert torch.allclose(back.cpu().float(), want_back.float(), **tolerance)
    if dtype == torch.float32:  # and transformers' own gate, in float32
        assert torch.allclose(act.cpu(), clamped_swiglu_reference(gate_up, 1.702, 0.8), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k,experts,inner", [(1, 1, 1, 1), (3, 8, 16, 7), (16384, 8, 128, 768),
                                                        (9000, 6, 64, 1408), (70_000, 1, 4, 12), (5, 2, 3, 0)])
def test_weighted_swiglu_cuda_equals_cpu_and_is_deterministic(dtype, tokens, top_k, experts, inner):
    """hasten::moe_weighted_swiglu on the GPU against the CPU op (float math both, one rounding),
    forward and both gradients, with dropped slots (ids outside [0, E): the GPU grouping sorts them
    last); rows past the grid's 65,535 loop; widths off the 16-byte vectors take the element path.
    The weights' gradient (a warp's sum in a fixed order) is bitwise the same on a second run."""
    from tests.reference import weighted_swiglu_reference

    gen = torch.Generator().manual_seed(tokens + inner)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[::7, 0] = experts  # dropped slots
    _, offsets, permutation, _ = torch.ops.hasten.moe_group(ids.cuda(), experts)
    slots = tokens * top_k
    gate_up = (torch.randn(slots, 2 * inner, generator=gen) * 3).to(dtype)
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype)
    grad = torch.randn(slots, inner, generator=gen).to(dtype)
    cuda = [t.cuda() for t in (gate_up, weights, permutation, offsets)]
    act = torch.ops.hasten.moe_weighted_swiglu(*cuda)
    back = torch.ops.hasten.moe_weighted_swiglu_backward(grad.cuda(), *cuda)
    again = torch.ops.hasten.moe_weighted_swiglu_backward(grad.cuda(), *cuda)
    cpu = (gate_up, weights, permutation.cpu(), offsets.cpu())
    want_act = torch.ops.hasten.moe_weighted_swiglu(*cpu)
    want_back = torch.ops.hasten.moe_weighted_swiglu_backward(grad, *cpu)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert torch.allclose(act.cpu().float(), want_act.float(), **tolerance)
    assert torch.allclose(back[0].cpu().float(), want_back[0].float(), **tolerance)
    # the weights' gradient sums `inner` products: float sums in another order differ by ~1e-6 of it
    scale = max(1.0, float(want_back[1].float().abs().max()))
    atol = (2e-5 if dtype == torch.float32 else 2e-2) * scale
    assert torch.allclose(back[1].cpu().float(), want_back[1].float(), atol=atol, rtol=tolerance["rtol"])
    assert torch.equal(back[0], again[0]) and torch.equal(back[1], again[1])
    valid = int(offsets[-1])
    assert torch.all(act[valid:] == 0) and torch.all(back[0][valid:] == 0)
    assert torch.all(back[1].reshape(-1)[permutation[valid:].long()] == 0)
    if dtype == torch.float32:
        want = weighted_swiglu_reference(gate_up, weights, permutation.cpu(), valid)
        assert torch.allclose(act.cpu().double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner,experts", [(65_536 + 3, 2880, 32), (70_000, 12, 5), (9, 3, 4), (37, 8, 16)])
def test_clamped_swiglu_with_expert_biases_cuda_equals_the_biases_added_apart(dtype, rows, inner, experts):
    """gpt-oss's gate_up biases inside the clamped kernel (each expert-sorted row's expert from the
    group ends by binary search): the CUDA kernel, forward and backward, against the same kernel on
    gate_up + one_hot @ bias (the unfused path, bitwise in bf16: the sum is rounded once either way)
    and against the CPU reference; experts of uneven sizes, one empty, rows past the ends, rows past
    the grid's 65,535, the vector path (2880) and the element path (odd widths); experts of a row or
    two, so that one thread's four consecutive rows span several experts and empty ones."""
    gen = torch.Generator().manual_seed(rows + experts)
    sizes = torch.randint(0, 2 * rows // experts + 1, (experts,), generator=gen)
    sizes[1] = 0
    ends = sizes.cumsum(0).clamp(max=rows - 1).to(torch.int32).cuda()
    gate_up = (torch.randn(rows, 2 * inner, generator=gen) * 2).to(dtype).cuda()
    bias = (torch.randn(experts, 2 * inner, generator=gen) * 0.8).to(dtype).cuda()
    grad = torch.randn(rows, inner, generator=gen).to(dtype).cuda()
    one_hot = moe_ops.row_experts_one_hot(ends, rows, dtype)
    apart = torch.addmm(gate_up, one_hot, bias)
    act = torch.ops.hasten.clamped_swiglu(gate_up, 1.702, 0.8, bias, ends)
    back = torch.ops.hasten.clamped_swiglu_backward(grad, gate_up, 1.702, 0.8, bias, ends)
    want_act = torch.ops.hasten.clamped_swiglu(apart, 1.702, 0.8)
    want_back = torch.ops.hasten.clamped_swiglu_backward(grad, apart, 1.702, 0.8)
    torch.testing.assert_close(act, want_act, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(back, want_back, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-5)
    cpu = torch.ops.hasten.clamped_swiglu(gate_up.cpu(), 1.702, 0.8, bias.cpu(), ends.cpu())
    tolerance = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    assert torch.allclose(act.cpu().float(), cpu.float(), **tolerance)
    # and through autograd: the bias's gradient is the rows' one-hot GEMM of the kernel's d gate_up
    leaves = [gate_up.clone().requires_grad_(), bias.clone().requires_grad_()]
    moe_ops.clamped_swiglu(leaves[0], 1.702, 0.8, leaves[1], ends).backward(grad)
    assert leaves[0].grad.equal(back)
    torch.testing.assert_close(leaves[1].grad.float(), (one_hot.t().float() @ back.float()), rtol=2e-2, atol=2e-2)


def _grouped_case(rows, experts, d_in, d_out, transposed, gen, empty=(1,)):
    """bfloat16 operands on the GPU with a random grouping, the experts in `empty` given no rows,
    and a few rows past the last group's end."""
    counts = torch.randint(1, 2 * rows // experts + 2, (experts,), generator=gen)
    for e in empty:
        counts[e] = 0
    counts = (counts.double() * (rows - 5) / counts.sum()).floor().long()  # 5+ rows past the end
    ends = counts.cumsum(0).to(torch.int32)
    x = torch.randn(rows, d_in, generator=gen).bfloat16()
    shape = (experts, d_in, d_out) if transposed else (experts, d_out, d_in)
    weight = (torch.randn(*shape, generator=gen) / d_in ** 0.5).bfloat16()
    return x.cuda(), weight.cuda(), ends.cuda()


# torch: at::_grouped_mm; the CUTLASS tiles forced; auto: the measured rule
@pytest.mark.parametrize("mode", ["auto", "torch", "cutlass_64x256", "cutlass_128x128"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("rows,experts,d_in,d_out", [(4099, 8, 768, 2048), (1000, 5, 2048, 264), (77, 4, 8, 16),
                                                     (12_300, 8, 1416, 1416)])
def test_grouped_mm_cuda_equals_per_expert_fp32(monkeypatch, mode, transposed, rows, experts, d_in, d_out):
    """Forward, input and weight gradients against per-expert float32 matmuls, with an empty
    expert (its weight gradient must be zeros: the ragged reduction of nothing) and rows past the
    last end (undefined in the output, never read: not compared)."""
    monkeypatch.setenv("HASTEN_GROUPED_GEMM", mode)
    gen = torch.Generator().manual_seed(rows + d_in + transposed)
    x, weight, ends = _grouped_case(rows, experts, d_in, d_out, transposed, gen)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    y = moe_ops.grouped_mm(x, weight, ends, transposed)
    grad = torch.randn(y.shape, generator=gen).bfloat16().cuda()
    valid = int(ends[-1])
    grad[valid:] = 0  # what combine's backward gives the rows past the end
    grad_x, grad_w = torch.autograd.grad(y, (x, weight), grad)
    xr, wr = x.detach().float().requires_grad_(True), weight.detach().float().requires_grad_(True)
    yr = grouped_mm_reference(xr, wr, ends, transposed)
    ref_x, ref_w = torch.autograd.grad(yr, (xr, wr), grad.float())

    def close(got, want, what):
        err = (got.float() - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-2, f"{what}: relative error {err:.2e} ({mode})"

    close(y[:valid], yr[:valid].detach(), "y")
    close(grad_x[:valid], ref_x[:valid], "grad_x")
    close(grad_w, ref_w, "grad_weight")
    assert torch.count_nonzero(grad_w[1]) == 0, "the empty expert's weight gradient must be zeros"


def test_grouped_mm_cuda_all_experts_empty_and_no_rows():
    x = torch.randn(24, 16, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(3, 32, 16, device="cuda", dtype=torch.bfloat16)
    dw = torch.ops.hasten.moe_grouped_mm_weight_grad(x, torch.randn(24, 32, device="cuda", dtype=torch.bfloat16),
                                                     torch.zeros(3, dtype=torch.int32, device="cuda"))
    assert dw.shape == (3, 16, 32) and torch.count_nonzero(dw) == 0
    y = torch.ops.hasten.moe_grouped_mm(x[:0], weight, torch.zeros(3, dtype=torch.int32, device="cuda"), False)
    assert y.shape == (0, 32)


def test_grouped_mm_cuda_syncs_nothing_and_names_a_bad_mode(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x, weight, ends = _grouped_case(4099, 8, 768, 2048, False, gen)
    moe_ops.grouped_mm(x, weight, ends)  # warm: the device attributes are read once
    with count_host_syncs() as syncs:
        y = moe_ops.grouped_mm(x, weight, ends)
        torch.ops.hasten.moe_grouped_mm_weight_grad(y, x, ends)
    assert syncs.count == 0
    monkeypatch.setenv("HASTEN_GROUPED_GEMM", "fastest")
    with pytest.raises(RuntimeError, match="HASTEN_GROUPED_GEMM must be auto, torch"):
        moe_ops.grouped_mm(x, weight, ends)


def _hasten_kernel_ran(fn) -> bool:
    """Whether fn launched hasten's CUTLASS grouped GEMM (its prepare kernel, which torch's own
    CUTLASS grouped GEMM does not have)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return any("prepare_groups" in e.name for e in prof.events())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="hasten's CUTLASS kernels are sm90 code")
def test_grouped_mm_cuda_runs_hastens_kernels_where_the_rule_says(monkeypatch):
    import hasten._C
    assert hasten._C.WITH_CUTLASS == 1, "this build has no CUTLASS grouped GEMM (set HASTEN_CUTLASS_DIR)"
    gen = torch.Generator().manual_seed(5)
    short_k = _grouped_case(4099, 8, 768, 2048, False, gen)  # K 768: 64x256
    long_k = _grouped_case(4099, 8, 2048, 1536, False, gen)  # K 2048, few rows per expert: torch's
    assert _hasten_kernel_ran(lambda: moe_ops.grouped_mm(*short_k))
    assert not _hasten_kernel_ran(lambda: moe_ops.grouped_mm(*long_k))
    assert _hasten_kernel_ran(lambda: torch.ops.hasten.moe_grouped_mm_weight_grad(long_k[0], long_k[0], long_k[2]))
    monkeypatch.setenv("HASTEN_GROUPED_GEMM", "torch")
    assert not _hasten_kernel_ran(lambda: moe_ops.grouped_mm(*short_k))
    monkeypatch.setenv("HASTEN_GROUPED_GEMM", "cutlass_128x128")
    assert _hasten_kernel_ran(lambda: moe_ops.grouped_mm(*long_k))


def test_fused_block_equals_eager_block_bf16_and_syncs_nothing():
    block, config = _w3_block()
    x = torch.randn(1, 4096, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # (B, T, H)
    config._experts_implementation = "eager"
    want = block(x)
    want.float().square().mean().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]
    x.grad = None
    block.zero_grad()
    config._experts_implementation = "hasten_fused"
    with registered():  # the name accelerate() would register; this bare block has no accelerate()
        got = block(x)  # warm-up and correctness
        got.float().square().mean().backward()
        assert _rel(got, want) <= 1e-2
        for i, (a, b) in enumerate(zip([x.grad] + [p.grad for p in block.parameters()], want_grads)):
            assert _rel(a, b) <= 2e-2, f"gradient {i}"
        with count_host_syncs() as syncs:
            block(x).float().square().mean().backward()
    assert syncs.count == 0, syncs.sites
    assert not fallback_counts(), fallback_counts()


def test_qwen3_moe_trains_like_eager_experts_for_20_steps():
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=16, num_experts_per_tok=4, output_router_logits=True)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(20):
        starts = torch.randint(0, 512, (4, 1), generator=gen)
        batches.append(((starts + torch.arange(128)) % 512).cuda())  # learnable runs

    def run(fused: bool):
        torch.manual_seed(3)
        model = Qwen3MoeForCausalLM(config).cuda().to(torch.bfloat16)
        if fused:
            handle = hasten.accelerate(model, Config.from_dict({"training": {"packed_sequence": False}}))
            # the default path on CUDA: the fused experts with the router's weights in the SwiGLU
            assert any("router's weights in the SwiGLU" in item for item in handle.active), handle.report()
        else:
            model.set_experts_implementation("eager")
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    eager, fused = run(False), run(True)
    print("eager", [round(v, 4) for v in eager])
    print("fused", [round(v, 4) for v in fused])
    for step, (a, b) in enumerate(zip(eager, fused)):
        assert abs(a - b) <= 0.03 * abs(a) + 0.03, f"step {step}: eager {a:.4f} fused {b:.4f}"
    assert fused[-1] < fused[0] - 0.5
