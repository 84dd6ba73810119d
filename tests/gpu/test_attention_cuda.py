"""torch's varlen attention (K/V heads read natively and repeated) and hasten's cuDNN op equal
attention computed one sequence at a time on the GPU, output and gradients, without falling back."""

import pytest
import torch

from hasten.ops import has_cuda_kernel

needs_cudnn_op = pytest.mark.skipif(not has_cuda_kernel("varlen_attention"),
                                    reason="hasten was built without the cuDNN attention op "
                                           "(no cudnn-frontend headers)")

from hasten.attention import varlen
from hasten.observability import fallback_counts, reset_fallbacks


def _outputs(backend, gqa, q, k, v, cu, max_len, grad, sliding_window=None):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = varlen.varlen_attention(*leaves, cu, max_len, backend=backend, gqa=gqa, sliding_window=sliding_window)
    out.backward(grad)
    return [out.detach().float()] + [x.grad.float() for x in leaves]


@pytest.mark.parametrize("backend,gqa", [("torch_varlen", "native"), ("torch_varlen", "repeat"),
                                         pytest.param("cudnn", "native", marks=needs_cudnn_op)])
@pytest.mark.parametrize("lengths,hq,hkv,head_dim", [([1], 2, 1, 128), ([300, 1, 77, 1000, 5], 16, 8, 128),
                                                     ([129, 64, 1], 4, 4, 64), ([2048, 700], 8, 2, 128),
                                                     ([33, 1, 1, 9], 2, 2, 64)])
def test_backend_equals_one_sequence_at_a_time(backend, gqa, lengths, hq, hkv, head_dim):
    reset_fallbacks()
    gen = torch.Generator(device="cuda").manual_seed(sum(lengths) + hq)
    t = sum(lengths)
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    got = _outputs(backend, gqa, q, k, v, cu, max(lengths), grad)
    want = _outputs("per_sequence", gqa, q, k, v, cu, max(lengths), grad)
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        scale = w.abs().max().clamp_min(1.0)
        torch.testing.assert_close(g / scale, w / scale, rtol=0, atol=2e-2, msg=f"{backend}/{gqa}: {label}")
    # per_sequence is the reference, not a fallback; the backend under test must not have fallen back
    assert not {k: n for k, n in fallback_counts().items() if k != "attention_per_sequence"}, fallback_counts()


def _cudnn_vs_flash(lengths, hq=16, hkv=8, head_dim=128, causal=True, seed=0, sliding_window=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = sum(lengths)
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    reset_fallbacks()
    got = _outputs("cudnn", "native", q, k, v, cu, max(lengths), grad, sliding_window)
    assert not fallback_counts(), fallback_counts()
    want = _outputs("torch_varlen", "native", q, k, v, cu, max(lengths), grad, sliding_window)
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        rel = float((g - w).norm() / w.norm())
        assert rel < 1e-2, f"{label}: relative error {rel:.2e} against FlashAttention-2 ({len(lengths)} sequences)"


@needs_cudnn_op
def test_cudnn_on_w1_sized_batches_matches_flash_attention():
    """16,384 tokens in many short samples and a few long ones; batches of different sequence counts
    and longest lengths land in different graph buckets and reuse them."""
    gen = torch.Generator().manual_seed(7)
    for count, longest in ((61, 4000), (200, 300), (9, 16384 // 9), (61, 4000), (130, 1100)):
        lengths = torch.randint(1, longest, (count,), generator=gen).tolist()
        lengths[-1] += 16384 - sum(lengths) if sum(lengths) < 16384 else 0
        _cudnn_vs_flash(lengths, seed=count)


@needs_cudnn_op
@pytest.mark.parametrize("hq,hkv,head_dim,window", [(16, 8, 128, 512), (4, 1, 256, 512), (8, 2, 64, 5)])
def test_cudnn_sliding_window_matches_flash_attention(hq, hkv, head_dim, window):
    """Gemma-3's shape (4 heads, 1 K/V head, head size 256, window 512) and others, 16,384 tokens of
    samples shorter and longer than the window: cuDNN's left bound is transformers' window."""
    gen = torch.Generator().manual_seed(window + head_dim)
    lengths = torch.randint(1, 1200, (12,), generator=gen).tolist() + [1, 1, 513, 512, 511]
    lengths.append(16384 - sum(lengths))  # at most 12 x 1199 + 1538 tokens above: a long last sample
    _cudnn_vs_flash(lengths, hq, hkv, head_dim, seed=window, sliding_window=window)


@needs_cudnn_op
def test_cudnn_softmax_statistics_and_full_attention():
    from hasten.ops.attention import varlen_attention as cudnn_op  # noqa: F401  (registers the fakes)

    lengths = [5, 130, 1, 64]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), h, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    for causal, window in ((True, 0), (False, 0), (True, 1), (True, 7), (True, 64)):
        out, lse = torch.ops.hasten.varlen_attention(q, k, v, cu, max(lengths), 0.125, causal, window, 0.0)
        ref_out, ref_lse = torch.ops.hasten.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), max(lengths), 0.125,
                                                            causal, window, 0.0)
        torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-2, rtol=0)
        torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=2e-2, rtol=0)


