// CUDA glue of hasten::varlen_attention and its backward: checks, the ragged-offset index tensors
// (a few tiny ATen ops once per batch, no host sync), and cuDNN's fused SDPA (cudnn_sdpa.cpp).
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <torch/types.h>

#include <dlfcn.h>
#include <glob.h>

#include <cstdlib>
#include <map>
#include <mutex>
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

// The token bucket T in sixteenths of a power of two above 2,048 (at most 1/8 above the count, up
// to 8 graphs an octave). cuDNN sizes the backward's workspace on T: a power-of-two bucket sized a
// 393,216-token step's for 524,288, 6 GiB more on Llama-8B's heads (5a4a550: the layer backward's
// transient 45.19 GiB at 393,216 against 13.05 at 131,072, 0.46 GiB a token-thousand over the line).
int64_t token_bucket(int64_t n) {
  const int64_t power = bucket(n, 128);
  if (power <= 2048) return power;
  const int64_t step = power / 16;
  return (n + step - 1) / step * step;
}

// The backward's float32 workspace: dQ, and dK and dV at the query heads' width, 12 bytes a token,
// a query head and a dim (49,280 bytes a token on Llama-8B's 32 x 128 measured at 1956431: the
// largest block of a long sequence's step). Above kBackwardPerHeadAboveBytes of it the backward
// runs once per K/V head with its query heads, each call's workspace 1/Hk of the whole (Llama-8B,
// 524,288 tokens: 3 GiB instead of 24), at the price of copying each head group's inputs and
// gradients (about 10 bytes a token, a query head and a dim, against the S^2 work of the call).
// HASTEN_ATTENTION_BACKWARD_PER_HEAD_ABOVE_BYTES overrides the bound (tests: 0 splits every call). It
// is read at each backward, not cached: tests move it between calls in one process, and one getenv
// costs nothing beside a call's S^2 work.
constexpr int64_t kBackwardPerHeadAboveBytes = int64_t{1} << 30;

int64_t backward_per_head_above_bytes() {
  const char* env = std::getenv("HASTEN_ATTENTION_BACKWARD_PER_HEAD_ABOVE_BYTES");
  if (env == nullptr || *env == '\0') return kBackwardPerHeadAboveBytes;
  char* end = nullptr;
  const long long value = std::strtoll(env, &end, 10);
  TORCH_CHECK(end != env && *end == '\0' && value >= 0,
              "HASTEN_ATTENTION_BACKWARD_PER_HEAD_ABOVE_BYTES must be a byte count (an integer >= 0), got '", env,
              "'");
  return value;
}

struct RaggedIndex {
  at::Tensor seq_len, offsets_q, offsets_kv, offsets_lse;  // (B), (B+1) x 3, int32
};

// The pointers forward and backward share; the backward adds grad_out and the three grads.
cudnn_sdpa::Pointers shared_pointers(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& out, const at::Tensor& lse, const RaggedIndex& index) {
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
  return ptr;
}

// cu_seqlens (N+1) padded to (B+1) by repeating its last entry: sequences N..B-1 have length 0.
RaggedIndex build_ragged_index(const at::Tensor& cu_seqlens, int64_t batch, int64_t q_heads, int64_t kv_heads,
                               int64_t head_dim) {
  const int64_t n = cu_seqlens.numel() - 1;
  auto cu = cu_seqlens.contiguous();
  if (batch > n) cu = at::cat({cu, cu.slice(0, n, n + 1).expand({batch - n})});
  return {(cu.slice(0, 1) - cu.slice(0, 0, batch)).contiguous(), cu * (q_heads * head_dim),
          cu * (kv_heads * head_dim), cu * q_heads};
}

// Every layer's forward and backward of one batch share one cu_seqlens tensor (packing metadata is
// built once per batch), so the index is built once per batch instead of twice per layer. The
// entry holds cu_seqlens itself: while it lives its memory cannot be reused by another batch's
// tensor, and the version counter catches in-place edits, so a hit is never stale. One entry per
// device, shared by the forward thread and autograd's backward thread; not used while a CUDA graph
// is being captured (the entry's tensors would belong to the graph's pool).
struct RaggedIndexEntry {
  at::Tensor cu_seqlens;
  uint32_t version = 0;
  c10::StreamId stream = 0;
  int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  RaggedIndex index;
};

