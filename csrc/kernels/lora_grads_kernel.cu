// The LoRA backward's one pass over the output gradient (lora_grads.cuh): gb = s g B and
// grad_b = s g^T xa from each tile of g read once.
//
// Block (256 threads, 8 warps) = a stripe of kStripeCols columns x a chunk of rows; it walks its
// chunk in tiles of TileRows rows through a Stages-deep cp.async ring in shared memory (rows past
// T and columns past N arrive as zeros, so the tensor-core fragments never read garbage):
//   grad_b: warp w owns the stripe's columns [64 w, 64 w + 64) and keeps their (64, r) partial of
//           g^T xa in float32 accumulators across the whole chunk;
//   gb:     the warps split the tile into 16-row fragments x column groups; each group's (16, r)
//           product is added to the others' in shared memory and the stripe's partial gb of the
//           tile written.
// A second kernel adds the stripes' gb partials and the chunks' grad_b partials in index order,
// scales them and rounds once to the outputs' types.
//
// Measured on the H200 (scripts/lora_grads_probe.py, 2026-12-04): g read at 2.0-2.2 TB/s at W4's
// shapes whatever the tile shape (16 x 4, 32 x 2, 32 x 3, 16 x 6, 64 x 2 stages), about what the
// two GEMMs take for reading it twice at ~4 TB/s; rank 32 at 1.0-1.4 TB/s, slower than the GEMMs,
// so only rank 16 runs here. Not memory-bound: Nsight Compute finds it latency- and
// instruction-bound (DRAM 43%, 8 cycles an issued instruction at 25% occupancy; docs/design.md).
#include <mma.h>

#include <algorithm>

#include "dtype_utils.cuh"
#include "gate_activation_math.cuh"
#include "lora_grads.cuh"

