"""W3: one MoE block forward + backward, 16,384 tokens, one H200. --block picks the shape:
  qwen3_30b_a3b     Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert intermediate 768)
  gpt_oss_20b       gpt-oss-20b (32 experts, top-4, hidden 2880, expert intermediate 2880: a router
                    with a bias, top-k before its softmax, transposed experts with biases and a
                    clamped SwiGLU on interleaved columns)
  deepseek_v2_lite  DeepSeek-V2-Lite (64 routed experts, top-6, 2 shared, hidden 2048, expert
                    intermediate 1408)
  llama4_scout      Llama-4-Scout (16 experts, top-1, a shared expert, hidden 5120, expert
                    intermediate 8192): its block is not transformers' experts interface, so
                    hf_moe_eager is the block's own forward (every expert on every token, the
                    router's scores on the inputs) and hasten_fused is hasten.moe.blocks' forward
                    (the chosen expert only); the other variants do not apply

Variants in one run (rows to benchmarks/results/W3.jsonl):
  hf_moe_eager        transformers' expert loop
  hf_moe_grouped_mm   transformers' experts_implementation="grouped_mm" (sort + histc + cumsum)
  hasten_fused        hasten: one-kernel grouping, grouped GEMM, fused SwiGLU (with the router's weights,
                      training.moe.weights_in_gate, where the gate is transformers' default), deterministic combine
  hasten_fused_torch_gemm  hasten_fused with every grouped GEMM on torch's kernel
                      (HASTEN_GROUPED_GEMM=torch): the A/B of hasten's CUTLASS tiles in one run
  hasten_fused_class_shared  hasten_fused with the shared experts' MLP left to its class (torch's
                      SiLU and product), beside hasten_fused's fused SwiGLU on them: the A/B of that
                      patch in one run (DeepSeek-V2-Lite, Llama 4; elsewhere equal to hasten_fused)
  hasten_graphed      hasten_fused with forward + backward captured once in a CUDA graph (after 3
                      warm-up iterations on a side stream) and replayed per step; parameter gradients
                      are None before capture, so each replay writes them afresh (= zero_grad + step)
  hasten_graphed_callables  hasten_fused through torch.cuda.make_graphed_callables: forward and
                      backward graphed apart, autograd adds the gradients into .grad (accumulation-safe)
  hasten_compiled     hasten_fused under torch.compile (default mode); recompiles over the timed steps
                      and graph breaks are in the notes
  hasten_router       hasten_fused with the block's router on hasten::moe_route (training.moe.fused_router:
                      the model's logits GEMM, then its scoring, top-k, renormalisation and scaling in one
                      kernel each way), after the check accelerate() makes
  hasten_router_graphed  hasten_router captured as hasten_graphed is
  hasten_weights_in_combine  hasten_fused with the router's weights in the combine
                      (training.moe.weights_in_gate: false), as before 2026-12-06: the A/B of
                      hasten::moe_weighted_swiglu (the weights inside the SwiGLU, a summing combine
                      that keeps no y, the weights' gradient from the SwiGLU's backward) in one run
The graphed and compiled variants check their output and every gradient (input and parameters)
against eager hasten_fused on the same inputs and print the largest relative difference. A variant
that fails writes its error into its row and the run goes on.
And the grouping alone: hasten::moe_group against sort + histc + cumsum + inverse scatter.

    python benchmarks/moe_block.py [--tokens 16384] [--iters 10] [--variants a,b] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._dynamo
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from hasten.integrations.transformers import registered  # noqa: E402
from hasten.observability import count_host_syncs, fallback_counts, reset_fallbacks  # noqa: E402
from hasten.moe.experts import weights_in_gate  # noqa: E402
from hasten.ops import moe as moe_ops  # noqa: E402

IMPL = {"hf_moe_eager": "eager", "hf_moe_grouped_mm": "grouped_mm", "hasten_fused": "hasten_fused",
        "hasten_graphed": "hasten_fused", "hasten_graphed_callables": "hasten_fused",
        "hasten_compiled": "hasten_fused", "hasten_fused_class_shared": "hasten_fused",
        "hasten_fused_torch_gemm": "hasten_fused", "hasten_router": "hasten_fused",
        "hasten_router_graphed": "hasten_fused", "hasten_weights_in_combine": "hasten_fused"}
# variants whose router runs on hasten::moe_route
FUSED_ROUTER = {"hasten_router", "hasten_router_graphed"}
# variants run with HASTEN_GROUPED_GEMM set (read by hasten's grouped GEMM on every call)
GROUPED_GEMM = {"hasten_fused_torch_gemm": "torch"}
# variants whose shared experts (DeepSeek's, Llama 4's) stay the class's own MLP under hasten's experts
CLASS_SHARED_MLPS = {"hasten_fused_class_shared"}
# variants whose experts take the router's weights in the combine (training.moe.weights_in_gate: false)
WEIGHTS_IN_COMBINE = {"hasten_weights_in_combine"}
# graphed replays must equal eager hasten (same kernels, same inputs); compiled may reorder float math
DEVICE = "cuda"  # the CPU smoke run of this script's code paths sets "cpu" (and a small block)
GRAD_TOLERANCE = {"hasten_graphed": 1e-3, "hasten_graphed_callables": 1e-3, "hasten_compiled": 1e-2,
                  "hasten_fused_torch_gemm": 2e-2,  # another GEMM kernel: bf16 outputs rounded apart
                  # the router's renormalising sum in another order: weights a float32 ulp apart
                  "hasten_router": 2e-2, "hasten_router_graphed": 2e-2,
                  # the weights multiply before the down GEMM: its bf16 output rounded at another point
                  "hasten_weights_in_combine": 2e-2}


BLOCK = "qwen3_30b_a3b"  # set by --block


class _HiddenOnly(torch.nn.Module):
    """gpt-oss's MoE block returns (hidden, router scores), Llama 4's (hidden flattened to (tokens,
    hidden), router logits), its own forward and hasten's alike: the block's hidden states alone, in
    the input's shape, as Llama 4's decoder layer takes them (`hidden_states.view(residual.shape)`)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block(x)[0].view(x.shape)


