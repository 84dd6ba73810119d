"""The residual add fused with the RMSNorm after it (kernels.fused_residual): the decoder layer's
own forward rewritten on its `h = residual + h; residual = h; h = self.<norm>(h)` runs, and on its
`residual = h; h = self.<norm>(h)` pairs (the norm passes its input through as a view whose
gradient its backward kernel adds), the rest of it (the attention's and MLP's calls, decorators)
the model's own; classes whose residual stream is written otherwise keep their forward, said once.
Every packed zoo type with it on: tests/integrations/test_model_parity.py."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import hasten
from hasten.config import Config
from hasten.dense.residual import NORM_SPEC_ATTRIBUTE, add_norm, fused_forward, install_fused_residual, norm_passing
from hasten.dense.spec import NormSpec
from hasten.ops.dense import rms_norm
from tests.tiny_models import MODELS, packed_batch

ON = Config.from_dict({"kernels": {"fused_residual": True}})


class _Norm(nn.Module):
    def __init__(self, hidden: int, patched: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(hidden))
        self.variance_epsilon = 1e-6
        if patched:  # as install_fused_norms leaves a norm it patched
            self.forward = lambda x: rms_norm(x, self.weight, self.variance_epsilon)
            setattr(self, NORM_SPEC_ATTRIBUTE, NormSpec())

    def forward(self, x):
        return rms_norm(x, self.weight, self.variance_epsilon)


def _renamed(old: str, new: str):
    """A kwarg-renaming decorator like transformers' deprecate_kwarg: must survive the rewrite."""
    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return wrapper
    return decorate


class _Layer(nn.Module):
    """Two fusable runs, the second written `h + r`, a decorator, an attention call with kwargs."""

    def __init__(self, hidden=16):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _Norm(hidden), _Norm(hidden)
        self.pre_mlp_layernorm = _Norm(hidden)
        self.attn, self.mlp = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    @_renamed("scale_old", "scale")
    def forward(self, hidden_states, scale=1.0):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.attn(hidden_states) * scale
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.pre_mlp_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        return hidden_states


class _Multiplied(_Layer):
    def forward(self, hidden_states):  # a residual multiplier, norms called inline: neither pattern
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = residual + hidden_states * 0.5
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class _CallsSuper(_Layer):
    def forward(self, hidden_states):  # super(): a closure cell the recompiled forward cannot carry
        return super().forward(hidden_states)


class _ResidualChangedInPlace(_Layer):
    def forward(self, hidden_states):  # `residual` changed in place after its pair: not rewritten
        skip = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.attn(hidden_states) + skip
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        residual = residual * 2
        residual.mul_(0.5)
        residual += 1.0
        return hidden_states + residual


class _Inherited(_Layer):
    pass


class _NamedBranch(_Layer):
    def forward(self, hidden_states):  # Llama 4: the attention's output keeps its own name
        residual = hidden_states
        attention_states = self.attn(self.input_layernorm(hidden_states))
        hidden_states = residual + attention_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states) + attention_states


def _loss_and_grads(layer, x, **kwargs):
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = layer(leaf, **kwargs)
    loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
    loss.backward()
    return out.detach(), [leaf.grad] + [p.grad for p in layer.parameters()]