@needs_cudnn_op
def test_cudnn_is_the_default_backend_on_this_gpu():
    q = torch.zeros(8, 4, 128, device="cuda", dtype=torch.bfloat16)
    assert varlen.select_backend(q) == "cudnn", varlen._cudnn_unavailable(q)


@needs_cudnn_op
def test_cudnn_ragged_index_is_never_stale():
    """The op keeps one batch's ragged offsets (built from cu_seqlens once per batch). An in-place
    edit of cu_seqlens, a new batch whose cu_seqlens reuses freed memory, and other head counts must
    each rebuild it: every call is compared with the CPU reference on the same inputs."""
    from hasten.ops.attention import varlen_attention as cudnn_op  # noqa: F401  (registers the fakes)

    def check(q, k, v, cu, max_len):
        out, lse = torch.ops.hasten.varlen_attention(q, k, v, cu, max_len, 0.125, True, 0, 0.0)
        ref_out, ref_lse = torch.ops.hasten.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cu.cpu(), max_len, 0.125, True,
                                                            0, 0.0)
        torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-2, rtol=0)

    gen = torch.Generator(device="cuda").manual_seed(11)
    t = 300
    q, k, v = (torch.randn(t, h, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 100, 101, 300], device="cuda", dtype=torch.int32)
    check(q, k, v, cu, 199)
    cu[1] = 50  # in place: same tensor, new boundaries (lengths 50, 51, 199)
    check(q, k, v, cu, 199)
    for lengths in ([7, 293], [150, 150], [1] * 3 + [297]):  # new tensors, freed memory reused
        del cu
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        check(q, k, v, cu, max(lengths))
    q8 = torch.randn(t, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)  # other head count, same cu
    check(q8, k, v, cu, 297)


@needs_cudnn_op
@pytest.mark.parametrize("causal,window,softcap,head_dim", [(True, 0, 1.0, 128), (True, 7, 1.0, 64),
                                                            (False, 0, 1.0, 64), (True, 33, 50.0, 256)])
def test_cudnn_softcap_matches_the_float32_reference(causal, window, softcap, head_dim):
    """Gemma 2's attention logit softcapping in cuDNN's graph (a score modifier that also builds the
    causal band and the padding): output, log-sum-exp and the three gradients against the CPU
    float32 reference on the same bf16 inputs, with one-token samples and samples longer than the
    window. The scores are scaled up so that a cap of 1 bends most of them (an omission shows)."""
    lengths = [5, 130, 1, 64, 300, 1]
    gen = torch.Generator(device="cuda").manual_seed(int(softcap) + window + head_dim)
    t = sum(lengths)
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (4, 2, 2, 4))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    scale = 4.0 / head_dim ** 0.5  # scores of spread ~4: tanh(s / 1) far from s
    args = (cu, max(lengths), scale, causal, window, softcap)
    out, lse = torch.ops.hasten.varlen_attention(q, k, v, *args)
    cpu = [x.cpu() for x in (q, k, v)]
    ref_out, ref_lse = torch.ops.hasten.varlen_attention(*cpu, cu.cpu(), *args[1:])
    uncapped, _ = torch.ops.hasten.varlen_attention(*cpu, cu.cpu(), *args[1:-1], 0.0)
    if softcap < 10:
        assert (uncapped - ref_out).abs().max() > 0.1  # the cap matters at these values
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=3e-2, rtol=0)
    torch.testing.assert_close(out.float().cpu(), ref_out.float(), atol=2e-2, rtol=0)
    grads = torch.ops.hasten.varlen_attention_backward(grad, q, k, v, out, lse, *args)
    ref_grads = torch.ops.hasten.varlen_attention_backward(grad.cpu(), *cpu, ref_out, ref_lse, cu.cpu(), *args[1:])
    for label, g, w in zip(("dq", "dk", "dv"), grads, ref_grads):
        rel = float((g.float().cpu() - w.float()).norm() / w.float().norm())
        assert rel < 2e-2, f"{label}: relative error {rel:.2e} against the float32 reference"


