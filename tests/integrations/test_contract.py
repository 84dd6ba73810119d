"""The per-piece contract: mask reading, attention arguments, and the checks that decide whether a
norm, MLP or rotary function is exactly what hasten's kernel computes."""

import pytest
import torch
from torch import nn
from transformers import masking_utils
import hasten

from hasten.dense.patch import rms_norm_mismatch, rope_mismatch, gated_mlp_mismatch
from hasten.integrations import contract
from hasten.integrations.contract import check_attention_kwargs, stateful_layers
from hasten.integrations.masks import BandMask, MaskNotSupported, read_band


@pytest.mark.parametrize("length", [1, 2, 7, 64, 301])
def test_causal_mask_reads_as_causal_without_window(length):
    assert read_band(masking_utils.causal_mask_function, length) == BandMask(True, None)


@pytest.mark.parametrize("window,length", [(1, 9), (5, 64), (63, 64), (64, 64), (500, 64), (4096, 8191)])
def test_sliding_window_mask_reads_as_its_window(window, length):
    band = read_band(masking_utils.sliding_window_causal_mask_function(window), length)
    assert band == BandMask(True, window if window < length else None)


def test_a_reading_is_reused_only_for_the_same_code_and_closure_values():
    # transformers builds a new closure every forward; its reading is reused, per window and length
    for window in (3, 5, 3):
        assert read_band(masking_utils.sliding_window_causal_mask_function(window), 30) == BandMask(True, window)
    assert read_band(masking_utils.sliding_window_causal_mask_function(5), 4) == BandMask(True, None)
    ids = torch.tensor([[0] * 8 + [1] * 12])  # a closure over a tensor is read afresh every time
    packed = masking_utils.and_masks(masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(ids))
    for _ in range(2):
        with pytest.raises(MaskNotSupported):
            read_band(packed, 20)


@pytest.mark.parametrize("make", [
    lambda: masking_utils.causal_mask_function,
    lambda: masking_utils.bidirectional_mask_function,
    lambda: masking_utils.sliding_window_causal_mask_function(1),
    lambda: masking_utils.sliding_window_causal_mask_function(37),
    lambda: masking_utils.sliding_window_causal_mask_function(64),
    lambda: masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv // 24 == q // 24),
    # pure, but not a band on every grid: keys bounded by a number the function holds
    lambda: masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv < 50),
])
def test_a_reading_on_the_shared_grid_is_the_reading_of_each_length(make):
    """Readings are taken on power-of-two grids and reused for every length up to the grid: for each
    length (off powers of two, 1 and the grids' edges among them) the band is the one a reading of
    that length alone gives, or the same refusal."""
    from hasten.integrations import masks

    for length in (1, 2, 3, 5, 23, 24, 25, 36, 37, 38, 49, 50, 51, 63, 64, 65, 100, 127, 129):
        try:
            alone = masks._read(make(), length, None)
        except MaskNotSupported:
            with pytest.raises(MaskNotSupported):
                read_band(make(), length)
            continue
        assert read_band(make(), length) == alone, length


def test_rows_of_many_lengths_share_a_few_readings(monkeypatch):
    """A run whose packed rows all differ in length reads a mask function once per power-of-two grid
    (before: once per length, and not at all reused after 256 lengths)."""
    from hasten.integrations import masks

    monkeypatch.setattr(masks, "_READINGS", {})
    calls = []
    real_read = masks._read
    monkeypatch.setattr(masks, "_read", lambda f, n, d: calls.append(n) or real_read(f, n, d))
    for length in range(3000, 4500, 7):
        assert read_band(masking_utils.sliding_window_causal_mask_function(128), length) == BandMask(True, 128)
    assert sorted(calls) == [4096, 8192]


def test_bidirectional_mask_reads_as_not_causal():
    assert read_band(masking_utils.bidirectional_mask_function, 40) == BandMask(False, None)


