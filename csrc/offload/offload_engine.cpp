#include "offload/offload_engine.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <string>

#include "hasten/checks.h"

#ifdef HASTEN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace hasten {
namespace {

// uint8 [nbytes] over the whole storage of `tensor`: one copy restores every view of it.
at::Tensor storage_bytes(const at::Tensor& tensor) {
  const auto& storage = tensor.storage();
  const int64_t nbytes = static_cast<int64_t>(storage.nbytes());
  return at::empty({0}, tensor.options().dtype(at::kByte)).set_(storage, 0, {nbytes}, {1});
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

std::unique_ptr<c10::Event> record_on(const c10::Stream& stream, bool timing = false) {
  auto event = std::make_unique<c10::Event>(
      stream.device_type(), timing ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT);
  event->record(stream);
  return event;
}

}  // namespace

OffloadEngine::OffloadEngine(int64_t max_cached_host_bytes) : host_pool_(max_cached_host_bytes) {}

OffloadEngine::~OffloadEngine() {
  try {
    synchronize();  // no copy may outlive the buffers it reads or writes
  } catch (...) {
  }
}

const OffloadEngine::Streams& OffloadEngine::streams_for(c10::Device device) {
  auto it = streams_.find(device.index());
  if (it != streams_.end()) return it->second;
  const auto* impl = c10::impl::getDeviceGuardImpl(device.type());
  // Two pool streams: copies each way run concurrently with each other and with compute
  // (the H200 has separate copy engines for each direction).
  Streams streams{impl->getStreamFromGlobalPool(device, false), impl->getStreamFromGlobalPool(device, false)};
  return streams_.emplace(device.index(), streams).first->second;
}

OffloadEngine::Entry& OffloadEngine::entry(int64_t ticket, const char* method) {
  auto it = entries_.find(ticket);
  TORCH_CHECK(it != entries_.end(), "hasten::OffloadEngine.", method, ": ticket ", num(ticket),
              " is unknown or already released (a saved activation was used after its graph was freed)");
  return it->second;
}

int64_t OffloadEngine::offload(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "hasten::OffloadEngine.offload: the tensor is undefined");
  TORCH_CHECK(tensor.device().is_cpu() || tensor.device().is_cuda(), "hasten::OffloadEngine.offload: tensors on ",
              tensor.device().str(), " are not supported (CPU or CUDA)");
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  Entry e;
  e.device = tensor.device();
  at::Tensor source = storage_bytes(tensor);
  e.nbytes = source.numel();
  e.host = host_pool_.acquire(e.nbytes);
  if (e.device.is_cpu()) {
    e.host.copy_(source);  // the CPU path copies synchronously
  } else {
    const c10::Stream compute = current_stream(e.device);
    const Streams& copy = streams_for(e.device);
    record_on(compute)->block(copy.d2h);  // the copy reads what compute has produced so far
    {
      c10::StreamGuard guard(copy.d2h);
      e.host.copy_(source, /*non_blocking=*/true);
    }
    e.stored = record_on(copy.d2h);
    e.device_source = source;  // kept alive until `stored`; then the allocator may reuse it
    d2h_bytes_in_flight_ += e.nbytes;
  }
  const int64_t ticket = next_ticket_++;
  bytes_offloaded_ += e.nbytes;
  host_bytes_held_ += e.nbytes;
  if (e.stored) awaiting_store_.push_back(ticket);
  entries_.emplace(ticket, std::move(e));
  return ticket;
}

void OffloadEngine::start_prefetch(Entry& e) {
  if (e.restored.defined()) return;
  if (e.device.is_cpu()) {
    e.restored = e.host.clone();
  } else {
    const c10::Stream compute = current_stream(e.device);
    const Streams& copy = streams_for(e.device);
    // Allocated in compute-stream order: the block may have been freed by compute work still
    // queued, so the copy waits for compute up to here, and for its own D2H copy.
    e.restored = at::empty({e.nbytes}, at::TensorOptions().dtype(at::kByte).device(e.device));
    record_on(compute)->block(copy.h2d);
    if (e.stored) e.stored->block(copy.h2d);
    {
      c10::StreamGuard guard(copy.h2d);
      e.restored.copy_(e.host, /*non_blocking=*/true);
    }
    e.restored_ready = record_on(copy.h2d);
  }
  device_bytes_held_ += e.nbytes;
  bytes_prefetched_ += e.nbytes;
}

void OffloadEngine::prefetch(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  start_prefetch(entry(ticket, "prefetch"));
}

