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

}  // namespace kernels
}  // namespace hasten
