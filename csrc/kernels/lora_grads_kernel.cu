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
// so only rank 16 runs here. Not memory-bound: why is open (see docs/design.md).
#include <mma.h>

#include "dtype_utils.cuh"
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

__device__ __forceinline__ void copy16_async(void* shared, const void* global, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are filled with zeros, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes));
}
__device__ __forceinline__ void copy16_async_to(unsigned shared_address, const void* global, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address), "l"(global), "r"(bytes));
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

template <typename T, typename TB>
void launch_sum(const Args<T>& a, const Plan& plan, const LoraGradsParams& p, cudaStream_t stream) {
  const int64_t total = (p.tokens + p.out_features) * kRank;
  lora_grads_sum_kernel<T, TB><<<static_cast<unsigned>((total + 255) / 256), 256, 0, stream>>>(
      a.gb_partial, a.db_partial, static_cast<T*>(p.gb), p.gb_stride, static_cast<TB*>(p.grad_b), p.tokens,
      p.out_features, kRank, plan.stripes, plan.chunks, plan.rows_padded, plan.cols_padded, p.scale);
}

Plan default_plan(const LoraGradsParams& p) {
  return plan_of(p, kTileRows, Config<kTileRows, kStages, kRank>::kBlocksPerSm);
}

// Lean (HASTEN_LORA_GRADS_CONFIG=4, read by the caller; scripts/lora_grads_probe.py): 2.2-2.5 TB/s
// of g against the plain kernel's 2.0-2.15 on the H200 (8c3886c), equal products in the GPU test;
// the default once a W4 row shows it.
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
  if (p.grad_b_type == ElementType::kFloat32) {
    launch_sum<T, float>(a, plan, p, stream);
  } else {
    launch_sum<T, T>(a, plan, p, stream);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_type(const LoraGradsParams& p, cudaStream_t stream) {
  return p.config == 4 ? launch<T, true>(p, stream) : launch<T, false>(p, stream);
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

}  // namespace kernels
}  // namespace hasten
