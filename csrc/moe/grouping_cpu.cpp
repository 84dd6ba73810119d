// CPU reference of hasten::moe_group: a stable counting sort of slots by expert.
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>
#include <vector>

#include "moe_checks.h"

namespace hasten {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_group_cpu(const at::Tensor& expert_ids,
                                                                         int64_t num_experts) {
  check_device(expert_ids, "moe_group", "expert_ids", c10::DeviceType::CPU);
  check_moe_group_args(expert_ids, num_experts);
  const auto ids = expert_ids.contiguous().to(at::kLong);
  const int64_t slots = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < num_experts, "hasten::moe_group: expert id ", num(id[s]), " at token ",
                num(s / ids.size(1)), ", choice ", num(s % ids.size(1)), " is outside [0, ", num(num_experts),
                "); check the router's top-k and the model's num_experts");
  }
  auto opts = ids.options().dtype(at::kInt);
  auto counts = at::zeros({num_experts}, opts);
  auto offsets = at::empty({num_experts + 1}, opts);
  auto permutation = at::empty({slots}, opts);
  auto inverse = at::empty({slots}, opts);
  int32_t* c = counts.data_ptr<int32_t>();
  int32_t* off = offsets.data_ptr<int32_t>();
  for (int64_t s = 0; s < slots; ++s) ++c[id[s]];
  off[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) off[e + 1] = off[e] + c[e];
  std::vector<int32_t> next(off, off + num_experts);
  int32_t* perm = permutation.data_ptr<int32_t>();
  int32_t* inv = inverse.data_ptr<int32_t>();
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t pos = next[id[s]]++;
    perm[pos] = static_cast<int32_t>(s);
    inv[s] = pos;
  }
  return {counts, offsets, permutation, inverse};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) { m.impl("moe_group", &moe_group_cpu); }

}  // namespace hasten
