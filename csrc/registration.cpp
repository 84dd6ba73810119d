// Every hasten op schema, declared once. Implementations register per backend in
// their own files (<family>/<op>_cpu.cpp, <family>/<op>_cuda.cpp).
#include <Python.h>
#include <torch/library.h>

#include "offload/host_pool.h"
#include "offload/offload_engine.h"

extern "C" {
// `import hasten._C` loads this shared object, which runs the static TORCH_LIBRARY
// initialisers below; the Python module itself has no functions, one constant:
// WITH_CUTLASS, 1 where the experts' CUTLASS grouped GEMM kernels were built (doctor reports it).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
#ifdef HASTEN_WITH_CUTLASS
  const long with_cutlass = 1;
#else
  const long with_cutlass = 0;
#endif
  if (module != nullptr && PyModule_AddIntConstant(module, "WITH_CUTLASS", with_cutlass) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(hasten, m) {
  // Packing metadata from position_ids of shape (..., L), flattened to T tokens.
  // A sequence starts at the first token of every row and wherever
  // position_ids[i] != position_ids[i-1] + 1.
  //   cu_seqlens (int32, T+1): cu_seqlens[0..N] are the N+1 boundaries; the tail
  //     cu_seqlens[N+1..T] repeats T so the shape depends on T only (no host sync).
  //   seq_idx    (int32, T):   index of the sequence each token belongs to.
  //   stats      (int32, 2):   [N, max_seqlen], read once per batch by the caller.
  m.def("varlen_meta(Tensor position_ids) -> (Tensor cu_seqlens, Tensor seq_idx, Tensor stats)");

  // MoE routing statistics from router top-k expert ids (T, k): S = T*k slots, slot s is
  // token s / k, choice s % k. All int32:
  //   counts (E,), offsets (E+1,) exclusive starts with offsets[E] = valid slots,
  //   permutation (S,) sorted position -> slot, stable (token order inside an expert),
  //   inverse (S,) slot -> sorted position.
  // Ids outside [0, E): an error on the CPU; on CUDA they are dropped slots, placed after
  // every expert (positions >= offsets[E]) and ignored by moe_permute / moe_combine.
  m.def("moe_group(Tensor expert_ids, int num_experts) -> (Tensor counts, Tensor offsets, Tensor permutation, "
        "Tensor inverse)");
  // x (T, H) -> (S, H) in expert order: out[p] = slot_scale[s] * x[s / k], s = permutation[p];
  // rows of dropped slots are zero.
  m.def("moe_permute(Tensor x, Tensor permutation, Tensor offsets, int top_k, Tensor? slot_scale) -> Tensor");
  // y (S, H) in expert order -> (T, H): out[t] = sum_j weights[t, j] * y'[inverse[t*k + j]]
  // (weight 1 without weights), summed in float in a fixed order: deterministic. y' = y, or with
  // bias (E, H) y[p] + bias[expert of p] rounded to y's dtype (the model's `y + bias`; gpt-oss's
  // down_proj bias without a pass of its own over y).
  m.def("moe_combine(Tensor y, Tensor inverse, Tensor offsets, int top_k, Tensor? weights, "
        "Tensor? bias=None) -> Tensor");
  // Router-weight gradient of moe_combine: (T, k), dot(grad_out[t], y'[inverse[t*k + j]]).
  m.def("moe_combine_weight_grad(Tensor grad_out, Tensor y, Tensor inverse, Tensor offsets, int top_k, "
        "Tensor? bias=None) -> Tensor");
  // The router's choice from its logits (T, E), one kernel each way (a model's softmax / sigmoid,
  // top-k, renormalise, scale; no host sync):
  //   scores = softmax(logits) ("softmax"), sigmoid(logits) ("sigmoid"), or the logits
  //     ("topk_softmax": the weights are the softmax of the k chosen logits), in float;
  //   choice = scores + selection_bias (E,) where given (in the choice only, no gradient), and
  //     with num_groups > 1 set to masked_choice (the model's masked_fill value, 0.0 or -inf)
  //     outside the top_groups best of num_groups contiguous groups (a group's score: "max", or
  //     "top2_sum" of its two largest choice values);
  //   ids (T, k) int64 = top-k of choice, descending, ties to the lower expert;
  //   weights (T, k) float32 (float64 for float64 logits, CPU): the chosen scores (with a selection bias) or choice values, then
  //     / (their sum + renorm_epsilon) where renormalize, then * scale.
  m.def("moe_route(Tensor logits, int top_k, str scoring, bool renormalize, float renorm_epsilon, float scale, "
        "int num_groups, int top_groups, str group_score, float masked_choice, Tensor? selection_bias) -> "
        "(Tensor weights, Tensor ids)");
  // d logits (T, E), the logits' dtype, from d weights (T, k) and the forward's ids.
  m.def("moe_route_backward(Tensor grad_weights, Tensor logits, Tensor ids, int top_k, str scoring, "
        "bool renormalize, float renorm_epsilon, float scale, int num_groups, int top_groups, str group_score, "
        "float masked_choice, Tensor? selection_bias) -> Tensor");
  // The experts' grouped GEMM: x (S, in) rows in expert order, expert g owning rows
  // [group_ends[g-1], group_ends[g]); weight (E, out, in), or (E, in, out) when transposed (as
  // transformers' is_transposed experts store it) -> (S, out) = x[rows of g] @ W_g^T. Rows past
  // group_ends[E-1] are zero on the CPU and undefined on CUDA. Its input gradient is the same op
  // with `transposed` flipped; its weight gradient the op below.
  m.def("moe_grouped_mm(Tensor x, Tensor weight, Tensor group_ends, bool transposed) -> Tensor");
  // out[g] = a[rows of g]^T @ b[rows of g]: a (S, M), b (S, N) -> (E, M, N), float32 accumulation,
  // zeros for an expert without rows.
  m.def("moe_grouped_mm_weight_grad(Tensor a, Tensor b, Tensor group_ends) -> Tensor");
  // SwiGLU on [gate | up] rows (R, 2I): silu(gate) * up -> (R, I); and its backward -> (R, 2I).
  m.def("swiglu(Tensor gate_up) -> Tensor");
  m.def("swiglu_backward(Tensor grad_act, Tensor gate_up) -> Tensor");
  // The same on two tensors of one shape (..., I): gate and up of a dense MLP (two projections).
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad_act, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  // GeGLU (Gemma's MLP) on gate and up (..., I): gelu(gate, approximate="tanh") * up -> (..., I).
  m.def("gelu_tanh_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("gelu_tanh_mul_backward(Tensor grad_act, Tensor gate, Tensor up) -> (Tensor grad_gate, Tensor grad_up)");
  // gpt-oss's experts: gate and up interleaved in (R, 2I) (gate = column 2c, up = 2c + 1),
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit) -> (R, I); and
  // its backward -> (R, 2I), interleaved as gate_up. With bias (E, 2I) and group_ends (E,) int32
  // (the inclusive ends of expert-sorted rows): each row's expert bias is added to gate_up (rounded
  // to its dtype) before the gate, in both; the bias's gradient is the caller's (rows' one-hot GEMM).
  m.def("clamped_swiglu(Tensor gate_up, float alpha, float limit, Tensor? bias=None, Tensor? group_ends=None) "
        "-> Tensor");
  m.def("clamped_swiglu_backward(Tensor grad_act, Tensor gate_up, float alpha, float limit, Tensor? bias=None, "
        "Tensor? group_ends=None) -> Tensor");
  // The MoE experts' SwiGLU with the router's weights folded in: gate_up (S, 2I) [gate | up] rows in
  // expert order, weights (T, k) in its dtype (slot s = t * k + j, T * k = S), permutation (S,) and
  // offsets (E + 1,) int32 of moe_group. act[p] = weights[s] * (silu(gate[p]) * up[p]), s =
  // permutation[p] -> (S, I): the down projection's rows come out weighted and the combine is a plain
  // sum. Rows at p >= offsets[E] (dropped slots) are zero. The backward -> (d gate_up (S, 2I),
  // d weights (T, k)): SwiGLU's backward of weights[s] * grad_act[p], and d weights[s] = sum over c of
  // silu(gate[p, c]) * up[p, c] * grad_act[p, c] (float accumulation, a fixed order); both zero for
  // dropped slots.
  m.def("moe_weighted_swiglu(Tensor gate_up, Tensor weights, Tensor permutation, Tensor offsets) -> Tensor");
  m.def("moe_weighted_swiglu_backward(Tensor grad_act, Tensor gate_up, Tensor weights, Tensor permutation, "
        "Tensor offsets) -> (Tensor grad_gate_up, Tensor grad_weights)");
  // Attention of each packed sequence to itself (causal or full): q (T, Hq, D), k and v (T, Hk, D),
  // Hq a multiple of Hk, cu_seqlens (N+1) int32 boundaries, max_seqlen >= the longest sequence.
  // out (T, Hq, D); lse (T, Hq) float32, the log-sum-exp of each query's scaled scores, which the
  // backward reads. Rows of tokens after cu_seqlens[N] are undefined. CUDA: cuDNN's fused SDPA
  // (built when the cudnn-frontend headers are present at install time).
  // window W > 0 (causal only): a query sees itself and the W - 1 tokens before it in its sequence
  // (transformers' sliding_window); 0: no window. softcap c > 0: the scaled scores s become
  // c * tanh(s / c) before the mask (Gemma 2's attn_logit_softcapping); 0: no cap.
  m.def("varlen_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, float scale, "
        "bool causal, int window, float softcap) -> (Tensor out, Tensor lse)");
  m.def("varlen_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor cu_seqlens, int max_seqlen, float scale, bool causal, int window, float softcap) -> (Tensor grad_q, "
        "Tensor grad_k, Tensor grad_v)");

  // RMSNorm over the last dimension of x (..., H) (kernels/rms_norm.cuh): y in x's dtype and
  // rstd (...,) float32; y = (weight + offset) * (x * rstd cast to x's dtype).
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> (Tensor y, Tensor rstd)");
  // weight_grad false (a frozen weight, as under LoRA): grad_weight is an empty tensor and the kernel
  // skips its per-block sums (at hidden 4096 they took 0.64 ms of a 0.1 ms pass, W4 on H200).
  // grad_add (the shape and dtype of x): added to grad_x before its one rounding (add_rms_norm's
  // backward: the gradient its sum gets from the residual stream).
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd, float offset, bool weight_grad=True, "
        "Tensor? grad_add=None) -> (Tensor grad_x, Tensor grad_weight)");
  // A pre-norm decoder's residual add and the norm after it in one kernel: sum = x + residual
  // (rounded to x's dtype, as the separate add gives it), y = rms_norm(sum). The backward is
  // rms_norm_backward of sum with grad_add = the sum's gradient from the residual stream.
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, float offset) "
        "-> (Tensor y, Tensor sum, Tensor rstd)");

  // Rotary embedding of x (batch, heads, length, head_dim) with cos, sin (batch or 1, length, R),
  // R even, 0 < R <= head_dim (kernels/rope.cuh): the first R features rotate in pairs, the
  // others pass through unchanged (partial rotary when R < head_dim). Pairs (j, j + R/2), j < R/2
  // (transformers' rotate_half), or with interleaved=true (2j, 2j + 1) (GLM, Cohere).
  // backward=true applies the transpose (the gradient map). Out keeps x's strides.
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool backward, bool interleaved) -> Tensor");
  // A head norm and the rotary embedding after it (Qwen3's and Gemma 3's q_norm / k_norm, then
  // apply_rotary_pos_emb) in one kernel each way (kernels/rms_norm_rope.cuh): out = rope(rms_norm(x))
  // with x (batch, heads, length, head_dim) normed over head_dim, weight (head_dim,), cos and sin as
  // for rope and of x's dtype; the values of rms_norm then rope. rstd (batch, heads, length) float32.
  // Out keeps x's strides. The backward gives rms_norm_backward(rope(grad_out, backward=true)).
  m.def("rms_norm_rope(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps, float offset, bool interleaved) "
        "-> (Tensor out, Tensor rstd)");
  m.def("rms_norm_rope_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd, Tensor cos, Tensor sin, "
        "float offset, bool interleaved, bool weight_grad=True) -> (Tensor grad_x, Tensor grad_weight)");

  // Cross-entropy over rows of LM-head logits (rows, vocab), float accumulation. Returns the
  // per-row loss (rows,) float32: lse - (1 - eps) * z_t - eps / vocab * sum_j z_j with
  // z = softcap * tanh(logit / softcap) when softcap > 0. With grad_scale (one float32: 1 / the
  // loss denominator) the logits are overwritten with d(sum of row losses)/d logits * grad_scale.
  // ignore_index rows: loss 0, zero gradient. Out-of-range targets: an error on the CPU, loss NaN
  // on the GPU (no host sync to raise from).
  m.def("cross_entropy_rows_(Tensor(a!) logits, Tensor targets, Tensor? grad_scale, int ignore_index, "
        "float label_smoothing, float softcap) -> Tensor");
  // A frozen base projection and its LoRA update (csrc/lora/lora_linear_composite.cpp): x (..., in),
  // x_lora dropout(x) or None (x itself), weight (out, in) and bias in x's dtype, lora_a (r, in),
  // lora_b (out, r) in float32 or x's dtype, scale the LoRA scaling. y = x W^T + b + scale *
  // (x_lora A^T) B^T (..., out); xa = x_lora A^T (..., r), kept for the backward. The base
  // weight and bias get no gradient (frozen). The backward returns d x, d x_lora (empty when
  // shared_input: then d x includes the LoRA path), d lora_a and d lora_b in the adapters' dtypes.
  // adapters: the forward's one copy of lora_a and lora_b in x's dtype when they have another
  // (flat [A | B]; empty when they have x's dtype), kept for the backward, which reads its views
  // instead of casting the adapters again (None: the backward casts them).
  m.def("lora_linear(Tensor x, Tensor? x_lora, Tensor weight, Tensor? bias, Tensor lora_a, Tensor lora_b, "
        "float scale) -> (Tensor y, Tensor xa, Tensor adapters)");
  m.def("lora_linear_backward(Tensor grad_y, Tensor x_lora, Tensor weight, Tensor lora_a, Tensor lora_b, Tensor xa, "
        "float scale, bool shared_input, Tensor? adapters=None) -> (Tensor grad_x, Tensor grad_x_lora, "
        "Tensor grad_a, Tensor grad_b)");
  // Frozen projections that read one input, each with its LoRA update (q/k/v, gate/up; same file):
  // x (..., in); per member i weight_i (out_i, in), lora_a_i (r_i, in), lora_b_i
  // (out_i, r_i), scale_i; biases empty or one (out_i) per member. ys[i] = x W_i^T (+ b_i) +
  // scale_i (x A_i^T) B_i^T (..., out_i); xa = x
  // [A_0; A_1; ...]^T (..., sum r_i), one thin GEMM for the group, kept for the backward. The
  // backward takes every member's grad_y and returns d x (one tensor: the members' terms summed by
  // accumulating GEMMs, no separate adds), d lora_a (every member's stacked, (sum r_i, in): one
  // GEMM's output, not copied apart; the caller splits it) and d lora_b_i in the adapters' dtypes.
  // grad_input false: x needs no gradient (the first layer's input under a frozen embedding), d x
  // is returned empty and its GEMMs are not run. adapters: as lora_linear's, flat
  // [A_0 | A_1 | ... | B_0 | B_1 | ...].
  m.def("lora_linear_group(Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] lora_a, Tensor[] lora_b, "
        "float[] scales) -> (Tensor[] ys, Tensor xa, Tensor adapters)");
  m.def("lora_linear_group_backward(Tensor[] grad_ys, Tensor x, Tensor[] weights, Tensor[] lora_a, "
        "Tensor[] lora_b, Tensor xa, float[] scales, bool grad_input=True, Tensor? adapters=None) -> "
        "(Tensor grad_x, Tensor grad_a, Tensor[] grad_b)");
  // A gated MLP's gate and up as one such group with the activation after it: act = f(gate) * up
  // (..., out) with f silu ("silu", SwiGLU) or tanh GELU ("gelu_tanh", GeGLU), weights = [gate, up]
  // of one output size. gate, up (..., out) and xa (..., r_0 + r_1) are returned for the backward.
  // The backward takes d act and returns what lora_linear_group_backward returns.
  m.def("lora_gated_group(Tensor x, Tensor[] weights, Tensor[] biases, Tensor[] lora_a, Tensor[] lora_b, "
        "float[] scales, str activation) -> (Tensor act, Tensor gate, Tensor up, Tensor xa)");
  m.def("lora_gated_group_backward(Tensor grad_act, Tensor gate, Tensor up, Tensor x, Tensor[] weights, "
        "Tensor[] lora_a, Tensor[] lora_b, Tensor xa, float[] scales, str activation, bool grad_input=True) -> "
        "(Tensor grad_x, Tensor grad_a, Tensor[] grad_b)");

  // LM head + cross-entropy in chunks of tokens (csrc/loss/linear_cross_entropy_composite.cpp):
  // hidden (T, H), weight (V, H), bias (V,)?, targets (T,) int64 (already shifted),
  // denominator: one value, the loss is sum / denominator. chunk_tokens 0 = about 1 GiB of logits
  // per chunk. With compute_grad the gradients of the loss come back too (else empty (0,) tensors):
  // (loss float32 scalar, grad_hidden (T, H), grad_weight (V, H), grad_bias (V,)?). weight_grad
  // false (a frozen LM head: LoRA) skips grad_weight (empty): its (V, H) float32 accumulator and
  // one GEMM per chunk.
  m.def("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor denominator, "
        "int ignore_index, float label_smoothing, float softcap, int chunk_tokens, bool compute_grad, "
        "bool weight_grad=True) -> (Tensor, Tensor, Tensor, Tensor)");

  // Host memory pool for activation offload (csrc/offload/host_pool.h): blocks reused by size
  // class, page-locked on CUDA builds. torch.classes.hasten.HostPool(max_cached_bytes).
  m.class_<hasten::HostPool>("HostPool")
      .def(torch::init<int64_t>())
      .def("acquire", &hasten::HostPool::acquire)
      .def("trim", &hasten::HostPool::trim)
      .def("set_limit", &hasten::HostPool::set_limit)
      .def("stats", &hasten::HostPool::stats);

  // Activation offload engine (csrc/offload/offload_engine.h): copies on their own streams,
  // events for every hand-off. torch.classes.hasten.OffloadEngine(max_cached_host_bytes).
  m.class_<hasten::OffloadEngine>("OffloadEngine")
      .def(torch::init<int64_t>())
      .def("offload", &hasten::OffloadEngine::offload)
      .def("prefetch", &hasten::OffloadEngine::prefetch)
      .def("fetch", &hasten::OffloadEngine::fetch)
      .def("release", &hasten::OffloadEngine::release)
      .def("poll", &hasten::OffloadEngine::poll)
      .def("bound_in_flight", &hasten::OffloadEngine::bound_in_flight)
      .def("synchronize", &hasten::OffloadEngine::synchronize)
      .def("stats", &hasten::OffloadEngine::stats)
      .def("reset_counters", &hasten::OffloadEngine::reset_counters)
      .def("set_host_limit", &hasten::OffloadEngine::set_host_limit)
      .def("trim_host_pool", &hasten::OffloadEngine::trim_host_pool)
      .def("host_pool_stats", &hasten::OffloadEngine::host_pool_stats)
      // asynchronous copy engines of CUDA device `device` (-1 where unknown, e.g. CPU builds)
      .def("copy_engine_count", [](const c10::intrusive_ptr<hasten::OffloadEngine>&, int64_t device) {
        return hasten::copy_engine_count(device);
      });
}
