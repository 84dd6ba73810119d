// Element types of hasten's kernels, for host code that launches them (no device code here).
#pragma once

namespace hasten {
namespace kernels {

enum class ElementType { kFloat32, kFloat16, kBFloat16 };

}  // namespace kernels
}  // namespace hasten
