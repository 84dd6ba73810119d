"""Activation offload on the GPU: copies on their own streams equal the values they copied while
compute keeps writing; gradients with offload (double and single buffer) equal those without over
several packed steps; device memory returns to its baseline after each step; the planner runs."""

import gc
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hasten
from hasten.config import Config
from hasten.memory.offload import LayerOffload, OffloadEngine, decoder_layers, measure_link_bandwidth
from hasten.packing import move_batch
from hasten.training.prefetch import NextBatchPrefetcher

SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)


def _model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).to("cuda", torch.bfloat16).train()


def _batches(n, seed=0, max_tokens=4096):
    gen = torch.Generator().manual_seed(seed)
    collator = hasten.PackingCollator(max_tokens=max_tokens)
    out = []
    for _ in range(n):
        lengths = [1, 2] + torch.randint(3, 700, (12,), generator=gen).tolist()
        samples = [{"input_ids": torch.randint(0, 1000, (k,), generator=gen).tolist()} for k in lengths]
        out.append(move_batch(collator(samples), "cuda"))
    return out


def _train(model, batches, lr=1e-2):
    """Losses and the final gradients of a few SGD steps (SGD keeps bf16 noise small; Adam's
    normalisation would blow up the differences of near-zero gradients)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], None
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
        optimizer.step()
    return losses, grads


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_engine_never_lets_memory_be_reused_before_its_copy_is_done():
    """Random sizes; the source is dropped right after offload and compute immediately fills fresh
    allocations (which the caching allocator serves from just-freed blocks) with junk. A buffer
    released before its copy finished would restore junk."""
    engine = OffloadEngine()
    rng = random.Random(0)
    busy = torch.randn(4096, 4096, device="cuda")
    tickets, junk = [], []
    for _ in range(60):  # random sizes, not multiples of anything
        n = rng.randint(1, 3_000_000)
        x = torch.randn(n, device="cuda")
        want = x.cpu()
        busy = busy @ busy * 1e-4  # the compute stream stays busy while copies are queued
        tickets.append((engine.offload(x), want))
        del x
        junk.append(torch.full((rng.randint(1, 3_000_000),), 7.0, device="cuda"))
        if len(junk) > 4:
            junk.pop(0)
        if rng.random() < 0.3:  # prefetch some early, while offloads are still in flight
            engine.prefetch(tickets[rng.randrange(len(tickets))][0])
    for ticket, want in tickets:
        got = engine.fetch(ticket).view(torch.float32)
        junk.append(torch.full_like(got, 9.0))  # compute writes right after the wait
        assert torch.equal(got.cpu(), want)
        engine.release(ticket)
    engine.synchronize()
    stats = engine.stats()
    assert stats.tickets == 0 and stats.device_bytes_held == 0 and stats.d2h_bytes_in_flight == 0


def test_engine_exact_round_trip_of_views_and_dtypes():
    engine = OffloadEngine()
    for dtype in (torch.bfloat16, torch.float32, torch.int64, torch.bool):
        base = (torch.randn(37, 129, device="cuda") * 100).to(dtype)
        view = base.t()[3:]
        ticket = engine.offload(view)
        del base  # the engine keeps the storage alive until its copy is done
        restored = engine.fetch(ticket)
        got = torch.empty(0, dtype=dtype, device="cuda").set_(restored.untyped_storage(), view.storage_offset(),
                                                            view.size(), view.stride())
        assert torch.equal(got, view)
        engine.release(ticket)


@pytest.mark.parametrize("double_buffer", [True, False], ids=["double", "single"])
def test_offload_gradients_equal_keeping_everything_over_packed_steps(double_buffer):
    batches = _batches(3)
    reference = _model()
    hasten.accelerate(reference, Config())
    want_losses, want_grads = _train(reference, batches)
    model = _model()
    hasten.accelerate(model, Config())
    layers = decoder_layers(model)
    offload = LayerOffload(layers, ["offload"] * (len(layers) - 1) + ["keep"], double_buffer=double_buffer)
    offload.attach()
    losses, grads = _train(model, batches)
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 1e-2 * abs(want)
    worst = max(_rel(grads[n], want_grads[n]) for n in want_grads)
    assert worst <= 2e-2, worst  # attention backward is not bitwise deterministic
    stats = offload.engine.stats()
    assert stats.bytes_offloaded > 50 << 20 and stats.fetches > 0
    if not double_buffer:
        assert stats.exposed_fetches > 0  # one buffer: every layer waits for its copy


@pytest.mark.parametrize("double_buffer", [True, False], ids=["double", "single"])
def test_offload_keeps_the_forward_bitwise_and_gradients_in_noise(double_buffer):
    """Same model, same kernels: offload changes where bytes live, not what is computed. The loss
    is bitwise equal; gradients differ only by the attention backward's nondeterminism."""
    batch = _batches(1, seed=5)[0]
    model = _model()
    hasten.accelerate(model, Config())
    torch.use_deterministic_algorithms(False)
    model.zero_grad(set_to_none=True)
    ref = model(**batch).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    offload = LayerOffload(decoder_layers(model), ["offload"] * 4, double_buffer=double_buffer)
    offload.attach()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    assert torch.equal(loss, ref)
    worst = max(_rel(p.grad.float(), want[n].float()) for n, p in model.named_parameters())
    assert worst <= 1e-2, worst  # attention backward may use atomics; everything else is exact


