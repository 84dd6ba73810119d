"""training.cuda_graphs: step on the CPU: the buckets, the padding (its shapes, and that a padded
batch trains exactly as the batch itself: loss and every gradient of a float32 model), the
settings refused before a run, the run-time refusals, and the CPU fallback (said once, the same
run as eager). The capture and replay are tested in tests/gpu/test_cuda_graphs_cuda.py."""

import contextlib
import json

import pytest
import torch

import hasten
from hasten.config import Config, ConfigError
from hasten.observability import fallback_counts, fallback_reasons
from hasten.packing import PackingCollator
from hasten.training import loop
from hasten.training.graphed_step import (FALLBACK, pad_packed_batch, refusal, shape_key, token_bucket,
                                          token_step)

TINY = {"model": {"default_size": "tiny"},
        "training": {"max_tokens": 384, "max_steps": 4, "learning_rate": 0.003, "warmup_steps": 2,
                     "logging_steps": 1, "gradient_accumulation_steps": 2,
                     "checkpoint": {"interval_steps": 2, "keep_last": 2}}}


# --- buckets and padding -------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens, step", [(4096, 512), (16384, 2048), (384, 64), (100, 64), (1000, 128)])
def test_token_step_is_an_eighth_of_max_tokens_in_multiples_of_64(max_tokens, step):
    assert token_step(max_tokens) == step


@pytest.mark.parametrize("tokens, max_tokens, bucket", [(1, 4096, 512), (512, 4096, 512), (513, 4096, 1024),
                                                        (4095, 4096, 4096), (4096, 4096, 4096), (65, 100, 100),
                                                        (999, 1000, 1000), (897, 1000, 1000), (896, 1000, 896)])
def test_token_bucket_rounds_up_to_the_step_and_never_past_max_tokens(tokens, max_tokens, bucket):
    assert token_bucket(tokens, max_tokens) == bucket


def _batch(lengths, seed=0, vocab=1000):
    gen = torch.Generator().manual_seed(seed)
    samples = [{"input_ids": torch.randint(1, vocab, (n,), generator=gen).tolist()} for n in lengths]
    return PackingCollator(max_tokens=sum(lengths))(samples)


def test_padding_appends_one_sequence_without_loss_and_empty_sequences_to_a_power_of_two():
    batch = _batch([1, 37, 5, 200])
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    padded = pad_packed_batch(batch, 320, pad_token_id=7)
    assert padded["input_ids"].shape == padded["labels"].shape == padded["position_ids"].shape == (1, 320)
    assert padded["seq_idx"].shape == (320,)
    assert padded["input_ids"][0, 243:].eq(7).all() and padded["labels"][0, 243:].eq(-100).all()
    assert padded["position_ids"][0, 243:].tolist() == list(range(77))
    assert padded["seq_idx"][243:].eq(4).all()
    assert padded["cu_seq_lens_q"] is padded["cu_seq_lens_k"]
    assert padded["cu_seq_lens_q"].tolist() == [0, 1, 38, 43, 243, 320, 320, 320, 320]  # 5 -> 8 sequences
    assert padded["cu_seq_lens_q"].dtype == torch.int32
    assert padded["max_length_q"] == padded["max_length_k"] == 256  # 200 -> a power of two
    for key in ("input_ids", "labels", "position_ids", "seq_idx"):
        assert torch.equal(padded[key][..., :243], batch[key]), key
    for key, value in before.items():  # the collator's batch is not written
        assert torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value


def test_padding_to_the_same_length_only_rounds_the_counts():
    batch = _batch([3, 60])
    padded = pad_packed_batch(batch, 63, pad_token_id=0)
    assert torch.equal(padded["input_ids"], batch["input_ids"])
    assert padded["cu_seq_lens_q"].tolist() == [0, 3, 63, 63, 63, 63, 63, 63, 63]
    assert padded["max_length_q"] == 64


def test_padding_refuses_what_it_cannot_pad():
    with pytest.raises(ValueError, match="one-row packed batch of at most 10 tokens"):
        pad_packed_batch(_batch([5, 6]), 10, pad_token_id=0)


