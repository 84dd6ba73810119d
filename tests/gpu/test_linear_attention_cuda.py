"""hasten.stateful on the GPU (issue 19): flash-linear-attention's varlen kernels behind the packed
forms of the short convolution, the gated delta rule and Kimi delta attention, and whole hybrid
models on packed rows.

1. The kernels: a packed row (samples of 1, 2, 63 and 500+ tokens) through hasten's replacement in
   bf16 against transformers' torch function run one sample at a time in float32, output and every
   input gradient, within a small multiple of the same torch function's own bf16 noise.
2. The models: every hybrid type of the zoo, a packed row of samples of 1, 2, 63 and 500+ tokens
   (and one of 18 short samples) through the hasten-accelerated bf16 model (cuDNN attention, fused
   kernels, fla's varlen kernels) against the unpatched float32 model run one sample at a time: loss and every gradient
   within bf16 noise (tests/gpu/test_model_parity_cuda.py's yardstick), with fla's kernels used
   (no per-sample fallback); and the negative control: with the sample boundaries dropped the same
   check fails."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from hasten.observability import fallback_counts
from hasten.packing.meta import LINEAR_META
from hasten.stateful import LinearMeta, fla_problem
from hasten.stateful.varlen import varlen_causal_conv1d, varlen_chunk_gated_delta_rule, varlen_chunk_kda
from tests.gpu.test_model_parity_cuda import check_packed_parity, torch_function_of

ISOLATION_LENGTHS = (1, 2, 63, 517, 7, 300)
# many boundaries: a state carried across them touches a large share of the tokens (the negative control)
BOUNDARY_LENGTHS = (1, 2, 5, 9, 3, 17, 4, 8, 1, 11, 6, 2, 30, 7, 12, 63, 3, 40)
HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lfm2", "lfm2_moe", "lfm3", "lara_mini",
           "kimi_linear")
NOISE_FACTOR = 3.0

pytestmark = pytest.mark.skipif(torch.cuda.is_available() and fla_problem(0) is not None,
                                reason=f"flash-linear-attention cannot run here: {fla_problem(0) if torch.cuda.is_available() else ''}")


def _torch_functions():
    """transformers' own torch functions (the modeling module keeps them when fla is missing;
    where fla is installed the module holds fla's, so the references come from the source)."""
    modeling = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    return torch_function_of(modeling.causal_conv1d_fn), torch_function_of(modeling.torch_chunk_gated_delta_rule)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _meta(lengths) -> LinearMeta:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return LinearMeta.build(cu, int(sum(lengths)))


def _per_sample(function, meta, tensors, **kwargs):
    pieces = [function(*(t[:, s:e] for t in tensors), **kwargs) for s, e in meta.bounds()]
    return torch.cat([p[0] if isinstance(p, tuple) else p for p in pieces], dim=1)


def _check_delta_rule_kernel(packed, torch_function, meta, base, grad_out, float32_inputs=(), **call):
    """A delta rule's packed form on fla's kernel (bf16) against the model's torch function per sample:
    the output and the gradients of q, k, v, g and beta within NOISE_FACTOR of the torch function's
    own bf16 distance from its float32 run. `base`: the CPU inputs (q, k, v, g, beta); those at
    `float32_inputs` stay float32 (KDA's decay, as its forget gate returns it)."""

    def run(dtype, hasten_path):
        inputs = [t.to("cuda", torch.float32 if i in float32_inputs else dtype).requires_grad_()
                  for i, t in enumerate(base)]
        if hasten_path:
            out, _ = packed(*inputs[:3], g=inputs[3], beta=inputs[4], use_qk_l2norm_in_kernel=True,
                            **call, **{LINEAR_META: meta})
        else:
            out = _per_sample(lambda q, k, v, g, b: torch_function(q, k, v, g=g, beta=b, use_qk_l2norm_in_kernel=True),
                              meta, inputs)
        return [out, *torch.autograd.grad(out, inputs, grad_out.to("cuda", out.dtype))]

    want, noise, got = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for name, g, n, w in zip(("out", "dq", "dk", "dv", "dg", "dbeta"), got, noise, want):
        assert _rel(g, w) <= NOISE_FACTOR * _rel(n, w) + 2e-3, (name, _rel(g, w), _rel(n, w))
    assert "stateful_per_sample" not in fallback_counts()


def test_gated_delta_rule_kernel_against_each_sample_alone():
    _, torch_rule = _torch_functions()
    packed = varlen_chunk_gated_delta_rule(torch_rule)
    meta = _meta(ISOLATION_LENGTHS)
    tokens = sum(ISOLATION_LENGTHS)
    gen = torch.Generator().manual_seed(0)
    # as many q/k heads as value heads: transformers 5.17's torch function takes no grouped value
    # heads (its models repeat q and k first); 5.24's does
    # heads of 16 as in the zoo's Gated DeltaNet models (fla compiles once per head shape)
    base = [torch.randn(1, tokens, 4, 16, generator=gen), torch.randn(1, tokens, 4, 16, generator=gen),
            torch.randn(1, tokens, 4, 16, generator=gen), -F.softplus(torch.randn(1, tokens, 4, generator=gen)) * 0.3,
            torch.rand(1, tokens, 4, generator=gen)]
    grad_out = torch.randn(1, tokens, 4, 16, generator=gen)
    _check_delta_rule_kernel(packed, torch_rule, meta, base, grad_out)


