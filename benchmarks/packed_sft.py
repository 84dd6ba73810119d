"""W1: packed SFT throughput on a Qwen3-0.6B-shaped model, one H200 (see docs/benchmarks.md).

`--model` picks another family's shape for the same workload (W1-<model> rows): gemma3_1b
(Gemma-3-1B), gemma2_2b (Gemma-2-2B: attention and final logit softcapping), olmo2_1b (OLMo-2-1B),
smollm3_3b (SmolLM3-3B), phi4_mini (Phi-4-mini, model type phi3), gpt_oss_20b (gpt-oss-20b: 32
experts top-4 with its clamped SwiGLU and biases, attention sinks, windows of 128 on every other
layer, yarn rotary; 4 of its 24 layers by default, 4.45B parameters, so that full fine-tuning fits
one H200; `--layers` sets another count); random weights of the real shape, the same 16,384-token
batch. On a MoE shape transformers' variants run its `grouped_mm` experts; on gpt-oss its eager
attention (the one that applies the sinks), so hf_packed_sdpa is not its path and hf_padded, in
micro-batches of 4, is the baseline.

One run measures every variant on the same 16,384-token batch of 61 samples:
  hf_padded          transformers, micro-batches of 8 samples padded, sdpa, gradient accumulation
  hf_packed_sdpa     transformers, one packed row with position_ids, sdpa, use_cache=False (dense mask)
  hasten             hasten.accelerate + PackingCollator metadata (no read-back), fused kernels on
  hasten_unfused     hasten with every kernels.* switch off (transformers' loss, norms, MLPs, rotary)
  hasten_fused_ce_only  hasten with only the fused cross-entropy of the kernels.* switches
  hasten_all_kernels hasten with RMSNorm, SwiGLU and RoPE kernels switched on too
  hasten_posids      hasten with position_ids only (metadata derived on the device once per forward)
  hasten_gqa_repeat  hasten with K/V heads repeated instead of read natively
  hasten_fa2         hasten with attention.backend torch_varlen (FlashAttention-2) instead of auto
  hasten_no_cache    hasten with training.metadata_cache false (metadata derived in every layer)
  hasten_compiled    hasten with each decoder layer under torch.compile (default mode), as training.compile
                     does it (hasten.training.compile: one graph per layer, dynamic shapes); compiled
                     graphs in the warm-up, recompiles over the timed steps and graph breaks are in the notes
  hasten_residual_unfused  hasten with kernels.fused_residual off: each decoder layer's residual add
                     a separate PyTorch add before the fused RMSNorm (what hasten ran before it)
  hasten_residual_grad_fused  hasten with kernels.fused_residual_grad on: a layer input's two
                     gradients added in the input norm's backward, not by autograd
  hasten_qk_norm_rope  hasten with kernels.fused_qk_norm_rope on: Qwen3's q/k head norms and the
                     rotary after them in one kernel each way (hasten::rms_norm_rope)
  hasten_linear_groups  hasten with kernels.fused_linear_groups on: q/k/v and gate/up with one input
                     gradient their GEMMs accumulate onto (no autograd adds)
  hasten_fused_router  hasten with training.moe.fused_router on: MoE routers after their logits on
                     hasten::moe_route (MoE shapes: gpt_oss_20b)
  hasten_graphed_optimizer  hasten with the AdamW step captured in a CUDA graph (GraphedAdamW, one eager
                     warm-up step; training.cuda_graphs: optimizer in hasten train)
  hasten_graphed_step  hasten with the whole step (forward, loss, backward, fused capturable AdamW) captured
                     in one CUDA graph after 3 eager steps, the batch's tensors its static inputs, replayed
                     per step: how much of hasten's step is launch and host time (an experiment: hasten
                     train does not graph the step)
  liger              hasten's packed attention with every kernels.* switch off, and Liger-Kernel's
                     RMSNorm, SwiGLU, RoPE and fused linear cross-entropy instead (needs liger_kernel;
                     it patches transformers' Qwen3 module for the rest of the process, so run it last)
Each row: median step time, non-padding tokens/s, peak memory, host syncs per step,
and an isolation check (a sample's logits inside the pack vs the sample alone). Warm-up steps are
never timed. A variant that fails writes its error into its row and the run goes on.

    python benchmarks/packed_sft.py [--steps 6] [--out benchmarks/results] [--profile hasten]

--profile VARIANTS prints, for one step of each named variant, where the GPU's time goes: the top
kernels by device time, grouped (GEMM, attention, optimizer, elementwise...), and how much of the
step the GPU sat idle (launch-bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import hasten  # noqa: E402
from hasten.config import Config, KernelsConfig  # noqa: E402
from hasten.observability import count_host_syncs, fallback_counts, reset_fallbacks  # noqa: E402
from hasten.packing import move_batch  # noqa: E402
from hasten.training.compile import compile_decoder_layers  # noqa: E402
from hasten.training.graphed_optimizer import GraphedAdamW  # noqa: E402

TOKENS = 16384
VOCAB = 151936  # Qwen3's; the other shapes draw their tokens below their own vocabulary
DEVICE = "cuda"  # the CPU smoke run of this script's code paths sets "cpu" (and small shapes)


def qwen3_06b() -> PretrainedConfig:
    return AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072,
                                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                tie_word_embeddings=True, max_position_embeddings=40960)


# The published configs' shapes (hidden, intermediate, layers, heads, head size, vocabulary, windows).
SHAPES = {
    "qwen3_0.6b": qwen3_06b,
    "gemma3_1b": lambda: AutoConfig.for_model(
        "gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        max_position_embeddings=32768, tie_word_embeddings=True, final_logit_softcapping=None),
    "gemma2_2b": lambda: AutoConfig.for_model(
        "gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=8192,
        tie_word_embeddings=True),
    "olmo2_1b": lambda: AutoConfig.for_model(
        "olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=1, bos_token_id=None, eos_token_id=2),
    "smollm3_3b": lambda: AutoConfig.for_model(
        "smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=4, no_rope_layer_interval=4, max_position_embeddings=65536,
        tie_word_embeddings=True, pad_token_id=128004, bos_token_id=128000, eos_token_id=128001),
    "phi4_mini": lambda: AutoConfig.for_model(
        "phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        pad_token_id=199999, bos_token_id=199999, eos_token_id=199999),
    # 4 of gpt-oss-20b's 24 layers (LAYERS): sliding (128) and full attention alternate, as published
    "gpt_oss_20b": lambda: AutoConfig.for_model(
        "gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=LAYERS or 4,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
        sliding_window=128, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        pad_token_id=199999, eos_token_id=200002),
}
MODEL = "qwen3_0.6b"  # set by --model
LAYERS = None  # set by --layers (the shapes that read it: gpt_oss_20b)
# transformers' attention for the baselines and the reference where its default would compute
# something else: 5.17 picks sdpa for Gemma 2, and its sdpa drops the attention softcap
ATTN_IMPLEMENTATION = {"gemma2_2b": "eager", "gpt_oss_20b": "eager"}
# samples per padded micro-batch (hf_padded): gpt-oss's eager attention keeps 64 heads of scores per
# layer, 8 rows of up to 2,048 tokens would hold about 13 GiB a layer
MICRO_BATCH = {"gpt_oss_20b": 4}


def make_samples(seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Log-normal lengths exp(N(5.3, 0.9)) clipped to [16, 2048], topped up to exactly TOKENS, of
    tokens below `vocab` (the same lengths for every vocabulary)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < TOKENS:
        n = int(min(2048, max(16, math.exp(5.3 + 0.9 * torch.randn((), generator=gen).item()))))
        lengths.append(min(n, TOKENS - sum(lengths)))
    if lengths[-1] < 16:  # fold a tiny tail into the previous sample
        tail = lengths.pop()  # (`lengths[-2] += lengths.pop()` read one sample and wrote another)
        lengths[-1] += tail
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def build_model() -> PreTrainedModel:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(SHAPES[MODEL](), dtype=torch.bfloat16,
                                                 **({"attn_implementation": ATTN_IMPLEMENTATION[MODEL]}
                                                    if MODEL in ATTN_IMPLEMENTATION else {}))
    return model.train()


def padded_microbatches(samples: list[list[int]], size: int = 8) -> list[dict]:
    out = []
    for i in range(0, len(samples), size):
        group = samples[i: i + size]
        width = max(len(s) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, s in enumerate(group):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        out.append(move_batch({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, DEVICE))
    return out


ISOLATION_TOLERANCE = 3e-2
# bf16 noise grows with depth and width: on the Phi-4-mini shape (32 layers, hidden 3072) transformers'
# own kernels (hasten_unfused) measured 3.4e-2 and Liger's 5.0e-2 (e06c381, H200), on SmolLM3-3B 3.4e-2 and
# 4.9e-2 (0766670); leakage across
# samples measures 0.3 and more
ISOLATION_TOLERANCE_BY_MODEL = {"phi4_mini": 8e-2, "smollm3_3b": 8e-2}
LOSS_TOLERANCE = 2e-2  # losses near 12 in bf16: run-to-run noise is about 1e-3
CHECKED = (0, 30, 60)  # samples whose logits are compared inside the pack and alone
# Models checked against the float32 truth instead of transformers' bf16 run: on gpt-oss-20b's shape
# (4 layers, random init) transformers' own bf16 eager run of a sample alone is 0.35 from its float32
# run (073aa48, H200, scripts/gptoss_isolation.py; 0.29 with router margins), so a fixed tolerance
# against the bf16 run cannot tell a leak from noise; hasten packed measured 0.32 from the truth there.
# A variant passes when it is no further from the truth than ISOLATION_NOISE_FACTOR x transformers' bf16.
FP32_TRUTH = {"gpt_oss_20b"}
ISOLATION_NOISE_FACTOR = 1.25


@dataclasses.dataclass
class Isolation:
    refs: dict[int, torch.Tensor]  # checked sample -> its logits alone (float32)
    tolerance: float  # the largest relative error a correct variant may show against refs
    basis: str  # what refs are, for the row's notes


def _alone(model, samples) -> dict[int, torch.Tensor]:
    return {i: model(input_ids=torch.tensor([samples[i]], device=DEVICE), use_cache=False).logits[0].float()
            for i in CHECKED}


@torch.no_grad()
def reference_logits(samples) -> Isolation:
    """The checked samples alone through transformers' own attention (sdpa, or eager where
    ATTN_IMPLEMENTATION says), same seed-0 weights as every variant; for FP32_TRUTH models in
    float32, with the tolerance set by transformers' own bf16 distance from it."""
    model = build_model().eval()
    tolerance = ISOLATION_TOLERANCE_BY_MODEL.get(MODEL, ISOLATION_TOLERANCE)
    if MODEL not in FP32_TRUTH:
        refs = _alone(model, samples)
        del model
        return Isolation(refs, tolerance, "transformers bf16 alone")
    bf16 = _alone(model, samples)
    refs = _alone(model.float(), samples)
    del model
    noise = max(float((bf16[i] - refs[i]).norm() / refs[i].norm()) for i in CHECKED)
    return Isolation(refs, max(tolerance, ISOLATION_NOISE_FACTOR * noise),
                     f"float32 alone; transformers bf16 alone {noise:.2e} from it")


