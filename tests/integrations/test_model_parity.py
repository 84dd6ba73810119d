"""Every model type hasten patches, and the ones it must refuse, against the unpatched model run one
sample at a time (float32 on the CPU: the only difference allowed is summation order).

Each type of tests/model_zoo.py has its family's features on at values where an omission shows
(a window shorter than the samples, a softcap of 1, random sinks, logit scaling...): the test
first checks that switching the feature off moves the reference far past the tolerance, so it
could see the feature dropped."""

import copy
import gc

import pytest
import torch

import hasten
from hasten.config import Config
from hasten.integrations.architectures import ARCHITECTURES
from hasten.integrations.transformers import PackedBatchRefused
from hasten.observability import fallback_counts, fallback_reasons, reset_fallbacks
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


def _assert_equal_to_reference(name, loss, grads, want_loss, want) -> None:
    assert abs(float(loss) - float(want_loss)) <= LOSS_TOLERANCE, (name, float(loss), float(want_loss))
    errors = zoo.relative_errors(grads, want)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= GRAD_TOLERANCE, f"{name}: gradient of {worst} off by {errors[worst]:.2e}"


def _reference_and_copy(entry, batch_samples):
    """(the copy to patch, the per-sample float32 loss and gradients of the unpatched model)."""
    reference = zoo.build(entry)
    patched = zoo.clone(reference)
    return patched, *zoo.per_sample_reference(reference, batch_samples)


def test_building_every_entry_leaves_every_entry_as_declared():
    """A config class may change the lists it is given in place (transformers 5.25's Gemma 4 sets
    the last of its layer_types to full attention): the zoo hands each build a copy, or every entry
    built after it in the process (on the GPU, the whole parity file) would test another model than
    it declares: SLIDING_3's last layer full, exaone_moe's LoRA row moving from 0.45 to 1.29 of its
    allowance."""
    declared = copy.deepcopy({name: entry.config for name, entry in zoo.ENTRIES.items()})
    shared = copy.deepcopy((zoo.SLIDING_3, zoo.FULL_3))
    for entry in zoo.ENTRIES.values():
        try:
            zoo.build(entry)
        except pytest.skip.Exception:  # a type this transformers does not have
            continue
    assert (zoo.SLIDING_3, zoo.FULL_3) == shared
    assert {name: entry.config for name, entry in zoo.ENTRIES.items()} == declared


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_packed_batch_equals_each_sample_alone_or_is_refused(name):
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    if entry.attention == "refused":
        with pytest.raises(PackedBatchRefused, match="packed_sequence: false"):
            zoo.packed_run(patched, batch_samples)
        return
    handle, loss, got = zoo.packed_run(patched, batch_samples)
    assert _attention_outcome(handle) == entry.attention, handle.report()
    _assert_equal_to_reference(name, loss, got, want_loss, want)


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
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    handle = hasten.accelerate(patched)
    assert handle.packing_refusal and "carry state along the sequence" in handle.packing_refusal
    assert "packing_refused_stateful_layers" in fallback_reasons()
    assert not any(item.startswith("varlen attention (packed") for item in handle.active)
    loss = patched(**zoo.padded_batch(batch_samples)).loss
    loss.backward()
    _assert_equal_to_reference(name, loss.detach(), zoo.gradients(patched), want_loss, want)


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_undo_restores_the_model_exactly(name):
    from hasten.dense.patch import release_dropped_rope_patches

    gc.collect()  # models of earlier tests dropped without undo(): their RoPE patches released first,
    release_dropped_rope_patches()  # so that `before` runs transformers' own rotary code
    entry = zoo.ENTRIES[name]
    model = zoo.build(entry).eval()
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    before = model(input_ids=ids).logits
    implementation = model.config._attn_implementation
    handle = hasten.accelerate(model)
    handle.undo()
    assert model.config._attn_implementation == implementation
    assert not any("forward" in m.__dict__ or "_hasten_attention" in m.__dict__ for m in model.modules())
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("name,lora", [("llama", False), ("llama", True), ("qwen3_moe", False), ("llama4_text", False)])
def test_undo_gives_back_the_forwards_the_modules_had(name, lora):
    """transformers >= 5.25 kernelizes what from_pretrained loads (the `kernels` package binds a hub
    layer's forward to each module it has a kernel for), and accelerate's hooks wrap forwards: a
    module may come with a forward of its own on the instance. hasten's patches replace it while
    they are on (they compute the class's code); undo() gives each module back the very forward it
    had, where undo used to drop it."""
    import types

    import peft

    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES[name]).eval()
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False)).get_base_model()
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    before = model(input_ids=ids).logits
    had = {}
    for module in model.modules():  # as kernels' kernelize does: the class's forward, bound on the instance
        module.forward = had[id(module)] = types.MethodType(type(module).forward, module)
    handle = hasten.accelerate(model)
    replaced = [m for m in model.modules() if m.__dict__["forward"] is not had[id(m)]]
    assert replaced, handle.report()  # hasten's pieces went on over the forwards that were there
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
    handle.undo()
    assert all(m.__dict__.get("forward") is had[id(m)] for m in model.modules())
    assert not any("_hasten_found_forwards" in m.__dict__ for m in model.modules())
    assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("lora", [False, True])
