// CPU reference of hasten::moe_route and its backward (registration.cpp states what they compute):
// one token at a time, in float (double for float64 logits), sums in expert order.
#include <ATen/Dispatch.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "moe_checks.h"

namespace hasten {
namespace {

enum class Scoring { kSoftmax, kSigmoid, kTopkSoftmax };  // the schema's "softmax", "sigmoid", "topk_softmax"

struct RouteSpec {
  int64_t experts, top_k;
  Scoring scoring;
  bool renormalize;
  double renorm_epsilon, scale;
  int64_t num_groups, top_groups;
  bool top2_sum;  // group score: the two largest choice values summed, else the largest
  double masked_choice;  // the choice value outside the top groups
};

// (a, ia) ranks before (b, ib) in top-k: NaN first, then the larger value, then the lower index
template <typename acc_t>
bool ranks_before(acc_t a, int64_t ia, acc_t b, int64_t ib) {
  const bool a_nan = std::isnan(a), b_nan = std::isnan(b);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// The top `k` of `values` (every entry a candidate), in rank order.
template <typename acc_t>
std::vector<int64_t> top_indices(const std::vector<acc_t>& values, int64_t k) {
  std::vector<int64_t> chosen;
  std::vector<bool> taken(values.size(), false);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < static_cast<int64_t>(values.size()); ++e) {
      if (!taken[e] && (best < 0 || ranks_before(values[e], e, values[best], best))) best = e;
    }
    taken[best] = true;
    chosen.push_back(best);
  }
  return chosen;
}

template <typename acc_t>
void softmax_in_place(std::vector<acc_t>& v) {
  acc_t max_value = v[0];
  for (acc_t x : v) max_value = max_value > x ? max_value : x;
  acc_t sum = 0;
  for (acc_t& x : v) {
    x = std::exp(x - max_value);
    sum += x;
  }
  for (acc_t& x : v) x = sum == 0 ? std::numeric_limits<acc_t>::quiet_NaN() : x / sum;
}

// One token's scores and choice values; `kept[g]`: group g is among the top groups.
template <typename scalar_t, typename acc_t>
void token_scores(const RouteSpec& s, const scalar_t* row, const std::vector<acc_t>& bias, bool has_bias,
                  std::vector<acc_t>& score, std::vector<acc_t>& choice, std::vector<bool>& kept) {
  for (int64_t e = 0; e < s.experts; ++e) score[e] = static_cast<acc_t>(row[e]);
  if (s.scoring == Scoring::kSoftmax) {
    softmax_in_place(score);
  } else if (s.scoring == Scoring::kSigmoid) {
    for (acc_t& x : score) x = acc_t(1) / (acc_t(1) + std::exp(-x));
  }
  for (int64_t e = 0; e < s.experts; ++e) choice[e] = has_bias ? score[e] + bias[e] : score[e];
  kept.assign(s.num_groups, true);
  if (s.num_groups <= 1) return;
  const int64_t size = s.experts / s.num_groups;
  std::vector<acc_t> group_values(s.num_groups);
  for (int64_t g = 0; g < s.num_groups; ++g) {
    std::vector<acc_t> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
    const auto best = top_indices(members, s.top2_sum ? 2 : 1);
    group_values[g] = s.top2_sum ? members[best[0]] + members[best[1]] : members[best[0]];
  }
  kept.assign(s.num_groups, false);
  for (int64_t g : top_indices(group_values, s.top_groups)) kept[g] = true;
  for (int64_t e = 0; e < s.experts; ++e) {
    if (!kept[e / size]) choice[e] = static_cast<acc_t>(s.masked_choice);
  }
}

template <typename acc_t>
std::vector<acc_t> bias_values(const std::optional<at::Tensor>& bias) {
  std::vector<acc_t> values;
  if (!bias) return values;
  const auto b = bias->to(at::kDouble).contiguous();
  const double* data = b.data_ptr<double>();
  for (int64_t e = 0; e < b.numel(); ++e) values.push_back(static_cast<acc_t>(data[e]));
  return values;
}

RouteSpec make_spec(const at::Tensor& logits, int64_t top_k, c10::string_view scoring, bool renormalize,
                    double renorm_epsilon, double scale, int64_t num_groups, int64_t top_groups,
                    c10::string_view group_score, double masked_choice) {
  const Scoring kind = scoring == "softmax" ? Scoring::kSoftmax
                       : scoring == "sigmoid" ? Scoring::kSigmoid
                                              : Scoring::kTopkSoftmax;  // check_route_args allows no other
  return RouteSpec{logits.size(1), top_k, kind, renormalize, renorm_epsilon, scale, num_groups,
                   num_groups > 1 ? top_groups : 1, std::string(group_score) == "top2_sum", masked_choice};
}

std::tuple<at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& logits, int64_t top_k, c10::string_view scoring,
                                                 bool renormalize, double renorm_epsilon, double scale,
                                                 int64_t num_groups, int64_t top_groups, c10::string_view group_score,
                                                 double masked_choice, const std::optional<at::Tensor>& selection_bias) {
  check_device(logits, "moe_route", "logits", c10::DeviceType::CPU);
  check_route_args("moe_route", logits, top_k, std::string(scoring), num_groups, top_groups, std::string(group_score),
                   selection_bias);
  const RouteSpec s = make_spec(logits, top_k, scoring, renormalize, renorm_epsilon, scale, num_groups, top_groups,
                                group_score, masked_choice);
  const auto lc = logits.contiguous();
  const auto weight_dtype = lc.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto weights = at::empty({lc.size(0), top_k}, lc.options().dtype(weight_dtype));
  auto ids = at::empty({lc.size(0), top_k}, lc.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lc.scalar_type(), "moe_route_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto bias = bias_values<acc_t>(selection_bias);
    std::vector<acc_t> score(s.experts), choice(s.experts);
    std::vector<bool> kept;
    acc_t* w = weights.data_ptr<acc_t>();
    int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < lc.size(0); ++t) {
      token_scores<scalar_t, acc_t>(s, lc.data_ptr<scalar_t>() + t * s.experts, bias, selection_bias.has_value(),
                                    score, choice, kept);
      const auto chosen = top_indices(choice, top_k);
      std::vector<acc_t> u(top_k);
      for (int64_t j = 0; j < top_k; ++j) u[j] = selection_bias ? score[chosen[j]] : choice[chosen[j]];
      if (s.scoring == Scoring::kTopkSoftmax) softmax_in_place(u);
      if (renormalize) {
        acc_t sum = 0;
        for (acc_t x : u) sum += x;
        const acc_t denominator = sum + static_cast<acc_t>(renorm_epsilon);
        for (acc_t& x : u) x = x / denominator;
      }
      for (int64_t j = 0; j < top_k; ++j) {
        w[t * top_k + j] = u[j] * static_cast<acc_t>(scale);
        id[t * top_k + j] = chosen[j];
      }
    }
  });
  return {weights, ids};
}

