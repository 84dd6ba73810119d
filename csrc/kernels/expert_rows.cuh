// The expert of a row in expert-sorted order, shared by the kernels that add an expert's bias to
// its rows (the clamped SwiGLU's gate_up bias, the combine's down-projection bias).
#pragma once

#include <cstdint>

namespace hasten {
namespace kernels {

// How many inclusive group ends (E,) are <= r, at most E - 1: the expert of sorted row r. Rows past
// the valid slots get the last expert (their values are never combined). E <= 512: nine steps.
__device__ __forceinline__ int64_t expert_of_row(const int32_t* group_ends, int64_t experts, int64_t r) {
  int64_t low = 0, high = experts;  // the first e with group_ends[e] > r
  while (low < high) {
    const int64_t middle = (low + high) / 2;
    if (group_ends[middle] > r) high = middle;
    else low = middle + 1;
  }
  return low < experts ? low : experts - 1;
}

}  // namespace kernels
}  // namespace hasten
