"""Every model type hasten patches, and the ones it must refuse, against the unpatched model run one
sample at a time (float32 on the CPU: the only difference allowed is summation order).

Each type of tests/model_zoo.py has its family's features on at values where an omission shows
(a window shorter than the samples, a softcap of 1, random sinks, logit scaling...): the test
first checks that switching the feature off moves the reference far past the tolerance, so it
could see the feature dropped."""

import pytest
import torch

from hasten.integrations.transformers import PackedBatchRefused
from hasten.observability import fallback_reasons
from tests import model_zoo as zoo

# float32, same math, other summation order: errors of 1e-7..1e-6 seen; 100x headroom below what a
# dropped feature gives (the feature-off check demands 100x the tolerance)
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4


def _attention_outcome(handle) -> str:
    if handle.packing_refusal is not None:
        return "refused"
    if any(item.startswith("varlen attention (packed") for item in handle.active):
        return "hasten"
    assert any(item.startswith("varlen attention (") for item in handle.inactive), handle.report()
    return "transformers"


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_packed_batch_equals_each_sample_alone_or_is_refused(name):
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    reference = zoo.build(entry)
    patched = zoo.clone(reference)
    want_loss, want = zoo.per_sample_reference(reference, batch_samples)

    if entry.attention == "refused":
        with pytest.raises(PackedBatchRefused, match="packed_sequence: false"):
            zoo.packed_run(patched, batch_samples)
        handle = patched._hasten_test_handle if hasattr(patched, "_hasten_test_handle") else None
        return
    handle, loss, got = zoo.packed_run(patched, batch_samples)
    assert _attention_outcome(handle) == entry.attention, handle.report()
    assert abs(float(loss) - float(want_loss)) <= LOSS_TOLERANCE, (float(loss), float(want_loss))
    errors = zoo.relative_errors(got, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_TOLERANCE, f"{name}: gradient of {worst} off by {errors[worst]:.2e}"


@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.feature_off or e.tensor_feature_off))
def test_the_features_are_visible_at_these_values(name):
    """Without this, a parity test that passes could be one that cannot fail."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    want_loss, want = zoo.per_sample_reference(zoo.build(entry), batch_samples)
    off = zoo.build(entry, **entry.feature_off)
    if entry.tensor_feature_off is not None:
        entry.tensor_feature_off(off)
    off_loss, off_grads = zoo.per_sample_reference(off, batch_samples)
    errors = zoo.relative_errors(off_grads, want)
    assert max(errors.values()) > 100 * GRAD_TOLERANCE, f"{name}: switching the feature off changes little"


@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention == "refused"))
def test_stateful_models_refuse_packing_but_train_padded_batches_exactly(name):
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples(lengths=(7, 1, 19, 12))
    reference = zoo.build(entry)
    patched = zoo.clone(reference)
    want_loss, want = zoo.per_sample_reference(reference, batch_samples)
    import hasten

    handle = hasten.accelerate(patched)
    assert handle.packing_refusal and "carry state along the sequence" in handle.packing_refusal
    assert "packing_refused_stateful_layers" in fallback_reasons()
    assert not any(item.startswith("varlen attention (packed") for item in handle.active)
    loss = patched(**zoo.padded_batch(batch_samples)).loss
    loss.backward()
    assert abs(float(loss) - float(want_loss)) <= LOSS_TOLERANCE
    errors = zoo.relative_errors(zoo.gradients(patched), want)
    assert max(errors.values()) <= GRAD_TOLERANCE, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_undo_restores_the_model_exactly(name):
    entry = zoo.ENTRIES[name]
    model = zoo.build(entry).eval()
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    before = model(input_ids=ids).logits
    implementation = model.config._attn_implementation
    import hasten

    handle = hasten.accelerate(model)
    handle.undo()
    assert model.config._attn_implementation == implementation
    assert not any("forward" in m.__dict__ or "_hasten_attention" in m.__dict__ for m in model.modules())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.equal(model(input_ids=ids).logits, before)