def test_train_and_eval_keep_hastens_forwards_where_transformers_kernelizes(tmp_path, lora):
    """transformers >= 5.25 kernelizes what from_pretrained loads and does it again whenever the
    kernels mode changes, which model.train() and model.eval() do: the `kernels` package pops the
    instance forward of each module it has no hub kernel for, and took hasten's fused RMSNorm off
    every norm at the Trainer's first train() without a word. hasten's forwards stay on through it,
    and undo leaves nothing of hasten's behind."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    zoo.build(zoo.ENTRIES["qwen3"]).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers does not kernelize what from_pretrained loads (before 5.25)")
    if lora:  # hasten's LoRA layers, q/k/v and gate/up grouped (their forwards swapped once more)
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False)).get_base_model()
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    before = model(input_ids=ids).logits
    handle = hasten.accelerate(model)
    ours = {id(m): m.__dict__["forward"] for m in model.modules() if "_hasten_set_forwards" in m.__dict__}
    assert any(type(m).__name__.endswith("RMSNorm") and id(m) in ours for m in model.modules()), handle.report()
    for switch in (model.train, model.eval, model.train):
        switch()
        assert all(m.__dict__.get("forward") is ours[id(m)] for m in model.modules() if id(m) in ours), switch
    assert torch.allclose(model.eval()(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
    handle.undo()
    assert not any("_hasten_set_forwards" in m.__dict__ for m in model.modules())
    assert "set_use_kernels" not in model.__dict__
    assert torch.equal(model(input_ids=ids).logits, before)


@pytest.mark.parametrize("lora", [False, True])
def test_modules_under_accelerates_hooks_are_left_to_transformers_and_said(lora):
    """accelerate's hooks (device_map over several devices, offload) wrap a module's forward to move
    its weights and inputs; hasten's forward in their place would skip that. Those modules keep
    their hooked forward, the report says why, the rest is accelerated, and the model computes the
    same."""
    import peft
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    torch.manual_seed(0)
    model = zoo.build(zoo.ENTRIES["llama"]).eval()
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                           init_lora_weights=False)).get_base_model()
    ids = torch.tensor([zoo.samples()[2]["input_ids"]])
    before = model(input_ids=ids).logits
    layer = model.model.layers[0]
    hooked = [model, layer, layer.input_layernorm, layer.mlp, layer.self_attn.q_proj]
    for module in hooked:
        add_hook_to_module(module, AlignDevicesHook(execution_device="cpu"))
    theirs = {id(m): m.__dict__["forward"] for m in hooked}
    handle = hasten.accelerate(model)
    try:
        assert all(m.__dict__["forward"] is theirs[id(m)] for m in hooked)
        assert "accelerate's hooks wrap their forward" in handle.report(), handle.report()
        assert "forward" in model.model.layers[1].input_layernorm.__dict__  # the others are hasten's
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
    finally:
        handle.undo()
    assert all(m.__dict__["forward"] is theirs[id(m)] for m in hooked)


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek_v3"])
def test_own_attention_keeps_samples_apart_over_several_padded_rows(name):
    """The packed mask is built per row from the collator's seq_idx; rows end in padding."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    hasten.accelerate(patched)
    batch = hasten.PackingCollator(max_tokens=40)(batch_samples)
    assert batch["input_ids"].shape[0] > 1
    loss = patched(**batch).loss
    loss.backward()
    _assert_equal_to_reference(name, loss.detach(), zoo.gradients(patched), want_loss, want)


