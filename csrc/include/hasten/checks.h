// Input checks for every hasten op, in one place, with messages that name the op,
// the argument and the fix. Ops call these before touching data.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <string>

namespace hasten {

// Numbers and shapes in error messages go through std::to_string, never through
// std::ostream: on the CUDA build (torch 2.11+cu130 on the H200) streaming an integer
// from this library ran a foreign copy of ostream::_M_insert<long> and crashed the
// process (cuda-gdb backtrace, 2026-11-30). tests/ops/test_error_paths.py guards it.
inline std::string num(int64_t value) { return std::to_string(value); }

inline std::string shape(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

inline std::string dtype_list(std::initializer_list<at::ScalarType> allowed) {
  std::string names;
  for (auto t : allowed) {
    if (!names.empty()) names += " or ";
    names += c10::toString(t);
  }
  return names;
}

// The torch spelling of a dtype, for "convert it with .to(...)" hints.
inline const char* torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    default: return "a supported dtype";
  }
}

// Rows of a tensor read as (rows, last dim); 0 when the last dim is 0 (the kernels' row count).
inline int64_t rows_of(const at::Tensor& t) { return t.size(-1) ? t.numel() / t.size(-1) : 0; }

inline void check_dtype(const at::Tensor& t, const char* op, const char* arg,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed) {
    if (t.scalar_type() == a) return;
  }
  TORCH_CHECK(false, "hasten::", op, ": `", arg, "` must be ", dtype_list(allowed), ", got ",
              t.scalar_type(), ". Convert it with .to(", torch_dtype_name(*allowed.begin()), ") before the call.");
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_contiguous(), "hasten::", op, ": `", arg,
              "` must be contiguous (call .contiguous() first); got strides ", shape(t.strides()));
}

inline void check_device(const at::Tensor& t, const char* op, const char* arg, c10::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, "hasten::", op, ": `", arg, "` is on ", t.device().str(),
              " but this implementation runs on ", c10::DeviceTypeName(type));
}

inline void check_fits_int32(int64_t n, const char* op, const char* what) {
  TORCH_CHECK(n < static_cast<int64_t>(INT32_MAX), "hasten::", op, ": ", what, " (", num(n),
              ") does not fit the int32 offsets that varlen attention kernels take; "
              "split the batch into smaller ones.");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a,
                              const char* arg_b) {
  TORCH_CHECK(a.device() == b.device(), "hasten::", op, ": `", arg_a, "` is on ", a.device().str(), " but `", arg_b,
              "` is on ", b.device().str(), "; move them to one device");
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* arg, const char* expected_shape) {
  TORCH_CHECK(t.dim() == dim, "hasten::", op, ": `", arg, "` must be ", expected_shape, ", got shape ",
              hasten::shape(t.sizes()));
}

inline void check_size(const at::Tensor& t, int64_t dim, int64_t expected, const char* op, const char* arg,
                       const char* meaning) {
  TORCH_CHECK(t.size(dim) == expected, "hasten::", op, ": `", arg, "` dimension ", num(dim), " must be ", meaning,
              " (", num(expected), "), got shape ", shape(t.sizes()));
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a,
                             const char* arg_b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "hasten::", op, ": `", arg_b, "` must have the dtype of `", arg_a,
              "` (", a.scalar_type(), "), got ", b.scalar_type());
}

}  // namespace hasten