def block_config(name: str):
    """The published shape of a --block name as transformers' config (the one place the four blocks'
    sizes are written; benchmarks/workload_floor.py counts their FLOPs from it)."""
    if name == "gpt_oss_20b":
        from transformers import GptOssConfig

        return GptOssConfig(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4)
    if name == "llama4_scout":
        from transformers import Llama4TextConfig

        return Llama4TextConfig(hidden_size=5120, intermediate_size=8192, num_local_experts=16, num_experts_per_tok=1)
    if name == "deepseek_v2_lite":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
                                num_experts_per_tok=6, n_shared_experts=2, n_group=1, topk_group=1)
    if name == "qwen3_30b_a3b":
        return Qwen3MoeConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                              norm_topk_prob=True)
    raise ValueError(f"unknown block '{name}'")


def build_block():
    torch.manual_seed(0)
    config = block_config(BLOCK)
    with torch.device(DEVICE):
        if BLOCK == "gpt_oss_20b":
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

            block = _HiddenOnly(GptOssMLP(config))
        elif BLOCK == "llama4_scout":
            from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

            block = _HiddenOnly(Llama4TextMoe(config))
        elif BLOCK == "deepseek_v2_lite":
            from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

            block = DeepseekV2Moe(config)
        else:
            block = Qwen3MoeSparseMoeBlock(config)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
    block = block.to(torch.bfloat16)
    if BLOCK == "deepseek_v2_lite":
        # the router weight's dtype as from_pretrained loads it: float32 where the model class keeps
        # it so (_keep_in_fp32_modules_strict = ["gate.weight"], transformers 5.25), bfloat16 before
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2PreTrainedModel

        if "gate.weight" in (getattr(DeepseekV2PreTrainedModel, "_keep_in_fp32_modules_strict", None) or ()):
            block.gate.float()
    decide_gates(block)
    return block, config


def decide_gates(block: torch.nn.Module) -> None:
    """The gate kernel hasten's experts run, decided as accelerate() decides it: gpt-oss's clamped
    SwiGLU takes hasten's kernel only after the check against the class's own gate passes. The
    block is built without accelerate(), and the experts forward's default is the class's own gate:
    W3's gpt-oss rows up to 1956431 measured that (clamp, sigmoid and products: 6.9 ms of 26.2)."""
    from hasten.moe.experts import clamped_bias_mismatch, clamped_gate_mismatch, gate_kernel, uses_fused_swiglu

    for module in block.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "num_experts"):
            clamped = not uses_fused_swiglu(module) and clamped_gate_mismatch(module) is None
            module._hasten_gate = gate_kernel(module, checked=clamped)
            if module._hasten_gate == "clamped_swiglu" and getattr(module, "has_bias", False):
                # gate_up's biases inside the clamped kernel, after accelerate()'s check (90ee0bd)
                module._hasten_fused_bias = clamped_bias_mismatch(module) is None


