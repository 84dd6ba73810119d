// Sums over the lanes of a group inside one warp, for kernels that give each row a group of lanes.
#pragma once

#include <cstdint>

namespace hasten {
namespace kernels {

// Sum over the `group` lanes (a power of two up to 32) that share a row; every lane of the group
// gets it. All 32 lanes of the warp must call it (xor offsets below `group` stay inside the group).
__device__ __forceinline__ float group_sum(float value, int group) {
  for (int offset = group / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffff, value, offset);
  return value;
}

// Lanes per row: enough for one vector each, a power of two, at most a warp (host and device).
__host__ __device__ __forceinline__ int lanes_per_row(int64_t vectors) {
  int group = 1;
  while (group < 32 && group < vectors) group *= 2;
  return group;
}

}  // namespace kernels
}  // namespace hasten