namespace hasten {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStripeCols = 512;
constexpr int kPad = 8;                        // elements: rows 16 bytes apart in the banks
constexpr int kLdG = kStripeCols + kPad;       // shared g tile's row stride
constexpr int kDbColumns = kStripeCols / kWarps;  // columns of a warp's grad_b partial (64)
constexpr int kSharedPerSm = 232448;           // bytes of shared memory an sm_90 multiprocessor has
constexpr int kSharedReserved = 1024;          // per block, kept by the driver

// A tile shape and pipeline depth: TileRows rows of g per stage, Stages stages in flight. Lean
// (the probe's config 4; 2.2-2.5 TB/s of g against 2.0-2.15): each thread's copy positions fixed
// for the chunk (a pointer step a tile instead of index math per 16-byte copy: Nsight Compute
// counted 640 instructions a warp a tile), B's fragments kept in registers, the partial sums' rows
// padded by 4 floats (4-way bank conflicts on their stores otherwise).
template <int TileRows, int Stages, int R, bool Lean = false>
struct Config {
  static constexpr int kRowFrags = TileRows / 16;          // gb: 16-row fragments of a tile
  static constexpr int kGroups = kWarps / kRowFrags;       // gb: column groups (warps per row fragment)
  static constexpr int kGroupCols = kStripeCols / kGroups;
  static constexpr int kLdR = R + kPad;
  static constexpr int kLdSum = Lean ? R + 4 : R;          // a partial-sum row's stride, floats
  static constexpr int kShared = (Stages * TileRows * kLdG + kStripeCols * kLdR + Stages * TileRows * kLdR) * 2 +
                                 2 * kGroups * TileRows * kLdSum * static_cast<int>(sizeof(float));
  static constexpr int kBlocksPerSm = kSharedPerSm / (kShared + kSharedReserved) >= 2 ? 2 : 1;
};

// How the (T, N) gradient is cut: stripes x chunks blocks, one wave over the multiprocessors.
struct Plan {
  int64_t stripes, chunks, chunk_rows, rows_padded, cols_padded;
};

Plan plan_of(const LoraGradsParams& p, int tile_rows, int blocks_per_sm) {
  Plan plan{};
  plan.stripes = (p.out_features + kStripeCols - 1) / kStripeCols;
  const int64_t wave = static_cast<int64_t>(p.sm_count > 0 ? p.sm_count : 1) * blocks_per_sm;
  const int64_t wanted = wave > plan.stripes ? wave / plan.stripes : 1;
  const int64_t tiles = (p.tokens + tile_rows - 1) / tile_rows;
  const int64_t tiles_per_chunk = (tiles + wanted - 1) / wanted;
  plan.chunk_rows = tiles_per_chunk * tile_rows;
  plan.chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;  // every chunk has rows
  plan.rows_padded = plan.chunks * plan.chunk_rows;
  plan.cols_padded = plan.stripes * kStripeCols;
  return plan;
}

template <typename T>
struct Args {
  const T* g;
  int64_t g_stride;
  const T* b;
  const T* xa;
  int64_t xa_stride;
  float* gb_partial;  // (stripes, rows_padded, R)
  float* db_partial;  // (chunks, cols_padded, R)
  int64_t tokens, cols, chunk_rows, rows_padded, cols_padded;
};

// 16 bytes from global to shared memory, asynchronously; not `valid`: the 16 bytes are filled with
// zeros and nothing is read
__device__ __forceinline__ void copy16_async_to(unsigned shared_address, const void* global, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address), "l"(global), "r"(bytes));
}
__device__ __forceinline__ void copy16_async(void* shared, const void* global, bool valid) {
  copy16_async_to(static_cast<unsigned>(__cvta_generic_to_shared(shared)), global, valid);
}
__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Stages-deep cp.async ring over the chunk's tiles, one barrier a tile: at the top of tile t the
// barrier makes tile t visible, frees the stage tile t - 1 used (refilled with tile t + Stages - 1)
// and the gb products tile t - 1 left in s_sum, which are added up and written then.
template <typename T, int R, int TileRows, int Stages, bool Lean>
__global__ void __launch_bounds__(kThreads, (Config<TileRows, Stages, R, Lean>::kBlocksPerSm))
    lora_grads_kernel(Args<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  using C = Config<TileRows, Stages, R, Lean>;
  constexpr int kLdR = C::kLdR;
  constexpr int kLdSum = C::kLdSum;
  constexpr int kRankFrags = R / 16;
  constexpr int kSumFloats = C::kGroups * TileRows * kLdSum;  // one tile's gb products, per column group
  extern __shared__ __align__(128) unsigned char shared_raw[];
  T* s_g = reinterpret_cast<T*>(shared_raw);          // [Stages][TileRows][kLdG]
  T* s_b = s_g + Stages * TileRows * kLdG;             // [kStripeCols][kLdR]
  T* s_x = s_b + kStripeCols * kLdR;                   // [Stages][TileRows][kLdR]
  float* s_sum = reinterpret_cast<float*>(s_x + Stages * TileRows * kLdR);  // [2][kGroups][TileRows][kLdSum]

  const int64_t stripe = blockIdx.x, chunk = blockIdx.y;
  const int64_t col0 = stripe * kStripeCols;
  const int64_t row_begin = chunk * a.chunk_rows;
  const int64_t row_end = min(a.tokens, row_begin + a.chunk_rows);
  const int tiles = static_cast<int>((row_end - row_begin + TileRows - 1) / TileRows);

  // B's stripe, once (rows past N as zeros), in the first copy group with tile 0
  for (int i = threadIdx.x; i < kStripeCols * (R / 8); i += kThreads) {
    const int row = i / (R / 8), part = i % (R / 8);
    const bool valid = col0 + row < a.cols;
    copy16_async(s_b + row * kLdR + part * 8, valid ? a.b + (col0 + row) * R + part * 8 : a.b, valid);
  }
  // Lean: thread t copies part t % 64 of rows t / 64 + 4 k (and xa's part for threads < TileRows * R / 8)
  constexpr int kParts = kStripeCols / 8, kRowStep = kThreads / kParts;
  const int part = threadIdx.x % kParts, row0 = threadIdx.x / kParts;
  const bool column_in = col0 + part * 8 < a.cols;
  const T* g_first = a.g + (row_begin + row0) * a.g_stride + col0 + part * 8;
  const unsigned g_first_shared = static_cast<unsigned>(__cvta_generic_to_shared(s_g + row0 * kLdG + part * 8));
  const int x_row = threadIdx.x / (R / 8), x_part = threadIdx.x % (R / 8);
  const T* x_first = a.xa + (row_begin + x_row) * a.xa_stride + x_part * 8;
  const unsigned x_first_shared = static_cast<unsigned>(__cvta_generic_to_shared(s_x + x_row * kLdR + x_part * 8));
  auto load_tile_lean = [&](int tile) {
    const int stage = tile % Stages;
    const int64_t r0 = row_begin + static_cast<int64_t>(tile) * TileRows;
    const int rows_left = static_cast<int>(min(static_cast<int64_t>(TileRows), row_end - r0));
    const T* src = g_first + static_cast<int64_t>(tile) * TileRows * a.g_stride;
    const int64_t step = kRowStep * a.g_stride;
    const unsigned dst = g_first_shared + stage * TileRows * kLdG * static_cast<unsigned>(sizeof(T));
#pragma unroll
    for (int k = 0; k < TileRows / kRowStep; ++k) {
      const bool valid = column_in && row0 + k * kRowStep < rows_left;
      copy16_async_to(dst + k * kRowStep * kLdG * static_cast<unsigned>(sizeof(T)), valid ? src : a.g, valid);
      src += step;
    }
    if (threadIdx.x < TileRows * (R / 8)) {
      const bool valid = x_row < rows_left;
      copy16_async_to(x_first_shared + stage * TileRows * kLdR * static_cast<unsigned>(sizeof(T)),
                      valid ? x_first + static_cast<int64_t>(tile) * TileRows * a.xa_stride : a.xa, valid);
    }
  };
  auto load_tile = [&](int tile) {
    if constexpr (Lean) {
      load_tile_lean(tile);
      return;
    }
    const int stage = tile % Stages;
    const int64_t r0 = row_begin + static_cast<int64_t>(tile) * TileRows;
    T* g_dst = s_g + stage * TileRows * kLdG;
    for (int i = threadIdx.x; i < TileRows * (kStripeCols / 8); i += kThreads) {
      const int row = i / (kStripeCols / 8), part = i % (kStripeCols / 8);
      const int64_t col = col0 + part * 8;
      const bool valid = r0 + row < row_end && col < a.cols;  // N % 8 == 0: a part is all in or all out
      copy16_async(g_dst + row * kLdG + part * 8, valid ? a.g + (r0 + row) * a.g_stride + col : a.g, valid);
    }
    T* x_dst = s_x + stage * TileRows * kLdR;
    for (int i = threadIdx.x; i < TileRows * (R / 8); i += kThreads) {
      const int row = i / (R / 8), part = i % (R / 8);
      const bool valid = r0 + row < row_end;
      copy16_async(x_dst + row * kLdR + part * 8, valid ? a.xa + (r0 + row) * a.xa_stride + part * 8 : a.xa,
                   valid);
    }
  };
  // the stripe's partial gb of tile `tile`: its column groups added in order
  auto write_gb = [&](int tile) {
    const float* sums = s_sum + (tile & 1) * kSumFloats;
    float* out = a.gb_partial + (stripe * a.rows_padded + row_begin + static_cast<int64_t>(tile) * TileRows) * R;
    for (int i = threadIdx.x; i < TileRows * R; i += kThreads) {
      const int at = (i / R) * kLdSum + i % R;
      float total = sums[at];
#pragma unroll
      for (int group = 1; group < C::kGroups; ++group) total += sums[group * TileRows * kLdSum + at];
      out[i] = total;
    }
  };
#pragma unroll
  for (int tile = 0; tile < Stages - 1; ++tile) {
    if (tile < tiles) load_tile(tile);
    commit_copies();  // empty groups too: the count wait_copies relies on
  }

  const int warp = threadIdx.x / 32;
  const int gb_row = 16 * (warp % C::kRowFrags), gb_group = warp / C::kRowFrags;
  const int gb_col = C::kGroupCols * gb_group;
  const int db_col = kDbColumns * warp;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> db_acc[kDbColumns / 16][kRankFrags];
#pragma unroll
  for (int m = 0; m < kDbColumns / 16; ++m) {
#pragma unroll
    for (int n = 0; n < kRankFrags; ++n) wmma::fill_fragment(db_acc[m][n], 0.0f);
  }

  // Lean: the warp's slice of B as fragments, loaded once (B arrived with tile 0)
  constexpr int kHeldB = Lean ? C::kGroupCols / 16 : 1;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_held[kHeldB][kRankFrags];

  for (int tile = 0; tile < tiles; ++tile) {
    wait_copies<Stages - 2>();
    __syncthreads();
    if constexpr (Lean) {
      if (tile == 0) {
#pragma unroll
        for (int k = 0; k < kHeldB; ++k) {
#pragma unroll
          for (int n = 0; n < kRankFrags; ++n) {
            wmma::load_matrix_sync(b_held[k][n], s_b + (gb_col + 16 * k) * kLdR + 16 * n, kLdR);
          }
        }
      }
    }
    if (tile + Stages - 1 < tiles) load_tile(tile + Stages - 1);
    commit_copies();
    if (tile > 0) write_gb(tile - 1);
    const T* g = s_g + (tile % Stages) * TileRows * kLdG;
    const T* x = s_x + (tile % Stages) * TileRows * kLdR;

    // grad_b partial += g^T xa over the tile's rows: g read column-major is g^T
#pragma unroll
    for (int k = 0; k < TileRows / 16; ++k) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> x_frag[kRankFrags];
#pragma unroll
      for (int n = 0; n < kRankFrags; ++n) wmma::load_matrix_sync(x_frag[n], x + 16 * k * kLdR + 16 * n, kLdR);
#pragma unroll
      for (int m = 0; m < kDbColumns / 16; ++m) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> gt_frag;
        wmma::load_matrix_sync(gt_frag, g + 16 * k * kLdG + db_col + 16 * m, kLdG);
#pragma unroll
        for (int n = 0; n < kRankFrags; ++n) wmma::mma_sync(db_acc[m][n], gt_frag, x_frag[n], db_acc[m][n]);
      }
    }

    // gb over the warp's column group, for its 16 rows
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> gb_acc[kRankFrags];
#pragma unroll
    for (int n = 0; n < kRankFrags; ++n) wmma::fill_fragment(gb_acc[n], 0.0f);
