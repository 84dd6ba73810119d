// Column sums of a (rows, columns) float32 block (column_sums.cuh). A block owns 32 columns: each
// of its 32 warps reads rows warp, warp + 32, ... of those columns (one 128-byte row segment per
// warp and row), then warp 0 adds the 32 warp sums in warp order. The order of additions is fixed
// (the same totals on every run: kill-and-resume stays bit-identical).
#include "column_sums.cuh"
#include "dtype_utils.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kColumns = 32;  // a block's columns: one lane each
constexpr int kWarps = 32;    // warps splitting the rows

template <typename T>
__global__ void __launch_bounds__(kColumns * kWarps)
    column_sums_kernel(const float* partial, int64_t rows, int64_t columns, T* out) {
  __shared__ float warp_sums[kWarps][kColumns + 1];  // + 1: warp 0 reads a column without bank conflicts
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kColumns + lane;
  float sum = 0.f;
  if (column < columns) {
#pragma unroll 8
    for (int64_t row = warp; row < rows; row += kWarps) sum += partial[row * columns + column];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp != 0 || column >= columns) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w][lane];
  out[column] = from_float<T>(total);
}

}  // namespace

cudaError_t launch_column_sums(const float* partial, int64_t rows, int64_t columns, void* out, ElementType type,
                               cudaStream_t stream) {
  if (columns == 0) return cudaSuccess;
  const int64_t blocks = (columns + kColumns - 1) / kColumns;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return HASTEN_DISPATCH_ELEMENT(type, {
    column_sums_kernel<T><<<static_cast<unsigned>(blocks), kColumns * kWarps, 0, stream>>>(
        partial, rows, columns, static_cast<T*>(out));
    return cudaGetLastError();
  });
}

}  // namespace kernels
}  // namespace hasten