def test_a_chunk_reading_is_taken_only_where_the_config_declares_that_chunk_size():
    """Packed samples of equal length under transformers' packed-sequence overlay read as chunks;
    hasten's attention takes a chunk reading only from a model whose config sets that chunk size."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import hasten_attention_forward

    overlay = masking_utils.and_masks(masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(
        torch.tensor([[0] * 20 + [1] * 20])))
    band = read_band(overlay, 40)
    assert band == BandMask(True, None, 20)
    model = zoo.build(zoo.ENTRIES["qwen3"])
    handle = hasten.accelerate(model)
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 40, 16)
    kv = torch.randn(1, 2, 40, 16)
    with pytest.raises(NotImplementedError, match="chunks of 20 positions but its config declares"):
        hasten_attention_forward(attention, q, kv, kv, band, position_ids=torch.arange(40)[None])
    handle.undo()


def test_chunked_mask_reads_as_its_chunk_size():
    """Llama 4's chunked causal mask: causal within chunks of 8 positions (off block multiples: 40
    and 43 tokens); shorter than one chunk it is plain causal; shifted chunks (a left padding of 3)
    are refused, not read as chunks from 0."""
    for length in (40, 43):
        assert read_band(masking_utils.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)),
                         length) == BandMask(True, None, 8)
    assert read_band(masking_utils.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long)), 8) \
        == BandMask(True, None)
    with pytest.raises(MaskNotSupported):
        read_band(masking_utils.chunked_causal_mask_function(8, torch.full((1,), 3, dtype=torch.long)), 40)


def test_chunked_mask_over_a_device_tensor_is_read_on_that_device():
    """On CUDA, Llama 4's chunked overlay indexes its `left_padding`, a tensor on the model's device,
    so evaluating it with CPU index tensors raises: both the band's rows and the chunk size must then
    be read on the device read_band is given. torch's lazy (TorchScript) backend is a second device
    on a CPU-only machine that refuses CPU index tensors the same way CUDA does."""
    lazy = pytest.importorskip("torch._lazy.ts_backend")
    lazy.init()
    device = torch.device("lazy")
    mask = masking_utils.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long, device=device))
    zero = torch.zeros((), dtype=torch.long)
    with pytest.raises(RuntimeError):  # what the CPU-first reading meets
        mask(zero, zero, torch.arange(40)[:, None], torch.arange(40)[None, :])
    assert read_band(mask, 40, device) == BandMask(True, None, 8)
    with pytest.raises(MaskNotSupported):  # shifted chunks are still refused on the device
        read_band(masking_utils.chunked_causal_mask_function(8, torch.full((1,), 3, dtype=torch.long, device=device)),
                  40, device)


@pytest.mark.parametrize("make", [
    lambda: masking_utils.sliding_window_bidirectional_mask_function(4),
    lambda: masking_utils.and_masks(masking_utils.causal_mask_function,
                                    masking_utils.packed_sequence_mask_function(
                                        torch.tensor([[0] * 12 + [1] * 28]))),
    lambda: masking_utils.or_masks(masking_utils.causal_mask_function,
                                   lambda b, h, q, kv: (q < 4) & (kv < 4)),  # a bidirectional image prefix
])
def test_other_masks_are_refused_not_approximated(make):
    with pytest.raises(MaskNotSupported):
        read_band(make(), 40)


class _Attention(nn.Module):
    pass


@pytest.mark.parametrize("name,value", [("softcap", 50.0), ("s_aux", torch.zeros(4)), ("sinks", torch.ones(2)),
                                        ("output_attentions", True), ("position_bias", torch.zeros(1)),
                                        ("token_type_ids", torch.zeros(3)), ("deterministic", True)])
def test_attention_refuses_any_argument_it_would_drop(name, value):
    with pytest.raises(NotImplementedError, match=f"`{name}`"):
        check_attention_kwargs({name: value}, _Attention())


def test_attention_accepts_what_it_reads_or_what_computes_nothing():
    check_attention_kwargs({"position_ids": torch.zeros(3), "softcap": None, "s_aux": None, "output_attentions": False,
                            "use_cache": False, "cache_position": torch.arange(3), "num_items_in_batch": 7,
                            "num_samples": 2, "cu_seq_lens_q": torch.zeros(2), "max_length_q": 3}, _Attention())


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-6, offset=0.0, centred=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon, self.offset, self.centred = eps, offset, centred

    def forward(self, x):
        x32 = x.float()
        if self.centred:
            x32 = x32 - x32.mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight + self.offset) * x32.to(x.dtype)


class NoEpsRMSNorm(LlamaStyleRMSNorm):
    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12)


def test_rms_norm_check_passes_the_llama_norm_and_refuses_look_alikes():
    assert rms_norm_mismatch(LlamaStyleRMSNorm(48)) is None
    for norm in (LlamaStyleRMSNorm(48, offset=1.0), LlamaStyleRMSNorm(48, centred=True), NoEpsRMSNorm(48, eps=1e-2)):
        assert "computes something other" in rms_norm_mismatch(norm)


class GatedMLP(nn.Module):
    def __init__(self, act=nn.SiLU(), dropout=0.0, extra_scale=1.0):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(24, 40), nn.Linear(24, 40), nn.Linear(40, 24)
        self.act_fn, self.dropout, self.extra_scale = act, nn.Dropout(dropout), extra_scale

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x))) * self.extra_scale


def test_mlp_check_passes_swiglu_and_refuses_other_gates_dropout_and_scaling():
    assert gated_mlp_mismatch(GatedMLP()) is None
    assert "computes something other" in gated_mlp_mismatch(GatedMLP(act=nn.GELU(approximate="tanh")))
    assert "computes something other" in gated_mlp_mismatch(GatedMLP(extra_scale=1.5))
    assert "dropout" in gated_mlp_mismatch(GatedMLP(dropout=0.1))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)

    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def test_rope_check_passes_rotate_half_and_refuses_interleaved_pairs():
    assert rope_mismatch(rotate_half_rope, 16) is None
    assert "computes something other" in rope_mismatch(interleaved_rope, 16)
    assert "could not be checked" in rope_mismatch(lambda q, k, cos, sin, position_ids: (q, k), 16)


def test_stateful_layers_are_found_by_layer_type_or_module():
    class Cfg:
        layer_types = ["linear_attention", "full_attention"]

    class M(nn.Module):
        config = Cfg()

    assert stateful_layers(M()) == ["1 'linear_attention' layers"]

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = nn.Conv1d(8, 8, 4, groups=8, padding=3)

    class N(nn.Module):
        config = type("C", (), {})()

        def __init__(self):
            super().__init__()
            self.mixer = Mixer()

    assert stateful_layers(N()) == ["1 depthwise causal convolutions (nn.Conv1d)"]


def test_a_build_without_cuda_kernels_leaves_a_cuda_model_to_transformers(monkeypatch):
    """A CPU-only build (no nvcc at install) on a GPU machine: the pieces whose ops have no CUDA
    kernel stay transformers', said with the fix, instead of failing in the first forward."""
    import hasten
    import hasten.ops
    from tests import model_zoo as zoo

    import hasten.integrations.transformers as integration

    model = zoo.build(zoo.ENTRIES["qwen3_moe"])
    monkeypatch.setattr(integration, "_model_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(hasten.ops, "has_cuda_kernel", lambda op: False)
    handle = hasten.accelerate(model)
    inactive = " | ".join(handle.inactive)
    for piece in ("fused cross-entropy", "fused norm / MLP / RoPE", "fused MoE experts"):
        assert f"{piece} (" in inactive and "built without CUDA kernels" in inactive, inactive
    assert "make install" in inactive


def test_a_multimodal_wrapper_without_an_entry_is_outside_the_table():
    """paligemma (a vision tower + a Gemma text model) is keyed by its own model type: with no entry
    of its own, none of the table's pieces apply to it, said once."""
    import hasten
    from hasten.observability import fallback_reasons
    from transformers import AutoConfig

    from hasten.integrations.architectures import ARCHITECTURES

    assert "paligemma" not in ARCHITECTURES
    text = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    from transformers import PaliGemmaForConditionalGeneration

    model = PaliGemmaForConditionalGeneration(AutoConfig.for_model("paligemma", text_config=text,
                                                                   vision_config=vision))
    handle = hasten.accelerate(model)
    assert "model_type_not_in_table:paligemma" in fallback_reasons()
    assert not any(item.startswith(("fused kernels", "fused cross-entropy")) for item in handle.active), handle.report()
    handle.undo()


def test_gemma3_multimodal_trains_text_packed_and_refuses_packed_images():
    """Gemma3ForConditionalGeneration: hasten's attention in its text model only (the SigLIP tower
    keeps its own), text-only packed batches run (tests/model_zoo.py's parity case), a packed
    batch with image tokens is refused with the fix; undo restores both attention settings."""
    import hasten
    from hasten.integrations.transformers import PackedBatchRefused
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES["gemma3"])
    vision_before = model.config.vision_config._attn_implementation
    text_before = model.config.text_config._attn_implementation
    handle = hasten.accelerate(model)
    assert model.config.vision_config._attn_implementation == vision_before
    assert model.config.text_config._attn_implementation != text_before
    assert any(item.startswith("varlen attention (packed") for item in handle.active), handle.report()
    batch = zoo.packed_batch(zoo.samples())
    model(**batch).loss.backward()  # text only
    token_types = torch.zeros_like(batch["input_ids"])
    token_types[0, 3:5] = 1
    with pytest.raises(PackedBatchRefused, match="training.packed_sequence: false"):
        model(**batch, token_type_ids=token_types)
    handle.undo()
    assert model.config.text_config._attn_implementation == text_before
    assert model.config.vision_config._attn_implementation == vision_before


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_non_causal_modules_under_a_causal_mask_are_refused_packed(implementation):
    """PaliGemma (outside the table) builds its Gemma attention modules non-causal while its text
    model's mask is causal: alone, under sdpa the model drops the mask and attends both ways
    (measured: the packed causal row's gradients 1.41 from it), under eager it keeps it. hasten
    cannot tell which to reproduce, so a packed batch is refused whichever is loaded; padded
    batches stay the model's own."""
    from transformers import AutoModelForImageTextToText

    from hasten.integrations.transformers import PackedBatchRefused
    from tests import model_zoo as zoo

    entry = zoo.Entry("paligemma", dict(text_config=dict(model_type="gemma"), projection_dim=64,
                                        vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                           intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, image_size=32, patch_size=16)),
                      "refused", attn_implementation=implementation)
    model = zoo.build(entry, auto_class=AutoModelForImageTextToText)
    handle = hasten.accelerate(model)
    try:
        with pytest.raises(PackedBatchRefused, match="is built non-causal"):
            model(**zoo.packed_batch(zoo.samples()))
        model(**zoo.padded_batch(zoo.samples())).loss.backward()  # padded: the model's own attention
    finally:
        handle.undo()


