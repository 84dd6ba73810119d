// grouped_gemm.h's entry points: the kind and tile the glue chose -> that instance's functions.
#include "instances.h"

namespace hasten {
namespace kernels {
namespace {

struct Instance {
  size_t (*workspace_bytes)(const GroupedGemmParams&);
  cudaError_t (*run)(const GroupedGemmParams&);
};

// The built instance for (kind, tile), or null (instances.h lists what is built).
const Instance* find(GroupedGemmKind kind, GroupedGemmTile tile) {
#define HASTEN_CASE(KIND, TILE)                                                                    \
  if (kind == GroupedGemmKind::KIND && tile == GroupedGemmTile::TILE) {                       \
    static const Instance instance{HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, workspace_bytes),   \
                                   HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, run)};              \
    return &instance;                                                                          \
  }
  HASTEN_GROUPED_GEMM_SM90_INSTANCES(HASTEN_CASE)
#undef HASTEN_CASE
  return nullptr;
}

}  // namespace

size_t grouped_gemm_workspace_bytes(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p) {
  const Instance* instance = find(kind, tile);
  return instance ? instance->workspace_bytes(p) : 0;
}

cudaError_t run_grouped_gemm(GroupedGemmKind kind, GroupedGemmTile tile, const GroupedGemmParams& p) {
  const Instance* instance = find(kind, tile);
  return instance ? instance->run(p) : cudaErrorNotSupported;
}

}  // namespace kernels
}  // namespace hasten
