"""Packed (varlen) forms of the functions that carry state along the sequence in transformers'
hybrid models: the short causal convolution, the chunked gated delta rule (Gated DeltaNet) and
Kimi Delta Attention (KDA: the gated delta rule with a decay per key channel).

transformers' modeling files (qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid, lfm2...) call these
as module-level functions, `causal_conv1d_fn(x, weight, bias, activation=..., **kwargs)` and
`torch_chunk_gated_delta_rule(q, k, v, g=..., beta=..., ..., cu_seqlens=..., **kwargs)` (kimi_linear:
`chunk_kimi_delta_attention(q, k, v, g=..., beta=..., ..., **kwargs)`), passing
the layer's keyword arguments along. hasten's packing hook adds one `LinearMeta` per packed batch
to those arguments (`LINEAR_META`); the replacements below (installed by stateful/patch.py) then
compute each packed sample as if it were alone -- its convolution window and its recurrent state
start at zero at the sample's first token -- and call the model's own function unchanged when no
LinearMeta is there (padded batches, generation, another model).

On CUDA the kernels are flash-linear-attention's (fla-core): `causal_conv1d`,
`chunk_gated_delta_rule` and `chunk_kda` with `cu_seqlens` (Triton). Elsewhere (the CPU, CI) the model's own
function runs once per sample: exact by construction, and the reference the GPU path is tested
against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from hasten.packing.meta import LINEAR_META

FLA_INSTALL = "pip install flash-linear-attention"  # brings fla-core, the kernels hasten calls


@dataclass
class LinearMeta:
    """One packed batch's sample boundaries, as the varlen kernels take them. Built once per
    batch by the packing hook; every stateful layer of the forward (and its recompute under
    checkpointing) reads the same object through the layer's keyword arguments.

    cu_seqlens      (num_seqs + 1,) int64 on the batch's device: fla's varlen argument. Tokens past
                    the last sample (a padded tail) form one more sequence, so every output row is
                    written.
    cu_seqlens_cpu  the same on the host: fla plans its chunks from it without a read-back per call.
    calls           replacements that computed with this batch's boundaries (the packing hook checks
                    after the forward that every stateful layer did)."""

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    calls: int = field(default=0, compare=False)

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, tokens: int) -> "LinearMeta":
        """From the batch's cu_seqlens (int32, any device) and its token count. One read-back of
        cu_seqlens per batch (a few hundred bytes) when it lives on the GPU."""
        device = cu_seqlens.detach().to(torch.int64)  # on its own device: no copy back up
        host = device.cpu()
        if int(host[-1]) < tokens:  # a padded tail: one more sequence, so its rows are computed too
            tail = torch.tensor([tokens], dtype=torch.int64)
            host, device = torch.cat((host, tail)), torch.cat((device, tail.to(device.device)))
        return cls(device, host)

    def bounds(self) -> list[tuple[int, int]]:
        edges = self.cu_seqlens_cpu.tolist()
        return list(zip(edges[:-1], edges[1:]))


# --- flash-linear-attention ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def fla_problem(device_index: int | None = None) -> str | None:
    """Why fla's varlen kernels cannot run on this CUDA device (None: they can). The gated
    backward of fla's chunked delta rule is wrong on Hopper with Triton 3.4 to 3.7.0 (fla issue
    640); fla then dispatches it to TileLang, and raises without TileLang."""
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception as exc:  # missing, or broken against this torch/Triton
        return f"flash-linear-attention is not importable ({type(exc).__name__}: {exc}); {FLA_INSTALL}"
    if device_index is not None and torch.cuda.is_available():
        import triton
        from packaging.version import Version

        major, _ = torch.cuda.get_device_capability(device_index)
        if major == 9 and Version("3.4.0") <= Version(triton.__version__) < Version("3.7.1"):
            try:
                import tilelang  # noqa: F401
            except Exception:
                return (f"Triton {triton.__version__} on a Hopper GPU computes the gated delta rule's backward "
                        "wrongly (flash-linear-attention issue 640); install TileLang (pip install tilelang), which "
                        "fla then uses for it, or Triton >= 3.7.1")
    return None


FLA_ACTIVATIONS = (None, "silu", "swish")  # the convolution activations fla's kernel applies itself


# --- the replacements ------------------------------------------------------------------------------

def _per_sample_on_cuda(tensor: torch.Tensor, function: str, problem: str | None = None) -> None:
    """The per-sample loop is the CPU's path; on CUDA it is correct but slow: say so, once, counted."""
    if tensor.is_cuda:
        from hasten.observability import record_fallback

        record_fallback("stateful_per_sample", f"{function} runs once per packed sample on {tensor.device}: "
                        f"{problem or fla_problem(tensor.device.index) or 'fla has no kernel for this activation'}")


def _meta_of(kwargs: dict) -> LinearMeta | None:
    meta = kwargs.pop(LINEAR_META, None)
    return meta if isinstance(meta, LinearMeta) else None


