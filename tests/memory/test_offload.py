"""Activation offload on the CPU path (synchronous copies): the engine round-trips storages and
frees what it holds; offloaded, kept and recomputed layers give the loss and gradients of keeping
everything; the manager plans after one measured forward; accelerate() refuses what cannot run."""

import gc
import logging

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import hasten
from hasten.config import Config
from hasten.memory.offload import TO_HOST, LayerOffload, OffloadEngine, OffloadManager, decoder_layers
from hasten.observability import fallback_counts

DENSE = dict(vocab_size=120, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=12)


def _model(seed=0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**DENSE)).train()


def _batch(seed=1, lengths=(9, 1, 14, 6, 23)):
    gen = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(0, 120, (n,), generator=gen).tolist()} for n in lengths]
    return hasten.PackingCollator(max_tokens=64)(samples)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- engine ---------------------------------------------------------------------------------
def _view_back(engine, ticket, like):
    restored = engine.fetch(ticket)
    return torch.empty(0, dtype=like.dtype).set_(restored.untyped_storage(), like.storage_offset(), like.size(),
                                                 like.stride())


@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 0), (257, 3)])
def test_engine_round_trips_a_storage_and_its_views(shape):
    engine = OffloadEngine()
    base = torch.randn(shape)
    view = base.t() if base.dim() == 2 else base[1:]
    ticket = engine.offload(view)
    assert torch.equal(_view_back(engine, ticket, view), view)
    assert torch.equal(_view_back(engine, ticket, base), base)  # any view of the same storage
    stats = engine.stats()
    assert stats.bytes_offloaded == base.numel() * 4 and stats.tickets == 1
    engine.release(ticket)
    after = engine.stats()
    assert after.tickets == 0 and after.host_bytes_held == 0 and after.device_bytes_held == 0


def test_engine_copy_is_a_snapshot_and_unknown_tickets_are_named():
    engine = OffloadEngine()
    x = torch.arange(6.0)
    ticket = engine.offload(x)
    x.add_(100)  # later writes do not reach the offloaded copy
    assert torch.equal(_view_back(engine, ticket, x), torch.arange(6.0))
    engine.release(ticket)
    with pytest.raises(RuntimeError, match="ticket .* is unknown or already released"):
        engine.fetch(ticket)
    engine.release(ticket)  # releasing twice is harmless


# ---- layers -------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", [
    ["offload"] * 4,
    ["offload", "keep", "recompute", "offload"],
    ["recompute", "offload", "offload", "keep"],
    ["recompute_offload"] * 3 + ["recompute"],
    ["recompute_offload", "offload", "keep", "recompute_offload"],
], ids=["all", "mixed", "recompute-first", "checkpointed-inputs", "mixed-checkpointed-inputs"])
@pytest.mark.parametrize("double_buffer", [True, False], ids=["double", "single"])
def test_plans_give_the_loss_and_gradients_of_keeping_everything(plan, double_buffer):
    batch = _batch()
    want_loss, want = _loss_and_grads(_model(), batch)
    model = _model()
    offload = LayerOffload(decoder_layers(model), plan, double_buffer=double_buffer, min_bytes=0)
    offload.attach()
    for _ in range(2):  # a second step reuses the pooled host blocks
        loss, grads = _loss_and_grads(model, batch)
        assert torch.equal(loss, want_loss)
        assert grads.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    stats = offload.engine.stats()
    assert stats.bytes_offloaded > 0 and stats.fetches > 0
    gc.collect()
    assert stats.tickets == 0 and stats.host_bytes_held == 0  # autograd freed its saved tensors
    offloaded_layers = [i for i, choice in enumerate(plan) if choice in TO_HOST]
    assert all(offload.bytes_per_layer[i] > 0 for i in offloaded_layers)
    assert all(offload.bytes_per_layer[i] == 0 for i in range(4) if i not in offloaded_layers)
    hidden_bytes = int(batch["input_ids"].numel()) * DENSE["hidden_size"] * 4
    for i, choice in enumerate(plan):  # a checkpointed layer sends its input, [1, tokens, hidden], and nothing else
        if choice == "recompute_offload":
            assert offload.bytes_per_layer[i] == hidden_bytes, (i, offload.bytes_per_layer[i], hidden_bytes)


