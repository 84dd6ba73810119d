"""hasten inside the Hugging Face Trainer and PEFT (CPU, tiny Qwen3)."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainerCallback, TrainingArguments

import hasten.integrations.transformers as hasten_tf
from hasten.data import ByteTokenizer, load_dataset
from hasten.integrations.trainer import HastenCallback, prepare_trainer_model
from hasten.moe import MoeLoadStats
from hasten.packing import PackingCollator

peft = pytest.importorskip("peft")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _model(seed=0):
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16))


@pytest.fixture(scope="module")
def corpus():
    samples = load_dataset(None, ByteTokenizer())[:64]
    return [{"input_ids": s["input_ids"][:200]} for s in samples]


def _args(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, logging_steps=1, report_to=[],
                  use_cpu=True, remove_unused_columns=False, learning_rate=3e-3, save_strategy="no")
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


class _Recorder(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def _train_losses(history):
    return [row["loss"] for row in history if "loss" in row]


def test_trainer_trains_and_logs_hasten_metrics(tmp_path, corpus):
    model = _model()
    handle, collator, callback = prepare_trainer_model(model, max_tokens=2048, pad_token_id=256)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hasten").addHandler(handler)
    old_level = logging.getLogger("hasten").level
    logging.getLogger("hasten").setLevel(logging.INFO)
    try:
        trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=corpus, data_collator=collator,
                          callbacks=[callback])
        trainer.train()
    finally:
        logging.getLogger("hasten").removeHandler(handler)
        logging.getLogger("hasten").setLevel(old_level)

    history = trainer.state.log_history
    step_logs = [row for row in history if "loss" in row]
    assert len(step_logs) == 4
    for row in step_logs:
        assert row["hasten/packing_efficiency"] == pytest.approx(1.0)  # 8 samples of <= 200 tokens fit one row
        assert row["hasten/fallback/attention_per_sequence"] > 0      # CPU: per-sequence attention, counted
        assert row["hasten/fallbacks"] == sum(v for k, v in row.items() if k.startswith("hasten/fallback/"))
    # counts accumulate over the run: 2 layers per forward, one forward per step
    counts = [row["hasten/fallback/attention_per_sequence"] for row in step_logs]
    assert counts == sorted(counts) and counts[-1] >= 2 * 4
    losses = _train_losses(history)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses
    # accelerate's data loader reads one batch ahead, so the collator may have made one more than the steps
    assert collator.stats.batches in (4, 5) and collator.stats.samples_packed == 8 * collator.stats.batches
    reports = [r.getMessage() for r in records if r.levelno == logging.INFO and "hasten active" in r.getMessage()]
    assert reports == [handle.report()]
    assert model.config._attn_implementation == hasten_tf.ATTN_NAME


def test_callback_order_and_attach(tmp_path, corpus):
    model = _model()
    _, collator, callback = prepare_trainer_model(model, max_tokens=2048)
    before = _Recorder()  # a callback that runs before hasten's, like report_to integrations
    args = _args(tmp_path, max_steps=1, per_device_train_batch_size=2)
    trainer = Trainer(model=model, args=args, train_dataset=corpus, data_collator=collator,
                      callbacks=[before, callback])
    trainer.train()
    assert not any(k.startswith("hasten/") for k in before.logs[0])
    assert "hasten/packing_efficiency" in trainer.state.log_history[0]

    model = _model()
    _, collator, callback = prepare_trainer_model(model, max_tokens=2048)
    before = _Recorder()
    trainer = Trainer(model=model, args=args, train_dataset=corpus, data_collator=collator, callbacks=[before])
    callback.attach(trainer)
    trainer.train()
    assert "hasten/packing_efficiency" in before.logs[0]
    assert trainer.callback_handler.callbacks[0] is callback


def test_callback_reports_moe_load():
    stats = MoeLoadStats()
    layers = [torch.nn.Module(), torch.nn.Module()]
    for layer, counts in zip(layers, ([6, 2, 0, 4], [3, 3, 3, 3])):
        stats.track(layer, 4, torch.device("cpu"))
        stats.add(layer, torch.tensor(counts))

    class Handle:
        moe_stats = stats

    logs = {"loss": 1.0}
    HastenCallback(Handle()).on_log(None, type("S", (), {"log_history": [], "global_step": 1})(), None, logs=logs)
    assert logs["hasten/moe_tokens_per_expert_min"] == 0
    assert logs["hasten/moe_tokens_per_expert_max"] == 6
    assert logs["hasten/moe_imbalance_max"] == pytest.approx(2.0)
    assert "hasten/packing_efficiency" not in logs  # no collator given
    assert logs["hasten/fallbacks"] == 0


def _lora_model(seed=0):
    # init_lora_weights=False: B is random, so the adapter changes the logits and the checks below see it
    config = peft.LoraConfig(r=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    return peft.get_peft_model(_model(seed), config)


def test_peft_lora_isolation_and_only_lora_gradients(corpus):
    model = _lora_model()
    model.eval()
    samples = [corpus[i] for i in (3, 0, 7)] + [{"input_ids": corpus[5]["input_ids"][:1]}]
    alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]  # transformers' sdpa

    handle, collator, _ = prepare_trainer_model(model, max_tokens=1024)
    assert handle.model is model.get_base_model()
    batch = collator(samples)
    packed = model(**batch).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        assert torch.allclose(packed[s:e], alone[i], atol=1e-5, rtol=1e-4), f"sample {i} differs"
    plain = _model()  # same base weights, no adapter: the LoRA really changed the logits
    assert not torch.allclose(plain(input_ids=torch.tensor([samples[0]["input_ids"]])).logits[0], alone[0], atol=1e-3)

    model.train()
    model(**batch).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert with_grad == {n for n, p in model.named_parameters() if "lora_" in n}
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n in with_grad)


def test_peft_forward_reaches_the_patched_model_hook(monkeypatch, corpus):
    model = _lora_model()
    prepare_trainer_model(model, max_tokens=1024)
    calls = []
    derive = hasten_tf.PackedMeta.from_position_ids
    monkeypatch.setattr(hasten_tf.PackedMeta, "from_position_ids",
                        staticmethod(lambda pos: calls.append(1) or derive(pos)))
    batch = PackingCollator(max_tokens=1024)(corpus[:3])
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])  # TRL padding_free style
    assert len(calls) == 1  # once per forward by the model's hook, not once per layer (2 layers)


def test_peft_trainer_updates_only_lora(tmp_path, corpus):
    model = _lora_model()
    _, collator, callback = prepare_trainer_model(model, max_tokens=2048)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _args(tmp_path, max_steps=2, per_device_train_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=corpus, data_collator=collator, callbacks=[callback])
    trainer.train()
    for n, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[n])
        assert changed == ("lora_" in n), n
    losses = _train_losses(trainer.state.log_history)
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert "hasten/packing_efficiency" in trainer.state.log_history[0]


def test_prompt_learning_adapter_is_refused():
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(_model(), config)
    with pytest.raises(ValueError, match="prompt learning"):
        prepare_trainer_model(model, max_tokens=64)


def test_non_model_is_a_type_error():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        prepare_trainer_model(torch.nn.Linear(2, 2), max_tokens=64)


def _per_sample_loss(model, samples):
    """Mean next-token loss over all targets, each sample run alone (no packing)."""
    total, targets = 0.0, 0
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        if ids.shape[1] < 2:
            continue
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
        targets += ids.shape[1] - 1
    return total / targets


def test_trainer_loss_on_packed_batch_equals_per_sample_mean(tmp_path, corpus):
    model = _model().eval()
    samples = corpus[8:18] + [{"input_ids": [65]}]  # a 1-token sample has no target
    reference = _per_sample_loss(model, samples)
    _, collator, callback = prepare_trainer_model(model, max_tokens=450, pad_token_id=256)
    batch = collator(samples)
    assert batch["input_ids"].shape[0] > 1 and collator.stats.efficiency < 1.0  # several rows, padding segments
    loss = model(**batch).loss
    assert torch.allclose(loss, reference, atol=1e-5, rtol=1e-5)

    # the Trainer's own path: its token count for the batch and its compute_loss
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=corpus, data_collator=collator,
                      callbacks=[callback])
    batches, num_items = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    assert int(num_items) == sum(len(s["input_ids"]) - 1 for s in samples)
    trainer_loss = trainer.compute_loss(model, batches[0], num_items_in_batch=num_items)
    assert torch.allclose(trainer_loss, reference, atol=1e-5, rtol=1e-5)

    # control: labels that cross sample boundaries (no -100 at each sample start) change the loss
    labels, ids = batch["labels"].clone().view(-1), batch["input_ids"].view(-1)
    cu = batch["cu_seq_lens_q"].tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        if (labels[start:end] != -100).any():  # a real sample (not a padding segment)
            labels[start] = ids[start]
    crossing = dict(batch, labels=labels.view_as(batch["labels"]))
    assert not torch.allclose(model(**crossing).loss, reference, atol=1e-4)
