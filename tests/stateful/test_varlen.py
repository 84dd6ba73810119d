"""hasten.stateful on the CPU: the packed forms of the convolution, the gated delta rule and Kimi
delta attention, the batch's LinearMeta, the guard that every stateful layer got the batch's
boundaries, and undo.

The parity of whole hybrid models (packed row against each sample alone, float32) is in
tests/integrations/test_model_parity.py (qwen3_next, qwen3_5_text, qwen3_5_moe_text, olmo_hybrid,
lfm2, lfm2_moe, lfm3, lara_mini, kimi_linear); the GPU run of the same with flash-linear-attention's
kernels in tests/gpu."""

import gc
import inspect
import sys

import pytest
import torch

import hasten
from hasten.integrations.transformers import PackedBatchRefused
from hasten.packing.meta import LINEAR_META
from hasten.stateful import LinearMeta, fla_problem
from hasten.stateful.patch import REPLACED, release_dropped
from hasten.stateful.varlen import varlen_causal_conv1d, varlen_chunk_gated_delta_rule, varlen_chunk_kda
from tests import model_zoo as zoo

LENGTHS = (1, 2, 63, 70, 5)  # one- and two-token samples, and samples past the delta rule's 64-token chunk


def _modeling(name: str):
    import importlib

    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _meta(lengths=LENGTHS) -> LinearMeta:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return LinearMeta.build(cu, int(cu[-1]))


def test_meta_adds_a_padded_tail_as_one_more_sequence():
    meta = LinearMeta.build(torch.tensor([0, 3, 7], dtype=torch.int32), tokens=10)
    assert meta.cu_seqlens.dtype == torch.int64 and meta.cu_seqlens_cpu.device.type == "cpu"
    assert meta.bounds() == [(0, 3), (3, 7), (7, 10)]
    assert LinearMeta.build(torch.tensor([0, 3, 7], dtype=torch.int32), tokens=7).bounds() == [(0, 3), (3, 7)]


def test_packed_convolution_is_each_sample_alone_and_differs_from_the_unpacked_row():
    original = _modeling("qwen3_next").causal_conv1d_fn
    packed = varlen_causal_conv1d(original)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 12, sum(LENGTHS), generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    meta = _meta()
    got = packed(x, weight, None, activation="silu", **{LINEAR_META: meta, "cu_seq_lens_q": meta.cu_seqlens})
    edges = meta.bounds()
    want = torch.cat([original(x[..., s:e], weight, None, activation="silu") for s, e in edges], dim=-1)
    assert meta.calls == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    mixed = original(x, weight, None, activation="silu")  # the row as one sequence: windows cross samples
    assert (mixed - want).abs().max() > 1e-2
    # no LinearMeta (a padded batch, generation): the model's own function, unchanged
    torch.testing.assert_close(packed(x, weight, None, activation="silu"), mixed, rtol=0, atol=0)


def _alone_and_mixed(original, meta, q, k, v, g, beta):
    """A delta rule's output with each packed sample alone (what the packed form must give), and
    over the whole row as one sequence (the state carried across samples)."""
    alone = torch.cat([original(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                use_qk_l2norm_in_kernel=True)[0] for s, e in meta.bounds()], dim=1)
    return alone, original(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]


def test_packed_delta_rule_starts_each_sample_from_a_zero_state():
    original = _modeling("qwen3_next").torch_chunk_gated_delta_rule
    packed = varlen_chunk_gated_delta_rule(original)
    gen = torch.Generator().manual_seed(1)
    tokens = sum(LENGTHS)
    # as many q/k heads as value heads (transformers 5.17's torch function has no grouped value heads)
    q, k = (torch.randn(1, tokens, 4, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, tokens, 4, 8, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, tokens, 4, generator=gen))
    beta = torch.rand(1, tokens, 4, generator=gen)
    meta = _meta()
    out, state = packed(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=meta.cu_seqlens, **{LINEAR_META: meta})
    assert state is None and meta.calls == 1
    want, mixed = _alone_and_mixed(original, meta, q, k, v, g, beta)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert (mixed - want).abs().max() > 1e-2
    with pytest.raises(ValueError, match="zero state"):  # a recurrent state never meets a packed batch
        packed(q, k, v, g=g, beta=beta, initial_state=torch.zeros(1, 4, 8, 8), output_final_state=False,
               **{LINEAR_META: _meta()})


