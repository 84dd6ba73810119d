// Activation offload engine: saved activations go to pooled pinned host memory on a
// device-to-host copy stream while the compute stream runs on, and come back on a
// host-to-device stream ahead of their use in backward.
//
// Every hand-off is a c10::Event (device-generic: CUDA streams on GPU tensors, plain
// synchronous copies on CPU tensors):
//   offload:  compute --ready--> D2H copy --stored--> (device source released)
//   prefetch: compute --alloc--> H2D copy --restored--> compute waits in fetch()
// A device buffer is released only after the event of the copy that reads it has completed
// (polled, never record_stream), and a host block returns to the pool only after both of its
// copies have completed. The Python side (hasten.memory.offload) decides what to offload and
// when to prefetch; this class does the copies and the accounting.
#pragma once

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/custom_class.h>
#include <torch/types.h>

#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "offload/host_pool.h"

namespace hasten {

class OffloadEngine : public torch::CustomClassHolder {
 public:
  explicit OffloadEngine(int64_t max_cached_host_bytes);
  ~OffloadEngine() override;

  // Starts copying the whole storage of `tensor` (every view of it is restorable) to the host,
  // ordered after the work already queued on the current stream. Returns a ticket.
  int64_t offload(const at::Tensor& tensor);
  // Starts the copy back to the device (no-op when it is already on its way or there).
  void prefetch(int64_t ticket);
  // The restored storage (uint8 [nbytes] on the tensor's device), safe to use on the current
  // stream: the stream waits for the copy back, and a wait that was not already over is counted
  // as exposed, with its duration measured on the device. Callers rebuild their views on it.
  at::Tensor fetch(int64_t ticket);
  // Drops the engine's copies of `ticket` once no copy still reads them.
  void release(int64_t ticket);
  // Releases what completed copies have freed; returns the number of tickets still held.
  int64_t poll();
  // Waits for every copy in flight (end of step, tests).
  void synchronize();
  // Blocks the host, oldest device-to-host copy first, until at most `max_bytes` of them are in
  // flight, releasing their device sources; returns how many copies it waited for. A host that
  // runs ahead of the device (no syncs in a step) would otherwise still hold, at the loss, the
  // device copies of every layer whose offload the device has not reached yet: allocated memory
  // is the host's view, and only a completed copy lets the allocator hand the block out again.
  int64_t bound_in_flight(int64_t max_bytes);
  // [bytes_offloaded, bytes_fetched, bytes_prefetched, d2h_bytes_in_flight, device_bytes_held,
  //  host_bytes_held, fetches, exposed_fetches, exposed_wait_us, tickets]
  std::vector<int64_t> stats();
  void reset_counters();
  // The host pool's limit (the offload guard's, hasten.memory.offload.OffloadManager): a miss frees
  // cached blocks first so that the pool's page-locked bytes stay under it.
  void set_host_limit(int64_t limit_bytes) { host_pool_.set_limit(limit_bytes); }
  // Frees the pool's cached blocks (after the memory preflight's probes, whose sizes the run's
  // batches do not reuse); returns the bytes freed.
  int64_t trim_host_pool() { return host_pool_.trim(); }
  // HostPool::stats(): [in_use_bytes, cached_bytes, allocated_bytes, hits, misses, pinned]
  std::vector<int64_t> host_pool_stats() { return host_pool_.stats(); }

 private:
  struct Entry {
    int64_t nbytes = 0;
    c10::Device device{c10::kCPU};
    at::Tensor device_source;  // uint8 [nbytes] view of the offloaded storage, held until `stored`
    at::Tensor host;           // uint8 [nbytes], pooled (pinned on CUDA builds)
    at::Tensor restored;       // uint8 [nbytes] on the device, once prefetched
    std::unique_ptr<c10::Event> stored;    // D2H complete (null: synchronous copy)
    std::unique_ptr<c10::Event> restored_ready;  // H2D complete (null: synchronous copy)
    bool fetched_once = false;
  };
  struct StallTiming {  // bracketing events around a wait that was not over
    std::unique_ptr<c10::Event> before, after;
  };
  struct Streams {
    c10::Stream d2h, h2d;
  };

  Entry& entry(int64_t ticket, const char* method);
  const Streams& streams_for(c10::Device device);
  static bool done(const std::unique_ptr<c10::Event>& event) { return !event || event->query(); }
  void start_prefetch(Entry& e);
  void poll_locked();

  std::mutex mutex_;  // hooks run on the autograd engine's threads too
  HostPool host_pool_;
  std::unordered_map<int64_t, Entry> entries_;
  std::deque<int64_t> awaiting_store_;  // tickets whose D2H copy may still run, in issue order
  std::vector<Entry> retired_;          // released while a copy still read them
  std::vector<StallTiming> stall_timings_;
  std::unordered_map<c10::DeviceIndex, Streams> streams_;
  int64_t next_ticket_ = 1;

  int64_t bytes_offloaded_ = 0, bytes_fetched_ = 0, bytes_prefetched_ = 0;
  int64_t d2h_bytes_in_flight_ = 0, device_bytes_held_ = 0, host_bytes_held_ = 0;
  int64_t fetches_ = 0, exposed_fetches_ = 0;
  double exposed_wait_us_ = 0.0;
};

// Device-to-host/host-to-device copy engines of a CUDA device (cudaDevAttrAsyncEngineCount);
// -1 where unknown (CPU build).
int64_t copy_engine_count(int64_t device_index);

}  // namespace hasten