at::Tensor moe_route_backward_cpu(const at::Tensor& grad_weights, const at::Tensor& logits, const at::Tensor& ids,
                                  int64_t top_k, c10::string_view scoring, bool renormalize, double renorm_epsilon,
                                  double scale, int64_t num_groups, int64_t top_groups, c10::string_view group_score,
                                  double masked_choice, const std::optional<at::Tensor>& selection_bias) {
  check_device(logits, "moe_route_backward", "logits", c10::DeviceType::CPU);
  check_route_args("moe_route_backward", logits, top_k, std::string(scoring), num_groups, top_groups,
                   std::string(group_score), selection_bias);
  check_route_backward_args(grad_weights, logits, ids, top_k);
  const RouteSpec s = make_spec(logits, top_k, scoring, renormalize, renorm_epsilon, scale, num_groups, top_groups,
                                group_score, masked_choice);
  const auto lc = logits.contiguous(), idc = ids.contiguous();
  auto grad_logits = at::empty_like(lc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, lc.scalar_type(), "moe_route_backward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto bias = bias_values<acc_t>(selection_bias);
    const auto g_all = grad_weights.to(std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat).contiguous();
    const acc_t* g_data = g_all.data_ptr<acc_t>();
    std::vector<acc_t> score(s.experts), choice(s.experts), dp(s.experts);
    std::vector<bool> kept;
    const int64_t group_size = s.experts / s.num_groups;
    for (int64_t t = 0; t < lc.size(0); ++t) {
      token_scores<scalar_t, acc_t>(s, lc.data_ptr<scalar_t>() + t * s.experts, bias, selection_bias.has_value(),
                                    score, choice, kept);
      const int64_t* id = idc.data_ptr<int64_t>() + t * top_k;
      std::vector<acc_t> u(top_k), q(top_k), g(top_k), du(top_k), dv(top_k);
      std::vector<bool> masked(top_k);
      for (int64_t j = 0; j < top_k; ++j) {
        TORCH_CHECK(id[j] >= 0 && id[j] < s.experts, "hasten::moe_route_backward: expert id ", num(id[j]),
                    " at token ", num(t), " is outside [0, ", num(s.experts), ")");
        masked[j] = !selection_bias && !kept[id[j] / group_size];
        u[j] = masked[j] ? static_cast<acc_t>(masked_choice) : score[id[j]];
        g[j] = g_data[t * top_k + j] * static_cast<acc_t>(scale);
      }
      if (s.scoring == Scoring::kTopkSoftmax) {
        q = u;
        softmax_in_place(q);
        u = q;
      }
      du = g;
      if (renormalize) {
        acc_t sum = 0, dot = 0;
        for (int64_t j = 0; j < top_k; ++j) {
          sum += u[j];
          dot += g[j] * u[j];
        }
        const acc_t denominator = sum + static_cast<acc_t>(renorm_epsilon);
        for (int64_t j = 0; j < top_k; ++j) du[j] = g[j] / denominator - dot / (denominator * denominator);
      }
      dv = du;
      if (s.scoring == Scoring::kTopkSoftmax) {
        acc_t dot = 0;
        for (int64_t j = 0; j < top_k; ++j) dot += du[j] * q[j];
        for (int64_t j = 0; j < top_k; ++j) dv[j] = q[j] * (du[j] - dot);
      }
      std::fill(dp.begin(), dp.end(), acc_t(0));
      acc_t softmax_dot = 0;
      for (int64_t j = 0; j < top_k; ++j) {
        if (masked[j]) continue;
        dp[id[j]] = dv[j];
        softmax_dot += dv[j] * score[id[j]];
      }
      scalar_t* out = grad_logits.data_ptr<scalar_t>() + t * s.experts;
      for (int64_t e = 0; e < s.experts; ++e) {
        acc_t grad = dp[e];
        if (s.scoring == Scoring::kSoftmax) grad = dp[e] * score[e] - score[e] * softmax_dot;
        if (s.scoring == Scoring::kSigmoid) grad = dp[e] * (acc_t(1) - score[e]) * score[e];
        out[e] = static_cast<scalar_t>(grad);
      }
    }
  });
  return grad_logits;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) {
  m.impl("moe_route", &moe_route_cpu);
  m.impl("moe_route_backward", &moe_route_backward_cpu);
}

}  // namespace hasten