def test_device_memory_returns_to_its_baseline_after_each_step():
    batches = _batches(4, seed=2)
    model = _model()
    hasten.accelerate(model, Config())
    offload = LayerOffload(decoder_layers(model), ["offload"] * 4)
    offload.attach()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    baseline = None
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        offload.engine.synchronize()
        gc.collect()
        stats = offload.engine.stats()
        assert stats.tickets == 0 and stats.device_bytes_held == 0 and stats.d2h_bytes_in_flight == 0
        allocated = torch.cuda.memory_allocated()
        baseline = allocated if baseline is None else baseline
        assert allocated == baseline


def _step_peak(model, batch) -> int:
    """Peak device bytes above the step's start, after a warm-up step (pools, kernels, pinned blocks)."""
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() - start


def test_offload_lowers_the_peak():
    batch = _batches(1, seed=3, max_tokens=8192)[0]
    peaks = {}
    for plan in ("keep", "offload"):
        model = _model()
        hasten.accelerate(model, Config())
        offload = LayerOffload(decoder_layers(model), [plan] * 3 + ["keep"])
        offload.attach()
        peaks[plan] = _step_peak(model, batch)
        offload.detach()
        del model, offload
        gc.collect()
    assert peaks["offload"] < 0.8 * peaks["keep"], peaks


def test_offloaded_memory_is_freed_before_the_forward_ends():
    """Only layer 0 offloads; the later layers keep. Once its copy is done (forced here by a sync
    before the last layer), the device copy must be released during the forward, not at backward:
    the memory at the end of the last layer is lower by about layer 0's bytes."""
    batch = _batches(1, seed=6, max_tokens=8192)[0]
    at_end = {}
    for plan in ("keep", "offload"):
        model = _model()
        hasten.accelerate(model, Config())
        layers = decoder_layers(model)
        offload = LayerOffload(layers, [plan, "keep", "keep", "keep"])
        offload.attach()
        layers[2].register_forward_hook(lambda *args: torch.cuda.synchronize())
        layers[3].register_forward_hook(lambda *args: at_end.__setitem__(plan, torch.cuda.memory_allocated()))
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        if plan == "offload":
            saved = offload.bytes_per_layer[0]
        offload.detach()
        del model, offload, layers
        gc.collect()
    assert saved > 10 << 20
    assert at_end["keep"] - at_end["offload"] >= 0.9 * saved, (at_end, saved)


def test_accelerate_with_the_guides_double_buffer_plans_and_trains():
    batches = _batches(3, seed=4)
    want_losses, _ = _train(_model(), batches)
    model = _model()
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": {"double_buffer": True}}}))
    assert handle.offload is not None and handle.offload.mode == "auto"
    losses, _ = _train(model, batches)
    assert handle.offload.plan is not None and len(handle.offload.plan.choices) == 4
    assert handle.offload.bandwidth["h2d_gbps"] > 1.0
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 2e-2 * abs(want)
    row = handle.offload.summary()
    assert row["plan"].endswith("of 4 layers")


def test_link_bandwidth_is_measured():
    bandwidth = measure_link_bandwidth(torch.device("cuda"), nbytes=64 << 20)
    assert bandwidth["d2h_gbps"] > 1.0 and bandwidth["h2d_gbps"] > 1.0


