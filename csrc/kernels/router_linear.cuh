// Torch-free, host-includable interface of the float32 router linear (hasten::router_linear):
// logits (T, E) float32 = x (T, H) @ weight (E, H)^T with every product and sum in float32, as the
// models' `F.linear(hidden.type(torch.float32), weight.type(torch.float32))` computes it (DeepSeek,
// GLM-4.5, ERNIE-4.5 and others), but reading x and the weight in their own types: no float32 copy
// of x (T, H) is made, kept for the backward or cast back.
//
// Each GEMM runs on the CUDA cores (FFMA: float32 products, float32 sums; no tensor-core TF32 or
// split formats): the same arithmetic as cuBLAS's float32 GEMM, in another order of the sums.
// The weight gradient sums over the tokens in a fixed split (router_linear_splits, from the shapes
// only) and adds the splits' partials in order: deterministic, on any GPU.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"

namespace hasten {
namespace kernels {

struct RouterLinearParams {
  const void* x;       // (T, H) contiguous
  ElementType x_type;
  const void* weight;  // (E, H) contiguous
  ElementType weight_type;
  float* logits;       // (T, E)
  int64_t tokens, hidden, experts;
};
// logits = x @ weight^T in float32
cudaError_t launch_router_linear(const RouterLinearParams& params, cudaStream_t stream);

struct RouterLinearBackwardParams {
  const float* grad_logits;  // (T, E) contiguous
  const void* x;             // (T, H) contiguous
  ElementType x_type;
  const void* weight;        // (E, H) contiguous
  ElementType weight_type;
  void* grad_x;              // (T, H) in x_type, or nullptr: grad_logits @ weight, rounded once
  void* grad_weight;         // (E, H) in weight_type, or nullptr: grad_logits^T @ x, rounded once
  float* workspace;          // router_linear_workspace_floats(T, H, E) floats where grad_weight is asked
  int64_t tokens, hidden, experts;
};
cudaError_t launch_router_linear_backward(const RouterLinearBackwardParams& params, cudaStream_t stream);

// How many parts the weight gradient's sum over the tokens is split into (a function of the shapes).
int64_t router_linear_splits(int64_t tokens, int64_t hidden, int64_t experts);
// Floats of scratch the weight gradient needs: one (E, H) partial per split.
int64_t router_linear_workspace_floats(int64_t tokens, int64_t hidden, int64_t experts);

}  // namespace kernels
}  // namespace hasten
