// Torch-free host interface of the MoE experts' grouped GEMMs (grouped_gemm_sm90.cuh has the
// kernels). Rows S are in expert order; group g owns rows [ends[g-1], ends[g]).
//   kForward     out (S, N)    = a (S, K) @ b[g] (N, K)^T        b (E, N, K), the weights as stored
//   kInputGrad   out (S, N)    = a (S, K) @ b[g] (K, N)          b (E, K, N)
//   kWeightGrad  out[g] (M, N) = a[rows of g] (., M)^T @ b[rows of g] (., N)    a (S, M), b (S, N)
// All bfloat16, float32 accumulation, contiguous; row widths multiples of 8 (16-byte TMA rows).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace hasten {
namespace kernels {

enum class GroupedGemmKind : int { kForward = 0, kInputGrad = 1, kWeightGrad = 2 };

// The tile configurations built into hasten (grouped_gemm_sm90/*.cu), chosen per GEMM by the glue
// (csrc/moe/grouped_gemm_cuda.cpp) from what the H200 measured (docs/benchmarks.md, probe at 923db79).
enum class GroupedGemmTile : int {
  k64x256PingPong = 0,   // 64x256x64, cluster 2x1, ping-pong: short reductions (K <= 1408)
  k128x128PingPong = 1,  // 128x128x64, cluster 2x1, ping-pong: every weight gradient; mid-size GEMMs
};

struct GroupedGemmParams {
  const void* a;
  const void* b;
  void* out;
  const int32_t* group_ends;  // (groups,) inclusive ends on the device, non-decreasing
  int groups;
  int m;  // kWeightGrad: out's rows per group (unused otherwise)
  int n;  // out's columns
  int k;  // kForward / kInputGrad: the reduction (a's columns)
  int sm_count;
  void* workspace;  // grouped_gemm_workspace_bytes(...) bytes of device memory, any content
  size_t workspace_bytes;
  cudaStream_t stream;
};

// Device memory the call needs as workspace (per-group arrays and CUTLASS's own); 0 when this
// kind and tile are not built (then run_grouped_gemm returns cudaErrorNotSupported too).
size_t grouped_gemm_workspace_bytes(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p);
// One launch of the prepare kernel and one of the GEMM, on p.stream; no host sync. Errors:
// cudaErrorNotSupported (kind/tile not built, or a size CUTLASS cannot take), cudaErrorInvalidValue
// (workspace missing or too small).
cudaError_t run_grouped_gemm(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p);

}  // namespace kernels
}  // namespace hasten