@torch.no_grad()
def isolation_error(model, forward_pack, samples, refs) -> float:
    """Max relative error of the checked samples' logits inside the pack vs alone."""
    model.eval()
    logits = forward_pack().logits[0]
    model.train()
    starts = [0]
    for s in samples:
        starts.append(starts[-1] + len(s))
    return max(((logits[starts[i]: starts[i + 1]].float() - ref).norm() / ref.norm()).item()
               for i, ref in refs.items())


# first match wins: flash-attention kernels contain "gemm"-like words, and "nocast" is no cast
KERNEL_GROUPS = (("attention", ("flash", "fmha", "attention", "varlen")),
                 ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "wgmma")),
                 ("cross_entropy", ("cross_entropy", "linear_cross", "_ce_")),
                 ("optimizer", ("adam", "multi_tensor", "foreach")),
                 ("norm", ("rms", "norm")),
                 ("rope_swiglu", ("rope", "rotary", "swiglu", "silu")),
                 ("copy", ("direct_copy", "bfloat16_copy", "memcpy", "catarray", "fill", "memset")),
                 ("reduce", ("reduce_kernel", "reduce")),
                 ("elementwise", ("elementwise",)))


def kernel_group(kernel: str) -> str:
    lowered = kernel.lower()
    return next((group for group, keys in KERNEL_GROUPS if any(k in lowered for k in keys)), "other")


