// A pool of host memory blocks for activation offload: blocks are allocated once (page-locked
// with cudaHostAlloc on CUDA builds, so copies can be asynchronous; plain aligned memory on CPU
// builds) and reused by size class, never freed per tensor.
#pragma once

#include <torch/custom_class.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace hasten {

class HostPoolImpl {
 public:
  explicit HostPoolImpl(int64_t max_cached_bytes) : max_cached_bytes_(max_cached_bytes) {}
  ~HostPoolImpl();
  HostPoolImpl(const HostPoolImpl&) = delete;
  HostPoolImpl& operator=(const HostPoolImpl&) = delete;

  // Size class of a request: powers of two up to 2 MiB, then multiples of 2 MiB.
  static int64_t round_size(int64_t nbytes);
  void* acquire(int64_t block_bytes);
  void release(void* ptr, int64_t block_bytes);
  int64_t trim();  // frees every cached block; returns the bytes freed
  std::vector<int64_t> stats();

  bool pinned() const;

 private:
  std::mutex mutex_;
  std::map<int64_t, std::vector<void*>> free_;  // size class -> cached blocks
  int64_t max_cached_bytes_;
  int64_t cached_bytes_ = 0;
  int64_t in_use_bytes_ = 0;
  int64_t allocated_bytes_ = 0;  // in use + cached
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

// TorchScript-visible handle: torch.classes.hasten.HostPool(max_cached_bytes).
class HostPool : public torch::CustomClassHolder {
 public:
  explicit HostPool(int64_t max_cached_bytes);
  // A uint8 CPU tensor of `nbytes` bytes backed by a pooled block; the block returns to the
  // pool when the tensor's storage is freed (the pool outlives its last tensor).
  at::Tensor acquire(int64_t nbytes);
  int64_t trim();
  // [in_use_bytes, cached_bytes, allocated_bytes, hits, misses, pinned]
  std::vector<int64_t> stats();

 private:
  std::shared_ptr<HostPoolImpl> impl_;
};

}  // namespace hasten
