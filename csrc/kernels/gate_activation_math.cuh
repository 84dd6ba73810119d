// Device math of the gated-MLP activations (gate_activation.h): f(g) and f'(g) in float, one
// definition for every kernel that computes them (the SwiGLU / GeGLU kernels and the LoRA
// backward that fuses the gated MLP's backward, lora_grads.cuh), so their roundings agree.
#pragma once

#include "dtype_utils.cuh"
#include "gate_activation.h"

namespace hasten {
namespace kernels {

// f(g) and f'(g) of the gate activation; the forward kernels use only f, the compiler drops f'.
struct GateValue {
  float value, slope;
};

template <GateActivation A>
__device__ __forceinline__ GateValue gate_activation(float g);

template <>
__device__ __forceinline__ GateValue gate_activation<GateActivation::kSilu>(float g) {
  const float sg = 1.0f / (1.0f + __expf(-g));
  return {g * sg, sg * (1.0f + g * (1.0f - sg))};
}

// torch's tanh-approximate GELU and its derivative (aten GeluBackward, approximate="tanh"):
// t = tanh(k (g + c g^3)), f = 0.5 g (1 + t), f' = 0.5 (1 + t) + 0.5 g (1 - t^2) k (1 + 3 c g^2).
// tanhf, not a fast approximation: the result must match torch to float rounding.
template <>
__device__ __forceinline__ GateValue gate_activation<GateActivation::kGeluTanh>(float g) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  const float g2 = g * g;
  const float t = tanhf(kSqrt2OverPi * (g + kCubic * g2 * g));
  const float half_g = 0.5f * g, one_plus_t = 1.0f + t;
  return {half_g * one_plus_t,
          0.5f * one_plus_t + half_g * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kCubic * g2)};
}

// The gated MLP's backward at one element, rounded to T as both kernels round it:
// d_gate = d_act * up * f'(gate), d_up = d_act * f(gate).
template <GateActivation A, typename T>
__device__ __forceinline__ void gated_backward_element(T& gate_to_grad, T& up_to_grad, T grad_act) {
  const float uf = to_float(up_to_grad), df = to_float(grad_act);
  const GateValue f = gate_activation<A>(to_float(gate_to_grad));
  gate_to_grad = from_float<T>(df * uf * f.slope);
  up_to_grad = from_float<T>(df * f.value);
}

}  // namespace kernels
}  // namespace hasten