def test_prefix_lm_token_types_are_refused_under_hasten_attention():
    """HRM-Text (prefix_lm): the tokens token_type_ids mark attend to each other both ways, which
    hasten's varlen attention does not compute. Its mask reading samples rows of the first batch
    row only, so a prefix elsewhere would pass as causal: a batch marking any token is refused,
    packed or not. Unmarked batches train (the zoo's parity case runs them causally)."""
    import hasten
    from hasten.integrations.masks import MaskNotSupported
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES["hrm_text"])
    handle = hasten.accelerate(model)
    batch = zoo.packed_batch(zoo.samples(lengths=(40, 30)))
    model(**batch, token_type_ids=torch.zeros_like(batch["input_ids"])).loss.backward()
    marked = torch.zeros_like(batch["input_ids"])
    marked[0, 41:45] = 1  # the second sample's tokens 1..4: rows the mask reading does not sample
    with pytest.raises(MaskNotSupported, match="training.packed_sequence: false"):
        model(**batch, token_type_ids=marked)
    ids = torch.tensor([s["input_ids"] for s in zoo.samples(lengths=(20, 20))])
    marked = torch.zeros_like(ids)
    marked[1, 5:9] = 1  # unpacked rows, the prefix in the second
    with pytest.raises(MaskNotSupported, match="training.packed_sequence: false"):
        model(input_ids=ids, labels=ids, token_type_ids=marked)
    handle.undo()


