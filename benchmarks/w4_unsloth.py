"""W4 helper: Unsloth 2026.10.9's LoRA / QLoRA training step, offline, for benchmarks/lora_sft.py.

The device machine has no network and no package index, so Unsloth comes from the bundle
`.whl/unsloth_offline.tar.gz` (gitignored; it travels with `carry: [".whl"]`). Extract it once and
put it on the path *before anything imports transformers, peft or trl* (Unsloth patches them at
import; imported later it warns and some of its patches do not apply):

    import w4_unsloth
    site = w4_unsloth.ensure_bundle("/tmp/unsloth_site")      # tar -xzf, once
    w4_unsloth.prepare_unsloth_env(site)                       # env vars + sys.path
    import unsloth                                             # noqa: then transformers etc.
    model, notes = w4_unsloth.unsloth_lora_model(config, r=16, alpha=32, target_modules=[...],
                                                 folder="/tmp/w4_llama8b", max_seq_length=16384)
    batch = w4_unsloth.unsloth_packed_batch(samples, "cuda")
    model(**batch).loss.backward()

Run Unsloth in its own process: loading a model through FastLanguageModel replaces transformers'
Llama forwards (attention, decoder layer, model, causal-LM head) for the rest of the process, so a
hasten or plain-transformers variant run after it in the same process would measure Unsloth's code.

What the bundle holds (versions checked against unsloth's and unsloth_zoo's Requires-Dist): unsloth
2026.10.9 (no studio/, no unsloth_cli/), unsloth_zoo 2026.10.9, cut_cross_entropy 25.1.1, tyro 1.0.17
with docstring_parser 0.18.0 and typeguard 4.6.1, msgspec 0.23.0 (cp312), datasets 4.8.5 with dill 0.4.1
and multiprocess 0.70.19 (py312), trl 1.15.0, torchao 0.18.0 and bitsandbytes 0.50.2 with only its
CUDA 13.0 (and CPU) library. Everything else it imports is in the device image (its package list is in
the manifest inside the tarball). xformers and flash-attn are not bundled; Unsloth treats both as
optional.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import importlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".whl" / "unsloth_offline.tar.gz"
UNSLOTH_VERSION = "2026.10.9"

# Set before `import unsloth`. What each one stops (read in the 2026.10.9 sources):
#   HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE / HF_DATASETS_OFFLINE: Hub calls of transformers, huggingface_hub
#     and datasets; Unsloth's has_internet() (a socket to 8.8.8.8:53, models/_utils.py has_internet) and its
#     mapper refresh from GitHub (loader_utils.get_model_name -> _env_says_offline) return early on them, and
#     unsloth_zoo then leaves hf_transfer off (unsloth_zoo/__init__.py, "Detect offline mode first").
#   UNSLOTH_DISABLE_STATISTICS: the usage ping from_pretrained sends (a snapshot_download of a small
#     "unslothai/<environment>" repo, models/_utils.py get_statistics); offline and local_files_only skip it
#     as well, this makes it explicit.
#   HF_HUB_DISABLE_TELEMETRY / DO_NOT_TRACK: huggingface_hub's own telemetry.
#   UNSLOTH_COMPILE_LOCATION (set in prepare_unsloth_env): unsloth_zoo writes generated modules to
#     "./unsloth_compiled_cache" by default (unsloth_zoo/compiler.py) and puts it on sys.path: a temp dir
#     keeps them out of the repo.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

_CHECKPOINT_MARKER = "w4_checkpoint.json"  # written last: a folder without it is incomplete
_BUNDLE_MARKER = ".w4_bundle.json"
_imported_before_unsloth: list[str] = []  # filled by prepare_unsloth_env, reported in the notes
_prepared: list[str] = []  # the site dir prepare_unsloth_env put on sys.path


def ensure_bundle(dest: str | os.PathLike, bundle: str | os.PathLike = BUNDLE) -> Path:
    """Extract `bundle` into `dest` unless the same tarball (by size and mtime) is already there.
    Returns `dest`, the directory to put on sys.path."""
    dest, bundle = Path(dest), Path(bundle)
    if not bundle.is_file():
        raise FileNotFoundError(f"{bundle} is missing (it is not in git: carry .whl, where it was built)")
    stamp = {"bundle": str(bundle), "size": bundle.stat().st_size, "mtime": int(bundle.stat().st_mtime)}
    marker = dest / _BUNDLE_MARKER
    if marker.is_file() and json.loads(marker.read_text()) == stamp and (dest / "unsloth").is_dir():
        return dest
    if dest.exists() and any(dest.iterdir()) and not marker.is_file():
        raise FileExistsError(f"{dest} is not empty and holds no extracted bundle: pick an empty directory")
    shutil.rmtree(dest, ignore_errors=True)  # an older extraction of the bundle, or nothing
    dest.mkdir(parents=True)
    with tarfile.open(bundle) as tar:
        # filter="data" (Python >= 3.12) refuses absolute paths, links out of dest and device files
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    marker.write_text(json.dumps(stamp))
    return dest


def prepare_unsloth_env(site_dir: str | os.PathLike) -> dict[str, str]:
    """Set the environment Unsloth needs offline and put `site_dir` (the extracted bundle) first on
    sys.path and on PYTHONPATH (for subprocesses such as Inductor's compile workers). Call it before
    `import unsloth` and before anything imports transformers / peft / trl. Returns what it set."""
    site = str(Path(site_dir).resolve())
    if not Path(site, "unsloth", "__init__.py").is_file():
        raise FileNotFoundError(f"{site} holds no unsloth package (extract the bundle with ensure_bundle)")
    env = dict(OFFLINE_ENV)
    env["UNSLOTH_COMPILE_LOCATION"] = os.environ.get(
        "UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "unsloth_compiled_cache"))
    os.environ.update(env)
    if site not in sys.path:
        sys.path.insert(0, site)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    os.environ["PYTHONPATH"] = os.pathsep.join([site, *parts])
    importlib.invalidate_caches()
    _prepared[:] = [site]
    _imported_before_unsloth[:] = [m for m in ("transformers", "peft", "trl") if m in sys.modules
                                   and "unsloth" not in sys.modules]
    if _imported_before_unsloth:
        warnings.warn(f"w4_unsloth: {', '.join(_imported_before_unsloth)} imported before unsloth; "
                      "Unsloth then runs without some of its patches", stacklevel=2)
    return env


def _config_digest(config) -> str:
    # The shape-defining fields only: a folder written for another shape is rebuilt, not reused.
    d = config.to_dict()
    keep = {k: d.get(k) for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "max_position_embeddings", "tie_word_embeddings",
                                  "rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps",
                                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                  "norm_topk_prob")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_tokenizer(folder: Path, config, model_max_length: int) -> None:
    """A WordLevel tokenizer with exactly config.vocab_size tokens ("t<id>"), its specials at the
    config's own ids, so that len(tokenizer) == the embedding rows and Unsloth's tokenizer checks
    (tokenizer_utils.check_tokenizer: no added token id >= embedding size; unsloth_zoo pad_token.py:
    a pad distinct from eos) pass without resizing the model. FastLanguageModel.from_pretrained always
    loads a tokenizer (llama.py, load_correct_tokenizer on tokenizer_name = the model folder) and has
    no option that skips it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n = int(config.vocab_size)

    def first_id(value, default):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        return int(value) if isinstance(value, int) and 0 <= value < n else default

    bos = first_id(getattr(config, "bos_token_id", None), 1)
    eos = first_id(getattr(config, "eos_token_id", None), 2)
    pad = first_id(getattr(config, "pad_token_id", None), n - 1)
    unk = 0
    if pad in (bos, eos):
        pad = next(i for i in range(n - 1, -1, -1) if i not in (bos, eos, unk))
    names = {unk: "<unk>", bos: "<s>", eos: "</s>", pad: "<pad>"}
    vocab = {names.get(i, f"t{i}"): i for i in range(n)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[unk]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names[bos], eos_token=names[eos],
                            unk_token=names[unk], pad_token=names[pad], model_max_length=model_max_length,
                            padding_side="right").save_pretrained(folder)


def _ensure_checkpoint(config, folder: Path, max_seq_length: int) -> bool:
    """Write a random-weight bf16 checkpoint of `config` (safetensors) plus a tokenizer to `folder`,
    unless a complete one of the same shape is there. Returns True when it wrote one."""
    import torch
    from transformers import AutoModelForCausalLM

    digest = _config_digest(config)
    marker = folder / _CHECKPOINT_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("config") == digest:
        return False
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(0)
    # Built on the GPU (seconds for 8B parameters, 16 GB of bf16) and freed before Unsloth loads it;
    # a copy of the config, since from_config writes its attention choice into the one it is given.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(partial, max_shard_size="5GB")
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    _write_tokenizer(partial, config, max_seq_length)
    (partial / _CHECKPOINT_MARKER).write_text(json.dumps({"config": digest}))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return True


def _attention_note() -> str:
    """Which kernel Unsloth's Llama attention takes for a packed row (unsloth/utils/attention_dispatch.py:
    select_attention_backend, then the SDPA branch of _run_attention)."""
    try:
        from unsloth.utils import attention_dispatch as ad
    except ImportError as exc:  # a private module: report, never fail the run on it
        return f"attention: unknown ({type(exc).__name__}: {exc})"
    backend = ad.select_attention_backend(use_varlen=True)
    if backend == getattr(ad, "SDPA", "sdpa"):
        if getattr(ad, "_TORCH_VARLEN_ATTN", None) is not None:
            route = "torch varlen_attn where it beats per-segment SDPA, else SDPA per run of equal lengths"
        elif getattr(ad, "_SDPA_PACKED_SEGMENTS", False):
            route = "SDPA once per run of equal-length samples (torch varlen_attn unavailable on this torch)"
        else:
            route = "SDPA over a dense block-diagonal mask"
        backend = f"sdpa: {route}"
    return (f"attention: {backend} (flash_attn {'on' if getattr(ad, 'HAS_FLASH_ATTENTION', False) else 'absent'},"
            f" xformers {'on' if getattr(ad, 'HAS_XFORMERS', False) else 'absent'})")


def _notes(model, load_in_4bit: bool) -> str:
    from importlib.metadata import version

    import torch
    import transformers
    import unsloth

    mode = getattr(model, "_unsloth_gradient_checkpointing", None)
    offloaded = torch.utils.checkpoint.CheckpointFunction.__name__ == "UnslothCheckpointFunction"
    gc_note = (f"gradient checkpointing: {mode!r}"
               + (" (Unsloth's, activations offloaded to CPU)" if offloaded else " (standard recompute)"))
    quant = f"QLoRA, bitsandbytes {version('bitsandbytes')} NF4" if load_in_4bit else "LoRA, bf16 base"
    config = getattr(model, "config", None)
    loaded = (f"loaded as {type(model.get_base_model() if hasattr(model, 'get_base_model') else model).__name__}"
              f" (attn_implementation {getattr(config, '_attn_implementation', None)!r},"
              f" experts_implementation {getattr(config, '_experts_implementation', None)!r})")
    parts = [f"unsloth {unsloth.__version__} (zoo {version('unsloth_zoo')})", quant, gc_note, loaded, _attention_note(),
             f"torch {torch.__version__}, transformers {transformers.__version__}, peft {version('peft')}"]
    if _imported_before_unsloth:
        parts.append(f"WARNING: {', '.join(_imported_before_unsloth)} imported before unsloth")
    return "; ".join(parts)


def _load(config, *, r: int, alpha: int, target_modules: list[str], folder: str, max_seq_length: int,
          load_in_4bit: bool, target_parameters: list[str] | None = None):
    if "unsloth" not in sys.modules and not _prepared:
        raise RuntimeError("call w4_unsloth.prepare_unsloth_env(site_dir) (and import unsloth) first")
    import torch
    import unsloth  # before transformers / peft / trl are imported, so it can patch them
    from unsloth import FastLanguageModel

    if unsloth.__version__ != UNSLOTH_VERSION:
        warnings.warn(f"w4_unsloth: expected unsloth {UNSLOTH_VERSION}, got {unsloth.__version__}", stacklevel=3)
    folder_path = Path(folder).resolve()
    _ensure_checkpoint(config, folder_path, max_seq_length)
    # loader.py FastLanguageModel.from_pretrained (2026.10.9): model_type "llama" dispatches to
    # FastLlamaModel (llama.py); load_in_4bit=True quantizes the bf16 checkpoint to bnb NF4 while it loads;
    # local_files_only forces offline around the whole load (loader_utils._offline_aware_load);
    # use_exact_model_name skips the repo-name remapping.
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(folder_path),
        max_seq_length=max_seq_length,
        dtype=torch.bfloat16,
        load_in_4bit=load_in_4bit,
        local_files_only=True,
        use_exact_model_name=True,
        use_gradient_checkpointing="unsloth",
    )
    # llama.py FastLlamaModel.get_peft_model: lora_dropout=0 and bias="none" are what its fused LoRA MLP /
    # QKV / O kernels need. "unsloth" checkpointing offloads activations to the CPU when
    # max_seq_length >= 512, else falls back to standard checkpointing (_utils.apply_unsloth_gradient_checkpointing).
    model = FastLanguageModel.get_peft_model(
        model,
        r=r,
        lora_alpha=alpha,
        lora_dropout=0,
        target_modules=list(target_modules),
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        max_seq_length=max_seq_length,
        # MoE experts (nn.Parameter, PEFT's target_parameters); None lets Unsloth derive them from
        # target_modules (_utils.get_moe_target_parameters), [] would turn them off
        **({"target_parameters": list(target_parameters)} if target_parameters is not None else {}),
    )
    FastLanguageModel.for_training(model)
    return model, _notes(model, load_in_4bit)


