// Packed (THD) causal attention through cuDNN's fused SDPA graphs (cudnn-frontend), without torch
// headers: the glue (varlen_attention_cuda.cpp) computes the index tensors and owns the memory.
//
// Layout: q (T, Hq, D), k and v (T, Hk, D), out and grads like their inputs, lse (T, Hq) float32,
// all contiguous. cuDNN sees them as (B, H, S, D) with one ragged offset per sequence:
//   seq_len (B) int32, offsets_q (B+1) = cu * Hq * D, offsets_kv (B+1) = cu * Hk * D,
//   offsets_lse (B+1) = cu * Hq, where cu are the sequence boundaries (int32, in tokens).
// B, S and T are bucket sizes (>= the batch's sequences, longest sequence and tokens): a graph is
// built once per bucket and reused; sequences past the real ones have length 0.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace hasten::cudnn_sdpa {

struct Problem {
  int64_t batch = 0;        // B bucket
  int64_t max_seqlen = 0;   // S bucket
  int64_t tokens = 0;       // T bucket (upper bound of the real token count; sizes workspaces)
  int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  float scale = 1.0f;
  bool causal = true;
  int64_t window = 0;       // > 0: a query sees itself and window - 1 keys before it (causal only)
  float softcap = 0.0f;     // > 0: scaled scores s -> softcap * tanh(s / softcap) before the mask
  bool bf16 = true;         // else float16
  int device = 0;
};

struct Pointers {
  const void *q = nullptr, *k = nullptr, *v = nullptr;
  void* out = nullptr;        // forward output; a backward input
  float* lse = nullptr;       // forward output; a backward input
  const void* grad_out = nullptr;
  void *grad_q = nullptr, *grad_k = nullptr, *grad_v = nullptr;
  const int32_t *seq_len = nullptr, *offsets_q = nullptr, *offsets_kv = nullptr, *offsets_lse = nullptr;
};

// Allocates `bytes` of device workspace that stays valid until the stream has run the graph.
using AllocateFn = void* (*)(void* context, int64_t bytes);

}  // namespace hasten::cudnn_sdpa

// This code lives in its own shared object (hasten/_cudnn_sdpa*.so), which _C.so opens with dlopen:
// linked into _C.so, the frontend's first `ostream << long` ran the broken copy of
// ostream::_M_insert<long> that _C.so carries (see docs/design.md) and crashed. C linkage, so the
// glue finds these with dlsym.
extern "C" {
// Runs the forward (is_backward 0) or backward graph. Returns nullptr on success, else a message
// naming what cuDNN refused, valid until the calling thread's next call. Thread-safe: graphs and
// handles are cached per thread (cuDNN plans are not shareable across threads).
const char* hasten_cudnn_sdpa_run(int is_backward, const hasten::cudnn_sdpa::Problem* problem,
                                  const hasten::cudnn_sdpa::Pointers* ptr, hasten::cudnn_sdpa::AllocateFn allocate,
                                  void* allocate_context, cudaStream_t stream);
}
