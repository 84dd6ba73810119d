"""Gemma 4 unified (and Gemma 4) under use_bidirectional_attention="vision", the unified default:
text is causal, so hasten's varlen attention runs text-only packed batches (the parity cases in
tests/model_zoo.py); image tokens attend to their own block both ways, so packed batches with media
are refused and padded ones run transformers' masks exactly. The wrappers pass `labels` down to
their decoder, whose attention call must take them as inert."""

import pytest
import torch

import hasten
from hasten.integrations.transformers import PackedBatchRefused
from tests import model_zoo as zoo


@pytest.mark.parametrize("media", ["pixel_values", "pixel_values_videos", "input_features", "mm_encoder_outputs",
                                   "mm_token_type_ids"])
def test_gemma4_unified_refuses_packed_media(media):
    model = zoo.build(zoo.ENTRIES["gemma4_unified"])
    handle = hasten.accelerate(model)
    assert any(item.startswith("varlen attention (packed") for item in handle.active), handle.report()
    batch = zoo.packed_batch(zoo.samples())
    marked = torch.zeros_like(batch["input_ids"])
    marked[0, 3:5] = 1
    value = {"pixel_values": torch.zeros(1, 4, 192), "pixel_values_videos": torch.zeros(1, 4, 192),
             "input_features": torch.zeros(1, 4, 8), "mm_encoder_outputs": {"image": None},
             "mm_token_type_ids": marked}[media]
    with pytest.raises(PackedBatchRefused, match="training.packed_sequence: false"):
        model(**batch, **{media: value})
    handle.undo()


def test_gemma4_unified_padded_image_batch_attends_both_ways_exactly():
    """A padded batch with an image (4 tokens marked in mm_token_type_ids) under hasten: the image
    block's two-way attention (which moves the reference) is transformers' mask, unchanged."""
    entry = zoo.ENTRIES["gemma4_unified"]
    reference = zoo.build(entry)
    model = zoo.clone(reference)
    image = reference.config.image_token_id
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, zoo.VOCAB, (2, 16), generator=gen)
    ids[0, 4:8] = image
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    labels = ids.masked_fill((mask == 0) | (ids == image), -100)
    pixels = dict(pixel_values=torch.randn(1, 4, 8 * 8 * 3, generator=gen),
                  image_position_ids=torch.tensor([[[0, 0], [1, 0], [0, 1], [1, 1]]]))

    def run(net, marked=True):
        net.zero_grad(set_to_none=True)
        loss = net(input_ids=ids, attention_mask=mask, labels=labels,
                   mm_token_type_ids=(ids == image).long() if marked else None, **pixels).loss
        loss.backward()
        return loss.detach(), zoo.gradients(net)

    want_loss, want = run(reference)
    _, causal = run(reference, marked=False)
    assert max(zoo.relative_errors(causal, want).values()) > 1e-2  # the two-way image block shows
    hasten.accelerate(model)
    loss, got = run(model)
    assert abs(float(loss) - float(want_loss)) < 1e-5
    assert max(zoo.relative_errors(got, want).values()) < 1e-4


@pytest.mark.parametrize("name", ["gemma4", "gemma4_unified"])
def test_wrappers_evaluate_with_labels(name):
    """Their forward hands `labels` to the decoder, and on to the attention call (outside training
    the fused loss does not take them first)."""
    reference = zoo.build(zoo.ENTRIES[name])
    model = zoo.clone(reference)
    handle = hasten.accelerate(model)
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    with torch.no_grad():
        assert abs(float(model(input_ids=ids, labels=ids).loss - reference(input_ids=ids, labels=ids).loss)) < 1e-5
    handle.undo()