def unsloth_lora_model(config, *, r: int, alpha: int, target_modules: list[str], folder: str,
                       max_seq_length: int):
    """Save a random-weight bf16 model of `config` (a transformers PretrainedConfig, Llama-8B shape) to
    `folder` (safetensors and a tokenizer; skipped when a complete one of the same shape is there), load
    it with unsloth.FastLanguageModel.from_pretrained(folder, dtype=torch.bfloat16, load_in_4bit=False,
    max_seq_length=..., local_files_only=True) and wrap it with FastLanguageModel.get_peft_model(r=r,
    lora_alpha=alpha, lora_dropout=0, target_modules=..., use_gradient_checkpointing="unsloth",
    bias="none"). Returns (model, notes): notes name the Unsloth version, its gradient-checkpointing mode
    and the attention backend it takes for packed rows.

    Build `config` after `import unsloth` (see the module docstring); the model is in training mode."""
    return _load(config, r=r, alpha=alpha, target_modules=target_modules, folder=folder,
                 max_seq_length=max_seq_length, load_in_4bit=False)


def unsloth_moe_lora_model(config, *, r: int, alpha: int, target_modules: list[str], target_parameters: list[str],
                           folder: str, max_seq_length: int):
    """unsloth_lora_model for an MoE config (W5, qwen3_moe): LoRA on `target_modules` (attention) and on
    the experts' fused weights `target_parameters` (e.g. mlp.experts.gate_up_proj). In 2026.10.9
    FastLanguageModel.from_pretrained hands qwen3_moe to FastModel (loader.py: only "qwen3" keeps its
    Llama-style fast path), whose experts run on unsloth_zoo's grouped-GEMM MoE patches."""
    return _load(config, r=r, alpha=alpha, target_modules=target_modules, folder=folder,
                 max_seq_length=max_seq_length, load_in_4bit=False, target_parameters=target_parameters)