def test_next_batch_prefetcher_hands_out_the_host_batches():
    collator = hasten.PackingCollator(max_tokens=512)
    gen = torch.Generator().manual_seed(0)
    hosts = []
    for _ in range(5):
        batch = collator([{"input_ids": torch.randint(0, 1000, (k,), generator=gen).tolist()} for k in (5, 1, 300)])
        hosts.append({k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()})
    prefetcher = NextBatchPrefetcher(iter(hosts), torch.device("cuda"))
    for host, (item, device_batch) in zip(hosts, prefetcher):
        assert item is host
        for key, value in host.items():
            if isinstance(value, torch.Tensor):
                assert device_batch[key].is_cuda and torch.equal(device_batch[key].cpu(), value)
    assert prefetcher.copies == 5


class _WidthChange(torch.nn.Module):
    """A layer that changes the width: what it saves for backward differs in size from its neighbours'."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.up = torch.nn.Linear(width_in, width_out)
        self.down = torch.nn.Linear(width_out, width_out)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x))) + x.mean(-1, keepdim=True)


@pytest.mark.parametrize("trial", range(4))
def test_random_layer_sizes_and_random_plans_give_the_same_gradients(trial):
    """Stress: random widths (none a multiple of anything), a random keep/offload plan, random
    token counts per step, double buffer. Offload moves bytes, not values: gradients are equal."""
    rng = random.Random(trial)
    widths = [rng.randint(129, 3001) for _ in range(rng.randint(3, 9))]
    plan = [rng.choice(["keep", "offload"]) for _ in widths[1:]]
    steps = [rng.randint(1, 4000) for _ in range(3)]

    def run(offloaded: bool):
        torch.manual_seed(trial)
        layers = torch.nn.ModuleList(_WidthChange(a, b) for a, b in zip(widths, widths[1:])).cuda()
        offload = LayerOffload(layers, plan, double_buffer=True) if offloaded else None
        if offload:
            offload.attach()
        grads = []
        for tokens in steps:
            x = torch.randn(tokens, widths[0], device="cuda", generator=torch.Generator("cuda").manual_seed(tokens))
            for layer in layers:
                x = layer(x)
            x.square().mean().backward()
            grads.append([p.grad.clone() for p in layers.parameters()])
            layers.zero_grad(set_to_none=True)
        return grads, offload

    want, _ = run(False)
    got, offload = run(True)
    for step_got, step_want in zip(got, want):
        for g, w in zip(step_got, step_want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # every seed offloads at least one layer whose activations clear the 1 MiB floor
    assert "offload" in plan and max(steps) * min(widths) * 4 >= 1 << 20
    assert offload.engine.stats().bytes_offloaded > 0
    offload.engine.synchronize()
    assert offload.engine.stats().tickets == 0


# ---- full checkpointing with offload, and the tiled MLP (training.checkpoint) ------------------
def _accelerated(checkpoint: dict, layers: int = SHAPE["num_hidden_layers"], trainable: str | None = None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(SHAPE | {"num_hidden_layers": layers}))).to("cuda", torch.bfloat16).train()
    if trainable is not None:  # as LoRA trains: few weights, so no gradients pile up over the backward
        for name, param in model.named_parameters():
            param.requires_grad_(trainable in name)
    handle = hasten.accelerate(model, Config.from_dict({"training": {"checkpoint": checkpoint}}))
    return model, handle


@pytest.mark.parametrize("tile_tokens", [0, 1000], ids=["untiled", "tiles-of-1000"])
def test_checkpointed_inputs_on_the_host_train_like_full_checkpointing(tile_tokens):
    """activations full + offload all (+ MLP tiles off block multiples): the losses and gradients of
    full checkpointing within bf16 noise, each layer but the last sending exactly its input
    ([tokens, hidden] bf16) to the host, the copies back ahead of use, and a lower peak."""
    batches = _batches(3, seed=7)
    reference, _ = _accelerated({"activations": "full"})
    want_losses, want_grads = _train(reference, batches)
    model, handle = _accelerated({"activations": "full", "offload": "all", "mlp_tile_tokens": tile_tokens})
    assert handle.offload is not None and handle.offload.checkpointed, handle.report()
    assert handle.offload.offload.plan == ["recompute_offload"] * 3 + ["recompute"]
    losses, grads = _train(model, batches)
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 1e-2 * abs(want), (losses, want_losses)
    worst = max(_rel(grads[n], want_grads[n]) for n in want_grads)
    assert worst <= 2e-2, worst
    hidden_bytes = int(batches[-1]["input_ids"].numel()) * SHAPE["hidden_size"] * 2
    assert handle.offload.offload.bytes_per_layer == [hidden_bytes] * 3 + [0]
    row = handle.offload.summary()
    assert row["gib_offloaded"] > 0 and row["fetches"] > 0
    print(f"tiles {tile_tokens}: offload {row}")


def test_a_32768_token_sequence_trains_alike_tiled_and_untiled():
    """Issue 21's check at its length: one 32,768-token sequence (the long-context shape of a batch),
    full checkpointing with the inputs on the host, the MLP untiled against tiles of 5,000 tokens
    (off block multiples, the last tile short): losses and every gradient within bf16 noise."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, SHAPE["vocab_size"], (32768,), generator=gen).tolist()
    batch = move_batch(hasten.PackingCollator(max_tokens=32768)([{"input_ids": ids}]), "cuda")
    results = {}
    for tile_tokens in (0, 5000):
        model, handle = _accelerated({"activations": "full", "offload": "all", "mlp_tile_tokens": tile_tokens})
        results[tile_tokens] = _train(model, [batch, batch])
        handle.undo()
        del model, handle
        gc.collect()
    (want_losses, want_grads), (losses, grads) = results[0], results[5000]
    for got, want in zip(losses, want_losses):
        assert abs(got - want) <= 1e-2 * abs(want), (losses, want_losses)
    worst = max(_rel(grads[n], want_grads[n]) for n in want_grads)
    print(f"32,768 tokens, tiles of 5,000 against untiled: losses {losses} / {want_losses}, worst gradient {worst:.2e}")
    assert worst <= 2e-2, worst


