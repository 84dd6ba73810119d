"""hasten's typed configuration, loadable from the deployment guide's YAML.

The schema is the dataclasses below; the YAML keys are their field names, nested
by section. Unknown keys are an error that names the key and the nearest valid one;
wrong types name the key and the expected type; values out of range (NaN and infinity
included) name the key, the value and the allowed range. Keys whose feature is not built
yet are accepted and listed by `Config.inactive_features()`.

What YAML 1.1 (PyYAML) reads differently from what was meant is taken as meant: a float
key given a string that is a finite number (`1e-4`, which YAML 1.1 reads as a string for
want of a dot) is that number; `true`/`false` for a key whose choices are the strings
"true"/"false" is that string; an empty string for a nullable key is null; a list key
takes a YAML list or a comma-separated string.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem, with the key path and the fix in the message."""


@dataclass
class CheckpointConfig:
    # Activation checkpointing per decoder layer: none keeps every activation; full recomputes
    # each layer in backward; selective keeps attention outputs (and grouped expert GEMMs),
    # recomputes the rest: matmuls and LoRA projections too, since models change those outputs in
    # place, which torch either misses (a silently wrong gradient on Gemma 3n) or stops on (OLMo).
    activations: Literal["none", "full", "selective"] = "none"
    # Activation offload to pinned host memory, per decoder layer, copies on their own streams:
    # none; all (every layer but the last); auto (measure the first step, then keep, offload or
    # recompute each layer so that the copies stay hidden, within max_memory_gib if given).
    # With activations: full, what goes to the host is each layer's checkpointed input (all: every
    # layer's but the last; auto: the planner keeps on the device what fits max_memory_gib). The
    # host memory it may hold: 80% of MemAvailable at start, divided among the processes on the
    # host (torchrun's LOCAL_WORLD_SIZE).
    offload: Literal["none", "all", "auto"] = "none"
    # The deployment guide's switch: true turns offload on (auto, unless offload names a mode) and
    # brings layer i-1's activations back while layer i runs its backward (two device buffers);
    # false keeps one buffer; empty: two buffers whenever offload is on. Falls back to one
    # buffer, with a warning, if two run out of device memory.
    double_buffer: bool | None = None
    # With offload auto: the peak device memory to plan for, in GiB; empty plans the lowest
    # memory that costs no step time.
    max_memory_gib: float | None = None
    # Sequence tiling of each decoder layer's dense MLP: tokens per tile (its intermediate then
    # exists one tile at a time, in forward and backward, for one more MLP forward per step;
    # for long sequences); 0 tiles nothing. Single process only.
    mlp_tile_tokens: int = 0
    # Optimizer steps between training checkpoints (OUTPUT_DIR/checkpoints), written atomically.
    interval_steps: int = 100
    # Checkpoints kept; older ones are deleted once a newer one is complete.
    keep_last: int = 3

    def offload_mode(self) -> str:
        """The offload that runs: `offload`, or auto when only the guide's double_buffer asks for it."""
        if self.offload == "none" and self.double_buffer:
            return "auto"
        return self.offload

    def offload_double_buffer(self) -> bool:
        return self.double_buffer is not False


@dataclass
class MoEConfig:
    # MoE experts through hasten: one-kernel grouping (counts, offsets, permutation),
    # grouped GEMMs, fused SwiGLU and a deterministic combine.
    fused_grouping: bool = True
    # MoE routers through hasten::moe_route: the model's logits GEMM, then its softmax or sigmoid,
    # selection bias, group-limited top-k, renormalisation and scaling in one kernel each way (the
    # table's router recipes, each router class checked against its own forward first; under
    # autocast the model's own router runs).
    fused_router: bool = False
    # The router's weights multiplied into each expert row inside the fused SwiGLU, before the down
    # projection (the same product: the projection is linear), so the combine is a plain sum and its
    # backward keeps no copy of the experts' (slots, hidden) output: the weights' gradient comes from
    # the SwiGLU's backward. False: the weights in the combine, as before. Experts with biases or
    # another gate (gpt-oss) keep them in the combine.
    weights_in_gate: bool = True


