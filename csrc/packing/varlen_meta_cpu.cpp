// CPU reference of hasten::varlen_meta: one pass over the flattened position_ids.
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <tuple>

#include "packing_checks.h"

namespace hasten {
namespace {

template <typename index_t>
void varlen_meta_cpu_impl(const index_t* pos, int64_t total, int64_t row_len, int32_t* cu,
                          int32_t* seq_idx, int32_t* stats) {
  int32_t num_seqs = 0;
  int32_t max_len = 0;
  int64_t start = 0;
  for (int64_t i = 0; i < total; ++i) {
    const bool is_start = (i % row_len == 0) || (pos[i] != pos[i - 1] + 1);
    if (is_start) {
      if (num_seqs > 0) max_len = std::max<int32_t>(max_len, static_cast<int32_t>(i - start));
      cu[num_seqs++] = static_cast<int32_t>(i);
      start = i;
    }
    seq_idx[i] = num_seqs - 1;
  }
  if (num_seqs > 0) max_len = std::max<int32_t>(max_len, static_cast<int32_t>(total - start));
  for (int64_t k = num_seqs; k <= total; ++k) cu[k] = static_cast<int32_t>(total);
  stats[0] = num_seqs;
  stats[1] = max_len;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_meta_cpu(const at::Tensor& position_ids) {
  check_device(position_ids, "varlen_meta", "position_ids", c10::DeviceType::CPU);
  check_varlen_meta_args(position_ids);
  const auto pos = position_ids.contiguous();
  const int64_t total = pos.numel();
  const int64_t row_len = pos.size(-1);

  auto opts = pos.options().dtype(at::kInt);
  auto cu = at::empty({total + 1}, opts);
  auto seq_idx = at::empty({total}, opts);
  auto stats = at::empty({2}, opts);
  AT_DISPATCH_INDEX_TYPES(pos.scalar_type(), "varlen_meta_cpu", [&] {
    varlen_meta_cpu_impl<index_t>(pos.data_ptr<index_t>(), total, std::max<int64_t>(row_len, 1),
                                  cu.data_ptr<int32_t>(), seq_idx.data_ptr<int32_t>(),
                                  stats.data_ptr<int32_t>());
  });
  return {cu, seq_idx, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) { m.impl("varlen_meta", &varlen_meta_cpu); }

}  // namespace hasten