RaggedIndex ragged_index(const at::Tensor& cu_seqlens, int64_t batch, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim) {
  if (cu_seqlens.is_inference() ||  // no version counter to check
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return build_ragged_index(cu_seqlens, batch, q_heads, kv_heads, head_dim);
  }
  static std::mutex mutex;
  // never destroyed: freeing CUDA tensors from a static destructor can run after the driver is gone
  static auto* entries = new std::map<c10::DeviceIndex, RaggedIndexEntry>();
  const auto stream = c10::cuda::getCurrentCUDAStream().id();
  const auto version = cu_seqlens._version();
  std::lock_guard<std::mutex> lock(mutex);
  auto& entry = (*entries)[cu_seqlens.get_device()];
  const bool hit = entry.cu_seqlens.defined() && entry.cu_seqlens.is_same(cu_seqlens) && entry.version == version &&
                   entry.stream == stream && entry.batch == batch && entry.q_heads == q_heads &&
                   entry.kv_heads == kv_heads && entry.head_dim == head_dim;
  if (!hit) {
    entry = {cu_seqlens, version, stream, batch, q_heads, kv_heads, head_dim,
             build_ragged_index(cu_seqlens, batch, q_heads, kv_heads, head_dim)};
  }
  return entry.index;
}

cudnn_sdpa::Problem problem_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_seqlens,
                               int64_t max_seqlen, double scale, bool causal, int64_t window, double softcap,
                               const char* op) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "hasten::", op,
              ": the CUDA path (cuDNN) takes bfloat16 or float16, got ", q.scalar_type());
  TORCH_CHECK(q.size(2) % 8 == 0 && q.size(2) <= 256, "hasten::", op,
              ": cuDNN needs head_dim a multiple of 8 and at most 256, got ", num(q.size(2)));
  check_fits_int32(q.numel(), op, "tokens x q_heads x head_dim");
  cudnn_sdpa::Problem p;
  p.batch = bucket(cu_seqlens.numel() - 1, 8);
  p.max_seqlen = bucket(max_seqlen, 64);
  p.tokens = token_bucket(q.size(0));
  p.q_heads = q.size(1);
  p.kv_heads = k.size(1);
  p.head_dim = q.size(2);
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  p.bf16 = q.scalar_type() == at::kBFloat16;
  p.device = q.get_device();
  return p;
}

// cuDNN reads 16-byte aligned pointers only.
at::Tensor aligned(const at::Tensor& t) {
  auto c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}

using RunFn = decltype(&hasten_cudnn_sdpa_run);

// hasten/_cudnn_sdpa*.so beside this library, opened once (see cudnn_sdpa.h for why it is separate).
RunFn cudnn_sdpa_run(const char* op) {
  static std::once_flag once;
  static RunFn run = nullptr;
  static std::string error;
  std::call_once(once, [] {
    Dl_info self{};
    if (dladdr(reinterpret_cast<void*>(&cudnn_sdpa_run), &self) == 0 || self.dli_fname == nullptr) {
      error = "could not locate hasten's own library";
      return;
    }
    std::string dir(self.dli_fname);
    dir = dir.substr(0, dir.rfind('/'));
    glob_t found{};
    const std::string pattern = dir + "/_cudnn_sdpa*.so";
    if (glob(pattern.c_str(), 0, nullptr, &found) != 0 || found.gl_pathc == 0) {
      globfree(&found);
      error = "no " + pattern + " (hasten was built without the cudnn-frontend headers)";
      return;
    }
    void* library = dlopen(found.gl_pathv[0], RTLD_NOW | RTLD_LOCAL);
    globfree(&found);
    if (library == nullptr) {
      error = std::string("dlopen failed: ") + dlerror();
      return;
    }
    run = reinterpret_cast<RunFn>(dlsym(library, "hasten_cudnn_sdpa_run"));
    if (run == nullptr) error = "the cuDNN attention library has no hasten_cudnn_sdpa_run";
  });
  TORCH_CHECK(run != nullptr, "hasten::", op, ": cuDNN attention is unavailable: ", error);
  return run;
}

// Workspace from torch's caching allocator; the tensor is released after the launch (stream-ordered).
void* allocate_workspace(void* context, int64_t bytes) {
  auto* workspace = static_cast<at::Tensor*>(context);
  *workspace = at::empty({bytes}, workspace->options());
  return workspace->data_ptr();
}

