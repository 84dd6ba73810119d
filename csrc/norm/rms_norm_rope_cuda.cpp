// CUDA glue of hasten::rms_norm_rope and its backward: checks, device guard, one launch each (plus
// the column sums of the backward's per-block weight-gradient partials: weight_grad_cuda.h).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

#include "../kernels/rms_norm.cuh"
#include "../kernels/rms_norm_rope.cuh"
#include "hasten/cuda_glue.h"
#include "norm_checks.h"
#include "weight_grad_cuda.h"

namespace hasten {
namespace {

// Whether the kernel reads `t` as it is: strides of whole 16-byte vectors, 16-byte aligned.
bool reads_as_vectors(const at::Tensor& t) {
  const int64_t vector = 16 / t.element_size();
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % vector != 0) return false;
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// `t`, or a fresh contiguous copy of it where the kernel cannot read it as it is (a fresh allocation
// is aligned; `.contiguous()` would return an unaligned contiguous view unchanged).
at::Tensor as_vectors(const at::Tensor& t) { return reads_as_vectors(t) ? t : t.clone(at::MemoryFormat::Contiguous); }

void check_kernel_shape(const char* op, const at::Tensor& x, int64_t rotary_dim, bool interleaved) {
  TORCH_CHECK(kernels::rms_norm_rope_fits(x.size(3), rotary_dim, interleaved, static_cast<int>(x.element_size())),
              "hasten::", op, ": the CUDA kernel takes head_dim a multiple of ", num(16 / x.element_size()),
              " and at most ", num(32 * (16 / x.element_size())), " elements, and a rotary dim whose ",
              interleaved ? "pairs" : "halves", " start on ", num(16 / x.element_size()),
              "-element boundaries; got head_dim ", num(x.size(3)), ", rotary dim ", num(rotary_dim),
              ". Run hasten::rms_norm and then hasten::rope instead (hasten.ops.dense.rms_norm_rope_covers says "
              "which shapes the fused op takes)");
  TORCH_CHECK(x.size(0) * x.size(1) * x.size(2) < (int64_t(1) << 31), "hasten::", op, ": ",
              num(x.size(0) * x.size(1) * x.size(2)), " rows do not fit the kernel's 32-bit row index; split the batch");
}

kernels::RmsNormRopeParams params_for(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& out, const at::Tensor& rstd,
                                      double offset, bool interleaved, const char* op) {
  kernels::RmsNormRopeParams p{};
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.weight = weight.data_ptr();
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.rstd = rstd.data_ptr<float>();
  p.batch = x.size(0);
  p.heads = x.size(1);
  p.length = x.size(2);
  p.dim = x.size(3);
  p.rotary_dim = cos.size(2);
  for (int i = 0; i < 3; ++i) {
    p.x_stride[i] = x.stride(i);
    p.out_stride[i] = out.stride(i);
  }
  p.cs_stride[0] = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.cs_stride[1] = cos.stride(1);
  p.offset = static_cast<float>(offset);
  p.interleaved = interleaved;
  p.type = element_type(x, op);
  return p;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rope_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                                                      const at::Tensor& cos_in, const at::Tensor& sin_in, double eps,
                                                      double offset, bool interleaved) {
  const char* op = "rms_norm_rope";
  check_device(x_in, op, "x", c10::DeviceType::CUDA);
  check_rms_norm_rope_args(op, x_in, weight_in, cos_in, sin_in);
  check_kernel_shape(op, x_in, cos_in.size(2), interleaved);
  const c10::cuda::CUDAGuard guard(x_in.device());
  // cos and sin share one layout for the kernel's indexing
  const auto x = as_vectors(x_in), weight = as_vectors(weight_in);
  const auto cos = as_vectors(cos_in.contiguous()), sin = as_vectors(sin_in.contiguous());
  auto out = at::empty_like(x_in);  // x's strides (q and k arrive transposed): whole rows of D, so whole vectors
  auto rstd = at::empty({x.size(0), x.size(1), x.size(2)}, x.options().dtype(at::kFloat));
  auto p = params_for(x, weight, cos, sin, out, rstd, offset, interleaved, op);
  p.eps = static_cast<float>(eps);
  check_launch(kernels::launch_rms_norm_rope_forward(p, c10::cuda::getCurrentCUDAStream()), op);
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rope_backward_cuda(const at::Tensor& grad_out_in, const at::Tensor& x_in,
                                                               const at::Tensor& weight_in, const at::Tensor& rstd_in,
                                                               const at::Tensor& cos_in, const at::Tensor& sin_in,
                                                               double offset, bool interleaved, bool weight_grad) {
  const char* op = "rms_norm_rope_backward";
  check_device(x_in, op, "x", c10::DeviceType::CUDA);
  check_rms_norm_rope_backward_args(grad_out_in, x_in, weight_in, rstd_in, cos_in, sin_in);
  check_kernel_shape(op, x_in, cos_in.size(2), interleaved);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = as_vectors(x_in), grad_out = as_vectors(grad_out_in), weight = as_vectors(weight_in);
  const auto cos = as_vectors(cos_in.contiguous()), sin = as_vectors(sin_in.contiguous()), rstd = rstd_in.contiguous();
  const int64_t rows = x.size(0) * x.size(1) * x.size(2), dim = x.size(3);
  auto grad_x = at::empty_like(x_in);
  if (rows == 0) return {grad_x, weight_grad ? at::zeros_like(weight_in) : at::empty({0}, weight_in.options())};
  const int blocks = kernels::rms_norm_backward_blocks(rows, x.get_device());
  auto partial = weight_grad ? at::empty({blocks, dim}, x.options().dtype(at::kFloat)) : at::Tensor();
  auto p = params_for(x, weight, cos, sin, grad_x, rstd, offset, interleaved, op);
  p.grad_out = grad_out.data_ptr();
  for (int i = 0; i < 3; ++i) p.grad_stride[i] = grad_out.stride(i);
  p.grad_weight_partial = weight_grad ? partial.data_ptr<float>() : nullptr;
  check_launch(kernels::launch_rms_norm_rope_backward(p, blocks, c10::cuda::getCurrentCUDAStream()), op);
  if (!weight_grad) return {grad_x, at::empty({0}, weight_in.options())};
  return {grad_x, summed_weight_grad(partial, weight_in, op)};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("rms_norm_rope", &rms_norm_rope_cuda);
  m.impl("rms_norm_rope_backward", &rms_norm_rope_backward_cuda);
}

}  // namespace hasten
