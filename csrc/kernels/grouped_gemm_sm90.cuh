// The MoE experts' grouped GEMMs on Hopper (sm90a): CUTLASS 3's pointer-array kernels (TMA,
// warp-specialised WGMMA, persistent tile scheduler over all groups), one launch per GEMM, with
// the groups' pointers, strides and sizes written on the device from the grouping's ends, so
// nothing is read on the host (no sync, capturable in a CUDA graph).
//
// Torch-free: included by the kernel TUs (grouped_gemm_sm90/*.cu, one per kind and tile, compiled
// in parallel) and by scripts/grouped_gemm_probe.py; the host glue sees only grouped_gemm.h.
//
// Three kinds, rows S in expert order, group g's rows [ends[g-1], ends[g]):
//   kForward     out (S, N)    = a (S, K) @ b[g] (N, K)^T      b (E, N, K)  the experts' weights as stored
//   kInputGrad   out (S, N)    = a (S, K) @ b[g] (K, N)        b (E, K, N)  grad_x = grad_y @ W
//   kWeightGrad  out[g] (M, N) = a[g rows] (., M)^T @ b[g rows] (., N)   a (S, M), b (S, N)
//                              (grad_W = grad_y^T @ x; a group without rows gets zeros)
#pragma once

// CUTLASS's device asserts are calls inside the mainloop: ptxas then serialises the WGMMA pipeline
// (warning C7510, "wgmma.mma_async instructions are serialized"); torch's extension build does
// not define NDEBUG, so the kernels' TUs do, before any header includes <cassert>.
#ifndef NDEBUG
#define NDEBUG
#endif

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "grouped_gemm.h"
#include "grouped_gemm_sm90/instances.h"

