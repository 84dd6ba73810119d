"""torch.compile of hasten-patched models (CPU, float32): no graph break inside a decoder layer with
packed batches, hasten's attention, dense kernels and fused experts on; a fullgraph layer gives
eager's output and gradients; batches of other token counts and longest sequences reuse the graph;
the whole model compiles (with breaks outside the layers) and gives eager's loss and gradients.

Tiny models (2 layers, hidden 64) keep the file near a minute on two cores: compile time is most
of it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import hasten
from hasten.config import Config
from hasten.observability import fallback_counts, reset_fallbacks

VOCAB = 211
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=96, **SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=96, **SMALL)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                                            num_experts=4, num_experts_per_tok=2, **SMALL)),
    # the same MoE model with its routers on hasten::moe_route (training.moe.fused_router)
    "qwen3_moe_router": lambda: MODELS["qwen3_moe"](),
}
SETTINGS = {"qwen3_moe_router": {"training": {"moe": {"fused_router": True}}}}
# The compiler backend of the parity tests: inductor (training.compile's) for the MoE layer, which
# holds every kind of hasten op (norms, rotary, experts, the host-loop fallbacks); the dense
# layers' inductor graph is the embedded Qwen3 that tests/training/test_train_compile.py trains.
# aot_eager for llama and qwen3: the same dynamo trace, guards and autograd graphs, without the C++
# builds that take most of a cold compile on two cores (inductor for all three: about 65 s).
BACKEND = {"llama": "aot_eager", "qwen3": "aot_eager", "qwen3_moe": "inductor", "qwen3_moe_router": "aot_eager"}
# packed batches of other token counts, sequence counts and longest sequences; one-token samples
BATCHES = [(7, 1, 19, 12), (3, 30, 1), (5, 5, 5, 5, 5, 5, 2), (40, 1, 1, 9, 2)]


def _batch(lengths, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in lengths]
    return hasten.PackingCollator(max_tokens=64)(samples)


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


def _layer_calls(model, lengths) -> list[tuple[tuple, dict]]:
    """What each decoder layer receives in a packed forward of the patched model: hidden states,
    hasten's BandMask, rotary cos/sin, position_ids and the collator's cu_seq_lens / max_length."""
    calls = []

    def record(module, args, kwargs):
        calls.append((_detached(args), {k: _detached(v) for k, v in kwargs.items()}))

    hooks = [layer.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    batch = _batch(lengths)
    batch.pop("labels")
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return calls


def _run(layer, call, forward=None):
    """The layer's output (through `forward`, default the layer itself) and the gradients of its
    input and parameters, for one upstream gradient."""
    args, kwargs = call
    hidden = args[0].clone().requires_grad_()
    out = (layer if forward is None else forward)(hidden, *args[1:], **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = list(layer.parameters())
    grads = torch.autograd.grad(out, [hidden, *params], upstream, allow_unused=True)
    return out.detach(), grads


def _assert_same(got, want, what):
    got_out, got_grads = got
    want_out, want_grads = want
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6, msg=f"{what}: output")
    assert len(got_grads) == len(want_grads)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert (g is None) == (w is None), f"{what}: gradient {i}"
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{what}: gradient {i}")


@pytest.fixture(scope="module", params=list(MODELS))
def patched(request):
    torch.manual_seed(0)
    model = MODELS[request.param]()
    handle = hasten.accelerate(model, Config.from_dict(SETTINGS.get(request.param, {})))
    active = " | ".join(handle.active)
    assert ("fused MoE routers" in active) == (request.param == "qwen3_moe_router"), active
    assert "varlen attention" in active and "RMSNorm" in active and "RoPE" in active, active
    # Qwen3's attention rewritten onto hasten::rms_norm_rope (kernels.fused_qk_norm_rope); the
    # shared-input projections (kernels.fused_linear_groups) run one by one under compile
    assert ("head RMSNorm + RoPE" in active) == request.param.startswith("qwen3"), active
    assert "shared-input projections" in active, active
    assert ("fused MoE experts" if request.param.startswith("qwen3_moe") else "SwiGLU MLP") in active, active
    calls = [_layer_calls(model, lengths) for lengths in BATCHES]  # per batch, per layer
    yield request.param, model, calls
    handle.undo()


def test_no_graph_break_inside_any_decoder_layer(patched):
    name, model, calls = patched
    for index, layer in enumerate(model.model.layers):
        torch._dynamo.reset()
        args, kwargs = calls[0][index]
        explained = torch._dynamo.explain(layer)(*args, **kwargs)
        reasons = [b.reason.splitlines()[0] for b in explained.break_reasons]
        assert explained.graph_break_count == 0 and explained.graph_count == 1, f"{name} layer {index}: {reasons}"


def test_fullgraph_layers_match_eager_across_batches_without_recompiling(patched):
    """Both layers through one fullgraph compile (dynamic shapes, as training.compile uses it): four
    packed batches of other token counts and longest sequences, each with eager's output and
    gradients, and one graph compiled for all of them (the layers share it)."""
    name, model, calls = patched
    torch._dynamo.reset()
    counters.clear()
    reset_fallbacks()
    compiled = torch.compile(lambda layer, *a, **k: layer(*a, **k), fullgraph=True, dynamic=True,
                             backend=BACKEND[name])
    for lengths, per_layer in zip(BATCHES, calls):
        for index, layer in enumerate(model.model.layers):
            want = _run(layer, per_layer[index])
            got = _run(layer, per_layer[index], lambda *a, **k: compiled(layer, *a, **k))
            _assert_same(got, want, f"{name} layer {index}, batch {lengths}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    # the CPU fallbacks are still said and counted (at trace time) under compile
    assert "attention_per_sequence" in fallback_counts()


def test_default_compile_recompiles_at_most_once_for_new_lengths(patched):
    """torch.compile's default (dynamic=None): the first batch compiles static shapes, the second
    recompiles with dynamic ones, and no later batch compiles again, however its token count or
    longest sequence (max_length_q, a host int) differ."""
    name, model, calls = patched
    layer = model.model.layers[0]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")  # dynamo's guards alone decide
    for per_layer in calls[:2]:
        _run(layer, per_layer[0], compiled)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for per_layer in calls[2:]:
            _run(layer, per_layer[0], compiled)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_whole_model_compiles_and_matches_eager():
    """torch.compile(model), not fullgraph: the model-level host work (hasten's mask reading,
    transformers' output capturing) breaks the graph outside the layers; loss, gradients and the
    experts' load counts are eager's. aot_eager: what the whole model adds to the layers is
    dynamo's handling of the model-level code (the layers' inductor graphs are tested above)."""
    torch.manual_seed(0)
    reference = MODELS["qwen3_moe"]()
    model = copy.deepcopy(reference)
    handles = [hasten.accelerate(m, Config()) for m in (reference, model)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    want = reference(**_batch(BATCHES[0], seed=3)).loss
    want.backward()
    got = compiled(**_batch(BATCHES[0], seed=3)).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (pname, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=pname)
    assert int(model.model.layers[1].mlp.experts._hasten_moe_tokens.sum()) == 39 * 2  # 39 tokens x top-2, once
    for handle in handles:
        handle.undo()
