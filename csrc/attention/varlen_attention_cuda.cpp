// CUDA glue of hasten::varlen_attention and its backward: checks, the ragged-offset index tensors
// (a few tiny ATen ops, no host sync), and cuDNN's fused SDPA (cudnn_sdpa.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <string>
#include <tuple>

#include "attention_checks.h"
#include "cudnn_sdpa.h"

namespace hasten {
namespace {

// Graphs are built per bucket: powers of two, so a run sees a handful of shapes.
int64_t bucket(int64_t n, int64_t minimum) {
  int64_t b = minimum;
  while (b < n) b *= 2;
  return b;
}

struct RaggedIndex {
  at::Tensor seq_len, offsets_q, offsets_kv, offsets_lse;  // (B), (B+1) x 3, int32
};

// cu_seqlens (N+1) padded to (B+1) by repeating its last entry: sequences N..B-1 have length 0.
RaggedIndex ragged_index(const at::Tensor& cu_seqlens, int64_t batch, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim) {
  const int64_t n = cu_seqlens.numel() - 1;
  auto cu = cu_seqlens.contiguous();
  if (batch > n) cu = at::cat({cu, cu.slice(0, n, n + 1).expand({batch - n})});
  return {(cu.slice(0, 1) - cu.slice(0, 0, batch)).contiguous(), cu * (q_heads * head_dim),
          cu * (kv_heads * head_dim), cu * q_heads};
}

cudnn_sdpa::Problem problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_seqlens,
                               int64_t max_seqlen, double scale, bool causal, const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "hasten::", op,
              ": the CUDA path (cuDNN) takes bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(q.size(2) % 8 == 0 && q.size(2) <= 256, "hasten::", op,
              ": cuDNN needs head_dim a multiple of 8 and at most 256, got ", num(q.size(2)));
  check_fits_int32(q.numel(), op, "tokens x q_heads x head_dim");
  cudnn_sdpa::Problem p;
  p.batch = bucket(cu_seqlens.numel() - 1, 8);
  p.max_seqlen = bucket(max_seqlen, 64);
  p.tokens = bucket(q.size(0), 128);
  p.q_heads = q.size(1);
  p.kv_heads = k.size(1);
  p.head_dim = q.size(2);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.bf16 = q.scalar_type() == at::kBFloat16;
  p.device = q.get_device();
  return p;
}

// cuDNN reads 16-byte aligned pointers only.
at::Tensor aligned(const at::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

void check_result(const std::string& error, const char* op) {
  TORCH_CHECK(error.empty(), "hasten::", op, ": ", error);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                         const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                         int64_t max_seqlen, double scale, bool causal) {
  const char* op = "varlen_attention";
  check_device(q_in, op, "q", c10::DeviceType::CUDA);
  check_varlen_attention_args(op, q_in, k_in, v_in, cu_seqlens, max_seqlen);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0 || cu_seqlens.numel() < 2) return {out, lse};
  const auto p = problem_of(q, k, cu_seqlens, max_seqlen, scale, causal, op);
  const auto index = ragged_index(cu_seqlens, p.batch, p.q_heads, p.kv_heads, p.head_dim);
  cudnn_sdpa::Pointers ptr;
  ptr.q = q.data_ptr();
  ptr.k = k.data_ptr();
  ptr.v = v.data_ptr();
  ptr.out = out.data_ptr();
  ptr.lse = lse.data_ptr<float>();
  ptr.seq_len = index.seq_len.data_ptr<int32_t>();
  ptr.offsets_q = index.offsets_q.data_ptr<int32_t>();
  ptr.offsets_kv = index.offsets_kv.data_ptr<int32_t>();
  ptr.offsets_lse = index.offsets_lse.data_ptr<int32_t>();
  at::Tensor workspace;  // from torch's caching allocator, released after the launch (stream-ordered)
  auto allocate = [&](int64_t bytes) {
    workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    return workspace.data_ptr();
  };
  check_result(cudnn_sdpa::forward(p, ptr, allocate, c10::cuda::getCurrentCUDAStream()), op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& cu_seqlens, int64_t max_seqlen,
    double scale, bool causal) {
  const char* op = "varlen_attention_backward";
  check_device(q_in, op, "q", c10::DeviceType::CUDA);
  check_varlen_attention_backward_args(grad_out_in, q_in, k_in, v_in, out_in, lse_in, cu_seqlens, max_seqlen);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = aligned(q_in), k = aligned(k_in), v = aligned(v_in), out = aligned(out_in),
             grad_out = aligned(grad_out_in), lse = aligned(lse_in);
  auto grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  if (q.size(0) == 0 || cu_seqlens.numel() < 2) return {grad_q.zero_(), grad_k.zero_(), grad_v.zero_()};
  const auto p = problem_of(q, k, cu_seqlens, max_seqlen, scale, causal, op);
  const auto index = ragged_index(cu_seqlens, p.batch, p.q_heads, p.kv_heads, p.head_dim);
  cudnn_sdpa::Pointers ptr;
  ptr.q = q.data_ptr();
  ptr.k = k.data_ptr();
  ptr.v = v.data_ptr();
  ptr.out = out.data_ptr();
  ptr.lse = lse.data_ptr<float>();
  ptr.grad_out = grad_out.data_ptr();
  ptr.grad_q = grad_q.data_ptr();
  ptr.grad_k = grad_k.data_ptr();
  ptr.grad_v = grad_v.data_ptr();
  ptr.seq_len = index.seq_len.data_ptr<int32_t>();
  ptr.offsets_q = index.offsets_q.data_ptr<int32_t>();
  ptr.offsets_kv = index.offsets_kv.data_ptr<int32_t>();
  ptr.offsets_lse = index.offsets_lse.data_ptr<int32_t>();
  at::Tensor workspace;
  auto allocate = [&](int64_t bytes) {
    workspace = at::empty({bytes}, q.options().dtype(at::kByte));
    return workspace.data_ptr();
  };
  check_result(cudnn_sdpa::backward(p, ptr, allocate, c10::cuda::getCurrentCUDAStream()), op);
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("varlen_attention", &varlen_attention_cuda);
  m.impl("varlen_attention_backward", &varlen_attention_backward_cuda);
}

}  // namespace hasten