def test_batches_of_one_bucket_share_a_shape_key_and_other_buckets_do_not():
    keys = {shape_key(pad_packed_batch(_batch(lengths, seed), 512, 0))
            for seed, lengths in enumerate([[1, 37, 200], [300, 100], [17] * 7, [450]])}
    assert len(keys) == 1  # <= 8 sequences, longest <= 512: one graph
    assert shape_key(pad_packed_batch(_batch([5] * 9), 512, 0)) not in keys  # 10 sequences -> 16
    assert shape_key(pad_packed_batch(_batch([100]), 128, 0)) not in keys


def _model(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).float()


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_padded_batch_trains_exactly_as_the_batch_itself():
    """float32 on the CPU with hasten's patches: the loss and every gradient of the padded batch
    (one-token and long samples, a padding sequence, empty sequences) equal the batch's own."""
    model = _model()
    model.train()
    handle = hasten.accelerate(model)
    try:
        batch = _batch([1, 37, 5, 200, 64, 1, 129], seed=3)
        want_loss, want = _loss_and_grads(model, batch)
        got_loss, got = _loss_and_grads(model, pad_packed_batch(batch, 512, pad_token_id=0))
    finally:
        handle.undo()
    assert torch.isfinite(want_loss)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
        assert got[name].abs().max() > 0, name  # every parameter is trained by the real tokens


# --- settings and refusals -----------------------------------------------------------------------

def test_cuda_graphs_takes_step():
    assert Config.from_dict({"training": {"cuda_graphs": "step"}}).training.cuda_graphs == "step"


@pytest.mark.parametrize("setting, named", [
    ({"training": {"packed_sequence": False}}, "`training.packed_sequence: false`"),
    ({"training": {"compile": True}}, "`training.compile: true`"),
    ({"training": {"metadata_cache": False}}, "`training.metadata_cache: false`"),
    ({"training": {"checkpoint": {"offload": "all", "activations": "full"}}}, "`training.checkpoint.offload: all`"),
    ({"training": {"checkpoint": {"mlp_tile_tokens": 1024}}}, "`training.checkpoint.mlp_tile_tokens`"),
    ({"attention": {"verify": True}}, "`attention.verify: true`"),
    ({"lora": {"enabled": True, "dropout": 0.1}}, "`lora.dropout: 0.1`"),
])
def test_step_graphs_refuse_settings_they_cannot_replay(setting, named):
    raw = json.loads(json.dumps(setting))
    raw.setdefault("training", {})["cuda_graphs"] = "step"
    with pytest.raises(ConfigError, match="`training.cuda_graphs: step` replays each micro-batch") as caught:
        Config.from_dict(raw)
    assert named in str(caught.value) and "set training.cuda_graphs: optimizer" in str(caught.value)


def _refusal(**overrides):
    args = dict(device=torch.device("cuda", 0), distributed=False, model=_model(), optimizer_captured=True)
    return refusal(**(args | overrides))


def test_step_graphs_refusals_at_run_time(monkeypatch):
    assert _refusal() is None
    assert "trains on cpu" in _refusal(device=torch.device("cpu"))
    assert "torchrun" in _refusal(distributed=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert "model type 'llama': padded packed batches are verified to train as unpadded only for qwen3" in \
        _refusal(model=llama)
    assert "model type '?'" in _refusal(model=torch.nn.Linear(2, 2))
    model = _model()
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.1))
    assert "dropout is on (model.layers.0.mlp.act_fn.1)" in _refusal(model=model)
    model = _model()
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.0))
    assert _refusal(model=model) is None
    model.config.attention_dropout = 0.1
    assert "dropout is on (attention_dropout)" in _refusal(model=model)
    assert "optimizer step is not captured" in _refusal(optimizer_captured=False)
    monkeypatch.setenv("HASTEN_VERIFY", "1")
    assert "HASTEN_VERIFY" in _refusal()


def test_cpu_run_with_step_graphs_equals_the_eager_run_exactly(tmp_path):
    eager = loop.train(Config.from_dict(TINY), tmp_path / "a", tmp_path / "a" / "logs", progress=False)
    raw = json.loads(json.dumps(TINY))
    raw["training"]["cuda_graphs"] = "step"
    graphed = loop.train(Config.from_dict(raw), tmp_path / "b", tmp_path / "b" / "logs", progress=False)
    assert graphed.losses == eager.losses  # exactly: nothing is padded when nothing is replayed
    summary = json.loads((tmp_path / "b" / "logs" / "summary.json").read_text())
    assert "trains on cpu" in summary["fallback_reasons"][FALLBACK]
    assert summary["fallbacks"][FALLBACK] == 1 and summary["step_graphs"] is None
    assert any(item.startswith("CUDA graphs per micro-batch (training.cuda_graphs step: this run trains on cpu")
               for item in summary["hasten_inactive"])


