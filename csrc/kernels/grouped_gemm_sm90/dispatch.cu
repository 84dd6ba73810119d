// grouped_gemm.h's entry points: the kind and tile the glue chose -> that instance's functions.
#include "instances.h"

namespace hasten {
namespace kernels {

size_t grouped_gemm_workspace_bytes(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p) {
#define HASTEN_CASE(KIND, TILE)                                              \
  if (kind == GroupedGemmKind::KIND && tile == GroupedGemmTile::TILE) { \
    return HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, workspace_bytes)(p);  \
  }
  HASTEN_GROUPED_GEMM_SM90_INSTANCES(HASTEN_CASE)
#undef HASTEN_CASE
  return 0;
}

cudaError_t run_grouped_gemm(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p) {
#define HASTEN_CASE(KIND, TILE)                                              \
  if (kind == GroupedGemmKind::KIND && tile == GroupedGemmTile::TILE) { \
    return HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, run)(p);              \
  }
  HASTEN_GROUPED_GEMM_SM90_INSTANCES(HASTEN_CASE)
#undef HASTEN_CASE
  return cudaErrorNotSupported;
}

}  // namespace kernels
}  // namespace hasten