@dataclass
class TrainingConfig:
    # Pack short samples into rows with per-sample boundaries (varlen attention; hybrid models' linear-attention and
    # short-convolution layers restart at each sample, with flash-linear-attention on a GPU).
    packed_sequence: bool = True
    # Build packing metadata once per batch and share it across layers; false
    # re-derives it inside every attention layer (slower; for comparison).
    metadata_cache: bool = True
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    # Tokens in one packed batch (rows of at most this many tokens).
    max_tokens: int = 4096
    # On a GPU, before the first step: one or two probe steps measure the memory per token under
    # these settings, and a max_tokens that would not fit the GPU (or, with activation offload, the
    # host) stops the run with the largest that fits. Single process only; false skips it.
    memory_preflight: bool = True
    # Samples longer than max_tokens: cut to max_tokens, or drop them.
    overlong: Literal["truncate", "drop"] = "truncate"
    # Optimizer steps to train (the LR schedule spans them).
    max_steps: int = 20
    # Peak learning rate of AdamW (linear warmup, then cosine down to 10%).
    learning_rate: float = 3e-4
    # AdamW decoupled weight decay.
    weight_decay: float = 0.0
    # Steps of linear LR warmup.
    warmup_steps: int = 2
    # Packed batches per optimizer step.
    gradient_accumulation_steps: int = 1
    # Seeds model init, data order and every RNG (resumed runs restore the RNG states).
    seed: int = 0
    # Optimizer steps between metric lines (console, metrics.jsonl).
    logging_steps: int = 1
    # auto: GPU when there is one, else CPU.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    # Under torchrun: ddp replicates the model, fsdp2 shards it per decoder layer (auto: ddp).
    distributed: Literal["auto", "ddp", "fsdp2", "none"] = "auto"
    # fsdp2: free each decoder layer's gathered weights after its forward (true: least memory) or
    # keep them until its backward (false: one all-gather per layer and step instead of two).
    fsdp2_reshard_after_forward: bool = True
    # fsdp2: consecutive decoder layers sharded as one unit (one gather, one reduce and one set of
    # hooks per unit; fewer, larger units cost the host less per step). 0 (auto): the fewest layers
    # that hold 50M parameters (Qwen3-0.6B: 4 per unit; 7B-class models: 1).
    fsdp2_layers_per_unit: int = 0
    # auto: bf16 on a GPU that supports it, float32 on the CPU.
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Compile each decoder layer with torch.compile (whole layer as one graph, fullgraph) after
    # hasten patches the model; token counts and sequence lengths are dynamic, so batches of other
    # sizes reuse the graph. The first steps include the compile time. If a layer fails to compile,
    # every layer runs eagerly, said once (fallback torch_compile). Needs metadata_cache: true,
    # attention.verify: false and no activation offload.
    compile: bool = False
    # CUDA graphs: false (none), or optimizer: the AdamW step is captured once in a CUDA graph and
    # replayed every step (the LR schedule is read from a device tensor; gradients are zeroed in
    # place, never freed, so each parameter keeps its gradient's memory through the forward).
    # Runs eagerly, with one warning, on the CPU, under fsdp2, or if capture fails. step: that, and
    # each micro-batch's forward and backward replayed from a CUDA graph of its shape (batches
    # padded on the host to a few shapes: tokens to multiples of max_tokens / 8, the sequence count
    # and longest sample to powers of two; the padding is a sequence of its own without loss); for
    # host-bound runs (small models). Verified for Qwen3-type models (the embedded default); runs
    # eagerly, with one warning, for other model types, under torchrun, or with dropout. Cannot
    # combine with activation offload, compile or padded batches.
    cuda_graphs: Literal["false", "optimizer", "step"] = "false"


@dataclass
class ModelConfig:
    # A local transformers model folder; empty means the embedded default model.
    path: str | None = None
    # Size of the embedded default model when `path` is empty (qwen3-0.6b: that model's shape,
    # random weights, for benchmarks).
    default_size: Literal["tiny", "small", "qwen3-0.6b"] = "small"