def unsloth_qlora_model(config, *, r: int, alpha: int, target_modules: list[str], folder: str,
                        max_seq_length: int):
    """unsloth_lora_model with load_in_4bit=True: the same bf16 checkpoint quantized to bitsandbytes NF4
    (double quantization, bf16 compute) as Unsloth loads it; LoRA adapters in bf16."""
    return _load(config, r=r, alpha=alpha, target_modules=target_modules, folder=folder,
                 max_seq_length=max_seq_length, load_in_4bit=True)


def unsloth_packed_batch(samples: list[list[int]], device) -> dict:
    """One padding-free packed row in the form Unsloth's own packed training path feeds its Llama forward.

    Returns, with T = sum of the sample lengths and n = number of samples:
      input_ids          (1, T) int64 on `device`: the samples back to back, no padding
      position_ids       (1, T) int64 on `device`: 0..len-1 restarting at every sample (RoPE positions)
      labels             (1, T) int64 on `device`: input_ids with -100 on each sample's first token
                         (the forward shifts internally, so this stops sample k's last token from being
                         trained to predict sample k+1's first token)
      packed_seq_lengths (n,) int32 on the CPU: the sample lengths, the kwarg that keeps samples apart
    and no attention_mask (an attention_mask sends attention to the masked SDPA path instead).

    What this is modelled on (unsloth 2026.10.9 wheel, trl 1.15.0; paths inside the bundle):
    - unsloth/utils/packing.py:233-283 enable_sample_packing (installed on SFTTrainer for packing /
      padding_free) wraps TRL's collator: TRL (trl/trainer/sft_trainer.py:180-209) flattens the batch to one
      (1, T) row with restarting position_ids and labels[position_ids == 0] = -100; Unsloth then adds
      batch["packed_seq_lengths"] = torch.tensor(lengths, dtype=torch.int32) (CPU), masks the boundary
      labels again and pops attention_mask (packing.py:262-282).
    - unsloth/models/llama.py:1339-1358 LlamaModel_fast_forward: packed_seq_lengths in kwargs lets the row
      exceed max_seq_length (no truncation); without it, a batch-1 row with position_ids, no mask and no
      cache has its lengths inferred from the zeros of position_ids (packing.py:1169-1194, a nonzero() and
      .item() host sync per forward) -- so position_ids alone also keeps samples apart, but costs a sync.
    - llama.py:1097 (LlamaAttention_fast_forward): every layer reads get_packed_info_from_kwargs
      (packing.py:1724-1786), cached per device for the forward; a CPU lengths tensor is staged once
      through pinned memory with its host copy kept, so no device-to-host read happens at all.
      llama.py:1115-1119: RoPE is indexed by position_ids (fast_rope_embedding with indices), so positions
      restart per sample. llama.py:1128-1129: with seq_info and no attention_mask the backend is
      select_attention_backend(use_varlen=True): flash-attn varlen if installed, else xformers
      BlockDiagonalCausalMask if installed, else SDPA, which for a packed row runs per segment
      (attention_dispatch.py:1520-1562, _sdpa_packed_segments at :922) or torch varlen_attn where torch has
      window_size + enable_gqa (attention_dispatch.py:448-466; per its comment torch >= 2.12). Every path is
      block-diagonal: no attention across samples.
    - llama.py:2115-2119 (CausalLM_fast_forward, fused-CE branch) and :2160-2168 (logits branch):
      mask_packed_boundary_labels / mask_packed_sequence_boundaries re-mask labels[cumsum(lengths)], so the
      -100s here are idempotent with Unsloth's own; gradient checkpointing passes **kwargs (and so
      packed_seq_lengths) through to every layer (llama.py:1621-1660).
    NOT verified on a GPU here (no GPU on the machine this was written on): that the forward with this
    batch runs, which SDPA route torch 2.11 takes on the H200, and isolation of samples inside the pack
    numerically. Check isolation the way benchmarks/packed_sft.py does before trusting throughput rows.
    """
    import torch

    lengths = [len(s) for s in samples]
    if not lengths or min(lengths) < 1:
        raise ValueError("unsloth_packed_batch needs at least one sample and no empty sample")
    ids = torch.tensor([t for s in samples for t in s], dtype=torch.long).view(1, -1)          # (1, T)
    pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).view(1, -1)         # (1, T)
    labels = ids.clone()
    labels[pos == 0] = -100                                                                     # (1, T)
    return {
        "input_ids": ids.to(device, non_blocking=True),
        "position_ids": pos.to(device, non_blocking=True),
        "labels": labels.to(device, non_blocking=True),
        # stays on the CPU on purpose: get_packed_info_from_kwargs copies it once (pinned, non_blocking)
        # and keeps the host tuple for the per-segment attention, so the step has no host sync for it
        "packed_seq_lengths": torch.tensor(lengths, dtype=torch.int32),
    }