namespace hasten {
namespace kernels {
namespace grouped_gemm_sm90 {

template <GroupedGemmKind Kind>
struct Layouts;
template <>
struct Layouts<GroupedGemmKind::kForward> {  // A K-major, B K-major (TN: the weights as stored)
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <>
struct Layouts<GroupedGemmKind::kInputGrad> {  // B N-major: W (out, in) read along in
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <>
struct Layouts<GroupedGemmKind::kWeightGrad> {  // both M/N-major: the reduction runs down the rows
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

// Tile (TM x TN x TK), cluster (CM x CN), and schedule: cooperative (two consumer warpgroups
// split one tile) or ping-pong (each consumer warpgroup owns a tile; one's epilogue overlaps the
// other's mainloop: for short K, where the epilogue is a large share of a tile's time).
template <int TM, int TN, int TK, int CM, int CN, bool PingPong>
struct Config {
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;
  using Cluster = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using KernelSchedule = std::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = std::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                              cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};

template <GroupedGemmKind Kind, class Cfg>
struct Gemm {
  using Element = cutlass::bfloat16_t;
  using Accumulator = float;
  static constexpr int kAlignment = 16 / sizeof(Element);  // TMA: 16-byte rows
  using LayoutA = typename Layouts<Kind>::A;
  using LayoutB = typename Layouts<Kind>::B;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, Accumulator, Accumulator,
      Element, LayoutD*, kAlignment, Element, LayoutD*, kAlignment, typename Cfg::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, Accumulator>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignment, Element, LayoutB*,
      kAlignment, Accumulator, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape = typename ProblemShape::UnderlyingProblemShape;
};

// A stride type has one dynamic (int64_t) mode among its first two; set it to the leading dimension.
template <class Stride>
__host__ __device__ inline Stride leading(int64_t ld) {
  Stride stride{};
  if constexpr (std::is_integral_v<std::remove_cv_t<std::remove_reference_t<decltype(cute::get<0>(stride))>>>) {
    cute::get<0>(stride) = ld;
  } else {
    cute::get<1>(stride) = ld;
  }
  return stride;
}

// Where the per-group arrays live in the caller's workspace: pointers first (16-byte aligned),
// then strides and shapes, then CUTLASS's own workspace at a 256-byte boundary.
template <class G>
struct Carve {
  static size_t round(size_t bytes) { return (bytes + 255) / 256 * 256; }
  static size_t arrays(int groups) {
    return round(size_t(groups) * (3 * sizeof(void*) + sizeof(typename G::StrideA) + sizeof(typename G::StrideB) +
                                   sizeof(typename G::StrideD) + sizeof(typename G::Shape)) + 64);
  }
};

// One block per group: thread 0 writes its sizes, pointers and leading dimensions from the ends.
// A weight gradient of an expert without rows is a GEMM with K = 0, which CUTLASS would not compute
// as zeros: its mainloop never runs, so the epilogue stores accumulator registers no MMA cleared
// (whatever the warpgroup's previous tile left). Such a group gets M = 0 instead (no tiles: the
// scheduler skips it) and its block writes the zeros.
template <GroupedGemmKind Kind, class G>
__global__ void prepare_groups(GroupedGemmParams p, const typename G::Element** a_ptrs,
                               const typename G::Element** b_ptrs, typename G::Element** d_ptrs,
                               typename G::StrideA* stride_a, typename G::StrideB* stride_b,
                               typename G::StrideD* stride_d, typename G::Shape* shapes) {
  const int g = blockIdx.x;
  const int64_t start = g == 0 ? 0 : p.group_ends[g - 1];
  const int rows = static_cast<int>(p.group_ends[g] - start);
  const auto* a = static_cast<const typename G::Element*>(p.a);
  const auto* b = static_cast<const typename G::Element*>(p.b);
  auto* d = static_cast<typename G::Element*>(p.out);
  if constexpr (Kind == GroupedGemmKind::kWeightGrad) {
    if (rows == 0) {  // out[g] (M, N) = 0, in 16-byte stores (M, N multiples of 8)
      uint4* out_g = reinterpret_cast<uint4*>(d + int64_t(g) * p.m * p.n);
      const int64_t vectors = int64_t(p.m) * p.n / 8;
      for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) out_g[i] = make_uint4(0, 0, 0, 0);
    }
  }
  if (threadIdx.x != 0) return;
  if constexpr (Kind == GroupedGemmKind::kWeightGrad) {
    shapes[g] = typename G::Shape(rows == 0 ? 0 : p.m, p.n, rows);
    a_ptrs[g] = a + start * p.m;  // (M, rows) M-major: the group's rows of a (S, M)
    b_ptrs[g] = b + start * p.n;  // (N, rows) N-major: the group's rows of b (S, N)
    d_ptrs[g] = d + int64_t(g) * p.m * p.n;
    stride_a[g] = leading<typename G::StrideA>(p.m);
    stride_b[g] = leading<typename G::StrideB>(p.n);
  } else {
    shapes[g] = typename G::Shape(rows, p.n, p.k);
    a_ptrs[g] = a + start * p.k;
    b_ptrs[g] = b + int64_t(g) * p.n * p.k;
    d_ptrs[g] = d + start * p.n;
    stride_a[g] = leading<typename G::StrideA>(p.k);
    // kForward: b[g] (N, K) K-major, ld K; kInputGrad: b[g] (K, N) N-major, ld N
    stride_b[g] = leading<typename G::StrideB>(Kind == GroupedGemmKind::kForward ? p.k : p.n);
  }
  stride_d[g] = leading<typename G::StrideD>(p.n);
}

template <GroupedGemmKind Kind, class Cfg>
struct Runner {
  using G = Gemm<Kind, Cfg>;

  struct Arrays {  // the per-group arrays, carved from the front of the workspace
    const typename G::Element** a;
    const typename G::Element** b;
    typename G::Element** d;
    typename G::StrideA* stride_a;
    typename G::StrideB* stride_b;
    typename G::StrideD* stride_d;
    typename G::Shape* shapes;
  };