# Chat roles whose turns are context: masked, never trained on (the trained ones: data.assistant_roles).
CONTEXT_ROLES = ("system", "user", "tool")


@dataclass
class DataConfig:
    # Local JSONL/JSON/Parquet file; empty means the embedded corpus.
    path: str | None = None
    # Field of plain-text records (records with prompt/completion or messages are detected).
    text_field: str = "text"
    # Chat records: the roles whose turns are trained on (a YAML list or a comma-separated string),
    # e.g. [model] for Gemma-style data. Turns of system, user and tool are context (masked); a
    # record with any other role, or with no turn of these roles, is an error naming the record.
    assistant_roles: list[str] = field(default_factory=lambda: ["assistant"])


@dataclass
class AttentionConfig:
    # auto: hasten's cuDNN op when built (cudnn-frontend headers at install), else flash-attn when
    # installed, else torch varlen (FlashAttention-2), else the per-sequence path.
    backend: Literal["auto", "cudnn", "flash_attn", "torch_varlen", "per_sequence"] = "auto"
    # Grouped-query attention: native lets the kernel read shared K/V heads;
    # repeat materialises repeated K/V (for comparison and old kernels).
    gqa: Literal["auto", "native", "repeat"] = "auto"
    # Re-derive packing metadata in every layer and compare (also HASTEN_VERIFY=1).
    verify: bool = False


@dataclass
class KernelsConfig:
    # LM head and cross-entropy in chunks of tokens (C++/CUDA): the (tokens, vocab) logits are
    # never materialised. Training forwards with labels return logits=None.
    fused_cross_entropy: bool = True
    # RMSNorm in one C++/CUDA kernel each way (Llama/Qwen semantics, weight offset variants).
    rms_norm: bool = True
    # With rms_norm: a decoder layer's `h = residual + h; residual = h; h = norm(h)` in one kernel
    # each way (the add, the norm, and in backward the sum of the stream's two gradients): one
    # read and one write of the hidden state fewer per fused norm, and one launch fewer. Only the
    # add inside a layer fuses (the one before its post-attention norm; the next layer's input norm
    # sits across the layer boundary): W1 and W4 measured 1.00x with it on or off.
    fused_residual: bool = True
    # With fused_residual: each `residual = h; h = norm(h)` too, the norm's backward adding the
    # stream's gradient of h (no separate add of a layer input's two gradients). Off: GPU parity
    # passes on every type, but W4 and W1 measured 1.00x with it on or off.
    fused_residual_grad: bool = False
    # silu(gate) * up of the dense MLPs in one kernel; backward keeps only gate and up.
    swiglu: bool = True
    # Rotary embedding of q and k in one kernel each (transformers' rotate_half convention).
    rope: bool = True
    # With rms_norm and rope: a head norm (Qwen3's, Gemma 3's q_norm / k_norm) and the rotary
    # embedding after it in one kernel each way, the attention's own forward rewritten on those
    # statements: one read and one write of q and k fewer each way (W1 +1.4% on an H100).
    fused_qk_norm_rope: bool = True
    # Full fine-tuning: the plain nn.Linear projections one module feeds the same input (q/k/v,
    # gate/up) computed together, with one input gradient their GEMMs accumulate onto (addmm, beta
    # 1) instead of autograd's add per extra member (W1 +1.6% on an H100).
    fused_linear_groups: bool = True
    # PEFT LoRA layers: the frozen base GEMM and the low-rank update in one op that keeps no
    # float32 copy of the layer input (PEFT's float32 adapters keep one per projection).
    fused_lora: bool = True
    # With fused_lora: the LoRA projections one module feeds the same input (q/k/v, gate/up) in
    # one op: one thin GEMM and one read of the input for all their adapters, and one input
    # gradient their base GEMMs accumulate onto (no separate adds).
    fused_lora_groups: bool = True


