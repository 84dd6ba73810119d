import gc

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import hasten
from hasten.config import Config
from hasten.observability import fallback_counts
from hasten.packing import StaleMetadataError

COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=16, **COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(sliding_window=None, **COMMON)),
}


def _samples(seed, lengths):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 200, (n,), generator=gen).tolist()} for n in lengths]


def _model(name):
    torch.manual_seed(0)
    return MODELS[name]().eval()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_isolation_logits_inside_pack_equal_sample_alone(name):
    model = _model(name)
    samples = _samples(1, [7, 1, 19, 4, 2])
    alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]
    handle = hasten.accelerate(model)
    batch = hasten.PackingCollator(max_tokens=64)(samples)
    packed = model(**batch).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        assert torch.allclose(packed[s:e], alone[i], atol=1e-5, rtol=1e-4), f"sample {i} differs"
    handle.undo()
    assert model.config._attn_implementation == "sdpa"


def test_position_ids_only_and_uncached_paths_match_collator_path():
    model = _model("qwen3")
    batch = hasten.PackingCollator(max_tokens=64)(_samples(2, [9, 3, 12, 1]))
    hasten.accelerate(model)
    with_meta = model(**batch).logits
    only_pos = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert torch.equal(with_meta, only_pos)
    uncached_model = _model("qwen3")
    hasten.accelerate(uncached_model, Config.from_dict({"training": {"metadata_cache": False}}))
    uncached = uncached_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert torch.equal(with_meta, uncached)


def test_loss_and_gradients_match_per_sample_training():
    reference, patched = _model("llama"), _model("llama")
    samples = _samples(3, [6, 11, 1, 5])
    ref_loss_sum, n_targets = 0.0, 0
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        if ids.shape[1] < 2:
            continue
        out = reference(input_ids=ids, labels=ids)
        ref_loss_sum = ref_loss_sum + out.loss * (ids.shape[1] - 1)
        n_targets += ids.shape[1] - 1
    (ref_loss_sum / n_targets).backward()
    hasten.accelerate(patched)
    loss = patched(**hasten.PackingCollator(max_tokens=64)(samples)).loss
    loss.backward()
    assert torch.allclose(loss, ref_loss_sum / n_targets, atol=1e-5)
    for (name, p), (_, q) in zip(reference.named_parameters(), patched.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name


def test_gradient_checkpointing_recompute_sees_the_same_metadata():
    model = _model("qwen3").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hasten.accelerate(model, Config.from_dict({"attention": {"verify": True}}))
    batch = hasten.PackingCollator(max_tokens=64)(_samples(4, [10, 3, 8]))
    model(**batch).loss.backward()  # verify re-derives and compares in every layer, forward and recompute
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_verify_catches_metadata_of_another_batch(monkeypatch):
    model = _model("qwen3")
    hasten.accelerate(model)
    collate = hasten.PackingCollator(max_tokens=64)
    first, second = collate(_samples(5, [4, 6])), collate(_samples(6, [3, 3, 4]))
    stale = dict(second, cu_seq_lens_q=first["cu_seq_lens_q"], cu_seq_lens_k=first["cu_seq_lens_k"],
                 max_length_q=first["max_length_q"], max_length_k=first["max_length_k"])
    monkeypatch.setenv("HASTEN_VERIFY", "1")
    with pytest.raises(StaleMetadataError, match="does not match this batch"):
        model(**stale)
    model(**second)  # consistent metadata passes


def test_padded_batch_falls_back_loudly_and_stays_correct():
    model = _model("llama")
    ids = torch.randint(0, 200, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    expected = model(input_ids=ids, attention_mask=mask).logits
    hasten.accelerate(model)
    got = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.allclose(got[1, :4], expected[1, :4], atol=1e-5)
    assert fallback_counts().get("attention_padded_batch", 0) == 2  # once per layer, warned once
    # with explicit position_ids too (common in evaluation code) it stays a padded batch
    positions = torch.arange(6).expand(2, 6)
    got = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.allclose(got[1, :4], expected[1, :4], atol=1e-5)


def test_packed_batch_with_padding_mask_is_refused():
    model = _model("qwen3")
    hasten.accelerate(model)
    batch = hasten.PackingCollator(max_tokens=64)(_samples(7, [3, 4]))
    batch["attention_mask"] = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match="Drop attention_mask"):
        model(**batch)
    batch["attention_mask"] = torch.ones(1, 7, dtype=torch.long)
    model(**batch)  # an all-ones mask is dropped


def test_generation_with_cache_is_untouched():
    model = _model("qwen3")
    prompt = torch.randint(0, 200, (1, 5))
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False)
    hasten.accelerate(model)
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), expected)