def test_the_rewrite_fuses_every_run_and_keeps_the_rest_of_the_forward():
    torch.manual_seed(0)
    layer = _Layer()
    x = torch.randn(2, 5, 16)
    want, want_grads = _loss_and_grads(layer, x, scale_old=0.5)  # through the decorator
    fused = {id(m) for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_mlp_layernorm)}
    undo, count, passing, reasons = install_fused_residual([layer], fused)
    assert (count, passing, reasons) == (1, 1, [])
    _, norms, passed, _ = fused_forward(_Layer, frozenset({"post_attention_layernorm", "pre_mlp_layernorm",
                                                           "input_layernorm"}))
    assert norms == ["input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm"]
    assert passed == ["input_layernorm"]
    got, got_grads = _loss_and_grads(layer, x, scale_old=0.5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    undo()
    assert "forward" not in layer.__dict__


def test_the_fused_op_runs_where_the_rewrite_calls_it(monkeypatch):
    import hasten.dense.residual as residual

    seen, passing = [], []
    real, real_passing = residual.add_rms_norm, residual.rms_norm_passing_input
    monkeypatch.setattr(residual, "add_rms_norm", lambda *a: seen.append(a[0].shape) or real(*a))
    monkeypatch.setattr(residual, "rms_norm_passing_input", lambda *a: passing.append(a[0].shape) or real_passing(*a))
    layer = _Layer()
    install_fused_residual([layer], {id(m) for m in layer.modules() if isinstance(m, _Norm)})
    layer(torch.randn(1, 3, 16, requires_grad=True))
    assert seen == [(1, 3, 16), (1, 3, 16)] and passing == [(1, 3, 16)]
    with torch.no_grad():  # nothing to pass a gradient to: the norm as written
        layer(torch.randn(1, 3, 16))
    assert len(passing) == 1


def test_layers_written_otherwise_keep_their_forward_and_say_why():
    layer = _Multiplied()
    undo, count, _, reasons = install_fused_residual([layer], {id(m) for m in layer.modules() if isinstance(m, _Norm)})
    assert count == 0 and "forward" not in layer.__dict__
    assert reasons == ["_Multiplied.forward has no `h = residual + h; residual = h; h = self.<norm>(h)` and no "
                       "`residual = h; h = self.<norm>(h)` to fuse (its residual stream is written otherwise)"]
    undo()


def test_a_forward_the_rewrite_cannot_carry_keeps_its_forward_and_says_why():
    layer = _CallsSuper()
    undo, count, passing, reasons = install_fused_residual([layer], {id(m) for m in layer.modules()
                                                                     if isinstance(m, _Norm)})
    assert (count, passing, "forward" in layer.__dict__) == (0, 0, False)
    assert reasons == ["_CallsSuper.forward uses super() (a closure the rewrite cannot carry)"]
    undo()


def test_a_residual_changed_in_place_keeps_its_pair_as_written():
    """A view a custom Function returned refuses in-place changes: a pair whose residual name is
    changed in place anywhere after it (`+=`, a method ending in `_`; by name, not by flow) stays as
    written; the other pair is fused."""
    norms = frozenset({"input_layernorm", "post_attention_layernorm"})
    _, fused, _, _ = fused_forward(_ResidualChangedInPlace, norms)
    assert fused == ["input_layernorm"]  # its outputs and gradients: the next test


def test_a_norm_hasten_did_not_patch_is_not_fused():
    layer = _Layer()  # only the first norm is hasten's: the runs on the other two stay as written
    undo, count, _, reasons = install_fused_residual([layer], {id(layer.input_layernorm)})
    assert count == 1 and not reasons
    _, norms, _, _ = fused_forward(_Layer, frozenset({"input_layernorm"}))
    assert norms == ["input_layernorm"]
    undo()


@pytest.mark.parametrize("cls", [_Inherited, _NamedBranch, _ResidualChangedInPlace])
def test_an_inherited_forward_and_a_named_branch(cls):
    """An inherited forward compiles in the namespace it was written in; a branch with its own
    name (Llama 4's attention_states) is fused and keeps its value for later statements; a layer
    with one pair left as written (in-place changes) gives the outputs and gradients it gave."""
    layer = cls()
    x = torch.randn(1, 4, 16)
    want, want_grads = _loss_and_grads(layer, x)
    undo, count, _, _ = install_fused_residual([layer], {id(m) for m in layer.modules() if isinstance(m, _Norm)})
    got, got_grads = _loss_and_grads(layer, x)
    assert count == 1
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    undo()


@pytest.mark.parametrize("case", ["hook", "dtype", "unpatched"])
def test_add_norm_runs_the_statements_as_written_where_the_op_would_differ(case, monkeypatch):
    import hasten.dense.residual as residual

    monkeypatch.setattr(residual, "add_rms_norm", lambda *a: pytest.fail("the fused op ran"))
    norm = _Norm(8, patched=case != "unpatched")
    x, r = torch.randn(2, 8), torch.randn(2, 8)
    if case == "hook":
        norm.register_forward_hook(lambda module, args, out: out * 2)
    if case == "dtype":  # float32 activations, a bf16 weight: the patched norm's own fallback case
        norm.weight.data = norm.weight.data.bfloat16()
        norm.forward = lambda t: t * norm.weight.float()
    y, total = add_norm(norm, x, r)
    assert torch.equal(total, r + x)
    assert torch.equal(y, norm(r + x))
    monkeypatch.setattr(residual, "rms_norm_passing_input", lambda *a: pytest.fail("the passing op ran"))
    leaf = x.clone().requires_grad_()
    y, passed = norm_passing(norm, leaf)
    assert passed is leaf and torch.equal(y, norm(leaf))


def test_norm_passing_gives_the_statements_gradients():
    """rms_norm_passing_input: the normed output and the view, and x's gradient through both (the
    view's added in the norm's backward) and the weight's, as `residual = h; h = norm(h)` gives them;
    only the view used, or only the output."""
    from hasten.ops.dense import rms_norm_passing_input

    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 7, 24, generator=gen), torch.randn(24, generator=gen)
    up_y, up_r = torch.randn(3, 7, 24, generator=gen), torch.randn(3, 7, 24, generator=gen)
    for uses in ("both", "view", "output"):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        refs = [t.clone().requires_grad_() for t in (x, w)]
        y, passed = rms_norm_passing_input(leaves[0], leaves[1], 1e-6, 0.5)
        want_y, want_r = rms_norm(refs[0], refs[1], 1e-6, 0.5), refs[0]
        torch.testing.assert_close(y, want_y, rtol=0, atol=0)
        assert torch.equal(passed, leaves[0]) and passed._base is leaves[0]
        loss = {"both": (y * up_y).sum() + (passed * up_r).sum(), "view": (passed * up_r).sum(),
                "output": (y * up_y).sum()}[uses]
        want = {"both": (want_y * up_y).sum() + (want_r * up_r).sum(), "view": (want_r * up_r).sum(),
                "output": (want_y * up_y).sum()}[uses]
        loss.backward()
        want.backward()
        torch.testing.assert_close(leaves[0].grad, refs[0].grad, msg=uses)
        if uses == "view":
            assert leaves[1].grad is None or torch.equal(leaves[1].grad, torch.zeros_like(w))
        else:
            torch.testing.assert_close(leaves[1].grad, refs[1].grad, msg=uses)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_accelerate_reports_the_fused_layers_and_undo_restores_them(name):
    torch.manual_seed(0)
    model = MODELS[name]().train()
    reference = MODELS[name]().train()
    reference.load_state_dict(model.state_dict())
    handle = hasten.accelerate(model, ON)
    fused = [item for item in handle.active if item.startswith("fused kernels")]
    assert fused and "residual add + RMSNorm x" in fused[0], handle.report()
    batch = packed_batch()
    off = hasten.accelerate(reference, Config())
    loss, want = model(**batch).loss, reference(**batch).loss
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    handle.undo()
    off.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_on_by_default_and_off_by_its_switch():
    model = MODELS["llama"]()
    handle = hasten.accelerate(model, Config())
    assert any("residual add + RMSNorm" in item for item in " ".join(handle.active).split(", ")), handle.active
    handle.undo()
    handle = hasten.accelerate(model, Config.from_dict({"kernels": {"fused_residual": False}}))
    assert not any("residual add" in item for item in handle.active), handle.active
    handle.undo()


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_input_norms_passing_switch_gives_the_models_loss_and_gradients(name, monkeypatch):
    """kernels.fused_residual_grad (off by default): each layer's input norm passes its input through
    (rms_norm_passing_input runs once per layer), and the packed loss and every gradient are those
    of the model with the switch off."""
    import hasten.dense.residual as residual

    torch.manual_seed(0)
    model = MODELS[name]().train()
    reference = MODELS[name]().train()
    reference.load_state_dict(model.state_dict())
    calls = []
    real = residual.rms_norm_passing_input
    monkeypatch.setattr(residual, "rms_norm_passing_input", lambda *a: calls.append(1) or real(*a))
    on = hasten.accelerate(model, Config.from_dict({"kernels": {"fused_residual_grad": True}}))
    off = hasten.accelerate(reference, Config.from_dict({"kernels": {"fused_residual_grad": False}}))
    batch = packed_batch()
    loss, want = model(**batch).loss, reference(**batch).loss
    loss.backward()
    want.backward()
    assert len(calls) == model.config.num_hidden_layers
    assert any(f"input RMSNorm passing its input x{len(calls)}" in item for item in on.active), on.active
    assert not any("passing its input" in item for item in off.active), off.active
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    on.undo()
    off.undo()
