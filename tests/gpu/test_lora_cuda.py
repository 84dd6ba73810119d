"""hasten's fused LoRA on the GPU against PEFT's own LoRA layers.

hasten::lora_linear computes the LoRA path in the base's bf16 (float32 adapters cast for the GEMMs,
their gradients taken from the GEMM's float32 accumulator), as PEFT does with bf16 adapters;
PEFT's default float32 adapters compute it in float32. So the yardsticks are: for one layer,
PEFT's layer with bf16 adapters against the float64 layer; for a model, the unpatched bf16 PEFT
model (float32 adapters) against the float32 one, the bf16 noise every parity test uses."""

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

import hasten  # noqa: E402
import hasten.ops  # noqa: E402
from hasten.config import Config  # noqa: E402
from hasten.lora import install_fused_lora, lora_layers  # noqa: E402
from hasten.packing import move_batch  # noqa: E402


def _layer(n_in, n_out, rank, adapter_dtype, seed):
    torch.manual_seed(seed)
    base = torch.nn.Sequential(torch.nn.Linear(n_in, n_out, bias=True)).to("cuda", torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"]))
    (layer,) = lora_layers(model)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.05)
    layer.lora_A.to(adapter_dtype)
    layer.lora_B.to(adapter_dtype)
    return model, layer


def _run(model, layer, x, upstream):
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(upstream)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    out = [y.detach().double(), x.grad.double(), a.grad.double(), b.grad.double()]
    a.grad = b.grad = None
    return out


@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,n_in,n_out,rank", [(4097, 4096, 1024, 16), (1, 640, 2048, 8), (300, 14336, 4096, 16)])
def test_fused_layer_is_within_the_bf16_noise_of_peft(tokens, n_in, n_out, rank, adapter_dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, n_in, device="cuda", dtype=torch.bfloat16, generator=gen)
    upstream = torch.randn(tokens, n_out, device="cuda", dtype=torch.bfloat16, generator=gen)
    model, layer = _layer(n_in, n_out, rank, adapter_dtype, seed=tokens)
    bf16_peft = copy.deepcopy(model)  # the bf16 yardstick: PEFT's layer with bf16 adapters
    (bf16_layer,) = lora_layers(bf16_peft)
    bf16_layer.lora_A.to(torch.bfloat16)
    bf16_layer.lora_B.to(torch.bfloat16)
    noise_out = _run(bf16_peft, bf16_layer, x, upstream)
    undo, count, _grouped, refused = install_fused_lora(model)
    assert count == 1 and not refused
    fused_out = _run(model, layer, x, upstream)
    assert layer.lora_A["default"].weight.dtype == adapter_dtype
    undo()
    model.double()
    exact = _run(model, layer, x.double(), upstream.double())
    for label, fused, theirs, want in zip(("y", "dx", "dA", "dB"), fused_out, noise_out, exact):
        error = float((fused - want).norm() / want.norm())
        noise = float((theirs - want).norm() / want.norm())
        assert error <= 1.5 * noise + 1e-4, f"{label}: hasten {error:.2e} vs PEFT's bf16 noise {noise:.2e}"


