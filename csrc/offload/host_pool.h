// A pool of host memory blocks for activation offload: blocks are allocated once (page-locked
// with cudaHostAlloc on CUDA builds, so copies can be asynchronous; plain aligned memory on CPU
// builds) and reused by size class, never freed per tensor.
//
// Packed batches vary in length from step to step, and so do the offloaded activations: a large
// request takes a cached block up to an eighth larger than its class (kReuseSlack), and with a
// limit set (the offload guard's host limit) a miss first frees cached blocks, largest first,
// until the new block fits under it. Without both, blocks of last step's sizes sat cached (up to
// max_cached_bytes, 64 GiB) beside the new ones, page-locked, outside the guard's count.
#pragma once

#include <torch/custom_class.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
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
  // A block of at least `block_bytes` (a size class): a cached one of that class, or for large
  // classes the smallest cached one at most an eighth larger; else a new one. Returns the block
  // and its size (which release() takes back).
  std::pair<void*, int64_t> acquire(int64_t block_bytes);
  void release(void* ptr, int64_t block_bytes);
  int64_t trim();  // frees every cached block; returns the bytes freed
  // At most `limit_bytes` allocated (in use + cached) where freeing cached blocks can keep it so;
  // a negative limit: none.
  void set_limit(int64_t limit_bytes);
  std::vector<int64_t> stats();

  bool pinned() const;

 private:
  std::mutex mutex_;
  std::map<int64_t, std::vector<void*>> free_;  // size class -> cached blocks (never empty)
  // Frees cached blocks, largest first, until allocated + `incoming` fits the limit (or none is
  // left); the caller holds mutex_ and frees the returned blocks outside it.
  std::vector<std::pair<void*, int64_t>> evict_for_locked(int64_t incoming);
  // The last cached block of class `cls`, erasing the class when it empties (so that every key of
  // free_ holds a block); the caller holds mutex_ and updates the byte counts.
  void* take_locked(std::map<int64_t, std::vector<void*>>::iterator cls);

  int64_t max_cached_bytes_;
  int64_t limit_bytes_ = -1;
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
  void set_limit(int64_t limit_bytes);
  // [in_use_bytes, cached_bytes, allocated_bytes, hits, misses, pinned]
  std::vector<int64_t> stats();

 private:
  std::shared_ptr<HostPoolImpl> impl_;
};

}  // namespace hasten
