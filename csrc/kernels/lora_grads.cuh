// Torch-free, host-includable interface of the LoRA backward's one pass over the output gradient.
//
// A LoRA projection's backward reads its output gradient g (T, N) for two thin products:
//   gb     = scale * g B        (T, r)   B = lora_b (N, r): feeds d lora_a and d x
//   grad_b = scale * g^T xa     (N, r)   xa = x_lora lora_a^T, kept from the forward
// As two GEMMs each reads all of g (2 T N bytes in bf16; 1.4 GB a layer of the Llama-8B shape, at
// the memory's rate), so g is read twice. This kernel reads each tile of g once into shared memory
// and feeds both products from it on the tensor cores. Each block owns a stripe of 512 columns and
// a chunk of rows: its gb over the stripe and its grad_b over the chunk are partial sums, written in
// float32 to a workspace and added up by a second kernel in a fixed order (the result does not
// depend on scheduling, so a run repeats bit for bit).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

#include "element_type.h"
#include "gate_activation.h"

namespace hasten {
namespace kernels {

struct LoraGradsParams {
  const void* grad_y;     // g (T, N), row r at grad_y + r * grad_y_stride, unit column stride
  int64_t grad_y_stride;
  const void* lora_b;     // B (N, r) contiguous, g's type
  const void* xa;         // (T, r), row r at xa + r * xa_stride, unit column stride, g's type
  int64_t xa_stride;
  void* gb;               // out (T, r), row r at gb + r * gb_stride, g's type
  int64_t gb_stride;
  void* grad_b;           // out (N, r) contiguous, grad_b_type
  int64_t tokens, out_features, rank;  // T, N, r
  float scale;
  ElementType type;         // float16 or bfloat16
  ElementType grad_b_type;  // float32, or g's type
  int sm_count;             // the device's multiprocessors: the grid fills them once
  int sm_major;             // compute capability's major: tensor cores with bfloat16 from 8
  int config;               // 0: the plain kernel (the tuning probe's comparison), anything else the lean one
  float* workspace;         // lora_grads_workspace_floats(params) floats, float32
};

// Whether the kernel takes these shapes and strides (else the caller runs the two GEMMs): rank 16
// (at rank 32 it measured slower than the GEMMs), N and the row strides multiples of 8 elements, 16-byte aligned pointers, float16/bfloat16,
// compute capability 8.0 or newer.
bool lora_grads_supported(const LoraGradsParams& params);
// Floats of workspace the launch needs: the partial sums (stripes x T' x r and chunks x N' x r,
// T' and N' rounded up to whole tiles).
int64_t lora_grads_workspace_floats(const LoraGradsParams& params);
// gb and grad_b as above, in two launches on `stream`.
cudaError_t launch_lora_grads(const LoraGradsParams& params, cudaStream_t stream);

// --- a gated MLP's gate/up LoRA pair: its activation's backward and both members' thin products ---
// In an MLP down(f(gate) * up) whose gate and up are LoRA projections of one input, the backward
// reads gate, up and d_act to write d_gate and d_up (the activation's backward), and then each
// LoRA backward reads d_gate and d_up again for gb and grad_b. This kernel does both in one pass:
// d_gate and d_up are written (the base GEMMs' d x reads them) and, from the same tiles in shared
// memory, gb and grad_b of both members are formed, so the separate read of the two (T, N)
// gradients goes away. d_gate and d_up are rounded exactly as the activation's own kernel rounds
// them (gate_activation_math.cuh), and the products then read those rounded values, as the
// separate ops do.
struct LoraGatedGradsParams {
  const void* gate;       // (T, N) at in_stride, unit column stride (the forward's gate projection)
  const void* up;         // (T, N) at in_stride
  int64_t in_stride;
  const void* grad_act;   // (T, N) contiguous
  void* grad_gate;        // out (T, N) contiguous
  void* grad_up;          // out (T, N) contiguous
  const void* lora_b[2];  // member 0 = gate, 1 = up: B (N, r) contiguous, g's type, 32-byte aligned
  const void* xa[2];      // (T, r) each at xa_stride, unit column stride
  int64_t xa_stride;
  void* gb[2];            // out (T, r) each at gb_stride
  int64_t gb_stride;
  void* grad_b[2];        // out (N, r) contiguous, grad_b_type
  float scale[2];
  int64_t tokens, inner, rank;  // T, N, r (both members' rank)
  ElementType type;             // float16 or bfloat16
  ElementType grad_b_type;      // float32, or g's type
  GateActivation activation;
  int sm_count, sm_major;
  float* workspace;             // lora_gated_grads_workspace_floats(params) floats
};
// Rank 16, N a multiple of 16 elements and the row strides of 8, 16-byte aligned pointers (lora_b
// 32-byte: its fragments load straight from global memory), float16/bfloat16, compute capability 8.0
// or newer.
bool lora_gated_grads_supported(const LoraGatedGradsParams& params);
int64_t lora_gated_grads_workspace_floats(const LoraGatedGradsParams& params);
// d_gate, d_up, both members' gb and grad_b, in three launches on `stream`.
cudaError_t launch_lora_gated_grads(const LoraGatedGradsParams& params, cudaStream_t stream);

}  // namespace kernels
}  // namespace hasten