@dataclass
class LoraConfig:
    # Train LoRA adapters through PEFT instead of every weight (one process, ddp or fsdp2).
    enabled: bool = False
    # Adapter rank.
    r: int = 16
    # LoRA scaling numerator (the update is scaled by alpha / r).
    alpha: int = 32
    # Dropout on the adapter input.
    dropout: float = 0.0
    # Module names to adapt: a YAML list or a comma-separated string (kept as the latter).
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    # QLoRA: nf4 loads model.path's Linear weights in 4 bits (bitsandbytes NF4, double-quantized
    # statistics, compute in training.dtype; under fsdp2 the packed bytes are stored as
    # training.dtype so FSDP2 can shard them); the adapters train on top. none: the model's dtype.
    quantize: Literal["none", "nf4"] = "none"


@dataclass
class LoggingConfig:
    # TensorBoard scalars under LOG_DIR/tensorboard: auto = when tensorboard is installed (YAML
    # true / false work as "true" / "false").
    tensorboard: Literal["auto", "true", "false"] = "auto"
    # GPU utilisation, memory, temperature and power per logging step (NVML, nvidia-ml-py).
    gpu_monitor: bool = True
    # Profile this optimizer step (0: none) with torch.profiler: LOG_DIR/profile_step<N>_rank<R>.txt
    # (operators by GPU and by CPU time) and a trace for Perfetto / chrome://tracing beside it.
    profile_step: int = 0


@dataclass
class Config:
    training: TrainingConfig = field(default_factory=TrainingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, *, source: str = "config") -> "Config":
        config = _build(cls, raw or {}, source, "")
        validate(config, source=source)
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Config":
        import yaml

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}\nFix: correct the file at that place; it holds a "
                              "mapping of sections, e.g. `training:` with `max_steps: 20` indented below it") from exc
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (training:, model:, ...), "
                              f"got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def inactive_features(self) -> list[str]:
        """Keys that are set but whose feature this version does not provide yet."""
        inactive = []
        checkpoint = self.training.checkpoint
        if checkpoint.offload_mode() == "none" and checkpoint.max_memory_gib is not None:
            inactive.append("training.checkpoint.max_memory_gib (applies with training.checkpoint.offload: auto)")
        return inactive


