// CUDA glue of the experts' grouped GEMMs: per GEMM, hasten's CUTLASS sm90 kernels
// (csrc/kernels/grouped_gemm_sm90/) where a tile of theirs measured faster on the H200, torch's
// own grouped GEMM (at::_grouped_mm: 128x256x64 cooperative) elsewhere and on other GPUs. No
// host sync on either path: the groups' sizes stay on the device.
//
// HASTEN_GROUPED_GEMM (read per call, so one process can A/B it): auto (the rule below), torch,
// cutlass_64x256 or cutlass_128x128 (that tile wherever CUTLASS can run, torch elsewhere).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "../kernels/grouped_gemm.h"
#include "hasten/cuda_glue.h"
#include "moe_checks.h"

namespace hasten {
namespace {

using kernels::GroupedGemmKind;
using kernels::GroupedGemmTile;

enum class Request { kAuto, kTorch, kTile64x256, kTile128x128 };

Request requested() {
  const char* value = std::getenv("HASTEN_GROUPED_GEMM");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "auto") == 0) return Request::kAuto;
  if (std::strcmp(value, "torch") == 0) return Request::kTorch;
  if (std::strcmp(value, "cutlass_64x256") == 0) return Request::kTile64x256;
  if (std::strcmp(value, "cutlass_128x128") == 0) return Request::kTile128x128;
  TORCH_CHECK(false, "hasten::moe_grouped_mm: HASTEN_GROUPED_GEMM must be auto, torch, cutlass_64x256 or "
              "cutlass_128x128, got '", value, "'");
}