def test_aliases_are_copied_once_and_parameters_never():
    model = _model()
    offload = LayerOffload(decoder_layers(model), ["offload"] * 4, min_bytes=0)
    packed_storages, kept = [], []
    original_pack = offload._pack

    def spying_pack(tensor):
        result = original_pack(tensor)
        (kept if result is tensor else packed_storages).append(tensor)
        return result

    offload._pack = spying_pack
    offload.attach()
    model(**_batch()).loss.backward()
    parameters = {p.data_ptr() for p in model.parameters()}
    assert not any(t.untyped_storage().data_ptr() in parameters for t in packed_storages)
    assert any(t.untyped_storage().data_ptr() in parameters for t in kept)  # weights were saved, and kept
    distinct = {t.untyped_storage().data_ptr() for t in packed_storages}
    assert len(distinct) < len(packed_storages)  # some storage was saved twice: one copy served both
    assert offload.engine.stats().bytes_offloaded == sum(offload.bytes_per_layer)


def test_a_graph_dropped_without_backward_releases_its_copies():
    model = _model()
    offload = LayerOffload(decoder_layers(model), ["offload"] * 4, min_bytes=0)
    offload.attach()
    loss = model(**_batch()).loss
    assert offload.engine.stats().tickets > 0
    del loss
    gc.collect()
    assert offload.engine.stats().tickets == 0


def test_detach_restores_the_layers():
    model = _model()
    layers = decoder_layers(model)
    offload = LayerOffload(layers, ["recompute", "offload", "keep", "keep"], min_bytes=0)
    offload.attach()
    assert layers[0].gradient_checkpointing and not layers[1].gradient_checkpointing
    offload.detach()
    assert not any(layer.gradient_checkpointing for layer in layers)
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers)
    model(**_batch()).loss.backward()
    assert offload.engine.stats().bytes_offloaded == 0


def test_bad_plans_are_refused():
    layers = decoder_layers(_model())
    with pytest.raises(ValueError, match="4 decoder layers"):
        LayerOffload(layers, ["offload"])
    with pytest.raises(ValueError, match="must be one of"):
        LayerOffload(layers, ["offload", "swap", "keep", "keep"])


def test_out_of_memory_in_prefetch_falls_back_to_one_buffer(caplog):
    batch = _batch()
    want_loss, want = _loss_and_grads(_model(), batch)
    model = _model()
    offload = LayerOffload(decoder_layers(model), ["offload"] * 4, double_buffer=True, min_bytes=0)
    offload.attach()
    engine_prefetch = offload.engine.prefetch
    calls = []

    def prefetch_that_runs_out(ticket):
        calls.append(ticket)
        if len(calls) == 4:  # the second buffer does not fit once
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        engine_prefetch(ticket)

    offload.engine.prefetch = prefetch_that_runs_out
    loss, grads = _loss_and_grads(model, batch)
    assert torch.equal(loss, want_loss)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6)
    assert not offload.double_buffer and "out of memory" in offload.fell_back_to_single_buffer
    assert fallback_counts().get("offload_double_buffer") == 1
    warned = [r.getMessage() for r in caplog.records if r.name == "hasten" and r.levelno == logging.WARNING]
    assert sum("continuing with one buffer" in m for m in warned) == 1  # said once, with the reason


# ---- manager --------------------------------------------------------------------------------
def test_auto_plans_after_the_first_forward_and_keeps_the_gradients():
    batch = _batch()
    want_loss, want = _loss_and_grads(_model(), batch)
    model = _model()
    manager = OffloadManager(model, "auto", min_bytes=0)
    assert manager.summary()["plan"] == "calibrating"
    for _ in range(3):  # measured on the second forward, planned at the third
        loss, grads = _loss_and_grads(model, batch)
        assert torch.equal(loss, want_loss)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6)
    assert manager.plan is not None and len(manager.plan.choices) == 4
    row = manager.summary()
    assert row["plan"].endswith("of 4 layers") and row["gib_offloaded"] >= 0
    manager.detach()


def test_host_memory_guard_refuses_before_running_short():
    model = _model()
    manager = OffloadManager(model, "all", min_bytes=0)
    manager.host_limit_bytes = 1024  # as if the machine had almost nothing to spare
    with pytest.raises(hasten.memory.offload.OffloadError, match="more host memory than this machine can spare"):
        model(**_batch()).loss.backward()
    manager.detach()


