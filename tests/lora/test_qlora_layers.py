"""PEFT's 4-bit LoRA layers (QLoRA: a bitsandbytes NF4 base) on hasten's fused LoRA path (CPU):
the same output and adapter gradients as PEFT's own layer within bf16 rounding (both dequantize
the same NF4 weight; PEFT runs the adapters in float32, hasten in bf16), the dequantized weight
not kept for the backward, and a float32 compute dtype left to PEFT."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

from hasten.lora import install_fused_lora, lora_layers  # noqa: E402


class TwoLayers(torch.nn.Module):
    """Two 4-bit projections, as PEFT sees a model loaded in 4 bits (is_loaded_in_4bit)."""

    is_loaded_in_4bit = True

    def __init__(self, compute_dtype=torch.bfloat16):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = self._linear4bit(64, 96, compute_dtype, gen)
        self.down = self._linear4bit(96, 48, compute_dtype, gen)

    @staticmethod
    def _linear4bit(n_in, n_out, compute_dtype, gen):
        layer = bnb.nn.Linear4bit(n_in, n_out, bias=True, compute_dtype=compute_dtype, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit((torch.randn(n_out, n_in, generator=gen) * 0.1).bfloat16(),
                                         requires_grad=False, quant_type="nf4")
        layer.bias = torch.nn.Parameter(torch.randn(n_out, generator=gen).bfloat16(), requires_grad=False)
        return layer.to("cpu")  # quantizes

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _peft(compute_dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = peft.get_peft_model(TwoLayers(compute_dtype), peft.LoraConfig(r=8, lora_alpha=16,
                                                                          target_modules=["up", "down"]))
    with torch.no_grad():
        for layer in lora_layers(model):
            layer.lora_B["default"].weight.normal_(std=0.1)
    return model


def _run(model, x):
    model.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    y = model(leaf)
    y.float().square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return y.detach().float(), leaf.grad.float(), grads


def test_fused_4bit_layers_match_peft_within_bf16_rounding():
    model = _peft()
    layers = lora_layers(model)
    assert {type(m).__module__ for m in layers} == {"peft.tuners.lora.bnb"}  # PEFT's QLoRA class
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = _run(model, x)
    undo, count, _grouped, refused = install_fused_lora(model)
    assert count == 2 and not refused
    got = _run(model, x)
    for name, g, w in [("y", got[0], want[0]), ("dx", got[1], want[1])] + [
            (n, got[2][n], want[2][n]) for n in want[2]]:
        assert float((g - w).norm() / w.norm()) < 2e-2, name
    undo()


def test_the_dequantized_weight_is_not_kept_for_the_backward():
    model = _peft()
    install_fused_lora(model)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(x)
    assert not any(t.shape in ((96, 64), (48, 96)) for t in kept)  # no (out, in) weight saved


def test_a_float32_compute_dtype_is_left_to_peft():
    model = _peft(compute_dtype=torch.float32)
    _, count, _grouped, refused = install_fused_lora(model)
    assert count == 0 and any("bnb_4bit_compute_dtype" in reason for reason in refused)


class QuantMLP(torch.nn.Module):
    """A Llama-layout MLP loaded in 4 bits (gate, up and down projections in NF4, bf16 compute)."""

    is_loaded_in_4bit = True

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.gate_proj = TwoLayers._linear4bit(64, 96, torch.bfloat16, gen)
        self.up_proj = TwoLayers._linear4bit(64, 96, torch.bfloat16, gen)
        self.down_proj = TwoLayers._linear4bit(96, 64, torch.bfloat16, gen)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("with_lora", [False, True])
def test_a_4bit_gated_mlp_is_checked_in_its_compute_dtype(with_lora):
    """The fused SwiGLU's check feeds the projections their compute dtype (bf16), not the packed
    weight's uint8: W4-Q on the H200 reported 'LlamaMLP could not be checked (silu_cuda not
    implemented for Byte)' and left its MLPs unfused. A formula that differs is still refused."""
    from hasten.dense.patch import gated_mlp_mismatch

    mlp = QuantMLP()
    if with_lora:
        mlp = peft.get_peft_model(mlp, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj",
                                                                                            "down_proj"]))
        mlp = mlp.get_base_model()
    assert gated_mlp_mismatch(mlp) is None
    scaled = type("ScaledMLP", (QuantMLP,), {"forward": lambda self, x: 2 * QuantMLP.forward(self, x)})()
    assert "computes something other" in gated_mlp_mismatch(scaled)
