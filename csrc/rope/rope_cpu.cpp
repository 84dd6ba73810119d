// CPU reference of hasten::rope (the CUDA kernel's contract, see kernels/rope.cuh).
#include <torch/library.h>
#include <torch/types.h>

#include "rope_checks.h"

namespace hasten {
namespace {

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in, bool backward,
                    bool interleaved) {
  check_device(x, "rope", "x", c10::DeviceType::CPU);
  check_rope_args(x, cos_in, sin_in);
  // double math; contiguous, so cos and sin share one layout (cos_in and sin_in may not)
  const auto cos = cos_in.to(at::kDouble).contiguous(), sin = sin_in.to(at::kDouble).contiguous();
  auto out = at::empty_like(x);  // x's strides (q and k arrive transposed)
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const int64_t R = cos.size(2), half = R / 2;
  const auto xs = x.strides(), os = out.strides();
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), cl = cos.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rope_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const double* c = cos.data_ptr<double>();
    const double* s = sin.data_ptr<double>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t l = 0; l < L; ++l) {
          const scalar_t* xr = xp + b * xs[0] + h * xs[1] + l * xs[2];
          scalar_t* orow = op + b * os[0] + h * os[1] + l * os[2];
          const double* cr = c + b * cb + l * cl;
          const double* sr = s + b * cb + l * cl;
          for (int64_t j = 0; j < half; ++j) {
            // the pair: rotate_half (j, j + R/2) or interleaved (2j, 2j + 1)
            const int64_t i_lo = interleaved ? 2 * j : j, i_hi = interleaved ? 2 * j + 1 : j + half;
            const double lo = double(xr[i_lo]), hi = double(xr[i_hi]);
            if (!backward) {
              orow[i_lo] = static_cast<scalar_t>(lo * cr[i_lo] - hi * sr[i_lo]);
              orow[i_hi] = static_cast<scalar_t>(hi * cr[i_hi] + lo * sr[i_hi]);
            } else {
              orow[i_lo] = static_cast<scalar_t>(lo * cr[i_lo] + hi * sr[i_hi]);
              orow[i_hi] = static_cast<scalar_t>(hi * cr[i_hi] - lo * sr[i_lo]);
            }
          }
          for (int64_t e = R; e < D; ++e) orow[e] = xr[e];  // partial rotary: the rest passes through
        }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CPU, m) { m.impl("rope", &rope_cpu); }

}  // namespace hasten