def test_packed_kimi_delta_attention_starts_each_sample_from_a_zero_state():
    """kimi_linear's chunk_kimi_delta_attention (a decay per key channel), called as its layer calls
    it: q, k, v positional, g, beta and the rest by keyword, the layer's kwargs along."""
    original = _modeling("kimi_linear").chunk_kimi_delta_attention
    packed = varlen_chunk_kda(original)
    gen = torch.Generator().manual_seed(2)
    tokens = sum(LENGTHS)
    q, k, v = (torch.randn(1, tokens, 2, 8, generator=gen) for _ in range(3))
    g = -0.1 * torch.nn.functional.softplus(torch.randn(1, tokens, 2, 8, generator=gen))  # slow, per channel
    beta = torch.rand(1, tokens, 2, generator=gen)
    meta = _meta()
    out, state = packed(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=True, **{LINEAR_META: meta, "cu_seq_lens_q": meta.cu_seqlens})
    assert state is None and meta.calls == 1
    want, mixed = _alone_and_mixed(original, meta, q, k, v, g, beta)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert (mixed - want).abs().max() > 1e-2
    # no LinearMeta (a padded batch, generation): the model's own function, unchanged
    torch.testing.assert_close(packed(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0], mixed, rtol=0, atol=0)
    # several packed rows are one sequence list: two rows of 71 tokens, the padded tail a sequence of its own
    wide = [torch.cat((t, t[:, :1]), dim=1) for t in (q, k, v, g, beta)]
    meta = LinearMeta.build(torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32), tokens + 1)
    rows = [t.reshape(2, (tokens + 1) // 2, *t.shape[2:]) for t in wide]
    got, _ = packed(*rows[:3], g=rows[3], beta=rows[4], use_qk_l2norm_in_kernel=True, **{LINEAR_META: meta})
    torch.testing.assert_close(got.reshape(1, tokens + 1, *got.shape[2:])[:, :tokens], want, rtol=0, atol=0)
    for state_args in (dict(initial_state=torch.zeros(1, 2, 8, 8)), dict(output_final_state=True)):
        with pytest.raises(ValueError, match="zero state"):  # a recurrent state never meets a packed batch
            packed(q, k, v, g=g, beta=beta, **state_args, **{LINEAR_META: _meta()})


def test_without_fla_the_problem_names_the_install():
    try:
        import fla  # noqa: F401
    except ImportError:
        problem = fla_problem(None)
        assert problem is not None and "pip install flash-linear-attention" in problem
    else:
        pytest.skip("flash-linear-attention is installed here")


def test_a_layer_that_drops_the_boundaries_stops_the_step():
    """A transformers version whose stateful layer does not pass its keyword arguments on would
    carry state across samples silently: the packing hook counts the calls and raises."""
    entry = zoo.ENTRIES["qwen3_next"]
    model = zoo.build(entry)
    hasten.accelerate(model)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet"))
    own_forward = layer.forward

    def forward_dropping_kwargs(hidden_states, cache=None, attention_mask=None, **kwargs):
        return own_forward(hidden_states, attention_mask=attention_mask)

    layer.forward = forward_dropping_kwargs
    with pytest.raises(PackedBatchRefused, match="only 2 of the 4"):
        model(**zoo.packed_batch(zoo.samples()))


def test_a_layer_without_keyword_arguments_is_refused_before_any_step():
    """transformers 5.17's Lfm2ShortConv.forward takes a fixed argument list (it forwards seq_idx
    alone): the boundaries cannot reach its convolution, so accelerate() refuses packed batches
    up front, naming the layer, instead of waiting for the first step's count."""
    model = zoo.build(zoo.ENTRIES["lfm2"])
    layer = next(m for m in model.modules() if type(m).__name__.endswith("ShortConv"))
    own_forward = layer.forward

    def fixed_forward(hidden_states, past_key_values=None, attention_mask=None, seq_idx=None):
        return own_forward(hidden_states, attention_mask=attention_mask)

    layer.forward = fixed_forward
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match=r"Lfm2ShortConv.forward takes no keyword arguments.*5.24"):
        model(**zoo.packed_batch(zoo.samples()))
    handle.undo()


def test_padded_batches_and_undo_leave_the_model_its_own():
    gc.collect()  # models of earlier tests dropped without undo(): their replacements released first
    release_dropped()
    entry = zoo.ENTRIES["qwen3_next"]
    model = zoo.build(entry)
    modeling = sys.modules[type(model).__module__]
    own = (modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule)
    batch = zoo.padded_batch(zoo.samples(lengths=(7, 1, 19)))
    want = model(**batch).loss
    other = zoo.clone(model)
    handle, second = hasten.accelerate(model), hasten.accelerate(other)
    assert modeling.causal_conv1d_fn is not own[0] and REPLACED.active(modeling, "causal_conv1d_fn")
    torch.testing.assert_close(model(**batch).loss, want)  # a padded batch: transformers' own path
    handle.undo()
    assert modeling.causal_conv1d_fn is not own[0]  # the other model still uses the replacement
    second.undo()
    assert (modeling.causal_conv1d_fn, modeling.torch_chunk_gated_delta_rule) == own


def test_the_gpu_parity_references_find_the_torch_function_under_a_live_replacement():
    """The GPU parity test's references run transformers' torch function (torch_function_of): with a
    hasten handle live, the modeling module holds hasten's replacement, functools.wraps of what
    5.25 puts there (the `kernels` package's nn.Module, `(*args, **kwargs)`); unwrapping stopped at
    that module, whose signature dropped the keyword arguments (g, beta) on the GPU at 5b235b3."""
    from tests.gpu.test_model_parity_cuda import torch_function_of

    model = zoo.build(zoo.ENTRIES["qwen3_next"])
    modeling = sys.modules[type(model).__module__]
    handle = hasten.accelerate(model)
    try:
        found = torch_function_of(modeling.torch_chunk_gated_delta_rule)
        assert inspect.isfunction(found) and found.__name__ == "torch_chunk_gated_delta_rule", found
        assert {"g", "beta"} <= set(inspect.signature(found).parameters)
    finally:
        handle.undo()


@pytest.mark.parametrize("name", ["qwen3_next", "lfm2", "lfm2_moe", "lfm3", "lara_mini", "kimi_linear"])
def test_several_packed_rows_each_sample_alone(name):
    """hasten.PackingCollator packs into several rows when the samples need them (the shorter rows
    end in a padding segment, a sequence of its own): the rows are one varlen sequence list."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    reference = zoo.build(entry)
    patched = zoo.clone(reference)
    want_loss, want = zoo.per_sample_reference(reference, batch_samples)
    hasten.accelerate(patched)
    batch = hasten.PackingCollator(max_tokens=40)(batch_samples)
    assert batch["input_ids"].shape[0] > 1
    loss = patched(**batch).loss
    loss.backward()
    assert abs(float(loss) - float(want_loss)) <= 1e-5
    errors = zoo.relative_errors(zoo.gradients(patched), want)
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_published_wrapper_packs_text_and_refuses_images(name):
    """Qwen3.5's checkpoints are image-text wrappers (Qwen3_5ForConditionalGeneration): its text
    model packs like the text entry; a packed batch with images is refused (they attend both ways)."""
    from transformers import AutoModelForImageTextToText

    reference = zoo.build(zoo.ENTRIES[name], auto_class=AutoModelForImageTextToText)  # the zoo builds its causal LM
    assert type(reference).__name__.endswith("ForConditionalGeneration")
    patched = zoo.clone(reference)
    batch_samples = zoo.samples()
    want_loss, want = zoo.per_sample_reference(reference, batch_samples)
    handle, loss, got = zoo.packed_run(patched, batch_samples)
    assert any(item.startswith("varlen stateful layers") for item in handle.active), handle.report()
    assert abs(float(loss) - float(want_loss)) <= 1e-5
    errors = zoo.relative_errors(got, want)
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])
    batch = zoo.packed_batch(batch_samples)
    with pytest.raises(PackedBatchRefused, match="pixel_values"):
        patched(**batch, pixel_values=torch.zeros(4, 3 * 2 * 16 * 16))