def use_shared_mlps(block, config, fused: bool) -> int:
    """The block's shared experts (DeepSeek's `shared_experts`, Llama 4's `shared_expert`: dense
    gated MLPs) as each side runs them: hasten's fused SwiGLU for hasten's variants, after the same
    check accelerate() makes on every gated MLP of a model (`install_fused_mlp`); the class's own
    for transformers'. W3's DeepSeek-V2-Lite rows up to bfa7b90 ran the class's own shared MLP under
    hasten too (torch's SiLU, product and their backward: about 0.4 ms of 12.75). Their gate/up
    then take one input gradient (`install_linear_groups`), as accelerate() gives every gated MLP
    in full fine-tuning (kernels.fused_linear_groups, on by default): rows up to ccbc92e ran them
    with a d x each and an add. Returns the number of MLPs on hasten's kernel."""
    from hasten.dense.linear_group import install_linear_groups
    from hasten.dense.patch import install_fused_mlp

    undo = block.__dict__.pop("_w3_shared_mlp_undo", None)
    if undo is not None:
        undo()
    if not fused:
        return 0
    undo_mlps, patched, _refused = install_fused_mlp(block, config=getattr(config, "text_config", None) or config)
    undo_groups, _groups, _refused = install_linear_groups(block)

    def undo_both() -> None:
        undo_groups()
        undo_mlps()

    block.__dict__["_w3_shared_mlp_undo"] = undo_both
    return patched


def use_routers(block, config, fused: bool) -> int:
    """The block's router on hasten::moe_route (fused) or its class's forward: as accelerate() does
    with training.moe.fused_router, the table's recipe checked against the class first. Returns the
    routers fused."""
    undo = block.__dict__.pop("_w3_router_undo", None)
    if undo is not None:
        undo()
    if not fused:
        return 0
    from hasten.integrations.architectures import spec_for
    from hasten.moe.router import find_routers, install_fused_routers

    spec = getattr(spec_for(config), "router", None)
    if spec is None:
        raise ValueError(f"the model table has no router recipe for {config.model_type}")
    undo, count, reasons = install_fused_routers(find_routers(block), spec)
    block.__dict__["_w3_router_undo"] = undo
    if reasons or not count:
        raise RuntimeError(f"the fused router refused this block: {'; '.join(reasons) or 'no router found'}")
    return count


def use_implementation(block, config, implementation: str, class_shared_mlps: bool = False,
                       fused_router: bool = False, weights_in_gate: bool = True) -> None:
    """The experts implementation for the next calls: transformers' experts interface name, or for
    Llama 4 (no such interface) its block's own forward ("eager") or hasten's ("hasten_fused"); the
    shared MLPs follow (use_shared_mlps) unless class_shared_mlps keeps them the class's own; the
    router's weights go into hasten's SwiGLU unless weights_in_gate is false (as accelerate() sets
    training.moe.weights_in_gate on each experts module)."""
    for module in block.modules():
        if hasattr(module, "_hasten_gate"):
            module._hasten_weights_in_gate = weights_in_gate
    fused_shared = implementation == "hasten_fused" and not class_shared_mlps
    block.__dict__["_w3_shared_mlps_fused"] = use_shared_mlps(block, config, fused_shared)
    use_routers(block, config, fused_router)
    if BLOCK != "llama4_scout":
        config._experts_implementation = implementation
        return
    from hasten.moe.blocks import llama4_block_forward

    moe = block.block
    if implementation == "hasten_fused":
        moe.forward = llama4_block_forward.__get__(moe)
    elif implementation == "eager":
        moe.__dict__.pop("forward", None)
    else:
        raise ValueError(f"the Llama 4 block has no '{implementation}' experts implementation")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| in float32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(out, x_grad, param_grads, want) -> tuple[float, float, bool]:
    """(output rel diff, largest gradient rel diff, all bitwise equal) against `want`."""
    w_out, w_x, w_params = want
    grads = [x_grad] + list(param_grads)
    wants = [w_x] + list(w_params)
    missing = [i for i, g in enumerate(grads) if g is None]
    if missing:
        raise RuntimeError(f"gradients missing after the step: {missing} (0 is the input, then the parameters)")
    grad_diff = max(rel(g, w) for g, w in zip(grads, wants))
    exact = torch.equal(out.float(), w_out) and all(torch.equal(g, w) for g, w in zip(grads, wants))
    return rel(out, w_out), grad_diff, exact


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "frames_ok": int(counters["frames"].get("ok", 0))}