def test_packed_sequence_off_leaves_model_alone():
    model = _model("qwen3")
    handle = hasten.accelerate(model, Config.from_dict({"training": {"packed_sequence": False}}))
    assert model.config._attn_implementation == "sdpa"
    assert any("packed_sequence is false" in item for item in handle.inactive)


def test_rejects_non_transformers_models():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hasten.accelerate(torch.nn.Linear(2, 2))


def test_packed_batch_without_position_ids_is_refused():
    model = _model("qwen3")
    hasten.accelerate(model)
    batch = hasten.PackingCollator(max_tokens=64)(_samples(8, [3, 4]))
    del batch["position_ids"]
    with pytest.raises(ValueError, match="no position_ids"):
        model(**batch)


def test_packed_forward_skips_transformers_packed_row_search(monkeypatch):
    """transformers' find_packed_sequence_indices ends in a host sync; inside a forward hasten
    prepared as packed its result would be thrown away, so it must not run there, and it must
    still run for a model hasten did not touch (and after undo)."""
    from transformers import masking_utils

    import hasten.integrations.transformers as integration
    from tests.tiny_models import MODELS, packed_batch

    calls = []

    def counting(position_ids):
        calls.append(position_ids.shape)
        return None

    # in place of transformers' search before accelerate(), which wraps whatever it finds there
    # when it registers; a fresh registrar, since models of earlier tests may still hold the
    # process's registrations (made before this stand-in was there)
    # accelerated models earlier tests dropped without undo() release the process's registrar when
    # collected: collected now, not during this test, where that release would take hasten's
    # attention name out from under this test's fresh registrar (seen as a KeyError, 2 runs in 9)
    gc.collect()
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    monkeypatch.setattr(integration, "_REGISTRATIONS", integration._Registrations())
    batch = packed_batch()
    plain = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    model = MODELS["qwen3"]()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"fused_cross_entropy": False}}))
    model(**batch)
    model(**plain)  # position_ids only: hasten derives the metadata itself
    assert calls == []
    handle.undo()
    assert masking_utils.find_packed_sequence_indices is counting  # the last undo put it back
    model(**plain, use_cache=False)  # (with a cache transformers skips the search anyway)
    assert len(calls) == 1  # transformers' own search is back for an unpatched model
    assert integration._forward_stack() == []  # every hooked forward left its entry


def test_registered_block_serves_a_bare_moe_block_and_restores_the_registry():
    """Code that picks "hasten_fused" itself, without accelerate() (benchmarks/moe_block.py), gets
    the name for the `registered()` block; after it the registry is what it was (which may hold
    hasten's names for models of earlier tests that were never undone)."""
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    import hasten.integrations.transformers as integration
    from hasten.moe import fused_experts_forward

    config = Qwen3MoeConfig(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():  # a bare block is not initialised (transformers' init is the model's)
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 9, 32)
    config._experts_implementation = "eager"
    want = block(x)
    before = dict(type(ALL_EXPERTS_FUNCTIONS)())
    config._experts_implementation = integration.EXPERTS_NAME
    with integration.registered():
        assert ALL_EXPERTS_FUNCTIONS[integration.EXPERTS_NAME] is fused_experts_forward
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
    after = dict(type(ALL_EXPERTS_FUNCTIONS)())
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