#pragma unroll
    for (int k = 0; k < C::kGroupCols / 16; ++k) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> g_frag;
      wmma::load_matrix_sync(g_frag, g + gb_row * kLdG + gb_col + 16 * k, kLdG);
#pragma unroll
      for (int n = 0; n < kRankFrags; ++n) {
        if constexpr (Lean) {
          wmma::mma_sync(gb_acc[n], g_frag, b_held[k][n], gb_acc[n]);
        } else {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_frag;
          wmma::load_matrix_sync(b_frag, s_b + (gb_col + 16 * k) * kLdR + 16 * n, kLdR);
          wmma::mma_sync(gb_acc[n], g_frag, b_frag, gb_acc[n]);
        }
      }
    }
    float* sums = s_sum + (tile & 1) * kSumFloats;
#pragma unroll
    for (int n = 0; n < kRankFrags; ++n) {
      wmma::store_matrix_sync(sums + (gb_group * TileRows + gb_row) * kLdSum + 16 * n, gb_acc[n], kLdSum,
                              wmma::mem_row_major);
    }
  }
  __syncthreads();
  if (tiles > 0) write_gb(tiles - 1);

  float* db_out = a.db_partial + (chunk * a.cols_padded + col0 + db_col) * R;
#pragma unroll
  for (int m = 0; m < kDbColumns / 16; ++m) {
#pragma unroll
    for (int n = 0; n < kRankFrags; ++n) {
      wmma::store_matrix_sync(db_out + 16 * m * R + 16 * n, db_acc[m][n], R, wmma::mem_row_major);
    }
  }
