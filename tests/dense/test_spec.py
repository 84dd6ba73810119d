"""The table's logit spec (hasten/dense/spec.py): which factor the fused loss multiplies the logits
by, where a model's head applies its config's scale in some transformers releases and not others."""

import inspect
import types

from hasten.dense.spec import LogitSpec


def test_a_scale_applies_always_or_only_where_the_forward_names_its_key():
    config = types.SimpleNamespace(logit_scale=0.5, logits_scaling=4.0)
    assert LogitSpec(scale_key="logit_scale").scale(config) == 0.5
    assert LogitSpec(scale_key="logits_scaling", scale_divides=True).scale(config) == 0.25
    wrapper = LogitSpec(scale_key="logit_scale", scale_where_forward_names=True)
    # transformers 5.25's AyaVisionForConditionalGeneration.forward, and 5.24's (lm_head alone)
    assert wrapper.scale(config, "logits = logits * self.config.text_config.logit_scale") == 0.5
    assert wrapper.scale(config, "logits = self.lm_head(hidden_states[:, slice_indices, :])") == 1.0
    assert wrapper.scale(config, None) == 1.0
    assert wrapper.accounted_keys() == {"logit_scale"}


def test_aya_vision_fused_loss_scales_as_this_transformers_head_does():
    """Whichever release is installed: the fused loss reports the logit scale exactly when the
    wrapper's own forward applies it (the zoo's parity tests check the loss and gradients)."""
    import hasten
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES["aya_vision"])
    applies = "logit_scale" in inspect.getsource(type(model).forward)
    handle = hasten.accelerate(model)
    try:
        fused = next(item for item in handle.active if item.startswith("fused cross-entropy"))
        assert ("logit scale 0.5" in fused) == applies, (applies, fused)
    finally:
        handle.undo()


def test_an_entry_the_head_code_disagrees_with_keeps_transformers_loss(monkeypatch):
    """The entry says Cohere's head multiplies by logit_scale; a release whose head no longer names
    it (simulated: the forward's source without it) must not get the scaled fused loss: transformers'
    loss runs, said once with both sides named."""
    import hasten
    from hasten.integrations import transformers as integration
    from hasten.observability import fallback_reasons, reset_fallbacks
    from tests import model_zoo as zoo

    model = zoo.build(zoo.ENTRIES["cohere"])
    getsource = inspect.getsource
    real = getsource(type(model).forward)
    assert "logit_scale" in real
    monkeypatch.setattr(integration.inspect, "getsource",  # the inspect module itself: restored after the test
                        lambda obj: real.replace("logit_scale", "unit") if obj is type(model).forward else getsource(obj))
    reset_fallbacks()
    handle = hasten.accelerate(model)
    try:
        assert not any(item.startswith("fused cross-entropy (LM head") for item in handle.active), handle.report()
        reason = fallback_reasons()["fused_cross_entropy"]
        assert "the table entry applies logit_scale" in reason and "does not name" in reason, reason
    finally:
        handle.undo()