#ifdef HASTEN_WITH_CUTLASS
// The tile for one GEMM (nullopt: torch's kernel), fitted to the H200's probe of W3's 18 expert
// GEMMs (docs/benchmarks.md, 923db79): weight gradients 128x128 ping-pong (all six blocks' won,
// 1.06-1.41x); short reductions 64x256 ping-pong (Qwen3's down forward, K 768: 1.24x; DeepSeek's,
// K 1408: 1.18x); mid-size GEMMs with many rows per expert 128x128 ping-pong (gpt-oss's and
// DeepSeek's down, 1.06-1.14x); torch's kernel kept where it won (Qwen3's gate_up forward and
// input gradients, gpt-oss's gate_up forward and input gradient: N or K of 5,760).
std::optional<GroupedGemmTile> rule(int64_t rows, int64_t experts, int64_t n, int64_t k) {
  if (k <= 1408) return GroupedGemmTile::k64x256PingPong;
  if (k <= 2880 && n <= 2880 && rows >= 1536 * experts) return GroupedGemmTile::k128x128PingPong;
  return std::nullopt;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Contiguous and 16-byte aligned (TMA), copying only a tensor that is neither.
at::Tensor dense(const at::Tensor& t) {
  auto c = t.contiguous();
  return aligned16(c) ? c : c.clone();
}

struct DeviceInfo {
  int sm_count = 0;
  bool sm90 = false;
};

// Read once per device (an attribute query per call costs host time on every GEMM).
const DeviceInfo& device_info(int device) {
  static std::array<DeviceInfo, 64> infos{};
  static std::array<bool, 64> known{};
  TORCH_CHECK(device >= 0 && device < 64, "hasten::moe_grouped_mm: device index ", num(device), " out of range");
  if (!known[device]) {
    int major = 0, minor = 0, sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    infos[device] = DeviceInfo{sms, major == 9 && minor == 0};
    known[device] = true;
  }
  return infos[device];
}

// Whether hasten's CUTLASS kernels can run these operands: an sm90 GPU (the kernels are sm_90a
// code), bfloat16, every row a multiple of 16 bytes (TMA).
bool cutlass_can_run(const at::Tensor& first, std::initializer_list<int64_t> widths) {
  if (!device_info(first.get_device()).sm90 || first.scalar_type() != at::kBFloat16) return false;
  for (int64_t w : widths) {
    if (w % 8 != 0) return false;
  }
  return true;
}

// A forward or input-gradient GEMM's tile (nullopt: torch's kernel); the weight gradient has one
// instance (128x128), taken unless torch's kernel is asked for.
std::optional<GroupedGemmTile> chosen_tile(Request request, int64_t rows, int64_t experts, int64_t n, int64_t k) {
  switch (request) {
    case Request::kTorch: return std::nullopt;
    case Request::kTile64x256: return GroupedGemmTile::k64x256PingPong;
    case Request::kTile128x128: return GroupedGemmTile::k128x128PingPong;
    case Request::kAuto: break;
  }
  return rule(rows, experts, n, k);
}

// out = the kind's product on the current stream; false when CUTLASS declined (a size it cannot take).
bool run_cutlass(GroupedGemmKind kind, GroupedGemmTile tile, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& group_ends, const at::Tensor& out, int64_t m, int64_t n, int64_t k) {
  kernels::GroupedGemmParams p{};
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.out = out.data_ptr();
  p.group_ends = group_ends.data_ptr<int32_t>();
  p.groups = static_cast<int>(group_ends.numel());
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  p.sm_count = device_info(a.get_device()).sm_count;
  p.stream = c10::cuda::getCurrentCUDAStream();
  const size_t bytes = kernels::grouped_gemm_workspace_bytes(kind, tile, p);
  if (bytes == 0) return false;
  auto workspace = at::empty({static_cast<int64_t>(bytes)}, a.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  const cudaError_t err = kernels::run_grouped_gemm(kind, tile, p);
  if (err == cudaErrorNotSupported) {  // nothing was launched: CUTLASS cannot take these sizes
    TORCH_WARN_ONCE("hasten::moe_grouped_mm: hasten's CUTLASS grouped GEMM declined a GEMM (m ", num(m), ", n ",
                    num(n), ", k ", num(k), ", ", num(p.groups), " experts); it and any like it run on torch's "
                    "grouped GEMM (correct, its speed)");
    return false;
  }
  check_launch(err, "moe_grouped_mm");
  return true;
}
#endif

at::Tensor moe_grouped_mm_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& group_ends,
                               bool transposed) {
  check_device(x, "moe_grouped_mm", "x", c10::DeviceType::CUDA);
  check_grouped_mm_args(x, weight, group_ends, transposed);
  const Request request = requested();  // a bad HASTEN_GROUPED_GEMM is an error on every build
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(transposed ? 2 : 1);
  if (rows == 0 || out_features == 0 || in == 0) return at::zeros({rows, out_features}, x.options());
#ifdef HASTEN_WITH_CUTLASS
  // transposed weight (E, in, out) is the input-gradient layout: b (E, K, N)
  const auto kind = transposed ? GroupedGemmKind::kInputGrad : GroupedGemmKind::kForward;
  const auto tile = chosen_tile(request, rows, weight.size(0), out_features, in);
  if (tile && cutlass_can_run(x, {in, out_features})) {
    const auto a = dense(x), b = dense(weight), ends = group_ends.contiguous();
    auto out = at::empty({rows, out_features}, x.options());
    if (run_cutlass(kind, *tile, a, b, ends, out, 0, out_features, in)) return out;
  }
#else
  (void)request;
#endif
  return at::_grouped_mm(x, transposed ? weight : weight.transpose(-2, -1), group_ends);
}

at::Tensor moe_grouped_mm_weight_grad_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_ends) {
  check_device(a, "moe_grouped_mm_weight_grad", "a", c10::DeviceType::CUDA);
  check_grouped_mm_weight_grad_args(a, b, group_ends);
  const Request request = requested();  // a bad HASTEN_GROUPED_GEMM is an error on every build
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t rows = a.size(0), m = a.size(1), n = b.size(1), experts = group_ends.numel();
  if (rows == 0 || m == 0 || n == 0) return at::zeros({experts, m, n}, a.options());
#ifdef HASTEN_WITH_CUTLASS
  if (request != Request::kTorch && cutlass_can_run(a, {m, n})) {
    const auto ac = dense(a), bc = dense(b), ends = group_ends.contiguous();
    auto out = at::empty({experts, m, n}, a.options());
    if (run_cutlass(GroupedGemmKind::kWeightGrad, GroupedGemmTile::k128x128PingPong, ac, bc, ends, out, m, n, 0)) {
      return out;
    }
  }
#else
  (void)request;
#endif
  return at::_grouped_mm(a.t(), b, group_ends);
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("moe_grouped_mm", &moe_grouped_mm_cuda);
  m.impl("moe_grouped_mm_weight_grad", &moe_grouped_mm_weight_grad_cuda);
}

}  // namespace hasten