@needs_cudnn_op
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (33, 1.0)])
def test_cudnn_attention_sinks_match_the_float32_reference(window, softcap):
    """gpt-oss's attention sinks on cuDNN (hasten_py::varlen_attention_sinks: the forward's
    log-sum-exp with each head's sink added, and cuDNN's backward given those statistics and the
    sink-scaled output): output and the gradients of q, k, v and the sinks against the same op on
    the CPU's float32 reference, bf16 inputs, one-token samples and samples past the window."""
    from hasten.ops.attention import varlen_attention_sinks

    lengths = [5, 130, 1, 64, 300, 1]
    gen = torch.Generator(device="cuda").manual_seed(window + 11)
    t, head_dim = sum(lengths), 64
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (4, 2, 2, 4))
    sinks = torch.randn(4, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    scale = head_dim ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    cpu = [x.detach().cpu().requires_grad_() for x in (q, k, v, sinks)]
    out = varlen_attention_sinks(*leaves[:3], cu, max(lengths), leaves[3], scale, True, window, softcap)
    ref = varlen_attention_sinks(*cpu[:3], cu.cpu(), max(lengths), cpu[3], scale, True, window, softcap)
    no_sink = torch.ops.hasten.varlen_attention(*(x.detach() for x in cpu[:3]), cu.cpu(), max(lengths), scale,
                                                True, window, softcap)[0]
    assert (no_sink.float() - ref.detach().float()).abs().max() > 0.05  # the sinks matter at these values
    torch.testing.assert_close(out.detach().float().cpu(), ref.detach().float(), atol=2e-2, rtol=0)
    out.backward(grad)
    ref.backward(grad.cpu())
    for label, g, w in zip(("dq", "dk", "dv", "dsinks"), leaves, cpu):
        rel = float((g.grad.float().cpu() - w.grad.float()).norm() / w.grad.float().norm())
        assert rel < 2e-2, f"{label}: relative error {rel:.2e} against the float32 reference"


@needs_cudnn_op
def test_selective_checkpointing_keeps_the_cudnn_attention_output():
    """Issue 21: `activations: selective` keeps hasten's cuDNN attention output, so its forward does
    not run again in the backward's recompute; the gradients are those of no checkpointing (bf16,
    up to the backward's own run-to-run noise)."""
    from tests.memory.test_checkpointing import attention_calls_under_selective

    forwards, selective, plain = attention_calls_under_selective(
        "cuda", torch.bfloat16, heads=(8, 2, 2), head_dim=128, lengths=(1, 700, 129))
    assert forwards == [], "hasten's cuDNN attention ran again in the recompute"
    for got, want in zip(selective, plain):
        scale = want.float().abs().max().clamp_min(1.0)
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=1e-2)


_PER_HEAD = "HASTEN_ATTENTION_BACKWARD_PER_HEAD_ABOVE_BYTES"


def _backward(monkeypatch, per_head_above, grad, q, k, v, out, lse, args):
    """`per_head_above`: the bound in bytes ("" for the built-in one)."""
    if per_head_above == "":
        monkeypatch.delenv(_PER_HEAD, raising=False)
    else:
        monkeypatch.setenv(_PER_HEAD, str(per_head_above))
    return torch.ops.hasten.varlen_attention_backward(grad, q, k, v, out, lse, *args)