def test_accelerate_on_cpu_says_offload_needs_a_gpu():
    model = _model()
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"double_buffer": True}}}))
    assert handle.offload is None
    assert any("runs on a GPU" in item for item in handle.inactive)
    assert fallback_counts().get("activation_offload") == 1


@pytest.mark.parametrize("raw,message", [
    ({"offload": "all", "activations": "selective"}, "cannot combine with `training.checkpoint.activations: selective`"),
    ({"double_buffer": True, "activations": "selective"}, "double_buffer: true` turns on activation offload"),
    ({"offload": "auto", "max_memory_gib": 0}, "max_memory_gib` must be a positive number of GiB"),
])
def test_conflicting_offload_config_is_refused(raw, message):
    with pytest.raises(hasten.config.ConfigError, match=message):
        Config.from_dict({"training": {"checkpoint": raw}})


def test_recomputed_layers_do_not_count_as_new_forwards():
    """A checkpointed layer's forward runs again inside backward; it must not look like a new step."""
    model = _model()
    offload = LayerOffload(decoder_layers(model), ["recompute", "offload", "recompute", "keep"], min_bytes=0)
    starts = []
    offload.layer_observers.append(lambda index, event: starts.append(index) if event == "forward_start" else None)
    offload.attach()
    for _ in range(2):
        model(**_batch()).loss.backward()
    assert starts == [0, 1, 2, 3] * 2


# ---- full checkpointing with offload (activations: full) -------------------------------------
def test_checkpointed_inputs_go_to_the_host_under_the_models_own_checkpointing():
    """activations: full turns transformers' checkpointing on first; recompute_offload then wraps each
    layer's own checkpoint function, sends only its input to the host, and detach gives the function back."""
    batch = _batch()
    want_loss, want = _loss_and_grads(_checkpointed_model(), batch)
    model = _checkpointed_model()
    layers = decoder_layers(model)
    transformers_functions = [layer._gradient_checkpointing_func for layer in layers]
    offload = LayerOffload(layers, ["recompute_offload"] * 3 + ["recompute"], min_bytes=0)
    offload.attach()
    for _ in range(2):
        loss, grads = _loss_and_grads(model, batch)
        assert torch.equal(loss, want_loss)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    hidden_bytes = int(batch["input_ids"].numel()) * DENSE["hidden_size"] * 4
    assert offload.bytes_per_layer == [hidden_bytes] * 3 + [0]
    assert offload.engine.stats().fetches > 0
    offload.detach()
    assert [layer._gradient_checkpointing_func for layer in layers] == transformers_functions
    assert all(layer.gradient_checkpointing for layer in layers)  # the model's own switch is left as it was


def _checkpointed_model():
    model = _model()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_checkpointed_auto_plans_between_keeping_and_sending_the_inputs():
    batch = _batch()
    want_loss, want = _loss_and_grads(_checkpointed_model(), batch)  # the unpatched model masks a packed batch
    model = _model()  # differently with and without its cache, which checkpointing turns off
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    manager = OffloadManager(model, "auto", min_bytes=0, checkpointed=True)
    assert manager.offload.plan == ["recompute_offload"] * 3 + ["recompute"]
    for _ in range(3):
        loss, grads = _loss_and_grads(model, batch)
        assert torch.equal(loss, want_loss)
        for name in want:
            torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6)
    assert manager.plan is not None
    assert set(manager.plan.choices) <= {"recompute", "recompute_offload"}  # never keeps a layer's activations
    manager.detach()


def test_full_checkpointing_with_offload_is_accepted_and_reported_on_cpu():
    config = Config.from_dict({"training": {"checkpoint": {"activations": "full", "offload": "all"}}})
    model = _model()
    handle = hasten.accelerate(model, config)
    try:
        assert handle.offload is None and any("runs on a GPU" in item for item in handle.inactive)
        assert any("activation checkpointing (full" in item for item in handle.active)
        assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    finally:
        handle.undo()
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(model))


def test_bounded_copies_wait_for_nothing_on_the_cpu_and_are_counted():
    """bound_in_flight waits only for device copies; the CPU engine copies synchronously, so a
    forward under offload waits for none, and the summary says so."""
    model = _model()
    manager = OffloadManager(model, "all", min_bytes=0)
    model(**_batch()).loss.backward()
    assert manager.offload.engine.bound_in_flight(0) == 0
    row = manager.summary()
    assert row["forward_waits"] == 0 and "boundary_max" not in row  # boundaries are measured on a GPU
    manager.detach()