def test_kimi_delta_attention_kernel_against_each_sample_alone():
    """fla's chunk_kda behind kimi_linear's chunk_kimi_delta_attention, called as its layer calls it:
    a decay per key channel (g: (B, T, H, K), float32 as the model's forget gate returns it), beta
    after its sigmoid, the q/k L2 norm in the kernel, the default scale."""
    torch_kda = torch_function_of(importlib.import_module(
        "transformers.models.kimi_linear.modeling_kimi_linear").chunk_kimi_delta_attention)
    packed = varlen_chunk_kda(torch_kda)
    meta = _meta(ISOLATION_LENGTHS)
    tokens = sum(ISOLATION_LENGTHS)
    gen = torch.Generator().manual_seed(2)
    # 2 heads of 16, the zoo's Kimi Linear layers (fla compiles once per head shape)
    base = [torch.randn(1, tokens, 2, 16, generator=gen), torch.randn(1, tokens, 2, 16, generator=gen),
            torch.randn(1, tokens, 2, 16, generator=gen),
            -F.softplus(torch.randn(1, tokens, 2, 16, generator=gen)) * 0.3, torch.rand(1, tokens, 2, generator=gen)]
    grad_out = torch.randn(1, tokens, 2, 16, generator=gen)
    _check_delta_rule_kernel(packed, torch_kda, meta, base, grad_out, float32_inputs=(3,),
                             initial_state=None, output_final_state=False)


def test_short_convolution_kernel_against_each_sample_alone():
    torch_conv, _ = _torch_functions()
    packed = varlen_causal_conv1d(torch_conv)
    meta = _meta(ISOLATION_LENGTHS)
    gen = torch.Generator().manual_seed(1)
    # 128 channels of width 4: the zoo's Gated DeltaNet convolution (q, k: 2 heads of 16; v: 4 of 16)
    x0, w0 = torch.randn(1, 128, sum(ISOLATION_LENGTHS), generator=gen), torch.randn(128, 4, generator=gen) * 0.5
    grad_out = torch.randn(x0.shape, generator=gen).cuda()

    def run(dtype, hasten_path, activation):
        x, w = x0.to("cuda", dtype).requires_grad_(), w0.to("cuda", dtype).requires_grad_()
        if hasten_path:
            y = packed(x, w, None, activation=activation, **{LINEAR_META: meta})
        else:
            y = torch.cat([torch_conv(x[..., s:e], w, None, activation=activation) for s, e in meta.bounds()], -1)
        return [y, *torch.autograd.grad(y, (x, w), grad_out.to(y.dtype))]

    for activation in ("silu", None):  # Gated DeltaNet's convolution, LFM2's
        want, noise = run(torch.float32, False, activation), run(torch.bfloat16, False, activation)
        got = run(torch.bfloat16, True, activation)
        for name, g, n, w in zip(("y", "dx", "dw"), got, noise, want):
            assert _rel(g, w) <= NOISE_FACTOR * _rel(n, w) + 2e-3, (activation, name, _rel(g, w), _rel(n, w))
    assert "stateful_per_sample" not in fallback_counts()


@pytest.mark.parametrize("lengths", [ISOLATION_LENGTHS, BOUNDARY_LENGTHS], ids=["long", "many"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_model_packed_equals_each_sample_alone(name, lengths):
    row = check_packed_parity(name, lengths)
    assert any(item.startswith("varlen stateful layers") for item in row["active"]), row
    assert "stateful_per_sample" not in row["fallbacks"], row


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_state_carried_across_samples_fails_the_check(name, monkeypatch):
    """The negative control: the same check with the batch's sample boundaries dropped (one
    sequence, so fla's kernels carry each layer's state and convolution window from one packed
    sample into the next, the bug this path exists to prevent) must fail. Proves the yardstick
    sees a leak at these sizes, through bf16 noise."""
    build = LinearMeta.build.__func__

    def one_sequence(cls, cu_seqlens, tokens):
        return build(cls, torch.tensor([0, tokens], dtype=cu_seqlens.dtype, device=cu_seqlens.device), tokens)

    monkeypatch.setattr(LinearMeta, "build", classmethod(one_sequence))
    with pytest.raises(AssertionError):
        check_packed_parity(name, BOUNDARY_LENGTHS, report=False)
    # the failure is the error checks', on fla's kernels and hasten's attention (no fallback tripped it)
    assert not {"stateful_per_sample", "attention_per_sequence"} & set(fallback_counts()), fallback_counts()