# --- StepGraphs' bookkeeping, with a stand-in for CUDA graphs on the CPU --------------------------

class _FakeStream:
    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


class _FakeGraph:
    """A capture runs nothing (the body runs, then the gradients it wrote are put back); a replay
    runs the captured micro-batch again on the graph's static inputs, adding into the gradients and
    writing its loss tensor in place, as the CUDA graph would."""

    owner = None  # the StepGraphs under test
    fail_with: Exception | None = None

    def replay(self):
        graphs = _FakeGraph.owner
        entry = next(e for e in graphs.entries.values() if e.graph is self)
        loss = graphs.model(**entry.static).loss / graphs.accumulation
        loss.backward()
        entry.loss.copy_(loss.detach())


class _fake_capture:
    def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
        graphs = _FakeGraph.owner
        assert pool is graphs.pool and stream is graphs.stream and capture_error_mode == "thread_local"

    def __enter__(self):
        if _FakeGraph.fail_with is not None:
            raise _FakeGraph.fail_with
        graphs = _FakeGraph.owner
        self.saved = [(p, p.grad.clone()) for p in graphs.params if p.grad is not None]

    def __exit__(self, *exc):
        with torch.no_grad():
            for p, grad in self.saved:
                p.grad.copy_(grad)
        return False


@pytest.fixture
def fake_cuda(monkeypatch):
    from hasten.training import graphed_step

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    _FakeGraph.fail_with = None
    model = _model()
    model.train()
    handle = hasten.accelerate(model)
    params = list(model.parameters())

    def make(**kwargs):
        graphs = graphed_step.StepGraphs(model, params, max_tokens=512, pad_token_id=0, device=torch.device("cpu"),
                                         **({"accumulation": 2} | kwargs))
        _FakeGraph.owner = graphs
        return graphs

    yield make, model, params
    _FakeGraph.owner = None
    handle.undo()


def _reference(model, params, batch, accumulation=2):
    """The micro-batch run eagerly, its gradients alone; the gradients stay the same tensors (as
    GraphedAdamW keeps them), zeroed after."""
    for p in params:
        if p.grad is not None:
            p.grad.zero_()
    loss = model(**batch).loss / accumulation
    loss.backward()
    want = [p.grad.clone() for p in params]
    for p in params:
        p.grad.zero_()  # in place, as GraphedAdamW's zero_grad
    return loss.detach(), want


# one shape: 449-512 tokens padded to 512, at most 7 samples (8 sequences with the padding), longest <= 256
BUCKET = [[1, 37, 5, 200, 64, 1, 160], [250, 3, 200], [90] * 4 + [130], [1, 255, 200]]


def test_step_graphs_warm_up_capture_and_replay_each_batch_as_its_eager_run(fake_cuda):
    make, model, params = fake_cuda
    graphs = make()
    for i, lengths in enumerate(BUCKET):
        batch = graphs.pad(_batch(lengths, seed=i))
        want_loss, want = _reference(model, params, batch)
        loss = graphs.forward_backward(batch)
        assert torch.equal(loss, want_loss), i
        assert all(torch.equal(p.grad, g) for p, g in zip(params, want)), i  # the replay read this batch's data
        for p in params:
            p.grad.zero_()
    assert graphs.summary() == {"graphs": 1, "shapes": 1, "captures": 1, "replays": 3, "eager_micro_batches": 1,
                                "disabled_reason": None}


def test_step_graphs_accumulate_micro_batches_into_the_gradients(fake_cuda):
    make, model, params = fake_cuda
    graphs = make()
    batches = [graphs.pad(_batch(lengths, seed=i)) for i, lengths in enumerate(BUCKET)]
    graphs.forward_backward(batches[0])  # the warm-up
    for p in params:
        p.grad.zero_()
    want = [torch.zeros_like(p) for p in params]
    for batch in batches[1:]:
        for w, g in zip(want, _reference(model, params, batch)[1]):
            w += g
    for batch in batches[1:]:  # capture + replay, replay, replay: three micro-batches of one step
        graphs.forward_backward(batch)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)