def test_the_preflights_split_keeps_the_last_offloaded_layers_on_the_device():
    """keep_on_device(k): the last k of the layers sending their checkpointed inputs to the host keep
    them instead (the gradients unchanged); 'auto' plans around them."""
    batch = _batch()
    want_loss, want = _loss_and_grads(_checkpointed_model(), batch)
    model = _checkpointed_model()
    manager = OffloadManager(model, "all", min_bytes=0, checkpointed=True)
    assert manager.host_layers == 3
    manager.keep_on_device(2)
    assert manager.offload.plan == ["recompute_offload", "recompute", "recompute", "recompute"]
    assert manager.host_layers == 1
    loss, grads = _loss_and_grads(model, batch)
    assert torch.equal(loss, want_loss)
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-6)
    assert manager.offload.bytes_per_layer[1:] == [0, 0, 0]  # only layer 0's input went to the host
    with pytest.raises(ValueError, match="only 1 go to the host"):
        manager.keep_on_device(2)
    manager.detach()

    model = _checkpointed_model()
    manager = OffloadManager(model, "auto", min_bytes=0, checkpointed=True)
    manager.keep_on_device(1)
    for _ in range(3):
        _loss_and_grads(model, batch)
    assert manager.plan is not None and manager.plan.choices[2] == "recompute"
    manager.restart_calibration()
    assert manager.offload.plan[2] == "recompute"
    manager.detach()


def test_batches_of_changing_lengths_keep_the_host_pool_under_the_guards_limit():
    """Each step's checkpointed inputs have its batch's length: the host pool frees cached blocks
    of earlier lengths rather than hold them beside new ones (they are page-locked on a GPU, outside
    the guard's count of live bytes). Without the limit the pool keeps them all (the control)."""
    batches = [_batch(seed=s, lengths=lengths) for s, lengths in
               enumerate([(9, 1, 14), (30, 2, 25, 6), (3, 1), (40, 20), (9, 1, 14)])]
    allocated = {}
    for limited in (False, True):
        model = _checkpointed_model()
        manager = OffloadManager(model, "all", min_bytes=0, checkpointed=True)
        engine = manager.offload.engine
        one_step = None
        if limited:  # room for the longest batch's inputs and little more
            one_step = 3 * 64 * 48 * 4 * 3 // 2
            manager.host_limit_bytes = one_step
            engine.set_host_limit(one_step)
        else:
            engine.set_host_limit(None)
        for batch in batches:
            _loss_and_grads(model, batch)
            if limited:
                assert engine.host_pool_stats().allocated_bytes <= one_step
        allocated[limited] = engine.host_pool_stats().allocated_bytes
        assert manager.summary()["host_pool_gib"] == allocated[limited] / 2**30
        manager.restart_calibration()  # the preflight's probes end here: their blocks go back
        assert engine.host_pool_stats().cached_bytes == 0
        manager.detach()
    assert allocated[False] > allocated[True]


def test_the_host_limit_is_shared_by_the_processes_on_the_host(monkeypatch):
    """Each torchrun rank reads the same MemAvailable before any pins a block: the guard's 80% is
    divided by LOCAL_WORLD_SIZE, so the ranks together promise no more than the host has; the
    refusal names the share."""
    from hasten.memory import offload

    monkeypatch.setattr(offload, "available_host_bytes", lambda: 10 * 2**30)
    limits = {}
    for ranks in (None, "1", "4", "junk"):
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        model = _model()
        manager = OffloadManager(model, "all", min_bytes=0)
        limits[ranks] = manager.host_limit_bytes
        manager.detach()
    assert limits[None] == limits["1"] == limits["junk"] == int(10 * 2**30 * 0.8)
    assert limits["4"] == int(10 * 2**30 * 0.8 / 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = _model()
    manager = OffloadManager(model, "all", min_bytes=0)
    manager.host_limit_bytes = 1024
    with pytest.raises(offload.OffloadError, match="80% of what was available at start, shared by the 4 processes"):
        model(**_batch()).loss.backward()
    manager.detach()
    from hasten.memory.preflight import HOST_FRACTION, host_share_bytes

    assert host_share_bytes(HOST_FRACTION) == int(10 * 2**30 * HOST_FRACTION / 4)
