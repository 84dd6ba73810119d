// Limits of hasten::moe_route, shared by its kernels and the argument checks of both backends
// (the CPU reference takes what the CUDA kernel takes, so a model routes alike on either). No
// CUDA or torch header: the CPU-only build includes it.
#pragma once

namespace hasten {
namespace kernels {

constexpr int kMoeRouteMaxExperts = 512;  // 16 values per lane of a warp
constexpr int kMoeRouteMaxTopK = 32;      // one chosen expert per lane
constexpr int kMoeRouteMaxGroups = 32;    // one group per lane

}  // namespace kernels
}  // namespace hasten