void run_graph(bool is_backward, const cudnn_sdpa::Problem& p, const cudnn_sdpa::Pointers& ptr,
               const at::Tensor& like, const char* op) {
  at::Tensor workspace = at::empty({0}, like.options().dtype(at::kByte));
  const char* error = cudnn_sdpa_run(op)(is_backward ? 1 : 0, &p, &ptr, &allocate_workspace, &workspace,
                                         c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(error == nullptr, "hasten::", op, ": ", error ? error : "");
}

// The backward's inputs and outputs, as one call (the whole problem or one K/V head's) sees them.
struct BackwardInputs {
  const at::Tensor &q, &k, &v, &out, &lse, &grad_out;
};
struct BackwardGrads {
  at::Tensor &grad_q, &grad_k, &grad_v;
};

void run_backward_graph(const cudnn_sdpa::Problem& p, const BackwardInputs& in, const BackwardGrads& grads,
                        const RaggedIndex& index, const char* op) {
  auto ptr = shared_pointers(in.q, in.k, in.v, in.out, in.lse, index);
  ptr.grad_out = in.grad_out.data_ptr();
  ptr.grad_q = grads.grad_q.data_ptr();
  ptr.grad_k = grads.grad_k.data_ptr();
  ptr.grad_v = grads.grad_v.data_ptr();
  run_graph(true, p, ptr, in.q, op);
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                         const at::Tensor& v_in, const at::Tensor& cu_seqlens,
                                                         int64_t max_seqlen, double scale, bool causal,
                                                         int64_t window, double softcap) {
  const char* op = "varlen_attention";
  check_device(q_in, op, "q", c10::DeviceType::CUDA);
  check_varlen_attention_args(op, q_in, k_in, v_in, cu_seqlens, max_seqlen);
  check_attention_window(op, causal, window);
  check_attention_softcap(op, softcap);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  auto out = at::empty_like(q);
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0 || cu_seqlens.numel() < 2) return {out, lse};
  const auto p = problem_of(q, k, cu_seqlens, max_seqlen, scale, causal, window, softcap, op);
  const auto index = ragged_index(cu_seqlens, p.batch, p.q_heads, p.kv_heads, p.head_dim);
  run_graph(false, p, shared_pointers(q, k, v, out, lse, index), q, op);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_backward_cuda(
    const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& cu_seqlens, int64_t max_seqlen,
    double scale, bool causal, int64_t window, double softcap) {
  const char* op = "varlen_attention_backward";
  check_device(q_in, op, "q", c10::DeviceType::CUDA);
  check_varlen_attention_backward_args(grad_out_in, q_in, k_in, v_in, out_in, lse_in, cu_seqlens, max_seqlen);
  check_attention_window(op, causal, window);
  check_attention_softcap(op, softcap);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const auto q = aligned(q_in), k = aligned(k_in), v = aligned(v_in), out = aligned(out_in),
             grad_out = aligned(grad_out_in), lse = aligned(lse_in);
  auto grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  if (q.size(0) == 0 || cu_seqlens.numel() < 2) return {grad_q.zero_(), grad_k.zero_(), grad_v.zero_()};
  const auto p = problem_of(q, k, cu_seqlens, max_seqlen, scale, causal, window, softcap, op);
  const int64_t workspace_bytes = p.tokens * p.q_heads * p.head_dim * 12;
  if (p.kv_heads == 1 || workspace_bytes <= backward_per_head_above_bytes()) {
    const auto index = ragged_index(cu_seqlens, p.batch, p.q_heads, p.kv_heads, p.head_dim);
    run_backward_graph(p, {q, k, v, out, lse, grad_out}, {grad_q, grad_k, grad_v}, index, op);
    return {grad_q, grad_k, grad_v};
  }
  // One call per K/V head h, on contiguous copies of its query heads [h * group, (h + 1) * group):
  // (T, group, D) q, out, grad_out, (T, group) lse, (T, 1, D) k and v. The copies keep the layout
  // the ragged offsets describe (packed rows); the caching allocator reuses them from one head to
  // the next.
  const int64_t group = p.q_heads / p.kv_heads;
  auto per_head = p;
  per_head.q_heads = group;
  per_head.kv_heads = 1;
  const auto index = ragged_index(cu_seqlens, per_head.batch, group, 1, per_head.head_dim);
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    const auto q_h = q.narrow(1, h * group, group).contiguous();
    const auto out_h = out.narrow(1, h * group, group).contiguous();
    const auto grad_out_h = grad_out.narrow(1, h * group, group).contiguous();
    const auto lse_h = lse.narrow(1, h * group, group).contiguous();
    const auto k_h = k.narrow(1, h, 1).contiguous(), v_h = v.narrow(1, h, 1).contiguous();
    auto grad_q_h = at::empty_like(q_h), grad_k_h = at::empty_like(k_h), grad_v_h = at::empty_like(v_h);
    run_backward_graph(per_head, {q_h, k_h, v_h, out_h, lse_h, grad_out_h}, {grad_q_h, grad_k_h, grad_v_h}, index,
                       op);
    grad_q.narrow(1, h * group, group).copy_(grad_q_h);
    grad_k.narrow(1, h, 1).copy_(grad_k_h);
    grad_v.narrow(1, h, 1).copy_(grad_v_h);
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace

TORCH_LIBRARY_IMPL(hasten, CUDA, m) {
  m.impl("varlen_attention", &varlen_attention_cuda);
  m.impl("varlen_attention_backward", &varlen_attention_backward_cuda);
}

}  // namespace hasten
