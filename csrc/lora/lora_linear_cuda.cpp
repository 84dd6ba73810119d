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

// The lean kernel by default (W4 +0.2-0.5% over the plain one in one call, d5b1af1);
// HASTEN_LORA_GRADS_CONFIG=0 picks the plain kernel (scripts/lora_grads_probe.py compares them)
int tile_config() {
  const char* env = std::getenv("HASTEN_LORA_GRADS_CONFIG");
  return env != nullptr ? std::atoi(env) : 4;
}

// HASTEN_LORA_GATED_KERNEL=0: a gated MLP's backward runs the activation's kernel and then the
// group's thin products (W4's same-run comparison), read at each call
bool gated_kernel_switched_off() {
  const char* env = std::getenv("HASTEN_LORA_GATED_KERNEL");
  return env != nullptr && std::strcmp(env, "0") == 0;
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
    const at::Tensor& lora_b, const at::Tensor& xa, double scale, bool shared_input,
    const std::optional<at::Tensor>& adapters) {
  return lora::linear_backward(&thin_grads_one_pass, grad_y, x_lora, weight, lora_a, lora_b, xa, scale,
                               shared_input, adapters);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_linear_group_backward_cuda(
    at::TensorList grad_ys, const at::Tensor& x, at::TensorList weights, at::TensorList lora_a,
    at::TensorList lora_b, const at::Tensor& xa, at::ArrayRef<double> scales, bool grad_input,
    const std::optional<at::Tensor>& adapters) {
  return lora::group_backward(&thin_grads_one_pass, grad_ys, x, weights, lora_a, lora_b, xa, scales, grad_input,
                              adapters);
}

// The gated MLP's one pass (lora_grads.cuh, LoraGatedGradsParams): d_gate, d_up and both members'
// gb and grad_b. False (the caller runs the activation's kernel and the thin products) for what it
// does not take: ranks other than 16, float32, rows not 16-byte aligned, gate and up at different
// row strides, HASTEN_LORA_GATED_KERNEL=0.
bool gated_grads_one_pass(const at::Tensor& grad_act, const at::Tensor& gate, const at::Tensor& up,
                          c10::string_view activation, const at::Tensor& xa, at::TensorList lora_b,
                          at::ArrayRef<double> scales, at::ScalarType grad_b_dtype, std::vector<at::Tensor>& gs,
                          at::Tensor& gb, std::vector<at::Tensor>& grad_b) {
  if (gated_kernel_switched_off() || !grad_act.is_cuda()) return false;
  const auto type = gate.scalar_type();
  if (!(type == at::kHalf || type == at::kBFloat16) || (grad_b_dtype != at::kFloat && grad_b_dtype != type)) {
    return false;
  }
  const auto g2 = lora::rows(gate), u2 = lora::rows(up);
  if (g2.stride(1) != 1 || u2.stride(1) != 1 || g2.stride(0) != u2.stride(0) || xa.stride(1) != 1) return false;
  const c10::cuda::CUDAGuard guard(gate.device());
  const auto d2 = lora::rows(grad_act).contiguous();
  const auto b0 = lora_b[0].contiguous(), b1 = lora_b[1].contiguous();
  const char* op = "lora_gated_group_backward";
  const DeviceShape& device = device_shape(gate.get_device());
  const int64_t rank = b0.size(1);
  kernels::LoraGatedGradsParams p{};
  p.gate = g2.data_ptr();
  p.up = u2.data_ptr();
  p.in_stride = g2.stride(0);
  p.grad_act = d2.data_ptr();
  p.lora_b[0] = b0.data_ptr();
  p.lora_b[1] = b1.data_ptr();
  p.xa[0] = xa.data_ptr();
  p.xa[1] = static_cast<const char*>(xa.data_ptr()) + rank * xa.element_size();
  p.xa_stride = xa.stride(0);
  p.gb[0] = gb.data_ptr();
  p.gb[1] = static_cast<char*>(gb.data_ptr()) + rank * gb.element_size();
  p.gb_stride = gb.stride(0);
  p.scale[0] = static_cast<float>(scales[0]);
  p.scale[1] = static_cast<float>(scales[1]);
  p.tokens = g2.size(0);
  p.inner = g2.size(1);
  p.rank = b1.size(1) == rank && xa.size(1) == 2 * rank ? rank : -1;  // both members at one rank
  p.type = element_type(gate, op);
  p.grad_b_type = grad_b_dtype == at::kFloat ? kernels::ElementType::kFloat32 : p.type;
  p.activation = activation == "silu" ? kernels::GateActivation::kSilu : kernels::GateActivation::kGeluTanh;
  p.sm_count = device.sm_count;
  p.sm_major = device.sm_major;
  // asked before the (T, N) outputs exist (null pointers pass the alignment test; fresh ones are
  // aligned): a call the kernel does not take allocates nothing here
  if (!kernels::lora_gated_grads_supported(p)) return false;
  auto grad_gate = at::empty({p.tokens, p.inner}, gate.options());
  auto grad_up = at::empty({p.tokens, p.inner}, gate.options());
  p.grad_gate = grad_gate.data_ptr();
  p.grad_up = grad_up.data_ptr();
  auto workspace = at::empty({kernels::lora_gated_grads_workspace_floats(p)}, gate.options().dtype(at::kFloat));
  grad_b = {at::empty({p.inner, rank}, gate.options().dtype(grad_b_dtype)),
            at::empty({p.inner, rank}, gate.options().dtype(grad_b_dtype))};
  p.grad_b[0] = grad_b[0].data_ptr();
  p.grad_b[1] = grad_b[1].data_ptr();
  p.workspace = workspace.data_ptr<float>();
  check_launch(kernels::launch_lora_gated_grads(p, c10::cuda::getCurrentCUDAStream()), op);
  gs = {grad_gate, grad_up};
  return true;
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> lora_gated_group_backward_cuda(
    const at::Tensor& grad_act, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& x,
    at::TensorList weights, at::TensorList lora_a, at::TensorList lora_b, const at::Tensor& xa,
    at::ArrayRef<double> scales, c10::string_view activation, bool grad_input) {
  return lora::gated_group_backward(&gated_grads_one_pass, &thin_grads_one_pass, grad_act, gate, up, x, weights,
                                    lora_a, lora_b, xa, scales, activation, grad_input);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("lora_linear_backward", &lora_linear_backward_cuda);
  m.impl("lora_linear_group_backward", &lora_linear_group_backward_cuda);
  m.impl("lora_gated_group_backward", &lora_gated_group_backward_cuda);
}

}  // namespace hasten
