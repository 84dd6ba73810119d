// Float conversions for the element types hasten's kernels take (float, half, bfloat16),
// without torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Elements per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / sizeof(T);

// Whether a pointer may be read as 16-byte vectors.
__host__ __device__ __forceinline__ bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// V consecutive elements starting at element v * V: one 16-byte access, or one element when V == 1.
template <typename T, int V>
__device__ __forceinline__ void load_chunk(const T* row, int64_t v, T (&chunk)[V]) {
  if constexpr (V == 1) {
    chunk[0] = row[v];
  } else {
    static_assert(V * sizeof(T) == 16, "a chunk is one element or 16 bytes");
    *reinterpret_cast<uint4*>(chunk) = reinterpret_cast<const uint4*>(row)[v];
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_chunk(T* row, int64_t v, const T (&chunk)[V]) {
  if constexpr (V == 1) {
    row[v] = chunk[0];
  } else {
    static_assert(V * sizeof(T) == 16, "a chunk is one element or 16 bytes");
    reinterpret_cast<uint4*>(row)[v] = *reinterpret_cast<const uint4*>(chunk);
  }
}

// Runs the statements with `T` bound to the CUDA type of `type`; returns their cudaError_t.
#define HASTEN_DISPATCH_ELEMENT(type, ...)                                        \
  [&]() -> cudaError_t {                                                          \
    switch (type) {                                                               \
      case ::hasten::kernels::ElementType::kFloat32: { using T = float; __VA_ARGS__ }         \
      case ::hasten::kernels::ElementType::kFloat16: { using T = __half; __VA_ARGS__ }        \
      case ::hasten::kernels::ElementType::kBFloat16: { using T = __nv_bfloat16; __VA_ARGS__ } \
    }                                                                             \
    return cudaErrorInvalidValue;                                                 \
  }()

}  // namespace kernels
}  // namespace hasten
