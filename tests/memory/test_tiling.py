"""Sequence tiling of the MLP (training.checkpoint.mlp_tile_tokens), CPU float32: the loss and
every gradient of a packed batch equal the untiled model's (tiles off block multiples, a
one-token sample, with and without full checkpointing, with LoRA adapters); the MLP keeps only
its input for backward; undo gives the forwards back; routed experts and dropout are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hasten
from hasten.config import Config, ConfigError
from hasten.memory.tiling import install_mlp_tiling, tiled_mlp_forward, tiling_refusal
from hasten.observability import fallback_counts
from tests import model_zoo as zoo


def _config(tile_tokens=0, activations="none"):
    return Config.from_dict({"training": {"checkpoint": {"mlp_tile_tokens": tile_tokens,
                                                         "activations": activations}}})


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(entry, tile_tokens, activations="none", lora=False):
    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES[entry])
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():  # lora_B starts at zero: random values make the update visible
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
    base = model.get_base_model() if lora else model
    handle = hasten.accelerate(base, _config(tile_tokens, activations))
    model.train()
    result = _loss_and_grads(model, zoo.packed_batch(zoo.samples()))
    return result, handle


@pytest.mark.parametrize("entry", ["qwen3", "gemma2"])
@pytest.mark.parametrize("activations", ["none", "full"])
def test_tiled_mlp_gives_the_untiled_loss_and_every_gradient(entry, activations):
    (want_loss, want), reference = _run(entry, 0, activations)
    (loss, grads), handle = _run(entry, 7, activations)
    assert any(item.startswith("MLP sequence tiling (7 tokens per tile") for item in handle.active), handle.report()
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    handle.undo()
    reference.undo()


@pytest.mark.parametrize("activations", ["none", "full"])
def test_tiled_mlp_under_lora_gives_the_adapters_gradients(activations):
    """Under LoRA the first layer's MLP input needs no gradient (frozen embeddings and norms)."""
    (want_loss, want), reference = _run("llama", 0, activations, lora=True)
    (loss, grads), handle = _run("llama", 5, activations, lora=True)
    assert any(item.startswith("MLP sequence tiling") for item in handle.active)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want.keys() and any("mlp" in name and "lora_A" in name for name in want)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


class _MLP(nn.Module):
    def __init__(self, hidden=6, intermediate=40):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


def _saved_bytes(fn):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


@pytest.mark.parametrize("tokens", [1, 9, 10, 23])
def test_only_the_input_is_saved_and_the_gradients_match(tokens):
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(1, tokens, 6, requires_grad=True)
    want_out, untiled_bytes = _saved_bytes(lambda: mlp(x))
    want = torch.autograd.grad(want_out.square().sum(), [x, *mlp.parameters()])
    got_out, tiled_bytes = _saved_bytes(lambda: tiled_mlp_forward(mlp, mlp.forward, x, tile_tokens=4))
    got = torch.autograd.grad(got_out.square().sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(got_out, want_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    if tokens > 4:  # tiled: the input, [tokens, 6] float32, and nothing of the [tokens, 40] intermediate
        assert tiled_bytes == tokens * 6 * 4 < untiled_bytes


def test_undo_gives_the_forwards_back_and_experts_and_dropout_are_refused():
    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES["qwen3"])
    mlps = [layer.mlp for layer in model.model.layers]
    before = [mlp.__dict__.get("forward") for mlp in mlps]
    undo, count, refused = install_mlp_tiling(model, 8)
    assert count == len(mlps) and not refused
    assert all("forward" in mlp.__dict__ for mlp in mlps)
    undo()
    assert [mlp.__dict__.get("forward") for mlp in mlps] == before
    moe = zoo.build(zoo.ENTRIES["qwen3_moe"])
    undo, count, refused = install_mlp_tiling(moe, 8)
    sparse = [layer for layer in moe.model.layers if not type(layer.mlp).__name__.endswith("MLP")]
    assert sparse and count == len(moe.model.layers) - len(sparse)  # the zoo case has a dense layer too
    assert any("not a dense MLP" in reason for reason in refused)
    undo()
    assert tiling_refusal(_MLP()) is None
    named = type("DropoutMLP", (_MLP,), {})()
    named.drop = nn.Dropout(0.1)
    assert "applies dropout" in tiling_refusal(named)


def test_a_model_with_experts_reports_the_untiled_blocks():
    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES["qwen3_moe"])
    handle = hasten.accelerate(model, _config(8))
    assert any("MLP sequence tiling" in item and "not a dense MLP" in item for item in handle.inactive)
    assert fallback_counts().get("mlp_tiling", 0) >= 1
    handle.undo()


