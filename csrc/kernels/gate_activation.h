// The activation of a gated MLP's gate, act = f(gate) * up, for host code (the CPU reference and
// the launches) and the CUDA kernels alike (no device code here):
//   kSilu      f(g) = g * sigmoid(g)                                  SwiGLU (Llama, Qwen, MoE experts)
//   kGeluTanh  f(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))  GeGLU-tanh (Gemma), exactly
//              torch.nn.functional.gelu(g, approximate="tanh")
#pragma once

namespace hasten {
namespace kernels {

enum class GateActivation { kSilu, kGeluTanh };

}  // namespace kernels
}  // namespace hasten