def test_every_table_type_has_a_parity_case():
    """Adding a model type to the table means adding its case here (and so to the GPU parity run)."""
    from hasten.integrations.architectures import ARCHITECTURES

    assert set(ARCHITECTURES) <= set(zoo.ENTRIES), sorted(set(ARCHITECTURES) - set(zoo.ENTRIES))


def _table_types():
    from hasten.integrations.architectures import ARCHITECTURES

    return sorted(n for n in zoo.ENTRIES if n in ARCHITECTURES)


@pytest.mark.parametrize("name", _table_types())
def test_table_types_run_every_piece_their_entry_declares(name):
    """No "not in the tested table" notice, and each piece the entry declares is on hasten's
    kernels: the norm, the gated MLP, the rotary embedding, the fused loss."""
    from hasten.integrations.architectures import ARCHITECTURES

    spec = ARCHITECTURES[name]
    handle = hasten.accelerate(zoo.build(zoo.ENTRIES[name]))
    assert f"model_type_not_in_table:{name}" not in fallback_reasons()
    fused = next((item for item in handle.active if item.startswith("fused kernels (")), "")
    expected = [] if spec.rotary.own else ["RoPE"]
    expected += {"rms": ["RMSNorm"], "layer": ["LayerNorm"]}.get(spec.norm.kind, [])
    if spec.family == "dense":  # MoE models may have no dense MLP at all (Mixtral, OLMoE)
        expected += {"swiglu": ["SwiGLU MLP"], "geglu_tanh": ["GeGLU MLP"]}.get(spec.mlp.kind, [])
    for piece in expected:
        assert piece in fused, (piece, handle.report())
    assert any(item.startswith("fused cross-entropy (LM head") for item in handle.active), handle.report()
    # what stays off is only what the entry says is torch's own kernel already
    # (the fused residual add rewrites a layer's own forward where it has the `h = r + a; r = h;
    # h = norm(h)` form; a layer written otherwise keeps its code and says why: both proven by
    # test_fused_residual_add_equals_each_sample_alone, on every type; so does an attention whose head
    # norms are not applied right before the rotary, per head (OLMo's over the whole projection,
    # Hunyuan's after the rotary): test_fused_head_norm_rope_equals_each_sample_alone)
    allowed = ("fused norm (the model's", "fused MLP (an ungated MLP", "fused MLP (the model's own MLP code",
               "fused RoPE (the model's own", "fused residual add (", "fused head norm + RoPE (") + (
        ("fused SwiGLU (no gated MLP modules",) if spec.family == "moe" else ()) + (
        ("fused MoE experts (",) if spec.experts else ())  # declared: the experts stay transformers'
    if spec.experts:  # declared outside transformers' experts interface: said so. A release that moved them
        # onto it (transformers 5.25: LongCat-Flash's, Step 3.7's) gets them fused, which the parity tests prove
        assert any(item.startswith("fused MoE experts (") for item in handle.inactive + handle.active), handle.report()
    off = [item for item in handle.inactive if item.startswith("fused") and not item.startswith(allowed)]
    assert not off, handle.report()
    handle.undo()