  static Arrays carve(int groups, void* base) {
    Arrays arrays;
    auto* bytes = static_cast<char*>(base);
    const size_t pointers = size_t(groups) * sizeof(void*);
    arrays.a = reinterpret_cast<const typename G::Element**>(bytes);
    arrays.b = reinterpret_cast<const typename G::Element**>(bytes + pointers);
    arrays.d = reinterpret_cast<typename G::Element**>(bytes + 2 * pointers);
    arrays.stride_a = reinterpret_cast<typename G::StrideA*>(bytes + 3 * pointers);
    arrays.stride_b = reinterpret_cast<typename G::StrideB*>(arrays.stride_a + groups);
    arrays.stride_d = reinterpret_cast<typename G::StrideD*>(arrays.stride_b + groups);
    arrays.shapes = reinterpret_cast<typename G::Shape*>(arrays.stride_d + groups);
    return arrays;
  }

  static typename G::Device::Arguments arguments(const GroupedGemmParams& p, const Arrays& arrays) {
    typename G::Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {p.groups, arrays.shapes, nullptr},  // sizes on the device only: no host copy of the ends
        {arrays.a, arrays.stride_a, arrays.b, arrays.stride_b},
        {{}, const_cast<const typename G::Element**>(arrays.d), arrays.stride_d, arrays.d, arrays.stride_d}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;  // C is never read
    args.hw_info.sm_count = p.sm_count;
    return args;
  }

  static size_t workspace_bytes(const GroupedGemmParams& p) {
    auto args = arguments(p, carve(p.groups, nullptr));  // sizing only: the pointers are not read
    return Carve<G>::arrays(p.groups) + G::Device::get_workspace_size(args);
  }

  static cudaError_t run(const GroupedGemmParams& p) {
    if (p.groups <= 0) return cudaSuccess;
    if (p.workspace == nullptr || p.workspace_bytes < workspace_bytes(p)) return cudaErrorInvalidValue;
    const Arrays arrays = carve(p.groups, p.workspace);
    prepare_groups<Kind, G><<<p.groups, 256, 0, p.stream>>>(
        p, arrays.a, arrays.b, arrays.d, arrays.stride_a, arrays.stride_b, arrays.stride_d, arrays.shapes);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    auto args = arguments(p, arrays);
    typename G::Device gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    void* cutlass_workspace = static_cast<char*>(p.workspace) + Carve<G>::arrays(p.groups);
    if (gemm.initialize(args, cutlass_workspace, p.stream) != cutlass::Status::kSuccess) return cudaErrorUnknown;
    if (gemm.run(p.stream) != cutlass::Status::kSuccess) return cudaErrorLaunchFailure;
    return cudaGetLastError();
  }
};

// grouped_gemm.h's tile names -> configurations
template <GroupedGemmTile Tile>
struct TileConfig;
template <>
struct TileConfig<GroupedGemmTile::k64x256PingPong> {
  using type = Config<64, 256, 64, 2, 1, true>;
};
template <>
struct TileConfig<GroupedGemmTile::k128x128PingPong> {
  using type = Config<128, 128, 64, 2, 1, true>;
};

}  // namespace grouped_gemm_sm90
}  // namespace kernels
}  // namespace hasten

// The body of one instance TU: instances.h's two functions for (KIND, TILE).
#define HASTEN_GROUPED_GEMM_SM90_INSTANCE(KIND, TILE)                                                          \
  namespace hasten {                                                                                          \
  namespace kernels {                                                                                         \
  using Runner_##KIND##_##TILE = grouped_gemm_sm90::Runner<                                                   \
      GroupedGemmKind::KIND, typename grouped_gemm_sm90::TileConfig<GroupedGemmTile::TILE>::type>;            \
  size_t HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, workspace_bytes)(const GroupedGemmParams& p) {               \
    return Runner_##KIND##_##TILE::workspace_bytes(p);                                                         \
  }                                                                                                           \
  cudaError_t HASTEN_GROUPED_GEMM_SM90_FN(KIND, TILE, run)(const GroupedGemmParams& p) {                      \
    return Runner_##KIND##_##TILE::run(p);                                                                     \
  }                                                                                                           \
  }                                                                                                           \
  }
