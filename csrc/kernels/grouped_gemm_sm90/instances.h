// The kind x tile combinations built into hasten: one TU each in this folder (CUTLASS kernels are
// slow to compile; separate TUs build in parallel), and the dispatch (dispatch.cu) over them.
// Torch-free and CUTLASS-free: the dispatch sees only these declarations.
#pragma once

#include <cstddef>

#include "../grouped_gemm.h"

// X(kind, tile): every instance; add one here and a TU with HASTEN_GROUPED_GEMM_SM90_INSTANCE(kind, tile).
#define HASTEN_GROUPED_GEMM_SM90_INSTANCES(X) \
  X(kForward, k64x256PingPong)                 \
  X(kForward, k128x128PingPong)                \
  X(kInputGrad, k64x256PingPong)               \
  X(kInputGrad, k128x128PingPong)              \
  X(kWeightGrad, k128x128PingPong)

#define HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, WHAT) grouped_gemm_sm90_##KIND##_##TILE##_##WHAT

namespace hasten {
namespace kernels {

#define HASTEN_GROUPED_GEMM_SM90_DECLARE(KIND, TILE)                                                \
  size_t HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, workspace_bytes)(const GroupedGemmParams& p); \
  cudaError_t HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, run)(const GroupedGemmParams& p);
HASTEN_GROUPED_GEMM_SM90_INSTANCES(HASTEN_GROUPED_GEMM_SM90_DECLARE)
#undef HASTEN_GROUPED_GEMM_SM90_DECLARE

}  // namespace kernels
}  // namespace hasten
