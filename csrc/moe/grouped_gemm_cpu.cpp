// CPU reference of the experts' grouped GEMMs (hasten::moe_grouped_mm and its weight gradient):
// one at::mm per expert over its rows. Rows past the last group's end are zero here (undefined
// on CUDA, where nothing reads them).
#include <torch/library.h>
#include <torch/types.h>

#include <vector>

#include "moe_checks.h"

namespace hasten {
namespace {

// group_ends on the host, checked: non-decreasing, within [0, rows]
std::vector<int64_t> group_bounds(const at::Tensor& group_ends, int64_t rows, const char* op) {
  const auto ends = group_ends.contiguous();
  const int32_t* e = ends.data_ptr<int32_t>();
  std::vector<int64_t> bounds{0};
  for (int64_t g = 0; g < ends.numel(); ++g) {
    TORCH_CHECK(e[g] >= bounds.back() && e[g] <= rows, "hasten::", op, ": `group_ends` must be non-decreasing "
                "within [0, ", num(rows), "] (the rows of x), got ", num(e[g]), " at expert ", num(g),
                " after ", num(bounds.back()));
    bounds.push_back(e[g]);
  }
  return bounds;
}

at::Tensor moe_grouped_mm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_ends,
                              bool transposed) {
  check_device(x, "moe_grouped_mm", "x", c10::DeviceType::CPU);
  check_grouped_mm_args(x, weight, group_ends, transposed);
  const auto bounds = group_bounds(group_ends, x.size(0), "moe_grouped_mm");
  const int64_t out_features = weight.size(transposed ? 2 : 1);
  auto out = at::zeros({x.size(0), out_features}, x.options());
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(bounds.size()); ++g) {
    if (bounds[g + 1] == bounds[g]) continue;
    const auto rows = x.slice(0, bounds[g], bounds[g + 1]);
    out.slice(0, bounds[g], bounds[g + 1]).copy_(at::mm(rows, transposed ? weight[g] : weight[g].t()));
  }
  return out;
}

at::Tensor moe_grouped_mm_weight_grad_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends) {
  check_device(a, "moe_grouped_mm_weight_grad", "a", c10::DeviceType::CPU);
  check_grouped_mm_weight_grad_args(a, b, group_ends);
  const auto bounds = group_bounds(group_ends, a.size(0), "moe_grouped_mm_weight_grad");
  auto out = at::zeros({group_ends.numel(), a.size(1), b.size(1)}, a.options());
  for (int64_t g = 0; g + 1 < static_cast<int64_t>(bounds.size()); ++g) {
    if (bounds[g + 1] == bounds[g]) continue;
    out[g].copy_(at::mm(a.slice(0, bounds[g], bounds[g + 1]).t(), b.slice(0, bounds[g], bounds[g + 1])));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("moe_grouped_mm", &moe_grouped_mm_cpu);
  m.impl("moe_grouped_mm_weight_grad", &moe_grouped_mm_weight_grad_cpu);
}

}  // namespace hasten
