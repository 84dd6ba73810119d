"""Packed training on the GPU: isolation, loss curves, host syncs, GQA modes."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

import hasten
from hasten.config import Config
from hasten.observability import count_host_syncs, fallback_counts
from hasten.packing import move_batch

SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=2)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=128, **SHAPE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(sliding_window=None, **SHAPE)),
}


def _model(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]().to("cuda", torch.bfloat16)


def _samples(seed, n, max_len=300, learnable=False):
    """Random lengths (one- and two-token samples included). Learnable samples are
    runs of consecutive ids mod 1000 from a random start, so loss can fall."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 2] + torch.randint(3, max_len, (n - 2,), generator=gen).tolist()
    if not learnable:
        return [{"input_ids": torch.randint(0, 1000, (k,), generator=gen).tolist()} for k in lengths]
    starts = torch.randint(0, 1000, (n,), generator=gen).tolist()
    return [{"input_ids": [(start + i) % 1000 for i in range(k)]} for start, k in zip(starts, lengths)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("gqa", ["native", "repeat"])
@pytest.mark.parametrize("name", sorted(MODELS))
@torch.no_grad()
def test_isolation_inside_pack_equals_alone_bf16(name, gqa):
    model = _model(name).eval()
    samples = _samples(1, 12)
    alone = [model(input_ids=torch.tensor([s["input_ids"]], device="cuda")).logits[0] for s in samples]
    hasten.accelerate(model, Config.from_dict({"attention": {"gqa": gqa}}))
    batch = move_batch(hasten.PackingCollator(max_tokens=8192)(samples), "cuda")
    packed = model(**batch).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    worst = max(_rel(packed[s:e], alone[i]) for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])))
    assert worst <= 1e-2, f"{name}/{gqa}: relative error {worst:.3e}"
    assert "attention_per_sequence" not in fallback_counts()


def test_twenty_steps_packed_match_padded_loss_curve():
    steps, micro = 20, 4
    data = [_samples(100 + step, micro * 2, max_len=200, learnable=True) for step in range(steps)]

    def run(packed: bool):
        model = _model("qwen3", seed=1).train()
        if packed:
            hasten.accelerate(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        losses = []
        collate = hasten.PackingCollator(max_tokens=1 << 16)
        for samples in data:
            if packed:
                loss = model(**move_batch(collate(samples), "cuda")).loss
            else:
                width = max(len(s["input_ids"]) for s in samples)
                ids = torch.zeros(len(samples), width, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, s in enumerate(samples):
                    ids[r, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
                    mask[r, : len(s["input_ids"])] = 1
                labels = ids.masked_fill(mask == 0, -100)
                loss = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    padded, packed = run(False), run(True)
    print("padded", [round(x, 4) for x in padded])
    print("packed", [round(x, 4) for x in packed])
    for step, (a, b) in enumerate(zip(padded, packed)):
        assert abs(a - b) <= 0.03 * abs(a) + 0.02, f"step {step}: padded {a:.4f} packed {b:.4f}"
    assert packed[-1] < packed[0] - 0.5, packed  # it trains


def test_host_syncs_per_step():
    model = _model("qwen3").train()
    hasten.accelerate(model)
    samples = _samples(7, 40)
    batch = move_batch(hasten.PackingCollator(max_tokens=16384)(samples), "cuda")
    posids_only = {k: batch[k] for k in ("input_ids", "position_ids", "labels")}
    model(**batch).loss.backward()  # warm-up (GQA probe, lazy init)
    with count_host_syncs() as collator_path:
        model(**batch).loss.backward()
    with count_host_syncs() as posids_path:
        model(**posids_only).loss.backward()
    print(f"host syncs per step: collator path {collator_path.count} {collator_path.sites}; "
          f"position_ids path {posids_path.count} {posids_path.sites}")
    # hasten adds none on the collator path and exactly one (the stats read-back) on the
    # position_ids path; transformers' own packed-sequence detection in create_causal_mask adds one.
    assert collator_path.count <= 1
    assert not any("/hasten/" in site for site in collator_path.sites), collator_path.sites
    hasten_sites = [site for site in posids_path.sites if "/hasten/" in site]
    assert len(hasten_sites) == 1 and "meta.py" in hasten_sites[0], posids_path.sites