def _padded_batch_equals_unpatched(model_type: str):
    """A padded batch through the accelerated model (its own eager attention with hasten's dense
    mask, as additive mask): loss and every gradient of the unpatched model. Returns both models."""
    import hasten
    from tests import model_zoo as zoo

    reference = zoo.build(zoo.ENTRIES[model_type])
    patched = zoo.clone(reference)
    batch = zoo.padded_batch(zoo.samples())
    want = reference(**batch).loss
    want.backward()
    handle = hasten.accelerate(patched)
    got = patched(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    errors = zoo.relative_errors(zoo.gradients(patched), zoo.gradients(reference))
    assert max(errors.values()) < 1e-4, max(errors.items(), key=lambda item: item[1])
    return reference, patched, handle, errors


def _generation_equals_unpatched(reference, patched) -> None:
    """Greedy decoding against a cache (patched is accelerated): the same tokens and logits."""
    from tests import model_zoo as zoo

    reference.eval()
    patched.eval()
    prompt = torch.tensor([zoo.samples()[0]["input_ids"]])
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
        got = patched.generate(prompt, max_new_tokens=4, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_gemma2_padded_batches_keep_the_softcap_and_the_padding_mask():
    """A padded batch of an accelerated Gemma 2 runs its own eager attention (sdpa would drop the
    softcap) with the dense mask hasten's mask interface built, which is sdpa's boolean kind: it
    must reach eager attention as the additive mask eager adds to its scores. Loss and gradients
    equal the unpatched eager model's on the same padded batch."""
    _, _, handle, _ = _padded_batch_equals_unpatched("gemma2")
    handle.undo()


def test_gemma2_generation_keeps_the_softcap_and_causality():
    """Decoding against a cache (and the prefill with generate's all-ones attention_mask) on an
    accelerated Gemma 2: its own eager attention with hasten's dense mask, the logits of the
    unpatched eager model at every step."""
    import hasten
    from tests import model_zoo as zoo

    reference = zoo.build(zoo.ENTRIES["gemma2"]).eval()
    patched = zoo.clone(reference)
    handle = hasten.accelerate(patched)
    _generation_equals_unpatched(reference, patched)
    handle.undo()


def test_gpt_oss_padded_batches_and_generation_keep_the_sinks():
    """gpt-oss's sinks on the paths hasten's varlen op does not take: a padded batch and decoding
    against a cache run the model's own eager attention (which reads module.sinks) with the additive
    mask; loss, gradients (the sinks' too) and generated logits equal the unpatched model's."""
    reference, patched, handle, errors = _padded_batch_equals_unpatched("gpt_oss")
    assert any(item.startswith("varlen attention (packed") for item in handle.active), handle.report()
    assert any("sinks" in name for name in errors)
    _generation_equals_unpatched(reference, patched)
    handle.undo()


def test_a_module_with_sinks_whose_call_passes_none_is_refused():
    from hasten.integrations.transformers import _attention_sinks

    module = _Attention()
    assert _attention_sinks(module, None) is None  # no sinks anywhere
    module.sinks = nn.Parameter(torch.zeros(4))
    assert _attention_sinks(module, module.sinks) is module.sinks
    with pytest.raises(NotImplementedError, match="passes none"):
        _attention_sinks(module, None)
    with pytest.raises(NotImplementedError, match="not its module's `sinks`"):
        _attention_sinks(module, torch.zeros(4))


def test_llama4_rows_longer_than_its_temperature_floor_are_refused_when_packed():
    """Llama 4 scales the queries of its layers without rotary by log1p(floor((i + 1) / floor_scale)),
    i the index along the row: rows of up to floor_scale - 1 tokens equal each sample alone (the
    zoo's parity case), longer rows holding several samples are refused with the limit, and a long
    row of one sample is not."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.ENTRIES["llama4_text"]
    batch_samples = zoo.samples()  # 73 tokens in one packed row
    model = zoo.build(entry, floor_scale=16, attn_scale=0.5)
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match="at most 15 tokens"):
        model(**zoo.packed_batch(batch_samples))
    long_alone = zoo.packed_batch([{"input_ids": list(range(3, 40))}])
    model(**long_alone).loss.backward()  # one sample in its row: what it computes alone
    handle.undo()
    patched = zoo.build(entry, floor_scale=74, attn_scale=0.5)  # the row's 73 tokens stay under the floor
    want_loss, want = zoo.per_sample_reference(zoo.build(entry, floor_scale=74, attn_scale=0.5), batch_samples)
    _, loss, got = zoo.packed_run(patched, batch_samples)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


def test_mla_head_sizes_are_read_as_the_modules_compute_them():
    """GLM-4.7-Flash's config can keep a qk_head_dim its attention does not use (its default 256
    after only head_dim is overridden; the module takes qk_nope_head_dim + qk_rope_head_dim): value
    heads wider than the module's are found, narrower ones not."""
    from hasten.integrations.contract import attention_features_not_implemented
    from tests import model_zoo as zoo

    wide = zoo.build(zoo.ENTRIES["glm4_moe_lite"], v_head_dim=32)  # q/k 16 + 8
    wide.config.qk_head_dim = 256  # stale, as AutoConfig.for_model("glm4_moe_lite", head_dim=16) leaves it
    assert "wider than the query/key heads (24)" in attention_features_not_implemented(wide)["mla"]
    assert "mla" not in attention_features_not_implemented(zoo.build(zoo.ENTRIES["glm4_moe_lite"]))


def test_model_code_that_reads_the_band_as_a_tensor_gets_the_fix():
    """Doge's attention reads its mask's dtype: the error names the problem and the fix."""
    band = BandMask(True, None)
    with pytest.raises(AttributeError, match="reads its attention mask as a tensor.*packed_sequence: false"):
        band.dtype  # noqa: B018
    assert not hasattr(band, "shape")


def test_a_dynamic_rotary_limits_packed_rows_to_its_original_context():
    """A "dynamic" rotary (InternLM3's published one) rescales the batch's frequencies once a
    position passes the original context: a packed batch whose longest sample is past it is refused
    (that sample would change the others' rotary); with every sample within it a longer row equals
    each sample alone."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.ENTRIES["llama"]
    dynamic = dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0))
    batch_samples = zoo.samples()  # 73 tokens in one row, the longest sample 33
    model = zoo.build(entry, max_position_embeddings=30, **dynamic)
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match="longest sample has 33 tokens.*dynamic rotary.*at most 30 tokens"):
        model(**zoo.packed_batch(batch_samples))
    handle.undo()
    want_loss, want = zoo.per_sample_reference(zoo.build(entry, max_position_embeddings=40, **dynamic), batch_samples)
    _, loss, got = zoo.packed_run(zoo.build(entry, max_position_embeddings=40, **dynamic), batch_samples)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


def test_a_longrope_rotary_limits_packed_rows_to_its_original_context():
    """A "longrope" rotary (MiniCPM3's and Phi-3-128k's published one) switches the batch to its
    long factors once a position passes the original context, as "dynamic" rescales: a packed batch
    whose longest sample is past it is refused; with every sample within it a longer row equals
    each sample alone."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.ENTRIES["minicpm3"]  # 8 rotary features a head: 4 factors

    def longrope(context):
        return dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.3, 1.6],
                                         long_factor=[1.0, 2.0, 4.0, 8.0], original_max_position_embeddings=context))
    batch_samples = zoo.samples()  # 73 tokens in one row, the longest sample 33
    model = zoo.build(entry, **longrope(30))
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match="longest sample has 33 tokens.*longrope rotary.*at most 30 tokens"):
        model(**zoo.packed_batch(batch_samples))
    handle.undo()
    want_loss, want = zoo.per_sample_reference(zoo.build(entry, **longrope(40)), batch_samples)
    _, loss, got = zoo.packed_run(zoo.build(entry, **longrope(40)), batch_samples)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "qwen2_5_vl", "glm4v", "glm4v_moe", "mistral3", "gemma4",
                                        "llava_onevision1_5", "ovis2_5"])