#endif
}

// gb[t] = s * sum over stripes of gb_partial[stripe][t], grad_b[n] = s * sum over chunks of
// db_partial[chunk][n], each in index order; one thread an element.
template <typename T, typename TB>
__global__ void lora_grads_sum_kernel(const float* __restrict__ gb_partial, const float* __restrict__ db_partial,
                                      T* __restrict__ gb, int64_t gb_stride, TB* __restrict__ grad_b, int64_t tokens,
                                      int64_t cols, int64_t rank, int64_t stripes, int64_t chunks,
                                      int64_t rows_padded, int64_t cols_padded, float scale) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t gb_count = tokens * rank;
  if (i < gb_count) {
    const int64_t row = i / rank, j = i % rank;
    float sum = 0.0f;
    for (int64_t s = 0; s < stripes; ++s) sum += gb_partial[(s * rows_padded + row) * rank + j];
    gb[row * gb_stride + j] = from_float<T>(sum * scale);
    return;
  }
  const int64_t k = i - gb_count;
  if (k >= cols * rank) return;
  const int64_t col = k / rank, j = k % rank;
  float sum = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) sum += db_partial[(c * cols_padded + col) * rank + j];
  grad_b[k] = from_float<TB>(sum * scale);
}

// The tile: 32 rows x 2 stages (16 x 4, 32 x 3, 16 x 6 and 64 x 2 measured no faster on the H200).
constexpr int kTileRows = 32, kStages = 2, kRank = 16;
static_assert(Config<kTileRows, kStages, kRank>::kBlocksPerSm == Config<kTileRows, kStages, kRank, true>::kBlocksPerSm,
              "the plain and lean kernels share one plan (and so one workspace size)");

// The sums of one projection's partials: gb (T, rank) at gb_stride and grad_b (N, rank) in
// grad_b_type (float32 or T), scaled.
template <typename T>
void launch_sum(const float* gb_partial, const float* db_partial, const Plan& plan, void* gb, int64_t gb_stride,
                void* grad_b, ElementType grad_b_type, int64_t tokens, int64_t cols, int64_t rank, float scale,
                cudaStream_t stream) {
  const int64_t total = (tokens + cols) * rank;
  const unsigned blocks = static_cast<unsigned>((total + 255) / 256);
  if (grad_b_type == ElementType::kFloat32) {
    lora_grads_sum_kernel<T, float><<<blocks, 256, 0, stream>>>(
        gb_partial, db_partial, static_cast<T*>(gb), gb_stride, static_cast<float*>(grad_b), tokens, cols, rank,
        plan.stripes, plan.chunks, plan.rows_padded, plan.cols_padded, scale);
  } else {
    lora_grads_sum_kernel<T, T><<<blocks, 256, 0, stream>>>(
        gb_partial, db_partial, static_cast<T*>(gb), gb_stride, static_cast<T*>(grad_b), tokens, cols, rank,
        plan.stripes, plan.chunks, plan.rows_padded, plan.cols_padded, scale);
  }
}

Plan default_plan(const LoraGradsParams& p) {
  return plan_of(p, kTileRows, Config<kTileRows, kStages, kRank>::kBlocksPerSm);
}

// Lean, the default (HASTEN_LORA_GRADS_CONFIG=0, read by the caller, picks the plain one): 2.2-2.5
// TB/s of g against the plain kernel's 2.0-2.15 on the H200 (8c3886c), equal products in the GPU
// test, W4 +0.2-0.5% in one call (d5b1af1).
template <typename T, bool Lean>
cudaError_t launch(const LoraGradsParams& p, cudaStream_t stream) {
  using C = Config<kTileRows, kStages, kRank, Lean>;
  const Plan plan = default_plan(p);
  Args<T> a{};
  a.g = static_cast<const T*>(p.grad_y);
  a.g_stride = p.grad_y_stride;
  a.b = static_cast<const T*>(p.lora_b);
  a.xa = static_cast<const T*>(p.xa);
  a.xa_stride = p.xa_stride;
  a.gb_partial = p.workspace;
  a.db_partial = p.workspace + plan.stripes * plan.rows_padded * kRank;
  a.tokens = p.tokens;
  a.cols = p.out_features;
  a.chunk_rows = plan.chunk_rows;
  a.rows_padded = plan.rows_padded;
  a.cols_padded = plan.cols_padded;
  auto kernel = lora_grads_kernel<T, kRank, kTileRows, kStages, Lean>;
  // over 48 KiB of shared memory must be asked for (per device: set at every launch, it is cheap)
  if (const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kShared);
      err != cudaSuccess) {
    return err;
  }
  if (plan.chunks > 65535) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(plan.stripes), static_cast<unsigned>(plan.chunks)), kThreads, C::kShared,
           stream>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  launch_sum<T>(a.gb_partial, a.db_partial, plan, p.gb, p.gb_stride, p.grad_b, p.grad_b_type, p.tokens,
                p.out_features, kRank, p.scale, stream);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_type(const LoraGradsParams& p, cudaStream_t stream) {
  return p.config == 0 ? launch<T, false>(p, stream) : launch<T, true>(p, stream);
}