# bf16 on the CPU, the model cast as from_pretrained(dtype=torch.bfloat16) loads it: the router
# weights, correction biases, sinks and dt_bias its class names stay float32 beside bf16 activations.
# hasten's pieces must take them as the model's own code does (no dtype error, none of them cast to
# bf16) and train. Within-noise parity in bf16 is the GPU twin's (tests/gpu/test_model_parity_cuda.py
# casts the same way): on these tiny MoE models one rounding flips a top-k choice, so bf16 gradients
# here move as far as routing chaos takes them (deepseek_v3: 7x the unpatched bf16 model's distance
# with hasten's SwiGLU, back to 1x with the router weights x8), while float32 (above) is exact.
BF16_LOSS_SLACK = 0.05  # nats: 10x the largest bf16 loss noise of these models (5e-3)


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_bf16_as_loaded_keeps_the_float32_pieces_and_trains(name):
    entry = zoo.ENTRIES[name]
    reference = zoo.build(entry)
    patched = zoo.cast_as_loaded(zoo.clone(reference), torch.bfloat16)
    kept = {n for n, t in [*patched.named_parameters(), *patched.named_buffers()] if t.dtype == torch.float32}
    if not kept:
        pytest.skip(f"{name} keeps nothing in float32 under bf16")
    assert any(t.dtype == torch.bfloat16 for t in patched.parameters())
    batch_samples = zoo.samples()
    want_loss, want = zoo.per_sample_reference(reference, batch_samples)
    if entry.attention == "refused":
        with pytest.raises(PackedBatchRefused, match="packed_sequence: false"):
            zoo.packed_run(patched, batch_samples)
        return
    handle, loss, got = zoo.packed_run(patched, batch_samples)
    still = {n for n, t in [*patched.named_parameters(), *patched.named_buffers()] if t.dtype == torch.float32}
    assert kept <= still, f"hasten cast {sorted(kept - still)} out of float32"
    assert abs(float(loss) - float(want_loss)) <= BF16_LOSS_SLACK, (float(loss), float(want_loss))
    assert set(got) == set(want) and all(bool(g.isfinite().all()) for g in got.values())
    handle.undo()


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_generation_after_accelerate_equals_the_unpatched_model(name):
    """Greedy decoding against a cache on the accelerated model (evaluation after training, TRL's
    online methods generating with the model they train): the tokens and logits of the unpatched
    model. Found by this test: Gemma 4's KV-shared layers slicing the mask to generate's last
    query (hasten's band mask refused the slice), LLaVA-OneVision handing `logits_to_keep` to its
    attention (refused as an unknown argument)."""
    from tests.integrations.test_contract import _generation_equals_unpatched

    reference = zoo.build(zoo.ENTRIES[name]).eval()
    patched = zoo.clone(reference)
    handle = hasten.accelerate(patched)
    try:
        _generation_equals_unpatched(reference, patched)
    finally:
        handle.undo()


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_a_batch_of_two_packed_rows_equals_each_sample_alone_or_is_refused(name):
    """The same samples packed into two rows (hasten.PackingCollator's usual batch: rows of
    max_tokens, boundaries per row): per-row metadata, positions and the loss over rows."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    batch = hasten.PackingCollator(max_tokens=max(len(s["input_ids"]) for s in batch_samples) + 7)(batch_samples)
    assert batch["input_ids"].shape[0] == 2
    handle = hasten.accelerate(patched)
    try:
        if entry.attention == "refused":
            with pytest.raises(PackedBatchRefused, match="packed_sequence: false"):
                patched(**batch)
            return
        patched.zero_grad(set_to_none=True)
        loss = patched(**batch).loss
        loss.backward()
        _assert_equal_to_reference(name, loss.detach(), zoo.gradients(patched), want_loss, want)
    finally:
        handle.undo()


@pytest.mark.parametrize("name", sorted(zoo.ENTRIES))
def test_a_padded_batch_through_the_accelerated_model_equals_the_unpatched_model(name):
    """Right-padded rows with an attention_mask (collators that do not pack, TRL without packing):
    hasten's dense-mask path, the model's own attention where its features need it; loss and every
    gradient of the unpatched model on the same batch."""
    from tests.integrations.test_contract import _padded_batch_equals_unpatched

    _, _, handle, _ = _padded_batch_equals_unpatched(name)
    handle.undo()


@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention != "refused"))
def test_selective_checkpointing_equals_each_sample_alone(name):
    """training.checkpoint.activations: selective on every packed type: the outputs it keeps are
    handed to the model's own code, which may change them in place (OLMo clamps its qkv, Gemma 3n's
    AltUp adds into a matmul's output); kept or recomputed, the gradients must be the model's."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    config = Config.from_dict({"training": {"checkpoint": {"activations": "selective"}}})
    handle, loss, got = zoo.packed_run(patched, batch_samples, config)
    try:
        _assert_equal_to_reference(name, loss, got, want_loss, want)
    finally:
        handle.undo()