@pytest.mark.parametrize("pixels", ["pixel_values", "pixel_values_videos"])
def test_vl_wrappers_train_text_packed_and_refuse_packed_images_and_videos(model_type, pixels):
    """Vision-language wrappers (Qwen, GLM-4V, Mistral 3, Gemma 4): hasten's attention (and fused experts) in the text model, text-only
    packed batches run (the parity cases), a packed batch with images or videos is refused with
    the fix before the vision tower runs."""
    import hasten
    from hasten.integrations.transformers import PackedBatchRefused
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES[model_type])
    handle = hasten.accelerate(model)
    assert any(item.startswith("varlen attention (packed") for item in handle.active), handle.report()
    if model_type.endswith("_moe"):
        assert any(item.startswith("fused MoE experts (") for item in handle.active), handle.report()
    batch = zoo.packed_batch(zoo.samples())
    model(**batch).loss.backward()
    with pytest.raises(PackedBatchRefused, match="training.packed_sequence: false"):
        model(**batch, **{pixels: torch.zeros(4, 3 * 2 * 16 * 16)})
    handle.undo()


@pytest.mark.parametrize("media", ["mm_token_type_ids", "input_features", "mm_encoder_outputs"])
def test_gemma4_refuses_packed_media_it_marks_or_encodes_without_pixels(media):
    """Gemma 4 marks media tokens in mm_token_type_ids and takes encoder outputs and audio features
    without pixel_values: a packed batch with any of them is refused, not run causally."""
    import hasten
    from hasten.integrations.transformers import PackedBatchRefused
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES["gemma4"])
    handle = hasten.accelerate(model)
    batch = zoo.packed_batch(zoo.samples())
    marked = torch.zeros_like(batch["input_ids"])
    marked[0, 3:5] = 1
    value = {"mm_token_type_ids": marked, "input_features": torch.zeros(1, 4, 8),
             "mm_encoder_outputs": torch.zeros(1, 2, 8)}[media]
    with pytest.raises(PackedBatchRefused, match="training.packed_sequence: false"):
        model(**batch, **{media: value})
    handle.undo()