// --- the gated MLP's gate/up pair (lora_grads.cuh, LoraGatedGradsParams) ----------------------------
// Block (512 threads, 16 warps, one a multiprocessor) = a stripe of kStripeCols columns x a chunk of
// rows, tiles of 16 rows through a 3-stage cp.async ring holding gate, up and d_act (two tiles in
// flight while one is worked on). Thread t copies part t % 64 (8 columns) of rows t / 64 + 8 k of
// each tensor, then computes d_gate and d_up at those very places, writing them to global memory
// and over gate and up in shared memory (its own copies: no other thread reads them before the
// barrier). From there, as in lora_grads_kernel, for both members: warp w keeps grad_b's (32, r)
// partial of its columns [32 w, 32 w + 32) in registers, with its B fragments (read once from
// global memory), and the tile's (16, r) gb product over those columns goes through shared memory,
// where the 16 warps' products are added in order. The first version (256 threads, 2 stages)
// ran at 1.8 TB/s on the H200, issue-bound: the activation's float math of every element on 8 warps.
namespace gated {
constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kTileRows = 16, kStages = 3, kRank = 16, kMembers = 2;
constexpr int kLdX = kMembers * kRank + kPad;       // a tile row of both members' xa
constexpr int kLdSum = kRank + 4;                   // padded partial-sum rows (bank conflicts)
constexpr int kGroupCols = kStripeCols / kWarps;    // 32: a warp's columns, for gb and grad_b alike
constexpr int kInputs = 3;                          // gate, up, d_act
constexpr int kTileElements = kTileRows * kLdG;
constexpr int kSumFloats = kMembers * kWarps * kTileRows * kLdSum;  // one tile's gb products
constexpr int kShared = (kStages * kInputs * kTileElements + kStages * kTileRows * kLdX) * 2 +
                        kSumFloats * static_cast<int>(sizeof(float));
static_assert(kShared + kSharedReserved <= kSharedPerSm, "one block fits a multiprocessor");
constexpr int kParts = kStripeCols / 8, kRowStep = kThreads / kParts;  // 64 parts a row, rows 8 apart
static_assert(kTileRows % kRowStep == 0 && kTileRows * kMembers * (kRank / 8) <= kThreads, "copy positions");
}  // namespace gated

template <typename T>
struct GatedArgs {
  const T* gate;
  const T* up;
  int64_t in_stride;
  const T* d;
  T* d_gate;
  T* d_up;
  const T* b[gated::kMembers];
  const T* xa[gated::kMembers];
  int64_t xa_stride;
  float* gb_partial[gated::kMembers];  // (stripes, rows_padded, r) each
  float* db_partial[gated::kMembers];  // (chunks, cols_padded, r) each
  int64_t tokens, cols, chunk_rows, rows_padded, cols_padded;
};

