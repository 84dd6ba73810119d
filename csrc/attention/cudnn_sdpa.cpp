// cuDNN fused SDPA on packed sequences (see cudnn_sdpa.h). Host C++ only; built when the
// cudnn-frontend headers are found at install time (setup.py), linked against the libcudnn that
// torch already loads.
#include "cudnn_sdpa.h"

#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace hasten::cudnn_sdpa {
namespace {

namespace fe = cudnn_frontend;
using Graph = fe::graph::Graph;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum Uid : int64_t {
  kQ = 1, kK, kV, kOut, kLse, kGradOut, kGradQ, kGradK, kGradV,
  kSeqLenQ, kSeqLenKv, kOffsetsQ, kOffsetsKv, kOffsetsLse,
};

// (B, H, S, D) over token-major THD memory: a token's heads are adjacent. The batch stride is
// ignored for ragged tensors but must be a multiple of 16 bytes.
std::vector<int64_t> thd_strides(const Problem& p, int64_t heads) {
  return {p.max_seqlen * heads * p.head_dim, p.head_dim, heads * p.head_dim, 1};
}

TensorPtr data_tensor(Graph& g, Uid uid, const char* name, const Problem& p, int64_t heads) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid)
                      .set_dim({p.batch, heads, p.max_seqlen, p.head_dim}).set_stride(thd_strides(p, heads)));
}

TensorPtr index_tensor(Graph& g, Uid uid, const char* name, int64_t n) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1})
                      .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
}

void set_output(const TensorPtr& t, Uid uid, const Problem& p, int64_t heads, const TensorPtr& offsets) {
  t->set_output(true).set_uid(uid).set_dim({p.batch, heads, p.max_seqlen, p.head_dim})
      .set_stride(thd_strides(p, heads)).set_ragged_offset(offsets);
}

// lse (T, Hq) float32 as (B, Hq, S, 1)
void describe_lse(const TensorPtr& t, const Problem& p, const TensorPtr& offsets) {
  t->set_uid(kLse).set_data_type(fe::DataType_t::FLOAT).set_dim({p.batch, p.q_heads, p.max_seqlen, 1})
      .set_stride({p.max_seqlen * p.q_heads, 1, p.q_heads, 1}).set_ragged_offset(offsets);
}