def _build(cls: type, raw: dict[str, Any], source: str, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: `{prefix.rstrip('.') or '<top>'}` must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        path = f"{prefix}{key}"
        if key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
            hint = (f"; did you mean `{prefix}{near[0]}`?" if near
                    else f"; valid keys here: {', '.join(prefix + k for k in sorted(known))}")
            raise ConfigError(f"{source}: unknown key `{path}`{hint}")
        values[key] = _coerce(hints[key], value, source, path)
    return cls(**values)


# Keys of type str that hold a comma-separated list and also take a YAML list (normalised to
# "a,b": the form the code reads).
_COMMA_STRING_KEYS = {"lora.target_modules"}
# Largest seed: torch's generators take 64-bit seeds and the batch sampler multiplies the seed
# by about 2**20; 2**32 - 1 is the usual bound and leaves room.
MAX_SEED = 2**32 - 1


def _shown(value: Any) -> str:
    return "nothing (an empty value)" if value is None else repr(value)


def _names(value: Any, source: str, path: str) -> list[str]:
    """A YAML list of names or a comma-separated string, as a list without blanks or repeats."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, list) and all(isinstance(item, str) for item in value):
        items = value
    else:
        raise ConfigError(f"{source}: `{path}` must be a list of names (e.g. [a, b]) or a comma-separated "
                          f"string (\"a,b\"); got {_shown(value)}")
    names = list(dict.fromkeys(item.strip() for item in items if item.strip()))
    if not names:
        raise ConfigError(f"{source}: `{path}` names nothing (got {value!r}); give at least one name, or remove "
                          "the key for its default")
    return names


def _coerce(hint: Any, value: Any, source: str, path: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, source, path + ".")
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if path in _COMMA_STRING_KEYS:
        return ",".join(_names(value, source, path))
    if origin is Literal:
        if isinstance(value, bool) and ("true" in args or "false" in args):
            value = "true" if value else "false"  # YAML reads an unquoted true/false as a boolean
        if isinstance(value, bool) or value not in args:
            raise ConfigError(f"{source}: `{path}` must be one of {', '.join(map(repr, args))}; got {_shown(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and not value.strip())):
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, source, path)
    if origin is list and args == (str,):
        return _names(value, source, path)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: `{path}` must be true or false; got {_shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: `{path}` must be an integer; got {_shown(value)}")
        return value
    if hint is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"{source}: `{path}` must be a number (e.g. 0.5 or 1e-4); got {_shown(value)}")
        try:
            number = float(number)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(f"{source}: `{path}` must be a finite number; got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: `{path}` must be a string; got {_shown(value)}")
        return value
    raise AssertionError(f"config schema has an unsupported type at {path}: {hint}")  # schema bug


def validate(config: Config, *, source: str = "config") -> None:
    """Range checks that the types alone cannot express: each names the key, the value and the range."""

    def refuse(message: str) -> ConfigError:
        return ConfigError(f"{source}: {message}")

    t = config.training
    for key, value in {"training.max_tokens": t.max_tokens, "training.max_steps": t.max_steps,
                       "training.gradient_accumulation_steps": t.gradient_accumulation_steps,
                       "training.logging_steps": t.logging_steps,
                       "training.checkpoint.interval_steps": t.checkpoint.interval_steps,
                       "training.checkpoint.keep_last": t.checkpoint.keep_last,
                       "lora.r": config.lora.r}.items():
        if value < 1:
            raise refuse(f"`{key}` must be at least 1; got {value}")
    if t.learning_rate <= 0:
        raise refuse(f"`training.learning_rate` must be positive (greater than 0, e.g. 3e-4); got {t.learning_rate}")
    if t.learning_rate / (1 - 0.9) >= 3.4028234663852886e38:  # AdamW's first step, lr / (1 - beta1), in float32
        raise refuse(f"training.learning_rate {t.learning_rate:g} overflows float32 in AdamW's first step "
                     "(lr / (1 - beta1) must stay below 3.4e38); fine-tuning rates are about 1e-5 to 1e-3")
    if t.weight_decay < 0:
        raise refuse(f"`training.weight_decay` must be zero (none) or positive; got {t.weight_decay}")
    if not 0 <= t.seed <= MAX_SEED:
        raise refuse(f"`training.seed` must be from 0 to {MAX_SEED}; got {t.seed}")
    if t.warmup_steps < 0:
        raise refuse(f"`training.warmup_steps` must be zero or more; got {t.warmup_steps}")
    if t.fsdp2_layers_per_unit < 0:
        raise refuse(f"`training.fsdp2_layers_per_unit` must be 0 (auto) or a number of layers; "
                     f"got {t.fsdp2_layers_per_unit}")
    checkpoint = t.checkpoint
    if checkpoint.mlp_tile_tokens < 0:
        raise refuse(f"`training.checkpoint.mlp_tile_tokens` must be 0 (no tiling) or a number of tokens per tile; "
                     f"got {checkpoint.mlp_tile_tokens}")
    if checkpoint.offload_mode() != "none" and checkpoint.activations == "selective":
        which = f"offload: {checkpoint.offload}" if checkpoint.offload != "none" else "double_buffer: true"
        raise refuse(f"`training.checkpoint.{which}` turns on activation offload, which plans per layer what is kept, "
                     "offloaded or recomputed; it cannot combine with `training.checkpoint.activations: selective` "
                     "(what selective keeps inside a layer is not offloaded). Set activations: none (offload auto "
                     "recomputes layers itself when that is cheaper) or full (the checkpointed inputs go to the host), "
                     "or turn offload off (offload: none, double_buffer: false).")
    if t.compile:
        # each of these puts host work inside every decoder layer, which a compiled layer cannot run
        blockers = []
        if checkpoint.offload_mode() != "none":
            which = f"offload: {checkpoint.offload}" if checkpoint.offload != "none" else "double_buffer: true"
            blockers.append(f"`training.checkpoint.{which}` (activation offload moves what each layer saves through "
                            "Python hooks and, in auto, times the first forwards to plan, which compiling distorts; "
                            "the two are not verified together)")
        if checkpoint.mlp_tile_tokens:
            blockers.append("`training.checkpoint.mlp_tile_tokens` (the tiled MLP loops over tiles in Python, in "
                            "forward and backward; the two are not verified together)")
        if not t.metadata_cache:
            blockers.append("`training.metadata_cache: false` (each layer then reads the batch's sequence count back "
                            "to the host, which breaks the compiled graph)")
        if config.attention.verify:
            blockers.append("`attention.verify: true` (each layer re-derives the metadata and compares it on the "
                            "host)")
        if blockers:
            raise refuse("`training.compile: true` compiles each decoder layer as one graph, which cannot combine "
                         f"with {'; nor with '.join(blockers)}. Turn those off, or set training.compile: false.")
    if t.cuda_graphs == "step":
        # settings that put host work or random numbers inside a micro-batch, or change its shapes
        blockers = []
        if not t.packed_sequence:
            blockers.append("`training.packed_sequence: false` (padded batches change shape with every batch)")
        if checkpoint.offload_mode() != "none":
            which = f"offload: {checkpoint.offload}" if checkpoint.offload != "none" else "double_buffer: true"
            blockers.append(f"`training.checkpoint.{which}` (activation offload copies on its own streams from "
                            "Python hooks)")
        if checkpoint.mlp_tile_tokens:
            blockers.append("`training.checkpoint.mlp_tile_tokens` (not verified under graphs)")
        if t.compile:
            blockers.append("`training.compile: true` (not combined yet)")
        if not t.metadata_cache:
            blockers.append("`training.metadata_cache: false` (each layer reads the sequence count back)")
        if config.attention.verify:
            blockers.append("`attention.verify: true` (each layer compares the metadata on the host)")
        if config.lora.enabled and config.lora.dropout > 0:
            blockers.append(f"`lora.dropout: {config.lora.dropout}` (random masks are not replayed from a graph)")
        if blockers:
            raise refuse("`training.cuda_graphs: step` replays each micro-batch from a CUDA graph, which cannot "
                         f"combine with {'; nor with '.join(blockers)}. Turn those off, or set training.cuda_graphs: "
                         "optimizer (the optimizer step alone) or false.")
    if checkpoint.max_memory_gib is not None and checkpoint.max_memory_gib <= 0:
        raise refuse("`training.checkpoint.max_memory_gib` must be a positive number of GiB, or empty for the lowest "
                     f"memory that costs no step time; got {checkpoint.max_memory_gib}")
    lora = config.lora
    if lora.alpha <= 0:
        raise refuse(f"`lora.alpha` must be positive (the update is scaled by alpha / r; e.g. 2 * r); got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise refuse(f"`lora.dropout` must be from 0 up to, not including, 1 (a probability; 0: none); "
                     f"got {lora.dropout}")
    if lora.quantize != "none":
        if not lora.enabled:
            raise refuse(f"`lora.quantize: {lora.quantize}` quantizes the base model for LoRA training; set "
                         "lora.enabled: true, or lora.quantize: none")
        if not config.model.path:
            raise refuse(f"`lora.quantize: {lora.quantize}` loads the weights of model.path in 4 bits; set model.path "
                         "to a local transformers model folder (the embedded default model has no weights to load)")
    if not config.data.text_field.strip():
        raise refuse("`data.text_field` must name a field of the records (default: text); got an empty string")
    context = sorted(set(config.data.assistant_roles) & set(CONTEXT_ROLES))
    if context:
        raise refuse(f"`data.assistant_roles` names {', '.join(map(repr, context))}, whose turns are context that is "
                     "given to the model, not generated by it, so it is never trained on; list only the roles of the "
                     "replies to train on (default: [assistant]; Gemma-style data: [model])")
    profile_step = config.logging.profile_step
    if profile_step < 0:
        raise refuse(f"`logging.profile_step` must be zero (off) or a step number; got {profile_step}")
    if profile_step > t.max_steps:
        raise refuse(f"`logging.profile_step` {profile_step} comes after the last step (training.max_steps "
                     f"{t.max_steps}), so nothing would be profiled; choose a step from 1 to {t.max_steps}, or 0 "
                     "for none")