template <typename T, GateActivation A>
__global__ void __launch_bounds__(gated::kThreads, 1) lora_gated_grads_kernel(GatedArgs<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  // the gated plan's constants (local names shadow the plain kernel's)
  constexpr int kThreads = gated::kThreads, kWarps = gated::kWarps;
  constexpr int kTileRows = gated::kTileRows, kStages = gated::kStages, kRank = gated::kRank;
  constexpr int kMembers = gated::kMembers, kLdX = gated::kLdX, kLdSum = gated::kLdSum;
  constexpr int kGroupCols = gated::kGroupCols, kInputs = gated::kInputs, kTileElements = gated::kTileElements;
  constexpr int kParts = gated::kParts, kRowStep = gated::kRowStep;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  T* s_in = reinterpret_cast<T*>(shared_raw);             // [kStages][kInputs][kTileRows][kLdG]
  T* s_x = s_in + kStages * kInputs * kTileElements;     // [kStages][kTileRows][kLdX]
  float* s_sum = reinterpret_cast<float*>(s_x + kStages * kTileRows * kLdX);  // [kMembers][kWarps][kTileRows][kLdSum]

  const int64_t stripe = blockIdx.x, chunk = blockIdx.y;
  const int64_t col0 = stripe * kStripeCols;
  const int64_t row_begin = chunk * a.chunk_rows;
  const int64_t row_end = min(a.tokens, row_begin + a.chunk_rows);
  const int tiles = static_cast<int>((row_end - row_begin + kTileRows - 1) / kTileRows);

  // this thread's places: part `part` of rows row0 + kRowStep k of every tile
  const int part = threadIdx.x % kParts, row0 = threadIdx.x / kParts;
  const int64_t col = col0 + part * 8;
  const bool column_in = col < a.cols;  // N % 16 == 0: a part is all in or all out
  const int64_t in_first = (row_begin + row0) * a.in_stride + col;  // gate and up
  const int64_t out_first = (row_begin + row0) * a.cols + col;      // d_act, d_gate, d_up
  const int shared_first = row0 * kLdG + part * 8;
  // xa: thread t < 64 copies 8 ranks of row t / 4 (parts 0-1 gate's, 2-3 up's)
  const int x_row = threadIdx.x / (kMembers * kRank / 8), x_part = threadIdx.x % (kMembers * kRank / 8);
  const int x_member = x_part / (kRank / 8);
  const bool x_copier = threadIdx.x < kTileRows * kMembers * (kRank / 8);

  auto load_tile = [&](int tile) {
    const int stage = tile % kStages;
    const int64_t r0 = row_begin + static_cast<int64_t>(tile) * kTileRows;
    const int rows_left = static_cast<int>(min(static_cast<int64_t>(kTileRows), row_end - r0));
    T* dst = s_in + stage * kInputs * kTileElements + shared_first;
    const int64_t in_at = in_first + static_cast<int64_t>(tile) * kTileRows * a.in_stride;
    const int64_t out_at = out_first + static_cast<int64_t>(tile) * kTileRows * a.cols;
#pragma unroll
    for (int k = 0; k < kTileRows / kRowStep; ++k) {
      const bool valid = column_in && row0 + k * kRowStep < rows_left;
      const int64_t in_k = in_at + static_cast<int64_t>(k) * kRowStep * a.in_stride;
      const int64_t out_k = out_at + static_cast<int64_t>(k) * kRowStep * a.cols;
      T* row_dst = dst + k * kRowStep * kLdG;
      copy16_async(row_dst, valid ? a.gate + in_k : a.gate, valid);
      copy16_async(row_dst + kTileElements, valid ? a.up + in_k : a.up, valid);
      copy16_async(row_dst + 2 * kTileElements, valid ? a.d + out_k : a.d, valid);
    }
    if (x_copier) {
      const bool valid = x_row < rows_left;
      const T* src = a.xa[x_member] + (r0 + x_row) * a.xa_stride + (x_part % (kRank / 8)) * 8;
      copy16_async(s_x + stage * kTileRows * kLdX + x_row * kLdX + x_part * 8, valid ? src : a.xa[x_member], valid);
    }
  };
  // the stripe's partial gb of tile `tile` for both members: the warps' products added in order
  auto write_gb = [&](int tile) {
    const int64_t row_at = row_begin + static_cast<int64_t>(tile) * kTileRows;
    for (int i = threadIdx.x; i < kMembers * kTileRows * kRank; i += kThreads) {
      const int member = i / (kTileRows * kRank), rest = i % (kTileRows * kRank);
      const int at = (member * kWarps * kTileRows + rest / kRank) * kLdSum + rest % kRank;
      float total = s_sum[at];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) total += s_sum[at + w * kTileRows * kLdSum];
      a.gb_partial[member][(stripe * a.rows_padded + row_at) * kRank + rest] = total;
    }
  };