@pytest.mark.parametrize("passing", [False, True], ids=["add", "add_and_passing"])
@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention != "refused"))
def test_fused_residual_add_equals_each_sample_alone(name, passing):
    """kernels.fused_residual on every packed type: the decoder layers whose forward has the
    `h = residual + h; residual = h; h = self.<norm>(h)` run on a norm hasten patched get it
    rewritten onto hasten::add_rms_norm (Llama, Qwen, Mistral, Gemma's pre-feedforward norm...);
    the others keep their forward and say why. With kernels.fused_residual_grad (`passing`) each
    `residual = h; h = self.<norm>(h)` too (rms_norm_passing_input), said in the handle's report.
    Either way the model's loss and gradients."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    config = Config.from_dict({"kernels": {"fused_residual": True, "fused_residual_grad": passing}})
    handle, loss, got = zoo.packed_run(patched, batch_samples, config)
    try:
        _assert_equal_to_reference(name, loss, got, want_loss, want)
        if not passing:
            assert not any("passing its input" in item for item in handle.active), handle.active
    finally:
        handle.undo()
    assert not any("forward" in m.__dict__ for m in patched.modules())


# Types whose attention applies q_norm / k_norm per head right before apply_rotary_pos_emb in the
# statements qk_norm_rope.py fuses (transformers 5.x): the fused path must be taken on them.
_HEAD_NORM_ROPE_TYPES = {"qwen3", "qwen3_moe", "gemma3_text"}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "gemma3_text", "llama", "olmo2"])
def test_the_default_fuses_head_norms_with_the_rotary_and_groups_shared_input_projections(name):
    """kernels.fused_qk_norm_rope and kernels.fused_linear_groups are on by default, so every
    parity test of the default settings (above: packed, two rows, selective checkpointing) proves
    them; here, that they are taken: the head norms with the rotary where the attention applies
    them per head right before it (Qwen3, Gemma 3; OLMo 2 normalises the whole projection and keeps
    its code, saying so), the shared-input projections everywhere."""
    reset_fallbacks()
    handle = hasten.accelerate(zoo.build(zoo.ENTRIES[name]))
    try:
        fused = any("head RMSNorm + RoPE" in item for item in handle.active)
        assert fused == (name in _HEAD_NORM_ROPE_TYPES), handle.report()
        if name == "olmo2":
            assert any(item.startswith("fused head norm + RoPE (") for item in handle.inactive), handle.report()
        assert any("shared-input projections" in item for item in handle.active), handle.report()
    finally:
        handle.undo()


@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention != "refused"))
def test_without_the_fused_head_norms_and_linear_groups_each_sample_alone(name):
    """The paths the two default switches replace (the head norm and the rotary as two kernels; the
    projections one by one, autograd adding their input gradients), still the model's loss and
    gradients with both off; undo() leaves no instance forward behind."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    config = Config.from_dict({"kernels": {"fused_qk_norm_rope": False, "fused_linear_groups": False}})
    handle, loss, got = zoo.packed_run(patched, batch_samples, config)
    try:
        _assert_equal_to_reference(name, loss, got, want_loss, want)
        assert not any("head RMSNorm + RoPE" in item or "shared-input" in item for item in handle.active)
    finally:
        handle.undo()
    assert not any("forward" in m.__dict__ for m in patched.modules())