def capture_forward_backward(block, x, grad, warmup: int = 3):
    """block(x).backward(grad) captured in a CUDA graph: (graph, static output). Before capture the
    gradients are None, so backward allocates them in the graph's pool and every replay overwrites
    them: a replay is zero_grad(set_to_none=True) + forward + backward on whatever x holds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
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
    return graph, out


def allocator_counts() -> dict:
    """The caching allocator's device calls so far: cudaMalloc, cudaFree and the retries that
    free cached blocks first (each cudaFree synchronizes the device)."""
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def host_launch_ms(step, iters: int = 3) -> float:
    """Median host milliseconds until step() returns, the device idle before each: the time the
    host takes to issue one step's work, which bounds the step from below when the host is slower."""
    times = []
    for _ in range(iters):
        common.sync()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        common.sync()
    return common.median(times)


def forward_kept_gib(block, x, grad) -> float:
    """GiB one eager forward keeps for its backward (what a model's layers accumulate until the
    backward reaches them): the memory allocated after the forward less before it, less the output;
    then the backward, and the gradients cleared."""
    x.grad = None
    block.zero_grad(set_to_none=True)
    common.sync()
    before = torch.cuda.memory_allocated()
    out = block(x)
    kept = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(grad)
    del out
    x.grad = None
    block.zero_grad(set_to_none=True)
    return kept / 2**30


def eager_step(call, module, x, grad):
    """(step, result): one zero_grad + call(x).backward(grad), and what it left (output, x.grad,
    the module's parameter gradients); `call` is the module itself, compiled or graphed."""
    box = {}

    def step():
        x.grad = None
        module.zero_grad(set_to_none=True)
        box["out"] = call(x)
        box["out"].backward(grad)

    def result():
        return box["out"], x.grad, [p.grad for p in module.parameters()]

    return step, result