#pragma unroll
  for (int tile = 0; tile < kStages - 1; ++tile) {
    if (tile < tiles) load_tile(tile);
    commit_copies();  // empty groups too: the count wait_copies relies on
  }

  const int warp = threadIdx.x / 32;
  const int warp_col = kGroupCols * warp;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> db_acc[kMembers][kGroupCols / 16];
  // the warp's slice of each member's B, once from global memory (16-column groups past N: zeros)
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b_held[kMembers][kGroupCols / 16];
#pragma unroll
  for (int member = 0; member < kMembers; ++member) {
#pragma unroll
    for (int k = 0; k < kGroupCols / 16; ++k) {
      wmma::fill_fragment(db_acc[member][k], 0.0f);
      const int64_t b_row = col0 + warp_col + 16 * k;
      if (b_row < a.cols) {
        wmma::load_matrix_sync(b_held[member][k], a.b[member] + b_row * kRank, kRank);
      } else {
        wmma::fill_fragment(b_held[member][k], from_float<T>(0.0f));
      }
    }
  }

  for (int tile = 0; tile < tiles; ++tile) {
    wait_copies<kStages - 2>();
    __syncthreads();  // tile `tile` landed; everyone is done with tile - 1's stage and its sums
    if (tile + kStages - 1 < tiles) load_tile(tile + kStages - 1);
    commit_copies();
    if (tile > 0) write_gb(tile - 1);

    // the activation's backward at this thread's places: to global memory and over gate and up
    T* g_tile = s_in + (tile % kStages) * kInputs * kTileElements;
    T* u_tile = g_tile + kTileElements;
    const T* d_tile = u_tile + kTileElements;
    {
      const int64_t r0 = row_begin + static_cast<int64_t>(tile) * kTileRows;
      const int rows_left = static_cast<int>(min(static_cast<int64_t>(kTileRows), row_end - r0));
      const int64_t out_at = out_first + static_cast<int64_t>(tile) * kTileRows * a.cols;
#pragma unroll
      for (int k = 0; k < kTileRows / kRowStep; ++k) {
        const int at = shared_first + k * kRowStep * kLdG;
        T g[8], u[8], d[8];
        *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(g_tile + at);
        *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(u_tile + at);
        *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(d_tile + at);
#pragma unroll
        for (int i = 0; i < 8; ++i) gated_backward_element<A>(g[i], u[i], d[i]);
        *reinterpret_cast<uint4*>(g_tile + at) = *reinterpret_cast<const uint4*>(g);
        *reinterpret_cast<uint4*>(u_tile + at) = *reinterpret_cast<const uint4*>(u);
        if (column_in && row0 + k * kRowStep < rows_left) {
          const int64_t out_k = out_at + static_cast<int64_t>(k) * kRowStep * a.cols;
          *reinterpret_cast<uint4*>(a.d_gate + out_k) = *reinterpret_cast<const uint4*>(g);
          *reinterpret_cast<uint4*>(a.d_up + out_k) = *reinterpret_cast<const uint4*>(u);
        }
      }
    }
    __syncthreads();  // d_gate and d_up of the tile in shared memory; tile - 1's sums written out

    const T* x = s_x + (tile % kStages) * kTileRows * kLdX;
#pragma unroll
    for (int member = 0; member < kMembers; ++member) {
      const T* g = g_tile + member * kTileElements;  // d_gate, then d_up
      // grad_b partial += g^T xa over the tile's 16 rows: g read column-major is g^T
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> x_frag;
      wmma::load_matrix_sync(x_frag, x + member * kRank, kLdX);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> gb_acc;
      wmma::fill_fragment(gb_acc, 0.0f);
#pragma unroll
      for (int m = 0; m < kGroupCols / 16; ++m) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> gt_frag;
        wmma::load_matrix_sync(gt_frag, g + warp_col + 16 * m, kLdG);
        wmma::mma_sync(db_acc[member][m], gt_frag, x_frag, db_acc[member][m]);
        // gb over the warp's columns, all 16 rows
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> g_frag;
        wmma::load_matrix_sync(g_frag, g + warp_col + 16 * m, kLdG);
        wmma::mma_sync(gb_acc, g_frag, b_held[member][m], gb_acc);
      }
      wmma::store_matrix_sync(s_sum + (member * kWarps + warp) * kTileRows * kLdSum, gb_acc, kLdSum,
                              wmma::mem_row_major);
    }
  }
  __syncthreads();
  if (tiles > 0) write_gb(tiles - 1);

#pragma unroll
  for (int member = 0; member < kMembers; ++member) {
    float* db_out = a.db_partial[member] + (chunk * a.cols_padded + col0 + warp_col) * kRank;
#pragma unroll
    for (int m = 0; m < kGroupCols / 16; ++m) {
      wmma::store_matrix_sync(db_out + 16 * m * kRank, db_acc[member][m], kRank, wmma::mem_row_major);
    }
  }
#endif
}

// The gated kernel runs one block a multiprocessor; the chunk count is picked so that the blocks
// fill whole waves (a last wave a quarter full leaves most of the machine idle for its time),
// each extra wave costing a little (its B loads and pipeline start); chunks keep 4 tiles or more.
Plan gated_plan(const LoraGatedGradsParams& p) {
  const int64_t stripes = (p.inner + kStripeCols - 1) / kStripeCols;
  const int64_t wave = p.sm_count > 0 ? p.sm_count : 1;
  const int64_t tiles = (p.tokens + gated::kTileRows - 1) / gated::kTileRows;
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(tiles / 4, 8 * wave / stripes + 1));
  int64_t best = 1;
  double best_score = -1.0;
  for (int64_t chunks = 1; chunks <= most; ++chunks) {
    const int64_t blocks = stripes * chunks, waves = (blocks + wave - 1) / wave;
    const double score = static_cast<double>(blocks) / static_cast<double>(waves * wave) - 0.02 * (waves - 1);
    if (score > best_score + 1e-9) best_score = score, best = chunks;
  }
  Plan plan{};
  plan.stripes = stripes;
  const int64_t tiles_per_chunk = (tiles + best - 1) / best;
  plan.chunk_rows = tiles_per_chunk * gated::kTileRows;
  plan.chunks = (tiles + tiles_per_chunk - 1) / tiles_per_chunk;
  plan.rows_padded = plan.chunks * plan.chunk_rows;
  plan.cols_padded = stripes * kStripeCols;
  return plan;
}