@pytest.mark.parametrize("metadata_cache", [True, False])
def test_llama4_chunks_are_built_once_per_batch(monkeypatch, metadata_cache):
    """Where the batch has its metadata (the collator's, or the cache's from position_ids) the
    chunk boundaries are built once per batch by the packing hook, and its two chunked layers read
    them; a batch of position_ids alone without the metadata cache derives them in each chunked
    layer. The loss and every gradient equal each sample alone either way."""
    import hasten.integrations.transformers as integration
    from hasten.config import Config
    from tests import model_zoo as zoo

    calls = []
    real = integration.chunk_boundaries
    monkeypatch.setattr(integration, "chunk_boundaries", lambda *a: calls.append(a[-1]) or real(*a))
    entry, batch_samples = zoo.ENTRIES["llama4_text"], zoo.samples()
    want_loss, want = zoo.per_sample_reference(zoo.build(entry), batch_samples)
    config = Config.from_dict({"training": {"metadata_cache": metadata_cache}})
    _, loss, got = zoo.packed_run(zoo.build(entry), batch_samples, config)  # the collator's metadata
    assert calls == [5]
    calls.clear()
    model = zoo.build(entry)
    hasten.accelerate(model, config)
    batch = zoo.packed_batch(batch_samples)
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss.backward()
    assert calls == ([5] if metadata_cache else [5, 5])
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


def test_an_unmarked_attention_class_is_packed_only_where_its_entry_vouches(monkeypatch):
    """StableLM's class leaves `_supports_attention_backend` off (its decoder layer passes the attention
    position_ids only): packed batches run on hasten's attention because its table entry says so
    (`attention_interface`), the metadata derived per layer; without that, they are refused."""
    import dataclasses

    from hasten.integrations import architectures
    from hasten.integrations.transformers import PackedBatchRefused
    from tests import model_zoo as zoo

    entry = zoo.ENTRIES["stablelm"]
    model = zoo.build(entry)
    assert not getattr(model, "_supports_attention_backend", False)
    handle = hasten.accelerate(model)
    assert handle.packing_refusal is None and "metadata derived per layer (the model's decoder layers" in \
        handle.report(), handle.report()
    handle.undo()
    monkeypatch.setitem(architectures.ARCHITECTURES, "stablelm",
                        dataclasses.replace(architectures.ARCHITECTURES["stablelm"], attention_interface=""))
    handle = hasten.accelerate(model)
    assert "does not use transformers' attention interface" in (handle.packing_refusal or ""), handle.report()
    with pytest.raises(PackedBatchRefused):
        model(**zoo.packed_batch(zoo.samples()))
    handle.undo()


# DeepSeek-V3.2's sparse attention (DSA) and A.X-K2's: an indexer keeps 4 keys per query, fewer than
# the long samples have, so a dropped selection shows
_DSA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, head_dim=8,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
            routed_scaling_factor=2.5, num_key_value_heads=4, index_topk=4, index_head_dim=16, index_n_heads=2)


def _padded_reference(entry, batch_samples):
    """(a copy of the entry's model, the unpatched model's loss and gradients on a padded batch):
    what a model whose packed batches hasten refuses must still compute padded."""
    from tests import model_zoo as zoo

    reference = zoo.build(entry)
    model = zoo.clone(reference)
    reference.zero_grad(set_to_none=True)
    want_loss = reference(**zoo.padded_batch(batch_samples)).loss
    want_loss.backward()
    return model, want_loss.detach(), zoo.gradients(reference)