def test_checkpointed_inputs_offloaded_and_tiles_lower_the_peak():
    """8 layers, only the q projections trained (as LoRA trains: a full fine-tune's weight gradients
    pile up over the backward and put its peak at the end, where no input is held; measured at
    01174a3: 153.0 MB full, 152.7 offloaded): full checkpointing holds all 8 inputs at the first
    backward; with offload the device holds the last layer's and at most two more brought back."""
    batch = _batches(1, seed=8, max_tokens=8192)[0]
    peaks, rows = {}, {}
    for name, checkpoint in [("full", {"activations": "full"}),
                             ("offload", {"activations": "full", "offload": "all"}),
                             ("tiled", {"activations": "full", "offload": "all", "mlp_tile_tokens": 2048})]:
        model, handle = _accelerated(checkpoint, layers=8, trainable="q_proj")
        peaks[name] = _step_peak(model, batch)
        rows[name] = handle.offload.summary() if handle.offload is not None else None
        handle.undo()
        del model, handle
        gc.collect()
    print("peaks above the step's start (MiB):", {k: v >> 20 for k, v in peaks.items()}, rows)
    hidden_bytes = int(batch["input_ids"].numel()) * SHAPE["hidden_size"] * 2
    assert peaks["full"] - peaks["offload"] >= 4 * hidden_bytes, (peaks, hidden_bytes)
    assert peaks["tiled"] < peaks["offload"], peaks


def test_copies_behind_a_host_that_runs_ahead_are_done_before_the_loss():
    """The device sleeps while the host queues the forward (as in a step without syncs): the
    offload copies would still be in flight at the loss, holding their device memory; the host
    waits for them instead (at most two layers' worth during the forward, none at its end)."""
    batch = _batches(1, seed=9, max_tokens=8192)[0]
    model, handle = _accelerated({"activations": "full", "offload": "all"}, layers=8)
    model(**batch).loss.backward()  # warm-up: pools, kernels
    model.zero_grad(set_to_none=True)
    handle.offload.summary()
    engine = handle.offload.offload.engine
    seen = {}
    last = decoder_layers(model)[-1]
    def probe_in_flight(*args):  # returns None: a forward hook's value would replace the layer's output
        seen.setdefault("in_flight", engine.stats().d2h_bytes_in_flight)

    probe = last.register_forward_hook(probe_in_flight)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # about a quarter of a second of device time queued first
    model(**batch).loss.backward()
    torch.cuda.synchronize()
    probe.remove()
    row = handle.offload.summary()
    print("after a sleeping device:", row, seen)
    assert seen["in_flight"] == 0  # hasten's own post-forward hook of the last layer ran first
    assert row["forward_waits"] > 0
    handle.undo()