@pytest.mark.parametrize("raw,message", [
    ({"checkpoint": {"mlp_tile_tokens": -1}}, "must be 0 \\(no tiling\\) or a number of tokens"),
    ({"checkpoint": {"mlp_tile_tokens": 4096}, "compile": True}, "mlp_tile_tokens` \\(the tiled MLP loops"),
])
def test_bad_tiling_config_is_refused(raw, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"training": raw})


def test_an_moe_block_named_mlp_is_not_tiled():
    """gpt-oss's GptOssMLP holds a router and experts and returns its router scores too."""
    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES["gpt_oss"])
    undo, count, refused = install_mlp_tiling(model, 4)
    assert count == 0 and refused == ["GptOssMLP is not a dense MLP (routed experts are not tiled)"]
    undo()


def test_the_recompute_runs_under_the_forwards_autocast():
    """Mixed precision on float32 weights (autocast, bf16): the tiles recomputed in backward run in
    bf16 as the forward did (seen inside the MLP), and the gradients equal the untiled MLP's."""
    torch.manual_seed(0)
    mlp = _MLP()
    seen = []
    mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    x = torch.randn(1, 23, 6, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out = mlp(x)
        got_out = tiled_mlp_forward(mlp, mlp.forward, x, tile_tokens=5)
    assert got_out.dtype == want_out.dtype == torch.bfloat16
    want = torch.autograd.grad(want_out.float().square().sum(), [x, *mlp.parameters()])
    seen.clear()
    got = torch.autograd.grad(got_out.float().square().sum(), [x, *mlp.parameters()])
    assert seen == [torch.bfloat16] * 5  # five tiles of 5 for 23 tokens, recomputed under autocast
    torch.testing.assert_close(got_out, want_out)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


class _Layer(nn.Module):
    """A decoder layer's tail: norm, MLP, residual add (nothing saved after the MLP), or with a norm
    on the MLP output (Gemma 2's post-feedforward norm: it saves the MLP output)."""

    def __init__(self, post_norm: bool):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(6), _MLP()
        self.post_norm = nn.LayerNorm(6) if post_norm else nn.Identity()

    def forward(self, x):
        return x + self.post_norm(self.mlp(self.norm(x)))


@pytest.mark.parametrize("post_norm", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
def test_a_checkpointed_layer_does_not_run_the_tiles_in_its_recompute(post_norm, x_grad):
    """Under non-reentrant checkpointing (early stop on, torch's default), a layer whose MLP is the
    last thing to save anything stops its recompute before the tiles: the MLP runs once per tile in
    forward and once per tile in backward (2 x 5 tiles of 23 tokens), not a third time; with a norm
    after the MLP the recompute must run the tiles (3 x 5), and the gradients match either way.
    x_grad False: the layer's input needs no gradient (a LoRA model's first layer)."""
    torch.manual_seed(0)
    layer = _Layer(post_norm)
    calls, untiled = [], layer.mlp.forward

    def run(x):
        calls.append(x.shape[0])
        return untiled(x)

    layer.mlp.forward = lambda x: tiled_mlp_forward(layer.mlp, run, x, tile_tokens=5)
    x = torch.randn(1, 23, 6, requires_grad=x_grad)
    params = list(layer.parameters())
    out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    got = torch.autograd.grad(out.square().sum(), ([x] if x_grad else []) + params)
    assert calls == [5, 5, 5, 5, 3] * (3 if post_norm else 2)
    del layer.mlp.forward
    want = torch.autograd.grad(layer(x).square().sum(), ([x] if x_grad else []) + params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
