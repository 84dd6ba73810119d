#include "host_pool.h"

#include <cstdlib>
#include <string>

#ifdef HASTEN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace hasten {
namespace {

constexpr int64_t kLargeGranule = int64_t{2} << 20;  // 2 MiB
constexpr int64_t kMinBlock = 512;

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

void* HostPoolImpl::acquire(int64_t block_bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(block_bytes);
    if (it != free_.end() && !it->second.empty()) {
      void* ptr = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= block_bytes;
      in_use_bytes_ += block_bytes;
      ++hits_;
      return ptr;
    }
    ++misses_;
  }
  void* ptr = allocate_block(block_bytes);  // outside the lock: page-locking is slow
  std::lock_guard<std::mutex> lock(mutex_);
  in_use_bytes_ += block_bytes;
  allocated_bytes_ += block_bytes;
  return ptr;
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
  const int64_t block = HostPoolImpl::round_size(nbytes);
  void* ptr = impl_->acquire(block);
  std::shared_ptr<HostPoolImpl> pool = impl_;  // the deleter keeps the pool alive
  return torch::from_blob(
      ptr, {nbytes}, [pool, block](void* p) { pool->release(p, block); },
      torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCPU).pinned_memory(impl_->pinned()));
}

int64_t HostPool::trim() { return impl_->trim(); }

std::vector<int64_t> HostPool::stats() { return impl_->stats(); }

}  // namespace hasten