def _assert_padded_batch_exact(model, batch_samples, want_loss, want):
    from tests import model_zoo as zoo

    model.zero_grad(set_to_none=True)
    loss = model(**zoo.padded_batch(batch_samples)).loss
    loss.backward()
    assert abs(float(loss.detach()) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(zoo.gradients(model), want).values()) < 1e-4


_DSA_TYPES = [("deepseek_v32", dict(first_k_dense_replace=1, n_group=2, topk_group=1)),
              ("axk2", dict(mlp_layer_types=["dense", "sparse", "sparse"], gated_norm_rank=4)),
              ("glm_moe_dsa", {}),  # GLM-5: its later layers reuse an earlier layer's selection
              ("hy_v4", {})]


def _counting(forward, calls: list):
    def counted(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return forward(self, *args, **kwargs)
    return counted


@pytest.mark.parametrize("model_type,extra", _DSA_TYPES)
def test_a_sparse_attention_selection_is_merged_as_the_model_merges_it_and_packed_samples_train_as_alone(model_type,
                                                                                                      extra,
                                                                                                      monkeypatch):
    """These models merge their indexer's top-k into the mask only when their attention
    implementation is named 'eager' or 'sdpa', and otherwise pass it to the attention function as
    `indices`. hasten's packed-mask attention merges it the same way; while no sample is longer than
    index_topk the selection keeps every key each query sees alone, so a packed row computes what
    each sample alone computes (the model's own eager attention, one sample at a time)."""
    from tests import model_zoo as zoo

    entry = zoo.Entry(model_type, dict(_DSA, **extra, index_topk=max(zoo.LENGTHS)), "transformers")
    model = zoo.build(entry)
    assert any(contract.merges_topk_selection(m) for m in model.modules())
    want_loss, want = zoo.per_sample_reference(zoo.clone(model), zoo.samples())
    indexers = {type(m) for m in model.modules() if type(m).__name__.endswith("Indexer")}
    calls = []
    for cls in indexers:  # the class's forward: what runs when hasten's skip does not
        monkeypatch.setattr(cls, "forward", _counting(cls.forward, calls))
    handle, loss, got = zoo.packed_run(model, zoo.samples())
    assert "sparse attention keeps each query's" not in (handle.packing_refusal or "")
    # no sample past index_topk: the indexer's top-k is every key, so hasten skips computing it
    assert indexers and calls == [], (indexers, len(calls))
    handle.undo()
    assert all("forward" not in m.__dict__ for m in model.modules() if type(m) in indexers)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


@pytest.mark.parametrize("model_type,extra", _DSA_TYPES)
def test_a_packed_sample_longer_than_the_sparse_selection_is_refused_and_padded_batches_train_exactly(model_type,
                                                                                                    extra):
    """Past index_topk the indexer chooses among a query's own keys in the packed row as alone, but
    the choice among equal scores could fall otherwise along the row: such a packed row is refused
    when it arrives (packed_row_limits), naming the limit. A padded batch computes what the unpatched
    model does, through hasten's packed-mask attention (the selection merged there) and with
    training.packed_sequence false (the attention transformers')."""
    from tests import model_zoo as zoo

    from hasten.config import Config
    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.Entry(model_type, dict(_DSA, **extra), "transformers")  # index_topk 4, samples up to 33 tokens
    batch_samples = zoo.samples()
    model, want_loss, want = _padded_reference(entry, batch_samples)
    assert (4, "sample") in [(limit, bounds) for limit, bounds, _ in contract.packed_row_limits(model)]
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match="longest sample has 33 tokens.*4 highest-scoring keys"):
        model(**zoo.packed_batch(batch_samples))
    # a padded batch through hasten's packed-mask attention: the selection merged there as the model
    # merges it (4 of up to 33 keys kept: a dropped or wrong merge shows)
    _assert_padded_batch_exact(model, batch_samples, want_loss, want)
    handle.undo()
    config = Config()
    config.training.packed_sequence = False
    handle = hasten.accelerate(model, config)
    _assert_padded_batch_exact(model, batch_samples, want_loss, want)
    handle.undo()