def run_variant(name: str, block, config, x, grad, iters: int, want, ref_out, run_id: str,
                profile: bool = False) -> dict:
    """One row; `want` is eager hasten's (output, x.grad, parameter grads), `ref_out` eager transformers'."""
    reset_fallbacks()
    use_implementation(block, config, IMPL[name], class_shared_mlps=name in CLASS_SHARED_MLPS,
                       fused_router=name in FUSED_ROUTER, weights_in_gate=name not in WEIGHTS_IN_COMBINE)
    notes, check = [], None
    cleanup = []
    kept_gib = None
    if DEVICE == "cuda" and name not in ("hasten_graphed", "hasten_router_graphed", "hasten_graphed_callables",
                                         "hasten_compiled"):
        kept_gib = forward_kept_gib(block, x, grad)
        notes.append(f"the forward keeps {kept_gib:.3f} GiB for the backward")
    if name in ("hasten_graphed", "hasten_router_graphed"):
        graph, static_out = capture_forward_backward(block, x, grad)
        cleanup.append(lambda: block.zero_grad(set_to_none=True))

        def step():
            graph.replay()

        def result():
            return static_out, x.grad, [p.grad for p in block.parameters()]
    elif name == "hasten_graphed_callables":
        own, own_config = build_block()  # make_graphed_callables replaces the module's forward: its own copy
        use_implementation(own, own_config, "hasten_fused")
        x.grad = None
        step, result = eager_step(torch.cuda.make_graphed_callables(own, (x,)), own, x, grad)
    elif name == "hasten_compiled":
        torch._dynamo.reset()
        step, result = eager_step(torch.compile(block), block, x, grad)
    else:
        step, result = eager_step(block, block, x, grad)

    before = dynamo_counts() if name == "hasten_compiled" else None
    iters = 3 if name == "hf_moe_eager" else iters
    for _ in range(2):  # warm-up, outside the timing (compiled: compiles forward and backward)
        step()
    common.sync()
    warm = dynamo_counts() if name == "hasten_compiled" else None
    allocator_before = allocator_counts()  # after the warm-up: its first-use segments are not counted
    if DEVICE == "cuda":  # the timed steps' peak: parameters, gradients and what the forward keeps
        torch.cuda.reset_peak_memory_stats()
    times = common.time_steps(step, warmup=0, iters=iters)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None
    if name == "hasten_compiled":
        after = dynamo_counts()
        notes.append(f"compiled graphs {warm['graphs'] - before['graphs']} in warm-up, recompiles in the timed steps "
                     f"{after['graphs'] - warm['graphs']}, graph breaks {after['graph_breaks'] - before['graph_breaks']}")
    allocator_after = allocator_counts()  # cudaMalloc / cudaFree inside the timed steps stall the GPU
    notes.append("allocator in the timed steps: " + ", ".join(
        f"{key} {allocator_after[key] - allocator_before[key]}" for key in allocator_after))
    launch_ms = host_launch_ms(step)
    bound = "host-bound" if launch_ms >= 0.9 * common.median(times) * 1e3 else "the device is the bound"
    notes.append(f"host ms to issue a step {launch_ms:.2f} ({bound})")
    if profile:  # where one forward + backward's GPU time goes, by kernel and by operator
        from packed_sft import print_profile

        print_profile(f"{BLOCK} {name}", step)
    with count_host_syncs() as syncs:
        step()
    common.sync()
    out, x_grad, param_grads = result()
    out_err = rel(out, ref_out)
    correct = out_err <= 1e-2
    notes.insert(0, f"fwd+bwd ms {[round(t * 1000, 2) for t in times]}; fallbacks {fallback_counts()}")
    if name.startswith("hasten"):
        gates = sorted({getattr(m, "_hasten_gate", "") for m in block.modules() if hasattr(m, "_hasten_gate")})
        fused_bias = sorted({bool(getattr(m, "_hasten_fused_bias", False)) for m in block.modules()
                             if hasattr(m, "_hasten_gate") and getattr(m, "has_bias", False)})
        notes.append(f"expert gate {gates or 'n/a'}; gate_up bias in the gate kernel {fused_bias or 'n/a'}; "
                     "shared MLPs on hasten's SwiGLU "
                     f"{block.__dict__.get('_w3_shared_mlps_fused', 0)}; router weights in the SwiGLU "
                     f"{sorted({weights_in_gate(m, m._hasten_gate) for m in block.modules() if hasattr(m, '_hasten_gate')})}"
                     "; router on hasten::moe_route "
                     f"{'_w3_router_undo' in block.__dict__}; grouped GEMM "
                     f"{os.environ.get('HASTEN_GROUPED_GEMM') or 'torch._grouped_mm (HASTEN_GROUPED_GEMM unset)'}")
    notes.append(f"output rel err vs eager {out_err:.2e}")
    if name in GRAD_TOLERANCE:
        check = compare(out, x_grad, param_grads, want)
        correct = correct and check[0] <= GRAD_TOLERANCE[name] and check[1] <= GRAD_TOLERANCE[name]
        notes.append(f"vs eager hasten_fused: output max rel diff {check[0]:.2e}, grads (input + "
                     f"{len(param_grads)} parameters) max rel diff {check[1]:.2e}, bitwise equal {check[2]}")
        print(f"{name}: vs eager hasten_fused on the same inputs: output rel diff {check[0]:.3e}, "
              f"largest gradient rel diff {check[1]:.3e}, bitwise equal {check[2]}", flush=True)
    for undo in cleanup:
        undo()
    return {"workload": "W3", "variant": name, "block": BLOCK, "run_id": run_id, **common.environment(),
            "tokens_per_s": x.shape[1] / common.median(times), "step_s": common.median(times), "peak_gib": peak_gib,
            "forward_kept_gib": kept_gib,
            "host_syncs_per_step": syncs.count, "correct": correct, "notes": "; ".join(notes)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="same as --iters")
    parser.add_argument("--variants", default=",".join(IMPL), help=f"comma-separated, of {','.join(IMPL)}")
    parser.add_argument("--no-grouping", action="store_true", help="skip the grouping-op rows")
    parser.add_argument("--block", default="qwen3_30b_a3b", choices=["qwen3_30b_a3b", "gpt_oss_20b", "deepseek_v2_lite",
                                                                     "llama4_scout"])
    parser.add_argument("--profile", default="", help="comma-separated variants to profile for one step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global BLOCK
    BLOCK = args.block
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in IMPL]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(IMPL)}")
    with registered():  # the "hasten_fused" experts name, which accelerate() would register
        return run(args, variants)