def test_step_graphs_turn_off_when_a_gradient_is_replaced(fake_cuda):
    make, model, params = fake_cuda
    graphs = make()
    batches = [graphs.pad(_batch(lengths, seed=i)) for i, lengths in enumerate(BUCKET)]
    graphs.forward_backward(batches[0])
    graphs.forward_backward(batches[1])  # captured
    params[1].grad = None  # zero_grad(set_to_none=True) by other code: the graph's adds would land elsewhere
    graphs.forward_backward(batches[2])
    params[1].grad = None
    loss = graphs.forward_backward(batches[3])
    assert "replaced or set to None" in graphs.disabled_reason and not graphs.entries
    assert fallback_counts()[FALLBACK] == 1 and "micro-batches run eagerly" in fallback_reasons()[FALLBACK]
    assert graphs.summary()["eager_micro_batches"] == 3 and torch.isfinite(loss)
    assert graphs.pad(batches[0]) is batches[0]  # no padding once off


def _warmed_up(fake_cuda):
    """StepGraphs after its bucket's eager warm-up (gradients zeroed in place), the bucket's next
    batch and that batch's eager loss and gradients."""
    make, model, params = fake_cuda
    graphs = make()
    batches = [graphs.pad(_batch(lengths, seed=i)) for i, lengths in enumerate(BUCKET[:2])]
    graphs.forward_backward(batches[0])
    for p in params:
        p.grad.zero_()
    return graphs, params, batches[1], *_reference(model, params, batches[1])


def test_a_failed_capture_runs_the_micro_batch_eagerly_once_and_turns_graphs_off(fake_cuda):
    graphs, params, batch, want_loss, want = _warmed_up(fake_cuda)
    _FakeGraph.fail_with = RuntimeError("operation not permitted when stream is capturing")
    loss = graphs.forward_backward(batch)
    assert torch.equal(loss, want_loss) and all(torch.equal(p.grad, g) for p, g in zip(params, want))
    assert "capturing a micro-batch failed (RuntimeError: operation not permitted" in graphs.disabled_reason
    assert fallback_counts()[FALLBACK] == 1


def test_a_gradient_first_made_inside_a_capture_turns_graphs_off_and_the_batch_runs_eagerly(fake_cuda):
    """A replay would write such a gradient instead of adding to it (and the capture never wrote
    it): it is set back to None, the graphs go off and the micro-batch runs eagerly."""
    graphs, params, batch, want_loss, want = _warmed_up(fake_cuda)
    params[2].grad = None  # before the first capture: not yet a gradient the graphs add into
    loss = graphs.forward_backward(batch)
    assert "first gradient inside a capture" in graphs.disabled_reason and graphs.captures == 0
    assert torch.equal(loss, want_loss) and all(torch.equal(p.grad, g) for p, g in zip(params, want))


def test_shapes_past_the_limit_run_eagerly_said_once(fake_cuda):
    make, model, params = fake_cuda
    graphs = make(max_graphs=1)
    small = graphs.pad(_batch([30, 20], seed=1))  # 64 tokens
    large = graphs.pad(_batch([300], seed=2))  # 320 tokens: another shape
    assert small["input_ids"].shape[-1] == 64 and large["input_ids"].shape[-1] == 320
    for batch in (small, large, large, small, small):
        graphs.forward_backward(batch)
    assert graphs.summary() == {"graphs": 1, "shapes": 1, "captures": 1, "replays": 2, "eager_micro_batches": 3,
                                "disabled_reason": None}
    assert fallback_counts()[FALLBACK] == 1 and "more than 1 batch shapes" in fallback_reasons()[FALLBACK]


def test_batches_of_several_rows_keep_their_shape():
    from hasten.training.graphed_step import StepGraphs

    graphs = StepGraphs.__new__(StepGraphs)
    graphs.disabled_reason, graphs.max_tokens, graphs.pad_token_id = None, 64, 0
    two_rows = PackingCollator(max_tokens=40)([{"input_ids": list(range(1, 31))}, {"input_ids": list(range(1, 21))}])
    assert two_rows["input_ids"].shape[0] == 2 and graphs.pad(two_rows) is two_rows