def test_config_values_reads_each_layer_where_a_heterogeneous_config_varies_an_attribute():
    """transformers 5.24+ raises on the global read of an attribute a heterogeneous config varies per
    layer (dots3's qk_nope_head_dim: 128, 128, 192 by default); hasten's checks read every layer's."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "dots3_note_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no dots3_note_text")
    config = AutoConfig.for_model("dots3_note_text", num_hidden_layers=3)
    with pytest.raises(RuntimeError):
        getattr(config, "qk_nope_head_dim", None)
    assert contract.config_values(config, "qk_nope_head_dim") == [128, 128, 192]
    assert contract.config_values(config, "hidden_size") == [config.hidden_size]
    assert contract.config_values(config, "no_such_attribute") == [None]


@pytest.mark.parametrize("model_type", ["roberta", "xlm-roberta"])
def test_positions_derived_from_the_tokens_refuse_packed_rows_and_padded_batches_train_exactly(model_type):
    """RoBERTa's family derives its positions from the tokens when no position_ids are given
    (padding_idx + 1 + the count of non-padding tokens before): alone, a sample starts at
    padding_idx + 1; a packed row's position_ids start every sample at 0. Before 2026-12-05 hasten
    trained such a packed row with those positions, silently (a sweep of transformers 5.25's causal
    LM types against each sample alone found it: loss off by 5e-3 to 1e-1). Refused now, naming the
    embeddings; a padded batch computes what the unpatched model does. Dropout off: these configs
    name theirs hidden_dropout_prob / attention_probs_dropout_prob."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.Entry(model_type, dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), "refused")
    batch_samples = zoo.samples()
    model, want_loss, want = _padded_reference(entry, batch_samples)
    assert "derives positions from the tokens" in (contract.positions_from_tokens(model) or "")
    handle = hasten.accelerate(model)
    assert "derives positions from the tokens" in (handle.packing_refusal or ""), handle.report()
    with pytest.raises(PackedBatchRefused, match="Embeddings derives positions from the tokens"):
        model(**zoo.packed_batch(batch_samples))
    _assert_padded_batch_exact(model, batch_samples, want_loss, want)
    handle.undo()


def test_only_the_top_k_merge_deepseek_v32_writes_is_recognised():
    """A class whose forward does not write DeepSeek-V3.2's merge statements (any other selection,
    or none) is not merged: hasten's attention refuses its `indices` as before."""

    class Other(nn.Module):
        def forward(self, x):
            return x

    assert not contract.merges_topk_selection(Other())
    assert not contract.merges_topk_selection(nn.Linear(2, 2))


def _distinct_hash_experts(model: nn.Module) -> None:
    """DeepSeek-V4's hash router reads its experts from a token -> ids table the model initialises
    to zero (every token to expert 0, twice: the router's weights then get no gradient but rounding);
    two distinct experts per token, as a checkpoint's table has."""
    gen = torch.Generator().manual_seed(5)
    for module in model.modules():
        table = module._buffers.get("tid2eid")
        if table is not None:
            experts = module.weight.shape[0]
            table.copy_(torch.stack([torch.randperm(experts, generator=gen)[:table.shape[1]]
                                     for _ in range(table.shape[0])]))


def test_deepseek_v4_refuses_packed_batches_and_trains_padded_ones_exactly():
    """DeepSeek-V4 (outside the table): its compressed layers pool windows of tokens along the row
    (across a packed row's samples) and extend the mask with their own block bias; the mask its
    attention then receives is not hasten's, so a packed batch is refused at that call. A padded
    batch runs the model's own attention and computes what the unpatched model does."""
    from tests import model_zoo as zoo

    from hasten.integrations.transformers import PackedBatchRefused

    entry = zoo.Entry("deepseek_v4", dict(num_key_value_heads=1, head_dim=32, q_lora_rank=24, n_routed_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=2,
                                          sliding_window=zoo.WINDOW, o_groups=2, o_lora_rank=16, index_n_heads=2,
                                          index_head_dim=16, index_topk=4, partial_rotary_factor=0.25,
                                          layer_types=["sliding_attention", "compressed_sparse_attention",
                                                       "heavily_compressed_attention"],
                                          compress_rates={"compressed_sparse_attention": 4,
                                                          "heavily_compressed_attention": 8},
                                          mlp_layer_types=["hash_moe", "moe", "moe"]), "transformers",
                      tensor_setup=_distinct_hash_experts)
    batch_samples = zoo.samples()
    model, want_loss, want = _padded_reference(entry, batch_samples)
    handle = hasten.accelerate(model)
    with pytest.raises(PackedBatchRefused, match="DeepseekV4Attention.*packed_sequence: false"):
        model(**zoo.packed_batch(batch_samples))
    _assert_padded_batch_exact(model, batch_samples, want_loss, want)
    handle.undo()


def test_a_band_keeps_part_of_its_queries_only_outside_a_packed_batch():
    """Outside a packed batch a band built by hasten_mask can be sliced to some of its queries (Gemma
    4's KV-shared layers in generate's prefill): transformers' own dense mask, sliced. In a packed
    batch (no `dense`) a dense mask of the row would join its samples: the slice stays an error."""
    from hasten.integrations.transformers import hasten_mask

    band = hasten_mask(batch_size=1, q_length=6, kv_length=6, mask_function=masking_utils.causal_mask_function,
                       device=torch.device("cpu"))
    assert band == BandMask(True, None) and band[:, :, slice(0, None), :] is band
    last_two = band[:, :, slice(-2, None), :]
    assert last_two.dtype == torch.bool and last_two.shape[-2:] == (2, 6)
    assert torch.equal(last_two[0, 0], torch.tril(torch.ones(6, 6, dtype=torch.bool))[-2:])
    with pytest.raises(NotImplementedError, match="keeps part of the queries"):
        BandMask(True, None)[:, :, slice(-2, None), :]