def run(args, variants: list[str]) -> int:
    iters = args.steps or args.iters
    block, config = build_block()
    x = torch.randn(1, args.tokens, config.hidden_size, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    run_id = common.new_run_id()

    # references on the same inputs: transformers' eager experts (output), eager hasten (output and grads)
    with torch.no_grad():
        use_implementation(block, config, "eager")
        ref_out = block(x).float()
    use_implementation(block, config, "hasten_fused")
    x.grad = None
    block.zero_grad(set_to_none=True)
    out = block(x)
    out.backward(grad)
    want = (out.detach().float(), x.grad.clone(), [p.grad.clone() for p in block.parameters()])
    del out

    rows = []
    for name in variants:
        previous_gemm = os.environ.get("HASTEN_GROUPED_GEMM")
        if name in GROUPED_GEMM:
            os.environ["HASTEN_GROUPED_GEMM"] = GROUPED_GEMM[name]
        try:
            rows.append(run_variant(name, block, config, x, grad, iters, want, ref_out, run_id,
                                    profile=name in args.profile.split(",")))
        except Exception as exc:  # noqa: BLE001 - one variant's failure must not cost the others
            traceback.print_exc()
            rows.append({"workload": "W3", "variant": name, "block": BLOCK, "run_id": run_id, **common.environment(),
                         "tokens_per_s": None, "step_s": None, "peak_gib": None, "host_syncs_per_step": None,
                         "correct": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}",
                         "notes": "failed"})
        finally:
            if previous_gemm is None:
                os.environ.pop("HASTEN_GROUPED_GEMM", None)
            else:
                os.environ["HASTEN_GROUPED_GEMM"] = previous_gemm
            x.grad = None
            block.zero_grad(set_to_none=True)
            common.sync()
            torch.cuda.empty_cache()
        row = rows[-1]
        path = common.write_rows([row], "W3", args.out)  # each row as it comes: a run cut short keeps them
        shown = f"{row['step_s'] * 1000:8.3f} ms" if row["step_s"] is not None else f"FAILED {row.get('error')}"
        print(f"{row['variant']:>24}: {shown}  syncs {row['host_syncs_per_step']}  correct {row['correct']}", flush=True)

    grouping_rows = []
    if not args.no_grouping:
        experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                   or config.n_routed_experts)
        top_k = config.num_experts_per_tok
        ids = torch.randint(0, experts, (args.tokens, top_k), device=DEVICE)

        def sort_histc_cumsum():
            flat = ids.view(-1)
            sorted_ids, perm = torch.sort(flat, stable=True)
            # int histc as before on the GPU (the row's figures stay comparable); the CPU has no int histc
            counts = torch.histc(sorted_ids.int() if DEVICE == "cuda" else sorted_ids.float(), bins=experts, min=0,
                                 max=experts - 1)
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.numel(), device=DEVICE)
            return offsets, perm, inverse

        for name, fn in (("torch_sort_histc_cumsum", sort_histc_cumsum),
                         ("hasten_moe_group", lambda: moe_ops.group(ids, experts))):
            times = common.time_steps(fn, warmup=5, iters=50)
            grouping_rows.append({"workload": "W3_grouping", "variant": name, "run_id": run_id, **common.environment(),
                         "tokens_per_s": None, "step_s": common.median(times), "peak_gib": None,
                         "host_syncs_per_step": 0, "correct": True,
                         "notes": f"{args.tokens} tokens x top-{top_k}, {experts} experts"})
    path = common.write_rows(grouping_rows, "W3", args.out)
    rows += grouping_rows
    for r in rows:
        shown = f"{r['step_s'] * 1000:8.3f} ms" if r["step_s"] is not None else "  FAILED  "
        print(f"{r['workload']:>12} {r['variant']:>24}: {shown}  syncs {r['host_syncs_per_step']}"
              f"  correct {r['correct']}  {r.get('error') or r['notes'][:110]}")
    by = {r["variant"]: r["step_s"] for r in rows if r["step_s"]}
    for a, b in (("hf_moe_grouped_mm", "hasten_fused"), ("hf_moe_eager", "hasten_fused"),
                 ("hasten_fused_torch_gemm", "hasten_fused"),
                 ("hasten_fused", "hasten_graphed"), ("hasten_fused", "hasten_graphed_callables"),
                 ("hasten_fused", "hasten_compiled"), ("hasten_fused", "hasten_router"),
                 ("hasten_weights_in_combine", "hasten_fused"),
                 ("hasten_graphed", "hasten_router_graphed"), ("hf_moe_grouped_mm", "hasten_router"),
                 ("hf_moe_grouped_mm", "hasten_router_graphed"), ("torch_sort_histc_cumsum", "hasten_moe_group")):
        if a in by and b in by:
            print(f"{b} vs {a}: {by[a] / by[b]:.2f}x")
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