@needs_cudnn_op
@pytest.mark.parametrize("hq,hkv,head_dim,window,softcap", [(8, 2, 128, 0, 0.0), (4, 4, 64, 7, 0.0),
                                                            (6, 3, 64, 33, 1.0), (2, 2, 256, 0, 0.0)])
def test_cudnn_backward_one_call_per_kv_head_equals_one_call(monkeypatch, hq, hkv, head_dim, window, softcap):
    """Long sequences run the backward once per K/V head (its workspace 1/Hk of one call's): forced
    here with the bound at 0 bytes, the gradients equal one call's (the same kernel on the same
    heads, up to cuDNN's run-to-run noise) and the float32 reference, with grouped and plain heads,
    a window, a softcap, one-token samples and a token count off every block multiple."""
    lengths = [5, 1300, 1, 64, 301, 1]
    gen = torch.Generator(device="cuda").manual_seed(hq * 7 + hkv + head_dim)
    t = sum(lengths)
    q, k, v, grad = (torch.randn(t, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    args = (cu, max(lengths), 2.0 / head_dim ** 0.5, True, window, softcap)
    out, lse = torch.ops.hasten.varlen_attention(q, k, v, *args)
    one_call = _backward(monkeypatch, 2**62, grad, q, k, v, out, lse, args)
    per_head = _backward(monkeypatch, 0, grad, q, k, v, out, lse, args)
    cpu = [x.cpu() for x in (grad, q, k, v, out, lse)]
    reference = torch.ops.hasten.varlen_attention_backward(*cpu, cu.cpu(), *args[1:])
    for label, g, one, w in zip(("dq", "dk", "dv"), per_head, one_call, reference):
        assert g.shape == w.shape and g.dtype == one.dtype
        scale = one.float().abs().max().clamp_min(1e-3)
        torch.testing.assert_close(g.float() / scale, one.float() / scale, atol=1e-2, rtol=0, msg=label)
        rel = float((g.float().cpu() - w.float()).norm() / w.float().norm())
        assert rel < 2e-2, f"{label}: relative error {rel:.2e} against the float32 reference"


def _backward_peak_bytes(monkeypatch, per_head_above, tokens, hq=32, hkv=8, head_dim=128):
    """The device's peak during one backward of a single causal sequence, above what was allocated."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, v, grad = (torch.randn(tokens, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for h in (hq, hkv, hkv, hq))
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    args = (cu, tokens, head_dim ** -0.5, True, 0, 0.0)
    out, lse = torch.ops.hasten.varlen_attention(q, k, v, *args)
    _backward(monkeypatch, per_head_above, grad, q, k, v, out, lse, args)  # graphs built outside the count
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    grads = _backward(monkeypatch, per_head_above, grad, q, k, v, out, lse, args)
    torch.cuda.synchronize()
    del grads
    return torch.cuda.max_memory_allocated() - start


@needs_cudnn_op
def test_cudnn_backward_workspace_follows_the_tokens_and_the_heads(monkeypatch):
    """Issue 21's long sequences: one call's float32 workspace (12 bytes a token, a query head and a
    dim) is sized on the token bucket, which now follows the count in sixteenths of a power of two
    (24,576 tokens no longer pay for 32,768), and one call per K/V head keeps 1/Hk of it. Llama-8B's
    heads (32 x 128, 8 K/V heads)."""
    one_call = {t: _backward_peak_bytes(monkeypatch, 2**62, t) for t in (24576, 32768)}
    assert one_call[24576] / one_call[32768] < 0.8, one_call  # about 0.75: linear; about 0.9: a 32,768 bucket
    per_head = _backward_peak_bytes(monkeypatch, 0, 32768)
    workspace = 32768 * 32 * 128 * 12  # 1.5 GiB in one call, 192 MiB per K/V head
    assert per_head < one_call[32768] - workspace // 2, (per_head, one_call)
    # by default a workspace above 1 GiB is split (Llama-8B: from about 21,800 tokens)
    default = _backward_peak_bytes(monkeypatch, "", 32768)
    assert default <= per_head * 1.05, (default, per_head)
