// The MoE permute (tokens -> expert-sorted rows) as it ships against the position-order gather it
// replaced (before 2026-12-06's part-major order), on W3's three block shapes at 16,384 tokens.
// Torch-free: it includes the kernel's TU, so it builds with nvcc alone in seconds.
//
// Routings: "uniform" (each token's k experts drawn at random), "skewed" (61 segments, like W1's
// samples, each with its own Zipf-like preference over the experts: a token's experts depend on
// where it is, which is what makes the parts' token windows drift apart), "dropped" (uniform with
// one slot in 16 routed to no expert). The grouping is built on the host, stable by slot, as
// hasten::moe_group's. Every output is checked bitwise against the old kernel's; L2 is flushed
// (a 256 MiB write) before each timed call; the median of 30 calls is printed.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -Icsrc/include -Icsrc/kernels \
//     scripts/moe_permute_probe.cu -o /tmp/moe_permute_probe && /tmp/moe_permute_probe
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "../csrc/kernels/moe_permute_kernel.cu"

#define CHECK(call)                                                                  \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

namespace {

constexpr int kOldRows = 4;

// The kernel before: block b moves positions 4b..4b+3.
__global__ void old_permute_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ permutation,
                                   const int32_t* __restrict__ offsets, __nv_bfloat16* __restrict__ out,
                                   int64_t num_slots, int64_t hidden, int num_experts, int top_k) {
  using V8 = uint4;  // 8 bf16
  const int64_t valid_slots = offsets[num_experts];
  const V8* src[kOldRows];
  V8* dst[kOldRows];
  bool live[kOldRows], valid[kOldRows];
#pragma unroll
  for (int r = 0; r < kOldRows; ++r) {
    const int64_t pos = static_cast<int64_t>(blockIdx.x) * kOldRows + r;
    live[r] = pos < num_slots;
    valid[r] = live[r] && pos < valid_slots;
    const int64_t slot = valid[r] ? permutation[pos] : 0;
    src[r] = reinterpret_cast<const V8*>(x + (slot / top_k) * hidden);
    dst[r] = reinterpret_cast<V8*>(out + (live[r] ? pos : 0) * hidden);
  }
  for (int64_t c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
    V8 chunk[kOldRows];
#pragma unroll
    for (int r = 0; r < kOldRows; ++r) chunk[r] = valid[r] ? src[r][c] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < kOldRows; ++r)
      if (live[r]) dst[r][c] = chunk[r];
  }
}

struct Block {
  const char* name;
  int hidden, experts, top_k;
};

// Expert ids (T * k), -1 for a dropped slot.
std::vector<int> route(const char* routing, int tokens, int experts, int top_k, std::mt19937& rng) {
  std::vector<int> ids(static_cast<size_t>(tokens) * top_k);
  std::vector<double> weight(experts);
  std::vector<int> rank(experts);
  int segment_end = 0;
  const bool skewed = std::strcmp(routing, "skewed") == 0;
  for (int t = 0; t < tokens; ++t) {
    if (skewed && t >= segment_end) {  // a new segment: its own order of preference
      segment_end = t + tokens / 61 + 1;
      for (int e = 0; e < experts; ++e) rank[e] = e;
      std::shuffle(rank.begin(), rank.end(), rng);
      for (int e = 0; e < experts; ++e) weight[e] = 1.0 / std::pow(1.0 + rank[e], 1.1);
    }
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < top_k) {
      int e;
      if (skewed) {
        std::discrete_distribution<int> pick(weight.begin(), weight.end());
        e = pick(rng);
      } else {
        e = std::uniform_int_distribution<int>(0, experts - 1)(rng);
      }
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int j = 0; j < top_k; ++j) ids[static_cast<size_t>(t) * top_k + j] = chosen[j];
  }
  if (std::strcmp(routing, "dropped") == 0)
    for (size_t s = 0; s < ids.size(); s += 16) ids[s] = -1;
  return ids;
}