std::shared_ptr<Graph> new_graph(const Problem& p) {
  auto g = std::make_shared<Graph>();
  g->set_io_data_type(p.bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// The causal band (with its left bound) and the padding, built as cuDNN builds them itself
// (score_modifiers::sliding_window_mask and padding_mask), for the softcapped graphs: cuDNN takes a
// score modifier only without its own masks, so the modifier applies them after the cap.
TensorPtr masked_scores(const std::shared_ptr<Graph>& g, TensorPtr scores, const Problem& p, const TensorPtr& seq_q,
                        const TensorPtr& seq_kv) {
  namespace mods = fe::graph::attn::score_modifiers;
  scores = mods::padding_mask(g, scores, seq_kv, seq_q);
  if (!p.causal) return scores;
  return mods::sliding_window_mask(g, scores, fe::DiagonalAlignment_t::TOP_LEFT,
                                   p.window > 0 ? std::optional<int64_t>(p.window) : std::nullopt,
                                   std::optional<int64_t>(0), 0, 0, nullptr, nullptr);
}

// Softcapping (Gemma 2): s -> c * tanh(s / c) on the scaled scores, before the mask (cuDNN applies
// attn_scale before the modifier, as transformers' eager attention does). Its backward multiplies
// dS by 1 - tanh^2 of the saved s / c; the forward modifier runs first in the backward graph too.
using Softcap = fe::graph::attn::score_modifiers::Softcap;

template <typename Attributes>
void set_mask(Attributes& a, const Problem& p, const TensorPtr& seq_q, const TensorPtr& seq_kv,
              const std::shared_ptr<Softcap>& softcap) {
  a.set_attn_scale(p.scale).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
  // workspaces sized by the real token count, not B x S
  a.set_max_total_seq_len_q(p.tokens).set_max_total_seq_len_kv(p.tokens);
  if (softcap) {
    const Problem problem = p;
    a.set_score_mod([softcap, problem, seq_q, seq_kv](std::shared_ptr<Graph> g, TensorPtr scores) {
      auto cap = std::make_shared<fe::graph::Tensor_attributes>(problem.softcap);
      return masked_scores(g, softcap->forward(g, scores, cap), problem, seq_q, seq_kv);
    });
    return;
  }
  a.set_padding_mask(true);
  if (p.causal) a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  // top-left aligned left bound W: key j is masked when j <= i - W (cudnn-frontend's reference in
  // test/python/test_mhas.py: tril(-left_bound)), transformers' sliding_window W exactly
  if (p.window > 0) a.set_diagonal_band_left_bound(p.window);
}

std::shared_ptr<Softcap> softcap_of(const Problem& p) {
  return p.softcap > 0.0f ? std::make_shared<Softcap>() : nullptr;
}

std::shared_ptr<Graph> forward_graph(const Problem& p) {
  auto g = new_graph(p);
  auto q = data_tensor(*g, kQ, "q", p, p.q_heads);
  auto k = data_tensor(*g, kK, "k", p, p.kv_heads);
  auto v = data_tensor(*g, kV, "v", p, p.kv_heads);
  auto offsets_q = index_tensor(*g, kOffsetsQ, "offsets_q", p.batch + 1);
  auto offsets_kv = index_tensor(*g, kOffsetsKv, "offsets_kv", p.batch + 1);
  auto offsets_lse = index_tensor(*g, kOffsetsLse, "offsets_lse", p.batch + 1);
  q->set_ragged_offset(offsets_q);
  k->set_ragged_offset(offsets_kv);
  v->set_ragged_offset(offsets_kv);
  auto options = fe::graph::SDPA_attributes().set_name("sdpa").set_generate_stats(true);
  set_mask(options, p, index_tensor(*g, kSeqLenQ, "seq_len_q", p.batch),
           index_tensor(*g, kSeqLenKv, "seq_len_kv", p.batch), softcap_of(p));
  auto [out, lse] = g->sdpa(q, k, v, options);
  set_output(out, kOut, p, p.q_heads, offsets_q);
  lse->set_output(true);
  describe_lse(lse, p, offsets_lse);
  return g;
}

std::shared_ptr<Graph> backward_graph(const Problem& p) {
  auto g = new_graph(p);
  auto q = data_tensor(*g, kQ, "q", p, p.q_heads);
  auto k = data_tensor(*g, kK, "k", p, p.kv_heads);
  auto v = data_tensor(*g, kV, "v", p, p.kv_heads);
  auto out = data_tensor(*g, kOut, "out", p, p.q_heads);
  auto grad_out = data_tensor(*g, kGradOut, "grad_out", p, p.q_heads);
  auto lse = g->tensor(fe::graph::Tensor_attributes().set_name("lse"));
  auto offsets_q = index_tensor(*g, kOffsetsQ, "offsets_q", p.batch + 1);
  auto offsets_kv = index_tensor(*g, kOffsetsKv, "offsets_kv", p.batch + 1);
  auto offsets_lse = index_tensor(*g, kOffsetsLse, "offsets_lse", p.batch + 1);
  describe_lse(lse, p, offsets_lse);
  for (auto* t : {&q, &out, &grad_out}) (*t)->set_ragged_offset(offsets_q);
  k->set_ragged_offset(offsets_kv);
  v->set_ragged_offset(offsets_kv);
  auto options = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward");
  const auto softcap = softcap_of(p);
  set_mask(options, p, index_tensor(*g, kSeqLenQ, "seq_len_q", p.batch),
           index_tensor(*g, kSeqLenKv, "seq_len_kv", p.batch), softcap);
  if (softcap) {
    const float cap_value = p.softcap;
    options.set_score_mod_bprop([softcap, cap_value](std::shared_ptr<Graph> g, TensorPtr grad_scores) {
      return softcap->backward(g, grad_scores, std::make_shared<fe::graph::Tensor_attributes>(cap_value));
    });
  }
  auto [grad_q, grad_k, grad_v] = g->sdpa_backward(q, k, v, out, grad_out, lse, options);
  set_output(grad_q, kGradQ, p, p.q_heads, offsets_q);
  set_output(grad_k, kGradK, p, p.kv_heads, offsets_kv);
  set_output(grad_v, kGradV, p, p.kv_heads, offsets_kv);
  return g;
}

std::string describe(const Problem& p) {
  return "B=" + std::to_string(p.batch) + " S=" + std::to_string(p.max_seqlen) + " T=" + std::to_string(p.tokens) +
         " Hq=" + std::to_string(p.q_heads) + " Hk=" + std::to_string(p.kv_heads) + " D=" +
         std::to_string(p.head_dim) + (p.bf16 ? " bf16" : " fp16") + (p.causal ? " causal" : "") +
         (p.window > 0 ? " window=" + std::to_string(p.window) : "") +
         (p.softcap > 0.0f ? " softcap=" + std::to_string(p.softcap) : "");
}

std::string cudnn_error(cudnnStatus_t status, const char* what) {
  return std::string(what) + " failed: " + cudnnGetErrorString(status);
}

struct ThreadState {
  std::unordered_map<int, cudnnHandle_t> handles;
  using Key =
      std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, bool, int64_t, float, bool, int>;
  std::map<Key, std::shared_ptr<Graph>> graphs;
  std::map<Key, std::string> refused;  // a bucket cuDNN cannot run stays refused, without rebuilding
};

ThreadState& state() {
  thread_local ThreadState s;
  return s;
}

struct Allocator {
  AllocateFn fn;
  void* context;
  void* operator()(int64_t bytes) const { return fn(context, bytes); }
};

std::string run(bool is_backward, const Problem& p, std::unordered_map<int64_t, void*>& pack,
                const Allocator& allocate, cudaStream_t stream) {
  auto& s = state();
  auto handle_it = s.handles.find(p.device);
  if (handle_it == s.handles.end()) {
    cudnnHandle_t handle = nullptr;
    if (auto status = cudnnCreate(&handle); status != CUDNN_STATUS_SUCCESS) return cudnn_error(status, "cudnnCreate");
    handle_it = s.handles.emplace(p.device, handle).first;
  }
  cudnnHandle_t handle = handle_it->second;
  if (auto status = cudnnSetStream(handle, stream); status != CUDNN_STATUS_SUCCESS) {
    return cudnn_error(status, "cudnnSetStream");
  }
  const ThreadState::Key key{is_backward, p.batch, p.max_seqlen, p.tokens, p.q_heads, p.kv_heads, p.head_dim,
                             p.scale, p.causal, p.window, p.softcap, p.bf16, p.device};
  if (auto refused = s.refused.find(key); refused != s.refused.end()) return refused->second;
  auto found = s.graphs.find(key);
  if (found == s.graphs.end()) {
    const char* what = is_backward ? "cuDNN SDPA backward" : "cuDNN SDPA forward";
    std::string error;
    std::shared_ptr<Graph> graph;
    try {
      graph = is_backward ? backward_graph(p) : forward_graph(p);
      fe::error_t status = graph->validate();
      if (status.is_good()) status = graph->build_operation_graph(handle);
      if (status.is_good()) status = graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
      if (status.is_good()) status = graph->check_support(handle);
      if (status.is_good()) status = graph->build_plans(handle, fe::BuildPlanPolicy_t::HEURISTICS_CHOICE);
      if (status.is_bad()) error = status.get_message();
    } catch (const std::exception& exc) {
      error = exc.what();
    }
    if (!error.empty()) {
      error = std::string(what) + " does not support " + describe(p) + ": " + error;
      s.refused.emplace(key, error);
      return error;
    }
    found = s.graphs.emplace(key, graph).first;
  }
  Graph& graph = *found->second;
  int64_t workspace_bytes = 0;
  if (fe::error_t status = graph.get_workspace_size(workspace_bytes); status.is_bad()) return status.get_message();
  void* workspace = workspace_bytes > 0 ? allocate(workspace_bytes) : nullptr;
  fe::error_t status = graph.execute(handle, pack, workspace);
  if (status.is_bad()) return std::string("cuDNN SDPA execute (") + describe(p) + "): " + status.get_message();
  return "";
}

void* mut(const void* p) { return const_cast<void*>(p); }

void add_index_tensors(std::unordered_map<int64_t, void*>& pack, const Pointers& ptr) {
  pack[kSeqLenQ] = mut(ptr.seq_len);
  pack[kSeqLenKv] = mut(ptr.seq_len);
  pack[kOffsetsQ] = mut(ptr.offsets_q);
  pack[kOffsetsKv] = mut(ptr.offsets_kv);
  pack[kOffsetsLse] = mut(ptr.offsets_lse);
}

}  // namespace
}  // namespace hasten::cudnn_sdpa

extern "C" const char* hasten_cudnn_sdpa_run(int is_backward, const hasten::cudnn_sdpa::Problem* problem,
                                             const hasten::cudnn_sdpa::Pointers* ptr,
                                             hasten::cudnn_sdpa::AllocateFn allocate, void* allocate_context,
                                             cudaStream_t stream) {
  using namespace hasten::cudnn_sdpa;
  thread_local std::string error;
  std::unordered_map<int64_t, void*> pack{{kQ, mut(ptr->q)}, {kK, mut(ptr->k)}, {kV, mut(ptr->v)},
                                          {kOut, ptr->out}, {kLse, ptr->lse}};
  if (is_backward) {
    pack[kGradOut] = mut(ptr->grad_out);
    pack[kGradQ] = ptr->grad_q;
    pack[kGradK] = ptr->grad_k;
    pack[kGradV] = ptr->grad_v;
  }
  add_index_tensors(pack, *ptr);
  error = run(is_backward != 0, *problem, pack, Allocator{allocate, allocate_context}, stream);
  return error.empty() ? nullptr : error.c_str();
}