def print_profile(name: str, step) -> None:
    """One profiled step: top kernels by device time, per group, and the GPU's idle share."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
    step_ms = start.elapsed_time(end)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    totals: dict[str, list] = {}
    for e in kernels:
        entry = totals.setdefault(e.name, [0.0, 0])
        entry[0] += e.time_range.elapsed_us() / 1e3
        entry[1] += 1
    busy = sum(t for t, _ in totals.values())
    groups: dict[str, float] = {}
    for kernel, (ms, _) in totals.items():
        groups[kernel_group(kernel)] = groups.get(kernel_group(kernel), 0.0) + ms
    print(f"profile {name}: step {step_ms:.1f} ms (profiled), kernels {busy:.1f} ms in {len(kernels)} launches, "
          f"GPU idle {max(0.0, step_ms - busy):.1f} ms")
    print("  by group: " + ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(groups.items(), key=lambda x: -x[1])))
    for kernel, (ms, count) in sorted(totals.items(), key=lambda x: -x[1][0])[:25]:
        print(f"  {ms:8.2f} ms {count:5d}x  {kernel_group(kernel):>13}  {kernel[:110]}")
    # which operators launch the time, with their input shapes (names the source of small kernels)
    ops = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
    print("  top operators by their own device time, with input shapes:")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:30]:
        print(f"  {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:40]:40s} {str(e.input_shapes)[:90]}")
    trace = os.environ.get("HASTEN_PROFILE_TRACE")  # a chrome trace, and where the GPU waited for the host
    if trace:
        import importlib.util

        prof.export_chrome_trace(trace)
        spec = importlib.util.spec_from_file_location(
            "trace_gaps", Path(__file__).resolve().parent.parent / "scripts" / "trace_gaps.py")
        gaps = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gaps)
        print(gaps.summarise(trace, top=int(os.environ.get("HASTEN_PROFILE_GAPS", "12"))))


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def run_variant(name: str, samples, isolation: Isolation, steps: int, profile: tuple[str, ...] = ()) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    reset_fallbacks()
    model = build_model()
    if name.startswith("hf_") and getattr(model.config, "num_local_experts", None):
        model.set_experts_implementation("grouped_mm")  # transformers' fastest experts (sort + histc + cumsum)
    try:
        return _run_variant(name, model, samples, isolation, steps, profile, handles := [])
    finally:
        for h in reversed(handles):  # also when the variant failed: the next one starts from an unpatched model
            h.undo()
        if name == "hasten_compiled":
            torch._dynamo.reset()


def _run_variant(name, model, samples, isolation: Isolation, steps, profile, handles: list) -> dict:
    handle = None
    kernel_switches = [f.name for f in dataclasses.fields(KernelsConfig)]
    unfused = dict.fromkeys(kernel_switches, False)
    hasten_cfg = {"hasten": {}, "hasten_unfused": {"kernels": unfused},
                  "hasten_all_kernels": {"kernels": dict.fromkeys(kernel_switches, True)},
                  "hasten_fused_ce_only": {"kernels": dict(unfused, fused_cross_entropy=True)},
                  "hasten_posids": {}, "hasten_gqa_repeat": {"attention": {"gqa": "repeat"}},
                  "hasten_fa2": {"attention": {"backend": "torch_varlen"}},
                  "hasten_no_cache": {"training": {"metadata_cache": False}},
                  "hasten_compiled": {}, "hasten_graphed_optimizer": {}, "hasten_graphed_step": {},
                  "hasten_residual_unfused": {"kernels": {"fused_residual": False}},
                  "hasten_residual_grad_fused": {"kernels": {"fused_residual_grad": True}},
                  "hasten_qk_norm_rope": {"kernels": {"fused_qk_norm_rope": True}},
                  "hasten_linear_groups": {"kernels": {"fused_linear_groups": True}},
                  "hasten_fused_router": {"training": {"moe": {"fused_router": True}}}}
    if name in hasten_cfg:
        handle = hasten.accelerate(model, Config.from_dict(hasten_cfg[name]))
        handles.append(handle)
    elif name == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

        handle = hasten.accelerate(model, Config.from_dict({"kernels": unfused}))
        handles.append(handle)
        MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type](model=model)
    extra_notes = []
    compiled = None
    if name == "hasten_compiled":
        torch._dynamo.reset()
        # what training.compile does in hasten train: every decoder layer's forward through
        # torch.compile (default mode, one graph per layer, dynamic shapes, shared by the layers),
        # after hasten's patches; a layer that fails to compile sends all back to eager, said once
        compiled = compile_decoder_layers(model)
        handles.append(compiled)
    packed = move_batch(hasten.PackingCollator(max_tokens=TOKENS)([{"input_ids": s} for s in samples]), DEVICE)
    if name in ("hasten", "hasten_unfused", "hasten_fused_ce_only", "hasten_all_kernels", "hasten_gqa_repeat",
                "hasten_fa2", "liger", "hasten_compiled", "hasten_graphed_optimizer", "hasten_graphed_step",
                "hasten_residual_unfused",
                "hasten_residual_grad_fused", "hasten_qk_norm_rope", "hasten_linear_groups", "hasten_fused_router"):
        inputs = [packed]
    elif name in ("hasten_posids", "hasten_no_cache"):
        inputs = [{k: packed[k] for k in ("input_ids", "position_ids", "labels")}]
    elif name == "hf_packed_sdpa":
        inputs = [{k: packed[k] for k in ("input_ids", "position_ids", "labels")} | {"use_cache": False}]
    elif name == "hf_padded":
        inputs = padded_microbatches(samples, MICRO_BATCH.get(MODEL, 8))
    else:
        raise ValueError(name)
    if name == "hasten_graphed_optimizer":
        optimizer = GraphedAdamW(model.parameters(), lr=1e-5, warmup_steps=1)  # captured in the 2nd warm-up step
    elif name == "hasten_graphed_step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True, capturable=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    losses = []

    if name == "hasten_graphed_step":
        step = graphed_training_step(model, inputs[0], optimizer, losses, extra_notes)
    else:
        step = common.training_step(model, inputs, optimizer, losses)

    # Isolation first, on the untrained seed-0 weights that the references were computed with.
    err = 0.0 if name == "hf_padded" else isolation_error(model, lambda: model(**inputs[0]), samples, isolation.refs)
    # hf_padded: each sample sits in its own padded row behind a padding mask. Threshold:
    # bf16 noise over 28 layers and 152k logits measured 1.3e-2 for transformers' own
    # correct packed path on H200; leakage across samples measures 0.3 and more.
    correct = err <= isolation.tolerance
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    compiled_before = dynamo_counts()
    started = time.perf_counter()
    common.time_steps(step, warmup=2, iters=0)  # warm-up: compiles, captures; never timed
    common.sync()
    warmup_s = time.perf_counter() - started
    compiled_warm = dynamo_counts()
    times = common.time_steps(step, warmup=0, iters=steps)
    compiled_after = dynamo_counts()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    with count_host_syncs() as syncs:
        step()
    step_s = common.median(times)
    if name == "hasten_compiled":
        extra_notes.append(f"training.compile's layers: {len(compiled.layers)}, failure {compiled.failure}")
        extra_notes.append(f"compiled graphs: {compiled_before['graphs']} in the isolation check (eval), "
                           f"{compiled_warm['graphs'] - compiled_before['graphs']} in the 2 warm-up steps, "
                           f"recompiles in the {steps} timed steps {compiled_after['graphs'] - compiled_warm['graphs']}; "
                           f"graph breaks {compiled_after['graph_breaks']}")
    if isinstance(optimizer, GraphedAdamW):
        extra_notes.append(f"optimizer graph: captured {optimizer.captured}, replays {optimizer.replays}, eager "
                           f"steps {optimizer.eager_steps}, disabled {optimizer.disabled_reason}")
    if name in profile:
        print_profile(name, step)
    row = {"workload": workload(), "variant": name, "model": MODEL, "layers": model.config.num_hidden_layers,
           "params": sum(p.numel() for p in model.parameters()), **common.environment(), "tokens_per_s": TOKENS / step_s,
           "step_s": step_s, "peak_gib": peak, "warmup_s": round(warmup_s, 2), "host_syncs_per_step": syncs.count,
           "correct": correct,
           "losses": [round(float(v), 5) for v in losses],  # every step's loss, warm-up included (same batch)
           "notes": f"isolation rel err {err:.2e} (against {isolation.basis}, tolerance {isolation.tolerance:.2e}); first loss {float(losses[0]):.4f}; "
                    f"steps {[round(t, 4) for t in times]}; "
                    f"fallbacks {fallback_counts()}" + "".join(f"; {n}" for n in extra_notes)}
    if name in ("hasten_compiled", "hasten_graphed_step") or isinstance(optimizer, GraphedAdamW):
        print(f"{name}: {'; '.join(extra_notes)}", flush=True)
    del model, optimizer, inputs, packed
    return row


def graphed_training_step(model, batch: dict, optimizer, losses: list, notes: list):
    """A step whose first call runs 3 eager steps on a side stream (cuDNN's graphs built, AdamW's
    state made, every allocation seen), then captures forward, loss, backward and the optimizer step
    in one CUDA graph, then replays it; later calls replay. The gradients are None when the capture
    starts, so backward allocates them in the graph's pool and each replay writes them afresh (no
    zero_grad). Every optimizer step, eager or replayed, appends its loss once, so the losses line
    up with `common.training_step`'s step by step. Possible because hasten's packed step syncs
    nothing; the batch's tensors are the graph's static inputs (the same batch every step here)."""
    state: dict = {}

    def eager() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def capture() -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                losses.append(eager())
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        state.update(graph=graph, loss=loss.detach())
        notes.append("whole step in one CUDA graph after 3 eager steps")

    def step() -> None:
        if "graph" not in state:
            capture()
        state["graph"].replay()
        losses.append(state["loss"].clone())

    return step


def workload() -> str:
    return "W1" if MODEL == "qwen3_0.6b" else "W1-" + MODEL


def main() -> int:
    global MODEL, LAYERS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SHAPES), default=MODEL, help="the shape (default: W1's Qwen3-0.6B)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of gpt_oss_20b (default 4 of 24)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile", default="", help="comma-separated variants to profile for one step")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default="hf_padded,hf_packed_sdpa,hasten,hasten_unfused,hasten_fused_ce_only,hasten_all_kernels,"
                                              "hasten_posids,"
                                              "hasten_gqa_repeat,hasten_no_cache")
    args = parser.parse_args()
    MODEL, LAYERS = args.model, args.layers
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("W1 needs a CUDA GPU", file=sys.stderr)
        return 1
    samples = make_samples(vocab=SHAPES[MODEL]().vocab_size)
    print(f"{workload()}: {len(samples)} samples, {sum(map(len, samples))} tokens, max {max(map(len, samples))}")
    isolation = reference_logits(samples)
    print(f"isolation check against {isolation.basis}, tolerance {isolation.tolerance:.2e}")
    run_id = common.new_run_id()
    rows = []
    path = None
    for name in args.variants.split(","):
        try:
            row = run_variant(name, samples, isolation, args.steps, tuple(args.profile.split(","))) | {"run_id": run_id}
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not cost the others
            traceback.print_exc()
            row = {"workload": workload(), "variant": name, "model": MODEL, **common.environment(), "tokens_per_s": None, "step_s": None,
                   "peak_gib": None, "host_syncs_per_step": None, "correct": False, "run_id": run_id,
                   "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}", "notes": "failed"}
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        done = {r["variant"]: r for r in rows if r["step_s"] is not None}
        # compiled layers and the graphed optimizer must train as hasten does: the same losses, step by step
        if name in ("hasten_compiled", "hasten_graphed_optimizer", "hasten_graphed_step") and name in done \
                and "hasten" in done:
            mine, want = row["losses"], done["hasten"]["losses"]
            worst = max(abs(a - b) for a, b in zip(mine, want))
            row["correct"] = row["correct"] and worst <= LOSS_TOLERANCE
            row["notes"] += f"; loss vs hasten over {min(len(mine), len(want))} steps: max abs diff {worst:.2e}"
            print(f"{name}: losses vs hasten over {min(len(mine), len(want))} steps: max abs diff {worst:.2e}",
                  flush=True)
        path = common.write_rows([row], workload(), args.out)  # each row as it comes: a run cut short keeps them
        if row["step_s"] is None:
            print(f"{name:>18}: FAILED {row['error']}", flush=True)
            continue
        print(f"{name:>18}: {row['tokens_per_s']:>9,.0f} tok/s  {row['step_s']:.4f} s  {row['peak_gib']:6.1f} GiB  "
              f"syncs {row['host_syncs_per_step']:>3}  correct {row['correct']}  ({row['notes'][:60]})", flush=True)
    base = {r["variant"]: r for r in rows if r["step_s"] is not None}
    if "hasten" in base:
        for ref in ("hf_padded", "hf_packed_sdpa", "hasten_unfused", "hasten_residual_unfused",
                    "hasten_residual_grad_fused", "hasten_qk_norm_rope", "hasten_linear_groups", "liger"):
            if ref in base:
                print(f"hasten vs {ref}: {base['hasten']['tokens_per_s'] / base[ref]['tokens_per_s']:.2f}x tokens/s, "
                      f"peak {base['hasten']['peak_gib']:.1f} vs {base[ref]['peak_gib']:.1f} GiB")
        for mine in ("hasten_compiled", "hasten_graphed_optimizer", "hasten_graphed_step", "hasten_fused_router"):
            if mine in base:
                print(f"{mine} vs hasten: {base[mine]['tokens_per_s'] / base['hasten']['tokens_per_s']:.3f}x tokens/s, "
                      f"peak {base[mine]['peak_gib']:.1f} vs {base['hasten']['peak_gib']:.1f} GiB")
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
