#include "host_pool.h"

#include <cstdlib>
#include <iterator>
#include <string>

#ifdef HASTEN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace hasten {
namespace {

constexpr int64_t kLargeGranule = int64_t{2} << 20;  // 2 MiB
constexpr int64_t kMinBlock = 512;
constexpr int64_t kReuseSlack = 8;  // a large request may take a cached block up to 1/8 larger

void* allocate_block(int64_t bytes) {
#ifdef HASTEN_WITH_CUDA
  void* ptr = nullptr;
  const cudaError_t err = cudaHostAlloc(&ptr, static_cast<size_t>(bytes), cudaHostAllocDefault);
  TORCH_CHECK(err == cudaSuccess, "hasten::HostPool: cudaHostAlloc of ", std::to_string(bytes),
              " bytes failed (", cudaGetErrorString(err), "); host memory for offload is exhausted: lower the "
              "offload budget or free host memory");
  return ptr;
#else
  void* ptr = std::aligned_alloc(64, static_cast<size_t>((bytes + 63) / 64 * 64));
  TORCH_CHECK(ptr != nullptr, "hasten::HostPool: allocating ", std::to_string(bytes), " bytes of host memory failed");
  return ptr;
#endif
}

void free_block(void* ptr) {
#ifdef HASTEN_WITH_CUDA
  cudaFreeHost(ptr);
#else
  std::free(ptr);
#endif
}

}  // namespace

HostPoolImpl::~HostPoolImpl() { trim(); }

int64_t HostPoolImpl::round_size(int64_t nbytes) {
  if (nbytes <= kMinBlock) return kMinBlock;
  if (nbytes >= kLargeGranule) return (nbytes + kLargeGranule - 1) / kLargeGranule * kLargeGranule;
  int64_t size = kMinBlock;
  while (size < nbytes) size <<= 1;
  return size;
}

bool HostPoolImpl::pinned() const {
#ifdef HASTEN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void* HostPoolImpl::take_locked(std::map<int64_t, std::vector<void*>>::iterator cls) {
  void* ptr = cls->second.back();
  cls->second.pop_back();
  if (cls->second.empty()) free_.erase(cls);
  return ptr;
}

std::vector<std::pair<void*, int64_t>> HostPoolImpl::evict_for_locked(int64_t incoming) {
  std::vector<std::pair<void*, int64_t>> evicted;
  while (limit_bytes_ >= 0 && allocated_bytes_ + incoming > limit_bytes_ && cached_bytes_ > 0) {
    const auto largest = std::prev(free_.end());  // no class is kept empty: see take_locked
    const int64_t size = largest->first;          // read before take_locked may erase the class
    evicted.emplace_back(take_locked(largest), size);
    cached_bytes_ -= size;
    allocated_bytes_ -= size;
  }
  return evicted;
}

std::pair<void*, int64_t> HostPoolImpl::acquire(int64_t block_bytes) {
  std::vector<std::pair<void*, int64_t>> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // the block's own class; for large classes, the smallest cached block at most an eighth larger
    const int64_t largest_fit = block_bytes >= kLargeGranule ? block_bytes + block_bytes / kReuseSlack : block_bytes;
    auto it = free_.lower_bound(block_bytes);
    if (it != free_.end() && it->first <= largest_fit) {
      const int64_t size = it->first;
      void* ptr = take_locked(it);
      cached_bytes_ -= size;
      in_use_bytes_ += size;
      ++hits_;
      return {ptr, size};
    }
    ++misses_;
    evicted = evict_for_locked(block_bytes);
  }
  for (auto& [ptr, size] : evicted) free_block(ptr);  // outside the lock, as the allocation below
  void* ptr = allocate_block(block_bytes);  // outside the lock: page-locking is slow
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_bytes_ += block_bytes;
  allocated_bytes_ += block_bytes;
  return {ptr, block_bytes};
}

void HostPoolImpl::set_limit(int64_t limit_bytes) {
  std::vector<std::pair<void*, int64_t>> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_bytes_ = limit_bytes;
    evicted = evict_for_locked(0);
  }
  for (auto& [ptr, size] : evicted) free_block(ptr);
}

void HostPoolImpl::release(void* ptr, int64_t block_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    in_use_bytes_ -= block_bytes;
    if (cached_bytes_ + block_bytes <= max_cached_bytes_) {
      free_[block_bytes].push_back(ptr);
      cached_bytes_ += block_bytes;
      return;
    }
    allocated_bytes_ -= block_bytes;
  }
  free_block(ptr);
}

int64_t HostPoolImpl::trim() {
  std::map<int64_t, std::vector<void*>> blocks;
  int64_t freed = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks.swap(free_);
    freed = cached_bytes_;
    allocated_bytes_ -= cached_bytes_;
    cached_bytes_ = 0;
  }
  for (auto& [size, ptrs] : blocks)
    for (void* ptr : ptrs) free_block(ptr);
  return freed;
}

std::vector<int64_t> HostPoolImpl::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {in_use_bytes_, cached_bytes_, allocated_bytes_, hits_, misses_, pinned() ? 1 : 0};
}

HostPool::HostPool(int64_t max_cached_bytes) : impl_(std::make_shared<HostPoolImpl>(max_cached_bytes)) {
  TORCH_CHECK(max_cached_bytes >= 0, "hasten::HostPool: max_cached_bytes must be zero or more");
}

at::Tensor HostPool::acquire(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "hasten::HostPool.acquire: nbytes must be zero or more, got ", std::to_string(nbytes));
  const auto acquired = impl_->acquire(HostPoolImpl::round_size(nbytes));
  void* ptr = acquired.first;
  const int64_t block = acquired.second;  // the class, or the larger cached block it took
  std::shared_ptr<HostPoolImpl> pool = impl_;  // the deleter keeps the pool alive
  return torch::from_blob(
      ptr, {nbytes}, [pool, block](void* p) { pool->release(p, block); },
      torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU).pinned_memory(impl_->pinned()));
}

int64_t HostPool::trim() { return impl_->trim(); }

void HostPool::set_limit(int64_t limit_bytes) { impl_->set_limit(limit_bytes); }

std::vector<int64_t> HostPool::stats() { return impl_->stats(); }

}  // namespace hasten
