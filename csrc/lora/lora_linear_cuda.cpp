// CUDA backward of hasten::lora_linear and lora_linear_group: the device-generic backward
// (lora_backward.h) with gb = s g B and d B = s g^T xa from one kernel that reads each tile of g
// once (csrc/kernels/lora_grads.cuh) instead of two GEMMs that read all of g each. Shapes the
// kernel does not take (ranks other than 16, float32, unaligned rows) run the two GEMMs, as
// does every call while HASTEN_LORA_GRADS_KERNEL=0 is set (read at each call: the W4 benchmark's
// same-run comparison, and a way around the kernel should it ever be suspected).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "../kernels/lora_grads.cuh"
#include "hasten/cuda_glue.h"
#include "lora_backward.h"

namespace hasten {
namespace {

// The multiprocessor count and compute capability of each device, read once (the backward runs
// this per projection, 224 times a W4 step).
struct DeviceShape {
  int sm_count = 0, sm_major = 0;
};

const DeviceShape& device_shape(int device) {
  static const std::vector<DeviceShape> shapes = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
    std::vector<DeviceShape> all(static_cast<size_t>(count));
    for (int d = 0; d < count; ++d) {
      cudaDeviceGetAttribute(&all[d].sm_count, cudaDevAttrMultiProcessorCount, d);
      cudaDeviceGetAttribute(&all[d].sm_major, cudaDevAttrComputeCapabilityMajor, d);
    }
    return all;
  }();
  static const DeviceShape unknown;  // sm_major 0: the kernel is not taken
  return device >= 0 && device < static_cast<int>(shapes.size()) ? shapes[device] : unknown;
}

bool kernel_switched_off() {
  const char* env = std::getenv("HASTEN_LORA_GRADS_KERNEL");
  return env != nullptr && std::strcmp(env, "0") == 0;
}

// HASTEN_LORA_GRADS_CONFIG=4 picks the lean kernel (scripts/lora_grads_probe.py's tuning)
int tile_config() {
  const char* env = std::getenv("HASTEN_LORA_GRADS_CONFIG");
  return env != nullptr ? std::atoi(env) : 0;
}

at::Tensor thin_grads_one_pass(const at::Tensor& g, const at::Tensor& b_in, const at::Tensor& xa, double scale,
                               at::ScalarType grad_b_dtype, at::Tensor& gb_out) {
  const c10::cuda::CUDAGuard guard(g.device());
  const auto b = b_in.contiguous();
  const auto type = g.scalar_type();
  const bool kernel_types = (type == at::kHalf || type == at::kBFloat16) && xa.scalar_type() == type &&
                            b.scalar_type() == type && gb_out.scalar_type() == type &&
                            (grad_b_dtype == at::kFloat || grad_b_dtype == type);
  const bool unit_columns = g.stride(1) == 1 && xa.stride(1) == 1 && gb_out.stride(1) == 1;
  if (!kernel_types || !unit_columns || kernel_switched_off()) {
    return lora::thin_grads_gemms(g, b, xa, scale, grad_b_dtype, gb_out);
  }
  const char* op = "lora_linear_backward";
  const DeviceShape& device = device_shape(g.get_device());
  kernels::LoraGradsParams p{};
  p.grad_y = g.data_ptr();
  p.grad_y_stride = g.stride(0);
  p.lora_b = b.data_ptr();
  p.xa = xa.data_ptr();
  p.xa_stride = xa.stride(0);
  p.gb = gb_out.data_ptr();
  p.gb_stride = gb_out.stride(0);
  p.tokens = g.size(0);
  p.out_features = g.size(1);
  p.rank = b.size(1);
  p.scale = static_cast<float>(scale);
  p.type = element_type(g, op);
  p.grad_b_type = grad_b_dtype == at::kFloat ? kernels::ElementType::kFloat32 : p.type;
  p.sm_count = device.sm_count;
  p.sm_major = device.sm_major;
  p.config = tile_config();
  if (!kernels::lora_grads_supported(p)) return lora::thin_grads_gemms(g, b, xa, scale, grad_b_dtype, gb_out);
  auto workspace = at::empty({kernels::lora_grads_workspace_floats(p)}, g.options().dtype(at::kFloat));
  auto grad_b = at::empty({p.out_features, p.rank}, g.options().dtype(grad_b_dtype));
  p.workspace = workspace.data_ptr<float>();
  p.grad_b = grad_b.data_ptr();
  check_launch(kernels::launch_lora_grads(p, c10::cuda::getCurrentCUDAStream()), op);
  return grad_b;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward_cuda(
    const at::Tensor& grad_y, const at::Tensor& x_lora, const at::Tensor& weight, const at::Tensor& lora_a,
    const at::Tensor& lora_b, const at::Tensor& xa, double scale, bool shared_input) {
  return lora::linear_backward(&thin_grads_one_pass, grad_y, x_lora, weight, lora_a, lora_b, xa, scale,
                               shared_input);
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> lora_linear_group_backward_cuda(
    at::TensorList grad_ys, const at::Tensor& x, at::TensorList weights, at::TensorList lora_a,
    at::TensorList lora_b, const at::Tensor& xa, at::ArrayRef<double> scales) {
  return lora::group_backward(&thin_grads_one_pass, grad_ys, x, weights, lora_a, lora_b, xa, scales);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("lora_linear_backward", &lora_linear_backward_cuda);
  m.impl("lora_linear_group_backward", &lora_linear_group_backward_cuda);
}

}  // namespace hasten