float median_ms(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const int tokens = 16384;
  const Block blocks[] = {{"qwen3_30b_a3b", 2048, 128, 8}, {"deepseek_v2_lite", 2048, 64, 6}, {"gpt_oss_20b", 2880, 32, 4}};
  const char* routings[] = {"uniform", "skewed", "dropped"};
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, L2 %d MiB\n", prop.name, prop.l2CacheSize >> 20);
  void* flush = nullptr;
  const size_t flush_bytes = size_t(256) << 20;
  CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::mt19937 rng(1234);
  for (const Block& b : blocks) {
    const int64_t slots = static_cast<int64_t>(tokens) * b.top_k;
    std::vector<__nv_bfloat16> x(static_cast<size_t>(tokens) * b.hidden);
    for (auto& v : x) v = __float2bfloat16(std::uniform_real_distribution<float>(-1, 1)(rng));
    __nv_bfloat16 *dx, *out_new, *out_old;
    int32_t *dperm, *doffsets;
    CHECK(cudaMalloc(&dx, x.size() * 2));
    CHECK(cudaMalloc(&out_new, slots * b.hidden * 2));
    CHECK(cudaMalloc(&out_old, slots * b.hidden * 2));
    CHECK(cudaMalloc(&dperm, slots * 4));
    CHECK(cudaMalloc(&doffsets, (b.experts + 1) * 4));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    for (const char* routing : routings) {
      const std::vector<int> ids = route(routing, tokens, b.experts, b.top_k, rng);
      // stable grouping: buckets 0..E-1, then E for dropped slots
      std::vector<int32_t> count(b.experts + 1, 0), offsets(b.experts + 1, 0), perm(slots);
      for (int e : ids) ++count[e < 0 ? b.experts : e];
      std::vector<int32_t> next(b.experts + 1, 0);
      for (int e = 1; e <= b.experts; ++e) next[e] = next[e - 1] + count[e - 1];
      for (int e = 0; e <= b.experts; ++e) offsets[e] = next[e];
      for (int64_t s = 0; s < slots; ++s) perm[next[ids[s] < 0 ? b.experts : ids[s]]++] = static_cast<int32_t>(s);
      CHECK(cudaMemcpy(dperm, perm.data(), slots * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(doffsets, offsets.data(), (b.experts + 1) * 4, cudaMemcpyHostToDevice));
      hasten::kernels::MoePermuteParams p{};
      p.x = dx;
      p.permutation = dperm;
      p.offsets = doffsets;
      p.slot_scale = nullptr;
      p.out = out_new;
      p.num_slots = slots;
      p.hidden = b.hidden;
      p.num_experts = b.experts;
      p.top_k = b.top_k;
      p.type = hasten::kernels::ElementType::kBFloat16;
      const int threads = std::min(256, std::max(32, b.hidden / 8));
      auto run_new = [&] { CHECK(hasten::kernels::launch_moe_permute(p, 0)); };
      auto run_old = [&] {
        old_permute_kernel<<<(slots + kOldRows - 1) / kOldRows, threads>>>(dx, dperm, doffsets, out_old, slots,
                                                                          b.hidden, b.experts, b.top_k);
        CHECK(cudaGetLastError());
      };
      auto time = [&](auto fn) {
        std::vector<float> ms;
        for (int i = 0; i < 33; ++i) {
          CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
          CHECK(cudaEventRecord(start));
          fn();
          CHECK(cudaEventRecord(stop));
          CHECK(cudaEventSynchronize(stop));
          float t = 0;
          CHECK(cudaEventElapsedTime(&t, start, stop));
          if (i >= 3) ms.push_back(t);
        }
        return median_ms(ms);
      };
      const float old_ms = time(run_old), new_ms = time(run_new), old_ms2 = time(run_old), new_ms2 = time(run_new);
      std::vector<uint16_t> a(slots * b.hidden), c(slots * b.hidden);
      CHECK(cudaMemcpy(a.data(), out_new, a.size() * 2, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(c.data(), out_old, c.size() * 2, cudaMemcpyDeviceToHost));
      const bool equal = a == c;
      const double least_gb = (double(slots) + tokens) * b.hidden * 2 / 1e9;  // S rows written, T read once
      std::printf(
          "{\"block\": \"%s\", \"routing\": \"%s\", \"parts\": %lld, \"old_ms\": [%.4f, %.4f], \"new_ms\": [%.4f, %.4f], "
          "\"ratio\": %.3f, \"new_least_traffic_tb_s\": %.2f, \"bitwise_equal\": %s}\n",
          b.name, routing, static_cast<long long>(hasten::kernels::moe_permute_parts(slots, b.experts)), old_ms,
          old_ms2, new_ms, new_ms2, std::min(old_ms, old_ms2) / std::min(new_ms, new_ms2),
          least_gb / (std::min(new_ms, new_ms2) * 1e-3) / 1e3, equal ? "true" : "false");
      if (!equal) return 1;
    }
    CHECK(cudaFree(dx));
    CHECK(cudaFree(out_new));
    CHECK(cudaFree(out_old));
    CHECK(cudaFree(dperm));
    CHECK(cudaFree(doffsets));
  }
  return 0;
}
