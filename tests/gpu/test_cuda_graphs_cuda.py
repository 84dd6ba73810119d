"""CUDA graphs on the GPU: GraphedAdamW against eager fused AdamW (changing LR, accumulation,
checkpoint resume, hasten train), and the captured MoE block's gradients against eager ones.
Each test prints what it measured (ulp differences, relative differences) for the GPU log."""

import io
import json

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from hasten.config import Config
from hasten.integrations.transformers import registered
from hasten.observability import count_host_syncs, fallback_counts
from hasten.training import loop
from hasten.training.graphed_optimizer import FALLBACK, GraphedAdamW

MANTISSA = {torch.float32: 23, torch.bfloat16: 7}


def _model(dtype, seed=0):
    """GEMMs and elementwise ops only: their gradients are bitwise reproducible run to run, so any
    difference between two runs is the optimizer's."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 16))
    return model.to("cuda", dtype)


def _batch(step, micro, dtype):
    gen = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(512, 64, generator=gen).to("cuda", dtype), torch.randn(512, 16, generator=gen).to("cuda", dtype)


def _train(model, opt, scheduler, steps, dtype, first=0, micro_batches=2):
    """Steps as hasten train runs them: backward per micro-batch (accumulating), step, schedule, zero."""
    for step in range(first, first + steps):
        for micro in range(micro_batches):
            x, y = _batch(step, micro, dtype)
            loss = torch.nn.functional.mse_loss(model(x).float(), y.float()) / micro_batches
            loss.backward()
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)


def _ulp(x, dtype):
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - MANTISSA[dtype])


def _ulps(a, b):
    """The largest difference in units of the last place of the tensor's largest element (the
    precision the tensor carries), the same per element (large for weights near zero, whose own
    last place is tiny), and the share of elements that differ."""
    a64, b64 = a.detach().double(), b.detach().double()
    diff = (a64 - b64).abs()
    return ((diff / _ulp(b64.abs().max(), b.dtype)).max().item(), (diff / _ulp(b64, b.dtype)).max().item(),
            (a != b).float().mean().item())


# rates per step: FACTORS_ANY make base * factor a double that float32 rounds; FACTORS_EXACT keep
# float32 numbers (powers of two), where the graph's float32 rate equals the eager double
FACTORS_ANY = [0.1, 0.55, 1.0, 0.7310585786300049, 0.3141592653589793, 0.123456789, 0.9, 0.42]
FACTORS_EXACT = [0.125, 0.5, 1.0, 0.75, 0.25, 0.375, 0.0625, 0.5]


def _pair(dtype, factors, warmup_steps, base_lr):
    eager_model, graphed_model = _model(dtype), _model(dtype)
    eager = torch.optim.AdamW(eager_model.parameters(), lr=base_lr, weight_decay=0.1, fused=True)
    graphed = GraphedAdamW(graphed_model.parameters(), lr=base_lr, weight_decay=0.1, warmup_steps=warmup_steps)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: factors[min(s, len(factors) - 1)])
                 for o in (eager, graphed)]
    return (eager_model, eager, schedules[0]), (graphed_model, graphed, schedules[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rates", ["float32_exact", "any"])
def test_graphed_adamw_equals_eager_fused_adamw_over_5_steps_with_a_changing_lr(dtype, rates):
    factors = FACTORS_EXACT if rates == "float32_exact" else FACTORS_ANY
    base = 2.0 ** -9 if rates == "float32_exact" else 1.3e-3
    (em, eo, es), (gm, go, gs) = _pair(dtype, factors, warmup_steps=1, base_lr=base)
    _train(em, eo, es, 5, dtype)
    _train(gm, go, gs, 5, dtype)
    assert (go.eager_steps, go.captures, go.replays) == (1, 1, 4), "the graph must run steps 2-5"
    assert not fallback_counts(), fallback_counts()
    assert [g["lr"] for g in go.param_groups] == [g["lr"] for g in eo.param_groups]  # floats, the same schedule
    worst = per_element = share = 0.0
    for a, b in zip(gm.parameters(), em.parameters()):
        ulps, element_ulps, differ = _ulps(a, b)
        worst, per_element, share = max(worst, ulps), max(per_element, element_ulps), max(share, differ)
    for a, b in zip(go.state.values(), eo.state.values()):
        assert torch.equal(a["step"], b["step"])
        if rates == "float32_exact":  # else the weights' last bits feed back into the gradients
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    print(f"\ngraphed vs eager fused AdamW, {dtype}, rates {rates}, 5 steps: max {worst:.2f} ulp of each tensor's "
          f"largest weight, {per_element:.1f} ulp of the element itself, {share:.2e} of elements differ")
    if rates == "float32_exact":
        assert worst == 0, "the same kernel on the same tensors with the same rate must be bit-identical"
    else:
        # a stale or wrong rate moves weights by whole updates (about 1e5 ulp here)
        assert worst <= 4, f"{worst} ulp: more than the rate's float32 rounding can explain"


def test_graphed_adamw_replays_without_host_syncs_and_reads_new_rates():
    (em, eo, es), (gm, go, gs) = _pair(torch.float32, FACTORS_EXACT, warmup_steps=2, base_lr=2.0 ** -9)
    _train(gm, go, gs, 3, torch.float32)
    assert go.captured
    x, y = _batch(50, 0, torch.float32)
    torch.nn.functional.mse_loss(gm(x), y).backward()
    torch.cuda.synchronize()
    with count_host_syncs() as syncs:
        go.step()
        gs.step()
        go.zero_grad()
    assert syncs.count == 0, syncs.sites
    # a rate of zero (weight decay is scaled by it too): the replay must leave the weights as they are
    before = [p.detach().clone() for p in gm.parameters()]
    for g in go.param_groups:
        g["lr"] = 0.0
    torch.nn.functional.mse_loss(gm(x), y).backward()
    go.step()
    assert all(torch.equal(a, b) for a, b in zip(gm.parameters(), before))


def test_graphed_adamw_checkpoint_resumes_identically_in_either_optimizer():
    dtype, base = torch.float32, 2.0 ** -9
    (em, eo, es), _ = _pair(dtype, FACTORS_EXACT, warmup_steps=2, base_lr=base)
    _train(em, eo, es, 8, dtype)  # the uninterrupted eager run

    def saved(model, opt, scheduler):
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, buf)
        buf.seek(0)
        return torch.load(buf, map_location="cuda", weights_only=True)

    def resumed(ckpt, graphed: bool):
        """A fresh (model, optimizer, scheduler), eager or graphed, loaded from ckpt."""
        eager, graph = _pair(dtype, FACTORS_EXACT, warmup_steps=2, base_lr=base)
        model, opt, scheduler = graph if graphed else eager
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        scheduler.load_state_dict(ckpt["sched"])
        return model, opt, scheduler

    # graphed 5 steps, checkpoint, a fresh graphed optimizer resumes for 3 (warms up, captures again)
    _, (gm, go, gs) = _pair(dtype, FACTORS_EXACT, warmup_steps=2, base_lr=base)
    _train(gm, go, gs, 5, dtype)
    rm, ro, rs = resumed(saved(gm, go, gs), graphed=True)
    _train(rm, ro, rs, 3, dtype, first=5)
    assert ro.captures == 1 and ro.replays == 1
    assert all(torch.equal(a, b) for a, b in zip(rm.parameters(), em.parameters()))

    # eager 3 steps -> graphed 3 steps -> eager 2 steps
    (am, ao, as_), _ = _pair(dtype, FACTORS_EXACT, warmup_steps=2, base_lr=base)
    _train(am, ao, as_, 3, dtype)
    bm, bo, bs = resumed(saved(am, ao, as_), graphed=True)
    _train(bm, bo, bs, 3, dtype, first=3)
    assert bo.replays == 1
    cm, co, cs = resumed(saved(bm, bo, bs), graphed=False)
    _train(cm, co, cs, 2, dtype, first=6)
    assert all(torch.equal(a, b) for a, b in zip(cm.parameters(), em.parameters()))


TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 512, "max_steps": 6, "learning_rate": 0.003, "warmup_steps": 2,
                     "logging_steps": 1, "gradient_accumulation_steps": 2,
                     "checkpoint": {"interval_steps": 2, "keep_last": 2}}}


def test_hasten_train_with_cuda_graphs_optimizer_follows_the_eager_run(tmp_path):
    eager = loop.train(Config.from_dict(TINY), tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    raw = json.loads(json.dumps(TINY))
    raw["training"]["cuda_graphs"] = "optimizer"
    graphed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False)
    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    print(f"\neager losses   {[round(v, 5) for v in eager.losses]}\ngraphed losses {[round(v, 5) for v in graphed.losses]}"
          f"\noptimizer_graph {summary['optimizer_graph']}; fallbacks {summary['fallbacks']}")
    assert summary["optimizer_graph"]["captured"] and summary["optimizer_graph"]["replays"] == 4
    assert summary["optimizer_graph"]["eager_steps"] == 2 and FALLBACK not in summary["fallbacks"]
    for step, (a, b) in enumerate(zip(eager.losses, graphed.losses), start=1):
        assert b == pytest.approx(a, rel=2e-2, abs=2e-2), f"step {step}: eager {a} graphed {b}"
    rows = [json.loads(line) for line in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(r["lr"], float) for r in rows)  # the schedule's floats, as without graphs
    # resume from the last checkpoint to 8 steps: loads the state, warms up again, trains on
    raw["training"]["max_steps"] = 8
    resumed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False,
                         resume="auto")
    assert resumed.steps == 8 and all(v == v for v in resumed.losses)


# --- the MoE block captured whole (W3's hasten_graphed at a smaller size) --------------------------

def _block(seed=0):
    config = Qwen3MoeConfig(hidden_size=512, num_experts=32, num_experts_per_tok=8, moe_intermediate_size=256,
                            norm_topk_prob=True)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        block = Qwen3MoeSparseMoeBlock(config)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
    config._experts_implementation = "hasten_fused"
    return block.to(torch.bfloat16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _eager(block, x, grad):
    x = x.detach().clone().requires_grad_()
    block.zero_grad(set_to_none=True)
    out = block(x)
    out.backward(grad)
    return out.detach(), x.grad, [p.grad.clone() for p in block.parameters()]


def _check(got, want, what):
    diffs = [_rel(a, b) for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]])]
    exact = all(torch.equal(a, b) for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]))
    print(f"\n{what}: output rel diff {diffs[0]:.2e}, input grad {diffs[1]:.2e}, parameter grads max "
          f"{max(diffs[2:]):.2e}, bitwise equal {exact}")
    assert max(diffs) <= 1e-3, diffs


def test_captured_moe_block_forward_backward_equals_eager():
    with registered():  # the "hasten_fused" name accelerate() would register; a bare block has none
        _captured_moe_block_forward_backward_equals_eager()


def _captured_moe_block_forward_backward_equals_eager():
    block = _block()
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(1, 4096, 512, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]
    grad = torch.randn(1, 4096, 512, generator=gen).to("cuda", torch.bfloat16)
    want = [_eager(block, d, grad) for d in data]

    x = data[0].clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.grad = None
            block.zero_grad(set_to_none=True)
            block(x).backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    block.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
        out.backward(grad)
    assert not fallback_counts(), fallback_counts()
    for i, d in enumerate(data * 2):  # a new input each replay, copied into the static one; twice round
        with torch.no_grad():
            x.copy_(d)
        with count_host_syncs() as syncs:
            graph.replay()
        torch.cuda.synchronize()
        assert syncs.count == 0
        _check((out, x.grad, [p.grad for p in block.parameters()]), want[i % 2], f"replay {i}")


@pytest.mark.xfail(strict=True, reason="measured on one H200 at b17c98e: after 2 accumulated micro-batches through "
                   "make_graphed_callables the parameter gradients were off by a relative 1.0 against eager; not "
                   "understood yet, so W3's hasten_graphed_callables row is measured with a zero_grad per step only")
def test_graphed_callables_moe_block_accumulates_gradients_like_eager():
    with registered():
        _graphed_callables_moe_block_accumulates_gradients_like_eager()


def _graphed_callables_moe_block_accumulates_gradients_like_eager():
    block, ref = _block(), _block()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randn(1, 2048, 512, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(2)]
    grad = torch.randn(1, 2048, 512, generator=gen).to("cuda", torch.bfloat16)
    graphed = torch.cuda.make_graphed_callables(block, (data[0].detach().clone().requires_grad_(),))
    ref.zero_grad(set_to_none=True)
    for d in data:  # two micro-batches accumulate into .grad
        ref(d).backward(grad)
    want_grads = [p.grad.clone() for p in ref.parameters()]
    block.zero_grad(set_to_none=True)
    outs = []
    for d in data:
        x = d.detach().clone().requires_grad_()
        out = graphed(x)
        out.backward(grad)
        outs.append(out.detach().clone())
    diffs = [_rel(a.grad, b) for a, b in zip(block.parameters(), want_grads)]
    print(f"\nmake_graphed_callables, 2 accumulated micro-batches: parameter grads max rel diff {max(diffs):.2e}")
    assert max(diffs) <= 1e-3
    with torch.no_grad():
        assert _rel(outs[1], ref(data[1])) <= 1e-3


# --- the whole packed dense step captured (W1's hasten_graphed_step at a tiny size) -----------------

def test_the_whole_packed_step_in_one_graph_follows_the_eager_step():
    """benchmarks/packed_sft.py's `graphed_training_step` on a tiny Qwen3 with hasten's default
    settings (cuDNN varlen attention, the fused kernels and loss): forward, loss, backward and a
    capturable fused AdamW captured in one CUDA graph and replayed follow the same model trained
    eagerly, loss by loss (bf16 noise; cuDNN's backward sums dQ in a float32 workspace in any
    order) and parameter by parameter after 7 steps; a replay syncs nothing, nothing falls back."""
    import copy
    import sys
    from pathlib import Path

    from transformers import Qwen3Config, Qwen3ForCausalLM

    import hasten
    from hasten.observability import reset_fallbacks
    from hasten.packing import move_batch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import common
    from packed_sft import graphed_training_step

    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(0)
    eager_model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
    graphed_model = copy.deepcopy(eager_model)
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 37, 5, 200, 64, 1, 129]  # one-token samples and a long one, off block multiples
    samples = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator).tolist()} for n in lengths]
    batch = move_batch(hasten.PackingCollator(max_tokens=sum(lengths))(samples), "cuda")
    reset_fallbacks()
    handles = [hasten.accelerate(m) for m in (eager_model, graphed_model)]
    try:
        optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True, capturable=True)
                      for m in (eager_model, graphed_model)]
        eager_losses, graphed_losses, notes = [], [], []
        eager_step = common.training_step(eager_model, [batch], optimizers[0], eager_losses)
        graphed_step = graphed_training_step(graphed_model, batch, optimizers[1], graphed_losses, notes)
        graphed_step()  # 3 eager steps, the capture, one replay: 4 optimizer steps
        assert len(graphed_losses) == 4 and notes
        for _ in range(4):
            eager_step()
        for _ in range(2):
            graphed_step()
            eager_step()
        with count_host_syncs() as syncs:
            graphed_step()
        eager_step()
        torch.cuda.synchronize()
        assert syncs.count == 0
        assert fallback_counts() == {}, fallback_counts()
        want = [float(v) for v in eager_losses]
        got = [float(v) for v in graphed_losses]
        print(f"\neager losses   {[round(v, 5) for v in want]}\ngraphed losses {[round(v, 5) for v in got]}")
        assert len(got) == len(want) == 7 and got[0] > got[-1]  # it trains
        for step, (a, b) in enumerate(zip(want, got), start=1):
            assert b == pytest.approx(a, rel=2e-2, abs=2e-2), f"step {step}: eager {a} graphed {b}"
        for (name, a), b in zip(eager_model.named_parameters(), graphed_model.parameters()):
            assert _rel(b.float(), a.float()) <= 2e-2, name
    finally:
        for handle in reversed(handles):
            handle.undo()


# --- training.cuda_graphs: step (hasten.training.graphed_step) ------------------------------------

def _tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)


def _host_batch(lengths, seed):
    import hasten

    gen = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(0, 1000, (n,), generator=gen).tolist()} for n in lengths]
    return hasten.PackingCollator(max_tokens=512)(samples)


def test_step_graphs_replay_each_micro_batch_as_its_eager_run():
    """StepGraphs on a tiny Qwen3 with hasten's defaults: the bucket's first batch runs eagerly, the
    second is captured and replayed, later ones replay with their own data; each micro-batch's loss
    and gradients against the same padded batch run eagerly (bf16: cuDNN's backward sums dQ in any
    order), no host sync in a replay, and a gradient set to None turns the graphs off, said once."""
    import hasten
    from hasten.observability import reset_fallbacks
    from hasten.packing import move_batch
    from hasten.training.graphed_step import FALLBACK as STEP_FALLBACK
    from hasten.training.graphed_step import StepGraphs

    model = _tiny_qwen3()
    model.train()
    reset_fallbacks()
    handle = hasten.accelerate(model)
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        graphs = StepGraphs(model, params, max_tokens=512, pad_token_id=0, accumulation=2, device=torch.device("cuda"))

        def eager_reference(device_batch):
            for p in params:
                p.grad = None
            loss = model(**device_batch).loss / 2
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in params]

        # four batches of one bucket (<= 8 sequences, longest <= 256, padded to 512 tokens)
        host = [_host_batch(lengths, seed) for seed, lengths in
                enumerate([[1, 37, 5, 200, 64, 1, 160], [250, 3, 200], [90] * 4 + [130], [1, 255, 200]])]
        padded = [graphs.pad(b) for b in host]
        assert len({tuple(p["input_ids"].shape) for p in padded}) == 1 and padded[0]["input_ids"].shape[-1] == 512
        references = [eager_reference(move_batch(p, "cuda")) for p in padded]
        for p in params:
            p.grad.zero_()  # the graphs add into gradients that stay in place
        for i, (batch, (want_loss, want_grads)) in enumerate(zip(padded, references)):
            with count_host_syncs() as syncs:
                loss = graphs.forward_backward(move_batch(batch, "cuda"))
            torch.cuda.synchronize()
            diffs = [_rel(p.grad, g) for p, g in zip(params, want_grads)]
            exact = all(torch.equal(p.grad, g) for p, g in zip(params, want_grads))
            print(f"\nmicro-batch {i}: loss {float(loss):.5f} (eager {float(want_loss):.5f}), gradients max rel diff "
                  f"{max(diffs):.2e}, bitwise equal {exact}, syncs {syncs.count}, {graphs.summary()}")
            assert float(loss) == pytest.approx(float(want_loss), rel=1e-2)
            assert max(diffs) <= 1e-2, diffs
            if i >= 2:
                assert syncs.count == 0
            for p in params:
                p.grad.zero_()
        assert graphs.summary() == {"graphs": 1, "shapes": 1, "captures": 1, "replays": 3, "eager_micro_batches": 1,
                                    "disabled_reason": None}
        assert STEP_FALLBACK not in fallback_counts(), fallback_counts()  # (a build without the cuDNN op counts its own)
        params[0].grad = None  # e.g. zero_grad(set_to_none=True) by other code: the graph's adds would be lost
        loss = graphs.forward_backward(move_batch(padded[1], "cuda"))
        assert graphs.disabled_reason is not None and "replaced or set to None" in graphs.disabled_reason
        assert fallback_counts()[STEP_FALLBACK] == 1 and params[0].grad is not None and torch.isfinite(loss)
    finally:
        handle.undo()


STEP_TINY = {"model": {"default_size": "tiny"},
             "training": {"max_tokens": 512, "max_steps": 12, "learning_rate": 0.003, "warmup_steps": 2,
                          "logging_steps": 1, "gradient_accumulation_steps": 2,
                          "checkpoint": {"interval_steps": 4, "keep_last": 2}}}


@pytest.mark.parametrize("activations", ["none", "full"])
def test_hasten_train_with_step_graphs_follows_the_eager_run(tmp_path, activations):
    from hasten.training.graphed_step import FALLBACK as STEP_FALLBACK

    raw = json.loads(json.dumps(STEP_TINY))
    raw["training"]["checkpoint"]["activations"] = activations
    eager = loop.train(Config.from_dict(raw), tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    raw["training"]["cuda_graphs"] = "step"
    graphed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False)
    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()]
    eager_rows = [json.loads(line) for line in (tmp_path / "a" / "logs" / "metrics.jsonl").read_text().splitlines()]
    print(f"\nactivations {activations}\neager losses   {[round(v, 5) for v in eager.losses]}\ngraphed losses "
          f"{[round(v, 5) for v in graphed.losses]}\nstep_graphs {summary['step_graphs']}; optimizer_graph "
          f"{summary['optimizer_graph']}; fallbacks {summary['fallbacks']}\nsyncs per step "
          f"{[r['host_syncs_per_step'] for r in rows]}; tokens {[r['tokens'] for r in rows]}")
    assert summary["step_graphs"]["replays"] > 0 and summary["step_graphs"]["disabled_reason"] is None
    assert STEP_FALLBACK not in summary["fallbacks"] and summary["optimizer_graph"]["captured"]
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in eager_rows]  # real tokens only, not the padding
    for step, (a, b) in enumerate(zip(eager.losses, graphed.losses), start=1):
        assert b == pytest.approx(a, rel=2e-2, abs=2e-2), f"step {step}: eager {a} graphed {b}"
    raw["training"]["max_steps"] = 14  # resume from the last checkpoint and go on under graphs
    resumed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False,
                         resume="auto")
    assert resumed.steps == 14 and all(v == v for v in resumed.losses)
    resumed_graphs = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())["step_graphs"]
    assert resumed_graphs["replays"] > 0 and resumed_graphs["disabled_reason"] is None, resumed_graphs