template <typename T, GateActivation A>
cudaError_t launch_gated(const LoraGatedGradsParams& p, cudaStream_t stream) {
  const Plan plan = gated_plan(p);
  GatedArgs<T> a{};
  a.gate = static_cast<const T*>(p.gate);
  a.up = static_cast<const T*>(p.up);
  a.in_stride = p.in_stride;
  a.d = static_cast<const T*>(p.grad_act);
  a.d_gate = static_cast<T*>(p.grad_gate);
  a.d_up = static_cast<T*>(p.grad_up);
  a.xa_stride = p.xa_stride;
  float* next = p.workspace;
  for (int member = 0; member < gated::kMembers; ++member) {
    a.b[member] = static_cast<const T*>(p.lora_b[member]);
    a.xa[member] = static_cast<const T*>(p.xa[member]);
    a.gb_partial[member] = next;
    next += plan.stripes * plan.rows_padded * gated::kRank;
    a.db_partial[member] = next;
    next += plan.chunks * plan.cols_padded * gated::kRank;
  }
  a.tokens = p.tokens;
  a.cols = p.inner;
  a.chunk_rows = plan.chunk_rows;
  a.rows_padded = plan.rows_padded;
  a.cols_padded = plan.cols_padded;
  auto kernel = lora_gated_grads_kernel<T, A>;
  if (const cudaError_t err =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, gated::kShared);
      err != cudaSuccess) {
    return err;
  }
  if (plan.chunks > 65535) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(static_cast<unsigned>(plan.stripes), static_cast<unsigned>(plan.chunks)), gated::kThreads,
           gated::kShared, stream>>>(a);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  for (int member = 0; member < gated::kMembers; ++member) {
    launch_sum<T>(a.gb_partial[member], a.db_partial[member], plan, p.gb[member], p.gb_stride, p.grad_b[member],
                  p.grad_b_type, p.tokens, p.inner, gated::kRank, p.scale[member], stream);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_gated_type(const LoraGatedGradsParams& p, cudaStream_t stream) {
  switch (p.activation) {
    case GateActivation::kSilu: return launch_gated<T, GateActivation::kSilu>(p, stream);
    case GateActivation::kGeluTanh: return launch_gated<T, GateActivation::kGeluTanh>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool lora_grads_supported(const LoraGradsParams& p) {
  const bool half_type = p.type == ElementType::kFloat16 || p.type == ElementType::kBFloat16;
  const bool grad_b_type = p.grad_b_type == ElementType::kFloat32 || p.grad_b_type == p.type;
  return half_type && grad_b_type && p.sm_major >= 8 && p.rank == kRank && p.tokens >= 1 &&
         p.out_features >= 1 && p.out_features % 8 == 0 && p.grad_y_stride % 8 == 0 && p.xa_stride % 8 == 0 &&
         aligned16(p.grad_y) && aligned16(p.lora_b) && aligned16(p.xa);
}

int64_t lora_grads_workspace_floats(const LoraGradsParams& p) {
  const Plan plan = default_plan(p);
  return (plan.stripes * plan.rows_padded + plan.chunks * plan.cols_padded) * p.rank;
}

cudaError_t launch_lora_grads(const LoraGradsParams& p, cudaStream_t stream) {
  if (!lora_grads_supported(p)) return cudaErrorInvalidValue;
  if (p.type == ElementType::kBFloat16) return launch_type<__nv_bfloat16>(p, stream);
  return launch_type<__half>(p, stream);
}

bool lora_gated_grads_supported(const LoraGatedGradsParams& p) {
  const bool half_type = p.type == ElementType::kFloat16 || p.type == ElementType::kBFloat16;
  const bool grad_b_type = p.grad_b_type == ElementType::kFloat32 || p.grad_b_type == p.type;
  const bool activation = p.activation == GateActivation::kSilu || p.activation == GateActivation::kGeluTanh;
  bool aligned = aligned16(p.gate) && aligned16(p.up) && aligned16(p.grad_act) && aligned16(p.grad_gate) &&
                 aligned16(p.grad_up);
  for (int member = 0; member < gated::kMembers; ++member) {  // B's fragments load from global memory: 32 bytes
    aligned = aligned && reinterpret_cast<uintptr_t>(p.lora_b[member]) % 32 == 0 && aligned16(p.xa[member]);
  }
  return half_type && grad_b_type && activation && aligned && p.sm_major >= 8 && p.rank == gated::kRank &&
         p.tokens >= 1 && p.inner >= 1 && p.inner % 16 == 0 && p.in_stride % 8 == 0 && p.xa_stride % 8 == 0;
}

int64_t lora_gated_grads_workspace_floats(const LoraGatedGradsParams& p) {
  const Plan plan = gated_plan(p);
  return gated::kMembers * (plan.stripes * plan.rows_padded + plan.chunks * plan.cols_padded) * gated::kRank;
}

cudaError_t launch_lora_gated_grads(const LoraGatedGradsParams& p, cudaStream_t stream) {
  if (!lora_gated_grads_supported(p)) return cudaErrorInvalidValue;
  if (p.type == ElementType::kBFloat16) return launch_gated_type<__nv_bfloat16>(p, stream);
  return launch_gated_type<__half>(p, stream);
}

}  // namespace kernels
}  // namespace hasten