at::Tensor OffloadEngine::fetch(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = entry(ticket, "fetch");
  const bool prefetched = e.restored.defined();
  start_prefetch(e);
  ++fetches_;
  if (!e.device.is_cpu()) {
    const c10::Stream compute = current_stream(e.device);
    if (!prefetched || !done(e.restored_ready)) {
      // compute will stall on this copy: bracket the wait to measure it on the device
      ++exposed_fetches_;
      StallTiming timing;
      timing.before = record_on(compute, /*timing=*/true);
      e.restored_ready->block(compute);
      timing.after = record_on(compute, /*timing=*/true);
      stall_timings_.push_back(std::move(timing));
    } else {
      e.restored_ready->block(compute);
    }
  }
  if (!e.fetched_once) {
    bytes_fetched_ += e.nbytes;
    e.fetched_once = true;
  }
  return e.restored;
}

void OffloadEngine::release(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(ticket);
  if (it == entries_.end()) return;
  Entry e = std::move(it->second);
  entries_.erase(it);
  host_bytes_held_ -= e.nbytes;
  if (e.restored.defined()) device_bytes_held_ -= e.nbytes;
  if (!done(e.stored) || !done(e.restored_ready)) retired_.push_back(std::move(e));
  poll_locked();
}

void OffloadEngine::poll_locked() {
  while (!awaiting_store_.empty()) {
    auto it = entries_.find(awaiting_store_.front());
    if (it != entries_.end()) {
      if (!done(it->second.stored)) break;  // copies complete in issue order on one stream
      if (it->second.device_source.defined()) {
        it->second.device_source.reset();
        d2h_bytes_in_flight_ -= it->second.nbytes;
      }
    }
    awaiting_store_.pop_front();
  }
  for (size_t i = 0; i < retired_.size();) {
    Entry& e = retired_[i];
    if (done(e.stored) && done(e.restored_ready)) {
      if (e.device_source.defined()) d2h_bytes_in_flight_ -= e.nbytes;
      retired_[i] = std::move(retired_.back());
      retired_.pop_back();
    } else {
      ++i;
    }
  }
  for (size_t i = 0; i < stall_timings_.size();) {
    StallTiming& t = stall_timings_[i];
    if (t.after->query()) {
      exposed_wait_us_ += 1000.0 * t.before->elapsedTime(*t.after);
      stall_timings_[i] = std::move(stall_timings_.back());
      stall_timings_.pop_back();
    } else {
      ++i;
    }
  }
}

int64_t OffloadEngine::poll() {
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  return static_cast<int64_t>(entries_.size());
}

void OffloadEngine::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [ticket, e] : entries_) {
    if (e.stored) e.stored->synchronize();
    if (e.restored_ready) e.restored_ready->synchronize();
  }
  for (auto& e : retired_) {
    if (e.stored) e.stored->synchronize();
    if (e.restored_ready) e.restored_ready->synchronize();
  }
  for (auto& t : stall_timings_) t.after->synchronize();
  poll_locked();
}

int64_t OffloadEngine::bound_in_flight(int64_t max_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  int64_t waits = 0;
  while (d2h_bytes_in_flight_ > max_bytes) {
    c10::Event* oldest = nullptr;  // copies complete in issue order on the one D2H stream
    for (const int64_t ticket : awaiting_store_) {
      auto it = entries_.find(ticket);
      if (it != entries_.end() && it->second.stored && it->second.device_source.defined()) {
        oldest = it->second.stored.get();
        break;
      }
    }
    if (oldest == nullptr) {  // only released entries still copying: wait for one of them
      for (auto& e : retired_) {
        if (e.stored && e.device_source.defined() && !done(e.stored)) {
          oldest = e.stored.get();
          break;
        }
      }
    }
    if (oldest == nullptr) break;
    oldest->synchronize();
    ++waits;
    poll_locked();
  }
  return waits;
}

std::vector<int64_t> OffloadEngine::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  poll_locked();
  return {bytes_offloaded_, bytes_fetched_,   bytes_prefetched_, d2h_bytes_in_flight_,
          device_bytes_held_, host_bytes_held_, fetches_,         exposed_fetches_,
          static_cast<int64_t>(exposed_wait_us_), static_cast<int64_t>(entries_.size())};
}

void OffloadEngine::reset_counters() {
  std::lock_guard<std::mutex> lock(mutex_);
  bytes_offloaded_ = bytes_fetched_ = bytes_prefetched_ = 0;
  fetches_ = exposed_fetches_ = 0;
  exposed_wait_us_ = 0.0;
}

int64_t copy_engine_count(int64_t device_index) {
#ifdef HASTEN_WITH_CUDA
  int count = -1;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrAsyncEngineCount, static_cast<int>(device_index)) != cudaSuccess) {
    cudaGetLastError();  // clear it: the answer is "unknown", not an error for later calls
    return -1;
  }
  return count;
#else
  (void)device_index;
  return -1;
#endif
}

}  // namespace hasten
