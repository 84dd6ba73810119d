"""training.cuda_graphs: step on the CPU: the buckets, the padding (its shapes, and that a padded
batch trains exactly as the batch itself: loss and every gradient of a float32 model), the
settings refused before a run, the run-time refusals, and the CPU fallback (said once, the same
run as eager). The capture and replay are tested in tests/gpu/test_cuda_graphs_cuda.py."""

import json

import pytest
import torch

import hasten
from hasten.config import Config, ConfigError
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
    args = dict(device=torch.device("cuda", 0), distributed=False, model=torch.nn.Linear(2, 2), moe=False,
                optimizer_captured=True)
    return refusal(**(args | overrides))


def test_step_graphs_refusals_at_run_time(monkeypatch):
    assert _refusal() is None
    assert "trains on cpu" in _refusal(device=torch.device("cpu"))
    assert "torchrun" in _refusal(distributed=True)
    assert "routes tokens to experts" in _refusal(moe=True)
    assert "dropout is on (1)" in _refusal(model=torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)))
    assert _refusal(model=torch.nn.Sequential(torch.nn.Dropout(0.0))) is None
    model = _model()
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
