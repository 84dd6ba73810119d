// Torch-free interface of the varlen_meta kernel: raw pointers and a params struct,
// so nvcc can compile-check it on a machine without a GPU or a CUDA build of torch.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace hasten {
namespace kernels {

struct VarlenMetaParams {
  const void* position_ids;  // (total,) int32 or int64, rows of row_len tokens, contiguous
  bool position_ids_int64;
  int64_t total;              // tokens T (< 2^31, checked by the caller)
  int64_t row_len;            // tokens per row (last dimension of position_ids), >= 1
  int32_t* cu_seqlens;        // (T + 1,) out
  int32_t* seq_idx;           // (T,) out
  int32_t* stats;             // (2,) out: [num_seqs, max_seqlen]
};

// One launch, one block: the scan over T tokens is sequential across tiles but
// parallel inside a tile, and T is at most a few million for one batch.
cudaError_t launch_varlen_meta(const VarlenMetaParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