@pytest.mark.parametrize("activations", ["none", "selective"])
@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention != "refused"))
def test_peft_lora_on_every_linear_trains_packed_like_peft_alone(name, activations):
    """The job most users run: PEFT LoRA on every linear layer (random adapters, so the update
    shows), hasten accelerating the base model (its fused LoRA projections where the layer is a
    Linear): the packed loss and every adapter gradient of PEFT's model run one sample at a time.
    Found by this test: OLMo and Gemma 3n change a projection's output in place, which the fused
    op's output (then a view made inside the op) refused, and which selective checkpointing stopped
    on while it kept the op's output."""
    import copy

    import peft

    batch_samples = zoo.samples()
    torch.manual_seed(0)
    reference = peft.get_peft_model(zoo.build(zoo.ENTRIES[name]), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    patched = copy.deepcopy(reference)
    try:
        want_loss, want = zoo.per_sample_reference(reference, batch_samples)
    except AttributeError as exc:  # PEFT's all-linear also wraps llama4_text's and phimoe's routers
        pytest.skip(f"PEFT's own model fails on {name}: {exc}")
    handle = hasten.accelerate(patched.get_base_model(),
                               Config.from_dict({"training": {"checkpoint": {"activations": activations}}}))
    try:
        patched.zero_grad(set_to_none=True)
        loss = patched(**zoo.packed_batch(batch_samples)).loss
        loss.backward()
        _assert_equal_to_reference(name, loss.detach(), zoo.gradients(patched), want_loss, want)
    finally:
        handle.undo()


@pytest.mark.parametrize("name", sorted(n for n, e in zoo.ENTRIES.items() if e.attention != "refused"))
def test_an_evaluation_forward_on_a_packed_batch_gives_the_models_loss(name):
    """Evaluation during training (the Trainer's eval loop): eval mode, no gradients, a packed
    batch through the accelerated model; the loss of the unpatched model run one sample at a time."""
    batch_samples = zoo.samples()
    reference = zoo.build(zoo.ENTRIES[name]).eval()
    patched = zoo.clone(reference)
    with torch.no_grad():
        total, targets = 0.0, 0
        for sample in batch_samples:
            ids = torch.tensor([sample["input_ids"]])
            if ids.shape[1] > 1:
                total += float(reference(input_ids=ids, labels=ids, use_cache=False).loss) * (ids.shape[1] - 1)
                targets += ids.shape[1] - 1
    handle = hasten.accelerate(patched)
    try:
        patched.eval()
        with torch.no_grad():
            loss = float(patched(**zoo.packed_batch(batch_samples)).loss)
        assert abs(loss - total / targets) <= LOSS_TOLERANCE, (name, loss, total / targets)
    finally:
        handle.undo()


_ROUTER_TYPES = sorted(n for n, e in zoo.ENTRIES.items()
                       if e.attention != "refused" and getattr(ARCHITECTURES.get(e.model_type), "router", None))


@pytest.mark.parametrize("name", _ROUTER_TYPES)
def test_fused_routers_equal_each_sample_alone(name):
    """training.moe.fused_router on every table type with a router recipe: each router class passes
    its check against its own forward and runs on hasten::moe_route (said in the report), with the
    model's loss and gradients, the routers' included; undo gives the routers' forwards back."""
    entry = zoo.ENTRIES[name]
    batch_samples = zoo.samples()
    patched, want_loss, want = _reference_and_copy(entry, batch_samples)
    config = Config.from_dict({"training": {"moe": {"fused_router": True}}})
    handle, loss, got = zoo.packed_run(patched, batch_samples, config)
    try:
        assert any(item.startswith("fused MoE routers (") for item in handle.active), handle.report()
        assert not any(item.startswith("fused MoE routers for") for item in handle.inactive), handle.report()
        _assert_equal_to_reference(name, loss, got, want_loss, want)
    finally:
        handle.undo()
    assert not any("forward" in m.__dict__ for m in patched.modules())
