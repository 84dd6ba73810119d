// Torch-free, host-includable interface of the gated-MLP kernels: act = f(gate) * up over rows
// whose gate and up halves sit at a common row stride, f = silu (SwiGLU) or tanh GELU (GeGLU,
// gate_activation.h). Two layouts use it:
//   MoE experts  one (R, 2I) tensor [gate | up]: gate = base, up = base + I, stride 2I
//   dense MLPs   two (R, I) tensors from gate_proj and up_proj: stride I
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"
#include "gate_activation.h"

namespace hasten {
namespace kernels {

struct SwigluParams {
  const void* gate;      // row r, column c at gate[r * in_stride + c]
  const void* up;        // row r, column c at up[r * in_stride + c]
  int64_t in_stride;
  const void* grad_act;  // (R, I) contiguous, backward only (else nullptr)
  void* out;             // forward: act (R, I) contiguous; backward: grad_gate at out_stride
  void* out_up;          // backward: grad_up at out_stride (forward: unused)
  int64_t out_stride;
  int64_t rows, inner;   // R, I
  ElementType type;
  GateActivation activation;  // f
};
// act = f(gate) * up
cudaError_t launch_swiglu_forward(const SwigluParams& params, cudaStream_t stream);
// d_gate = d_act * up * f'(gate), d_up = d_act * f(gate)
cudaError_t launch_swiglu_backward(const SwigluParams& params, cudaStream_t stream);

// gpt-oss's experts: one (R, 2I) tensor with gate and up interleaved (gate = column 2c, up =
// column 2c + 1), clamped, the up half shifted by one:
//   g = min(gate, limit), u = clamp(up, -limit, limit), act = (u + 1) * (g * sigmoid(alpha * g))
// backward (torch's clamp passes the gradient where the bound holds, equality included):
//   d_up   = d_act * g * sigmoid(alpha g)                                 where -limit <= up <= limit
//   d_gate = d_act * (u + 1) * (s + alpha g s (1 - s)), s = sigmoid(alpha g)  where gate <= limit
struct ClampedSwigluParams {
  const void* gate_up;   // (R, 2I) contiguous, interleaved
  const void* grad_act;  // (R, I) contiguous, backward only (else nullptr)
  void* out;             // forward: act (R, I); backward: d_gate_up (R, 2I), interleaved as gate_up
  int64_t rows, inner;   // R, I
  float alpha, limit;
  ElementType type;
  // Optional (gpt-oss's expert biases): each row's expert bias added to gate_up, rounded to the
  // element type as the model's y + bias is, before the gate (forward and backward alike). bias
  // (E, 2I) contiguous; row r's expert is the number of group_ends (E, int32: the inclusive ends
  // of the expert-sorted rows) <= r, at most E - 1 (rows past the valid slots: never combined).
  const void* bias = nullptr;
  const int32_t* group_ends = nullptr;
  int64_t experts = 0;
};
cudaError_t launch_clamped_swiglu_forward(const ClampedSwigluParams& params, cudaStream_t stream);
cudaError_t launch_clamped_swiglu_backward(const ClampedSwigluParams& params, cudaStream_t stream);

// The MoE experts' SwiGLU with the router's weights folded in (hasten::moe_weighted_swiglu): rows
// of [gate | up] (R, 2I) in expert order, row p scaled by the weight of its slot s = permutation[p],
//   act[p] = w[s] * (silu(gate[p]) * up[p])
// so that the down projection's rows come out weighted and the combine is a plain sum (its backward
// then needs no y: the weights' gradient is formed here, from values this pass reads anyway):
//   d_w[s]    = sum_c silu(gate[p, c]) * up[p, c] * d_act[p, c]      (float, one fixed order)
//   d_gate[p] = w[s] d_act[p] * up[p] * silu'(gate[p]),  d_up[p] = w[s] d_act[p] * silu(gate[p])
// Rows at p >= valid_rows[0] (dropped slots: their gate_up rows are undefined) are written as
// zeros, and so is their d_w.
struct MoeWeightedSwigluParams {
  const void* gate_up;         // (R, 2I) contiguous, [gate | up]
  const void* weights;         // (R,) the router's weights slot-major ((T, k) flat), gate_up's type
  const int32_t* permutation;  // (R,) sorted row -> slot
  const int32_t* valid_rows;   // one int32 on the device: offsets[E], the rows of valid slots
  const void* grad_act;        // (R, I) contiguous, backward only (else nullptr)
  void* out;                   // forward: act (R, I); backward: d_gate_up (R, 2I)
  void* grad_weights;          // backward: (R,) slot-major, the weights' type (forward: unused)
  int64_t rows, inner;         // R, I
  ElementType type;
};
cudaError_t launch_moe_weighted_swiglu_forward(const MoeWeightedSwigluParams& params, cudaStream_t stream);
cudaError_t launch_moe_weighted_swiglu_backward(const MoeWeightedSwigluParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