@pytest.mark.parametrize("rank", [8, 16])
def test_lora_model_gradients_are_within_the_bf16_noise_of_peft(rank):
    """A small Llama with LoRA on every projection, packed batch with one-token samples: every
    adapter gradient of the hasten-accelerated bf16 model against the float32 unpatched model,
    within the error of the unpatched bf16 PEFT model (float32 adapters, PEFT's default). The
    reference runs the packed row through transformers' own packed path in float32. Rank 16 runs
    the backward's one-pass kernel (csrc/kernels/lora_grads.cuh), rank 8 the two GEMMs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"])
    reference = peft.get_peft_model(LlamaForCausalLM(config).cuda(), lora)
    with torch.no_grad():
        for layer in lora_layers(reference):
            layer.lora_B["default"].weight.normal_(std=0.05)
    unpatched = copy.deepcopy(reference)
    unpatched.get_base_model().to(torch.bfloat16)
    for layer in lora_layers(unpatched):  # PEFT keeps float32 adapters under a bf16 base
        layer.lora_A.float()
        layer.lora_B.float()
    patched = copy.deepcopy(unpatched)
    gen = torch.Generator().manual_seed(3)
    samples = [{"input_ids": torch.randint(0, 512, (n,), generator=gen).tolist()} for n in (1, 200, 37, 1, 300)]
    # use_cache=False: with transformers' default cache its sdpa path does not detect the packed
    # samples and attends across them (hasten's packed path turns the cache off itself)
    batch = move_batch(hasten.PackingCollator(max_tokens=1024)(samples), "cuda") | {"use_cache": False}

    def adapter_grads(model):
        # the packed row through each model; the float32 reference is transformers' own packed path
        # (position_ids), whose isolation tests/integrations/test_model_parity.py covers
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return torch.cat([p.grad.double().flatten() for n, p in sorted(model.named_parameters()) if "lora_" in n])

    want = adapter_grads(reference)  # both unpatched runs before accelerate() registers anything
    noise = float((adapter_grads(unpatched) - want).norm() / want.norm())
    handle = hasten.accelerate(patched.get_base_model(), Config())
    assert any(item.startswith("fused LoRA projections (14 layers") for item in handle.active), handle.report()
    assert any(item.startswith("grouped LoRA projections (10 layers") for item in handle.active), handle.report()
    for gated in ("0", "1"):  # HASTEN_LORA_GATED=1: gate/up and the SwiGLU as one op (experimental)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("HASTEN_LORA_GATED", gated)
            names = _launched_kernels(lambda: adapter_grads(patched))
            assert any("lora_grads_kernel" in n for n in names) == (rank == 16)
            # the one op's backward is one pass at rank 16, the SwiGLU kernel (and the thin products) else
            assert any("lora_gated_grads_kernel" in n for n in names) == (rank == 16 and gated == "1")
            assert any("swiglu_backward_kernel" in n for n in names) == (rank != 16 or gated == "0")
            error = float((adapter_grads(patched) - want).norm() / want.norm())
        assert error <= 1.5 * noise, f"hasten (gated {gated}) {error:.3e} vs the unpatched bf16 model's {noise:.3e}"
    handle.undo()


def test_fused_4bit_layer_is_within_the_bf16_noise_of_peft():
    """QLoRA: PEFT's 4-bit LoRA layer over bitsandbytes' NF4 Linear4bit (bf16 compute) against the
    same layer with its dequantized weight in float64; hasten's fused path within 1.5x the bf16
    noise of PEFT's own bf16-adapter layer."""
    bnb = pytest.importorskip("bitsandbytes")

    class Model(torch.nn.Module):
        is_loaded_in_4bit = True  # PEFT then picks its 4-bit LoRA class

        def __init__(self):
            super().__init__()
            self.proj = bnb.nn.Linear4bit(4096, 1024, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
            self.proj.weight = bnb.nn.Params4bit((torch.randn(1024, 4096) * 0.02).bfloat16(), requires_grad=False,
                                                 quant_type="nf4")

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    model = peft.get_peft_model(Model().cuda(), peft.LoraConfig(r=16, lora_alpha=32, target_modules=["proj"]))
    (layer,) = lora_layers(model)
    assert type(layer).__module__ == "peft.tuners.lora.bnb"
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(std=0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4097, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    upstream = torch.randn(4097, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    import bitsandbytes.functional as bnb_functional

    base = layer.get_base_layer()
    weight = bnb_functional.dequantize_4bit(base.weight.data, base.weight.quant_state).double()
    a, b = (layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double())
    scale = layer.scaling["default"]
    xd = x.double().requires_grad_()
    ad, bd = a.clone().requires_grad_(), b.clone().requires_grad_()
    want_y = xd @ weight.T + scale * (xd @ ad.T) @ bd.T
    want_y.backward(upstream.double())
    exact = [want_y.detach(), xd.grad, ad.grad, bd.grad]
    layer.lora_A.to(torch.bfloat16)  # the bf16 yardstick: PEFT's own layer with bf16 adapters
    layer.lora_B.to(torch.bfloat16)
    noise_out = _run(model, layer, x, upstream)
    layer.lora_A.float()
    layer.lora_B.float()
    undo, count, _grouped, refused = install_fused_lora(model)
    assert count == 1 and not refused
    fused_out = _run(model, layer, x, upstream)
    undo()
    for label, fused, theirs, want in zip(("y", "dx", "dA", "dB"), fused_out, noise_out, exact):
        error = float((fused - want).norm() / want.norm())
        noise = float((theirs - want).norm() / want.norm())
        assert error <= 1.5 * noise + 1e-4, f"{label}: hasten {error:.2e} vs PEFT's bf16 noise {noise:.2e}"


def test_expert_lora_split_on_grouped_gemms_is_within_the_bf16_noise_of_peft():
    """LoRA on a Qwen3-MoE's experts (PEFT target_parameters, one adapter): hasten's split
    projection on grouped GEMMs (base, then x rhs^T, then its lhs^T) against the float32 unpatched
    model, within the error of the unpatched bf16 PEFT model, whose parametrization folds the
    merged expert stack into one weight per forward."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"],
                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    reference = peft.get_peft_model(Qwen3MoeForCausalLM(config).cuda(), lora)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    unpatched = copy.deepcopy(reference)
    unpatched.get_base_model().to(torch.bfloat16)
    for name, param in unpatched.named_parameters():  # float32 adapters under a bf16 base, as PEFT keeps them
        if "lora_" in name:
            param.data = param.data.float()
    patched = copy.deepcopy(unpatched)
    gen = torch.Generator().manual_seed(4)
    samples = [{"input_ids": torch.randint(0, 512, (n,), generator=gen).tolist()} for n in (1, 200, 37, 1, 300)]
    batch = move_batch(hasten.PackingCollator(max_tokens=1024)(samples), "cuda") | {"use_cache": False}

    def adapter_grads(model):
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return torch.cat([p.grad.double().flatten() for n, p in sorted(model.named_parameters())
                          if "lora_" in n and "experts" in n])

    want = adapter_grads(reference)
    noise = float((adapter_grads(unpatched) - want).norm() / want.norm())
    handle = hasten.accelerate(patched.get_base_model(), Config())
    assert any(item.startswith("fused MoE experts") for item in handle.active), handle.report()
    error = float((adapter_grads(patched) - want).norm() / want.norm())
    print(f"expert LoRA: hasten {error:.3e}, PEFT bf16 {noise:.3e}")
    assert error <= 1.5 * noise, f"hasten {error:.3e} vs the unpatched bf16 model's {noise:.3e}"
    handle.undo()


@pytest.mark.parametrize("tokens,n_in,outs,biased", [(4097, 4096, (4096, 1024, 1024), False),
                                                     (1, 640, (2048, 2048), True), (300, 896, (128, 64, 64), True)])
def test_group_op_is_within_the_bf16_noise_of_one_op_per_projection(tokens, n_in, outs, biased):
    """hasten::lora_linear_group (q/k/v- and gate/up-like members, float32 adapters of ranks 16
    and 8) against one hasten::lora_linear per member, both against the float64 computation."""
    from hasten.ops.lora import lora_linear, lora_linear_group

    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen) * scale

    x = rand(tokens, n_in)
    weights = [rand(n, n_in, scale=n_in ** -0.5) for n in outs]
    biases = [rand(n, scale=0.1) for n in outs] if biased else []
    ranks = [16 if i % 2 == 0 else 8 for i in range(len(outs))]
    lora_a = [rand(r, n_in, dtype=torch.float32, scale=n_in ** -0.5) for r in ranks]
    lora_b = [rand(n, r, dtype=torch.float32, scale=0.05) for n, r in zip(outs, ranks)]
    scales = [2.0, 0.5, 1.0][:len(outs)]
    upstream = [rand(tokens, n) for n in outs]

    def run(group: bool, dtype):
        xx = x.to(dtype).requires_grad_()
        a = [t.detach().to(torch.float64 if dtype == torch.float64 else t.dtype).requires_grad_() for t in lora_a]
        b = [t.detach().to(torch.float64 if dtype == torch.float64 else t.dtype).requires_grad_() for t in lora_b]
        w = [t.to(dtype) for t in weights]
        bs = [t.to(dtype) for t in biases]
        if dtype == torch.float64:  # the exact computation, written out
            ys = [xx @ wi.t() + s * (xx @ ai.t()) @ bi.t() + (bs[i] if bs else 0)
                  for i, (wi, ai, bi, s) in enumerate(zip(w, a, b, scales))]
        elif group:
            ys = lora_linear_group(xx, w, bs, a, b, scales)
        else:
            ys = [lora_linear(xx, wi, bs[i] if bs else None, ai, bi, s) for i, (wi, ai, bi, s) in
                  enumerate(zip(w, a, b, scales))]
        sum((y.double() * g.double()).sum() for y, g in zip(ys, upstream)).backward()
        return [torch.cat([y.detach().double().flatten() for y in ys]), xx.grad.double(),
                torch.cat([t.grad.double().flatten() for t in a]), torch.cat([t.grad.double().flatten() for t in b])]

    exact, grouped, separate = run(False, torch.float64), run(True, torch.bfloat16), run(False, torch.bfloat16)
    for label, got, theirs, want in zip(("ys", "dx", "dA", "dB"), grouped, separate, exact):
        error = float((got - want).norm() / want.norm())
        noise = float((theirs - want).norm() / want.norm())
        assert error <= 1.5 * noise + 1e-4, f"{label}: group {error:.2e} vs one op per projection {noise:.2e}"


# --- the backward's one pass over grad_y (csrc/kernels/lora_grads.cuh) ------------------------------

def _launched_kernels(fn) -> list[str]:
    hasten.ops.load()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _relative_error(got, want) -> float:
    return float((got.double() - want).norm() / max(float(want.norm()), 1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_dtype", [torch.float32, "x"])
@pytest.mark.parametrize("tokens,n_in,n_out,rank", [(4097, 64, 1024, 16), (1, 40, 520, 32), (300, 32, 14336, 16),
                                                    (1000, 48, 4104, 32), (77, 16, 24, 16), (33, 24, 8, 8),
                                                    (0, 16, 64, 16)])
def test_backward_reads_grad_y_once_and_matches_the_float64_products(tokens, n_in, n_out, rank, dtype, b_dtype,
                                                                     monkeypatch):
    """hasten::lora_linear_backward on CUDA with the one-pass kernel (rank 16) against the
    float64 formulas of the same rounded inputs, within 1.5x of the two GEMMs' error
    (HASTEN_LORA_GRADS_KERNEL=0); sizes off the kernel's tiles (32 rows, 512 columns), one token,
    no tokens, ranks it does not take (8 and 32: the GEMMs). Repeats bit for bit (fixed summation
    order). The plain kernel (HASTEN_LORA_GRADS_CONFIG=0) gives the same result as the default lean one."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + n_out)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    b_dtype = dtype if b_dtype == "x" else b_dtype
    g, x = rand(tokens, n_out), rand(tokens, n_in)
    w = rand(n_out, n_in, scale=n_in ** -0.5)
    a, b = rand(rank, n_in, scale=n_in ** -0.5, dt=b_dtype), rand(n_out, rank, scale=0.1, dt=b_dtype)
    xa = (x @ a.to(dtype).t())
    scale = 2.0

    hasten.ops.load()

    def run():
        return torch.ops.hasten.lora_linear_backward(g, x, w, a, b, xa, scale, True)

    names = _launched_kernels(run)
    one_pass = any("lora_grads_kernel" in n for n in names)
    assert one_pass == (rank == 16 and tokens > 0), names
    first, again = run(), run()
    for got, repeat in zip(first, again):
        assert torch.equal(got, repeat)
    for config in ("0",):  # the plain kernel (the default is the lean one)
        monkeypatch.setenv("HASTEN_LORA_GRADS_CONFIG", config)
        # the same sums in another order: float32 rounding apart, which gb's rounding to bf16 (one
        # unit in 256) carries into d lora_a and d x, float32 or not
        for got, other in zip(first, run()):
            biggest = float(other.abs().max()) if other.numel() else 0.0
            torch.testing.assert_close(got, other, rtol=2e-2, atol=1e-2 * biggest)
    monkeypatch.delenv("HASTEN_LORA_GRADS_CONFIG")
    monkeypatch.setenv("HASTEN_LORA_GRADS_KERNEL", "0")
    assert not any("lora_grads_kernel" in n for n in _launched_kernels(run))
    gemms = run()
    monkeypatch.delenv("HASTEN_LORA_GRADS_KERNEL")

    g64, x64, w64, xa64 = g.double(), x.double(), w.double(), xa.double()
    a64, b64 = a.to(dtype).double(), b.to(dtype).double()
    gb = scale * g64 @ b64
    want = {"grad_x": g64 @ w64 + gb @ a64, "grad_a": gb.t() @ x64, "grad_b": scale * g64.t() @ xa64}
    for index, label in ((0, "grad_x"), (2, "grad_a"), (3, "grad_b")):
        assert first[index].dtype == (dtype if label == "grad_x" else b_dtype)
        if tokens == 0:
            assert first[index].abs().sum() == 0
            continue
        error, noise = _relative_error(first[index], want[label]), _relative_error(gemms[index], want[label])
        assert error <= 1.5 * noise + 1e-5, f"{label}: one pass {error:.2e} vs two GEMMs {noise:.2e}"


@pytest.mark.parametrize("b_dtype", [torch.float32, torch.bfloat16])
def test_group_backward_one_pass_on_narrowed_ranks(b_dtype, monkeypatch):
    """The group's members write gb into column ranges of one (T, R) tensor and read xa's: ranks 16,
    32, 8 and 16 stacked (offsets 0, 16, 48, 56: the kernel's members at columns 0 and 56), output
    sizes off the 512-column stripes."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens, n_in, outs, ranks, scales = 2049, 96, (1032, 264, 4096, 520), (16, 32, 8, 16), [2.0, 0.5, 1.0, 1.5]

    def rand(*shape, scale=1.0, dt=torch.bfloat16):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    x = rand(tokens, n_in)
    weights = [rand(n, n_in, scale=n_in ** -0.5) for n in outs]
    lora_a = [rand(r, n_in, scale=n_in ** -0.5, dt=b_dtype) for r in ranks]
    lora_b = [rand(n, r, scale=0.1, dt=b_dtype) for n, r in zip(outs, ranks)]
    grads = [rand(tokens, n) for n in outs]
    xa = x @ torch.cat([t.to(torch.bfloat16) for t in lora_a]).t()

    hasten.ops.load()

    def run():
        return torch.ops.hasten.lora_linear_group_backward(grads, x, weights, lora_a, lora_b, xa, scales)

    names = _launched_kernels(run)
    assert sum("lora_grads_kernel" in n for n in names) == 2, names  # the rank-16 members; the others on the GEMMs
    got = run()
    monkeypatch.setenv("HASTEN_LORA_GRADS_KERNEL", "0")
    gemms = run()
    monkeypatch.delenv("HASTEN_LORA_GRADS_KERNEL")
    offsets = [0, 16, 48, 56, 72]
    gbs = [s * grads[i].double() @ lora_b[i].to(torch.bfloat16).double() for i, s in enumerate(scales)]
    want_x = sum(gbs[i] @ lora_a[i].to(torch.bfloat16).double() + grads[i].double() @ weights[i].double()
                 for i in range(4))
    want_a = [gb.t() @ x.double() for gb in gbs]
    want_b = [s * grads[i].double().t() @ xa[:, offsets[i]:offsets[i + 1]].double() for i, s in enumerate(scales)]
    pairs = [("grad_x", got[0], gemms[0], want_x)]
    pairs += [(f"grad_a[{i}]", got[1].split(ranks)[i], gemms[1].split(ranks)[i], want_a[i]) for i in range(4)]
    pairs += [(f"grad_b[{i}]", got[2][i], gemms[2][i], want_b[i]) for i in range(4)]
    for label, mine, theirs, want in pairs:
        error, noise = _relative_error(mine, want), _relative_error(theirs, want)
        assert error <= 1.5 * noise + 1e-5, f"{label}: one pass {error:.2e} vs two GEMMs {noise:.2e}"


# --- a gated MLP's gate/up pair: the activation's backward and both thin products in one pass -------

@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype,b_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, "x"),
                                           (torch.float16, torch.float32)])
@pytest.mark.parametrize("tokens,n_in,inner", [(4097, 64, 1024), (1, 40, 528), (300, 32, 14336), (77, 16, 48),
                                               (2049, 48, 4112), (0, 16, 64), (33, 24, 520)])
def test_gated_backward_one_pass_matches_the_float64_products(tokens, n_in, inner, dtype, b_dtype, activation,
                                                              monkeypatch):
    """hasten::lora_gated_group_backward with the one-pass kernel (csrc/kernels/lora_grads.cuh,
    LoraGatedGradsParams) against float64 formulas fed the activation kernel's own rounded d_gate and
    d_up, within 1.5x of the separate path's error (HASTEN_LORA_GATED_KERNEL=0: the activation's
    kernel, then the group's backward); sizes off the tiles (16 rows, 512 columns), one token, no
    tokens, and an inner size the kernel does not take (520: not a multiple of 16, the separate
    path); bit-identical repeats."""
    gen = torch.Generator(device="cuda").manual_seed(tokens + inner)

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dt)

    b_dtype = dtype if b_dtype == "x" else b_dtype
    x, grad_act = rand(tokens, n_in), rand(tokens, inner)
    gate, up = rand(tokens, inner, scale=2.0), rand(tokens, inner)
    weights = [rand(inner, n_in, scale=n_in ** -0.5) for _ in range(2)]
    lora_a = [rand(16, n_in, scale=n_in ** -0.5, dt=b_dtype) for _ in range(2)]
    lora_b = [rand(inner, 16, scale=0.1, dt=b_dtype) for _ in range(2)]
    xa = x @ torch.cat([a.to(dtype) for a in lora_a]).t()
    scales = [2.0, 0.5]

    hasten.ops.load()

    def run():
        return torch.ops.hasten.lora_gated_group_backward(grad_act, gate, up, x, weights, lora_a, lora_b, xa, scales,
                                                          activation)

    names = _launched_kernels(run)
    one_pass = tokens > 0 and inner % 16 == 0
    assert any("lora_gated_grads_kernel" in n for n in names) == one_pass, names
    assert any("swiglu_backward_kernel" in n for n in names) == (tokens > 0 and not one_pass), names
    first, again = run(), run()
    assert torch.equal(first[0], again[0])
    for mine, repeat in zip([first[1], *first[2]], [again[1], *again[2]]):
        assert torch.equal(mine, repeat)
    monkeypatch.setenv("HASTEN_LORA_GATED_KERNEL", "0")
    names = _launched_kernels(run)
    assert not any("lora_gated_grads_kernel" in n for n in names)
    separate = run()
    monkeypatch.delenv("HASTEN_LORA_GATED_KERNEL")

    backward = torch.ops.hasten.silu_mul_backward if activation == "silu" else torch.ops.hasten.gelu_tanh_mul_backward
    grad_gate, grad_up = (g.double() for g in backward(grad_act, gate, up))  # the rounded values both paths read
    gs = [grad_gate, grad_up]
    a64 = [a.to(dtype).double() for a in lora_a]
    b64 = [b.to(dtype).double() for b in lora_b]
    gbs = [s * g @ b for s, g, b in zip(scales, gs, b64)]
    want_x = sum(gb @ a + g @ w.double() for gb, a, g, w in zip(gbs, a64, gs, weights))
    want_a = [gb.t() @ x.double() for gb in gbs]
    want_b = [s * g.t() @ xa[:, 16 * i:16 * i + 16].double() for i, (s, g) in enumerate(zip(scales, gs))]
    pairs = [("grad_x", first[0], separate[0], want_x)]
    pairs += [(f"grad_a[{i}]", first[1].split(16)[i], separate[1].split(16)[i], want_a[i]) for i in range(2)]
    pairs += [(f"grad_b[{i}]", first[2][i], separate[2][i], want_b[i]) for i in range(2)]
    for label, mine, theirs, want in pairs:
        assert mine.dtype == theirs.dtype
        if tokens == 0:
            assert mine.abs().sum() == 0, label
            continue
        error, noise = _relative_error(mine, want), _relative_error(theirs, want)
        assert error <= 1.5 * noise + 1e-5, f"{label}: one pass {error:.2e} vs the separate path {noise:.2e}"
