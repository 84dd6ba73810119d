// Input checks for every hasten op, in one place, with messages that name the op,
// the argument and the fix. Ops call these before touching data.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <string>

namespace hasten {

inline std::string dtype_list(std::initializer_list<at::ScalarType> allowed) {
  std::string names;
  for (auto t : allowed) {
    if (!names.empty()) names += " or ";
    names += c10::toString(t);
  }
  return names;
}

inline void check_dtype(const at::Tensor& t, const char* op, const char* arg,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto a : allowed) {
    if (t.scalar_type() == a) return;
  }
  TORCH_CHECK(false, "hasten::", op, ": `", arg, "` must be ", dtype_list(allowed), ", got ",
              t.scalar_type(), ". Convert it with .to(torch.int64) before the call.");
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.is_contiguous(), "hasten::", op, ": `", arg,
              "` must be contiguous (call .contiguous() first); got strides ", t.strides());
}

inline void check_device(const at::Tensor& t, const char* op, const char* arg, c10::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, "hasten::", op, ": `", arg, "` is on ", t.device(),
              " but this implementation runs on ", c10::DeviceTypeName(type));
}

inline void check_fits_int32(int64_t n, const char* op, const char* what) {
  TORCH_CHECK(n < static_cast<int64_t>(INT32_MAX), "hasten::", op, ": ", what, " (", n,
              ") does not fit the int32 offsets that varlen attention kernels take; "
              "split the batch into smaller ones.");
}

}  // namespace hasten