def varlen_causal_conv1d(original):
    """`causal_conv1d_fn` of a modeling file, computed per packed sample when the call carries a
    LinearMeta. x: (rows, channels, L), the packed rows; weight: (channels, width); out like x."""

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        meta = _meta_of(kwargs)
        if meta is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        meta.calls += 1
        rows, channels, length = hidden_states.shape
        # the packed rows as one sequence of rows * L tokens, which the batch's cu_seqlens describe
        # (a row's padding tail is a sequence of its own): (rows, D, L) -> (1, D, rows * L)
        flat = hidden_states.transpose(0, 1).reshape(1, channels, rows * length) if rows > 1 else hidden_states
        if hidden_states.is_cuda and activation in FLA_ACTIVATIONS and fla_problem(hidden_states.device.index) is None:
            from fla.modules.causal_conv1d import causal_conv1d

            out, _ = causal_conv1d(flat.transpose(1, 2).to(weight.dtype), weight, bias,
                                   activation=activation, cu_seqlens=meta.cu_seqlens,
                                   cu_seqlens_cpu=meta.cu_seqlens_cpu)
            out = out.transpose(1, 2).to(hidden_states.dtype)
        else:
            _per_sample_on_cuda(hidden_states, "causal_conv1d_fn")
            # each sample alone, as a plain call (the packed batch's keyword arguments stay out of it)
            out = torch.cat([original(flat[..., start:end], weight, bias, activation=activation)
                             for start, end in meta.bounds()], dim=-1)
        return out.reshape(channels, rows, length).transpose(0, 1) if rows > 1 else out

    causal_conv1d_fn.__hasten_original__ = original
    return causal_conv1d_fn


def _fla_gated_delta_rule():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _fla_kda():
    from fla.ops.kda import chunk_kda

    return chunk_kda


@functools.lru_cache(maxsize=None)
def _fla_kda_problem() -> str | None:
    """Why fla has no chunked KDA kernel here (None: it has `fla.ops.kda.chunk_kda`)."""
    try:
        _fla_kda()
    except Exception as exc:
        return f"flash-linear-attention has no importable fla.ops.kda ({type(exc).__name__}: {exc}); {FLA_INSTALL}"
    return None


def _varlen_delta_rule(original, function: str, fla_kernel, fla_missing=lambda: None):
    """`function` of a modeling file, a chunked delta rule (q, k: (rows, L, H, K); v: (rows, L, HV, V);
    g: (rows, L, HV) a decay per token, or (rows, L, HV, K) one per key channel, in log space; beta:
    (rows, L, HV)), computed per packed sample, each from a zero state, when the call carries a
    LinearMeta. Returns (out (rows, L, HV, V), None): a packed batch keeps no final state. On CUDA
    `fla_kernel()` with exactly what transformers' call passes (the decay and beta as computed by
    the layer, `use_qk_l2norm_in_kernel`, the default scale 1/sqrt(K)) and the batch's cu_seqlens;
    elsewhere the model's own function once per sample."""

    @functools.wraps(original)
    def delta_rule(query, key, value, g, beta, *args, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
        meta = _meta_of(kwargs)
        if meta is None:
            return original(query, key, value, g, beta, *args, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        if args or initial_state is not None or output_final_state:
            raise ValueError(f"hasten: a packed batch reached {function} with a recurrent state or a chunk size "
                             "argument; packed training starts every sample from a zero state and keeps none")
        meta.calls += 1
        rows, length = query.shape[:2]
        # the packed rows as one sequence of rows * L tokens: (rows, L, ...) -> (1, rows * L, ...)
        q, k, v, g, beta = (t.reshape(1, rows * length, *t.shape[2:]) for t in (query, key, value, g, beta))
        problem = (fla_problem(query.device.index) or fla_missing()) if query.is_cuda else "not on CUDA"
        if problem is None:
            out, _ = fla_kernel()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  cu_seqlens=meta.cu_seqlens, cu_seqlens_cpu=meta.cu_seqlens_cpu)
            out = out.to(query.dtype)
        else:
            _per_sample_on_cuda(query, function, problem)
            out = torch.cat([original(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s, e in meta.bounds()],
                            dim=1)
        return out.reshape(rows, length, *out.shape[2:]), None

    delta_rule.__hasten_original__ = original
    return delta_rule


def varlen_chunk_gated_delta_rule(original):
    """`torch_chunk_gated_delta_rule` (Gated DeltaNet: a decay per token) in its packed form."""
    return _varlen_delta_rule(original, "torch_chunk_gated_delta_rule", _fla_gated_delta_rule)


def varlen_chunk_kda(original):
    """`chunk_kimi_delta_attention` (kimi_linear's Kimi Delta Attention: a decay per key channel) in its
    packed form; on CUDA fla's `chunk_kda` with its in-kernel gate, beta sigmoid and lower bound off
    (the layer has applied them)."""
    return _varlen_delta_rule(original, "chunk_kimi_delta_attention", _fla_kda, _fla_kda_problem)


# the modeling files' function names and hasten's packed form of each
REPLACEMENTS = {
    "causal_conv1d_fn": varlen_causal_conv1d,
    "torch_chunk_gated_delta_rule": varlen_chunk_gated_delta_rule,
    "chunk_kimi_delta_attention": varlen_chunk_kda,
}
