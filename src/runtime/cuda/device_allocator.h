// fsdp-run's GPU engine's device allocator: the one caching-allocator policy of the planner
// (core/caching_allocator.h, PyTorch's DeviceCachingAllocator: 512-byte rounding, small and large
// pools, splitting, per-stream caches, record_stream frees deferred to events, the free-and-retry
// path) over a cudaMalloc/cudaFree backend. One policy, two backends: the planner replays on a
// counting one, this engine runs on the device.
//
// Accounting: every block carries a category (sharded params, gradients, ...). "allocated" is
// the sum of the live requests rounded to 512 B (not the size of the block serving them) and
// falls at Free() (a block waiting on another stream's event no longer counts): the series
// depends only on the order of calls. "reserved" is the policy's: the segments cudaMalloc gave.
// The categories are recorded at the allocated peak, with the phase the engine named last.
//
// Contract: one allocator per device, used from one host thread; it must outlive every
// DeviceBuffer it handed out (declare it before them); its destructor waits for pending events
// and returns every block to the device.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "core/caching_allocator.h"
#include "core/phase.h"
#include "core/status.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/memory_ledger.h"

namespace fsdp::runtime::cuda {

class DeviceAllocator;

/// A device allocation that returns itself to the allocator when destroyed (as used only on the
/// stream it was allocated on) or when Release names the other streams that used it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceAllocator* owner, void* ptr, int64_t bytes) : owner_(owner), ptr_(ptr), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Release(); }

  /// Frees now; `also_used_on` lists streams other than the allocating one that read or wrote it.
  void Release(std::initializer_list<cudaStream_t> also_used_on = {});
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  int64_t bytes() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }

 private:
  DeviceAllocator* owner_ = nullptr;
  void* ptr_ = nullptr;
  int64_t bytes_ = 0;
};

class DeviceAllocator {
 public:
  DeviceAllocator();
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  /// `bytes` (> 0; 0 is served as 1) for use on `stream`, counted under `category`: a cached
  /// block of that stream when one fits, else cudaMalloc. Errors: OutOfMemory ("out of memory at
  /// <phase> ...", naming the largest category) when the device, after the retry that returns the
  /// cache, or the limit is exhausted; RunFailed when the retry's wait for the device fails (a
  /// collective NCCL reports broken). On error nothing is allocated.
  Result<DeviceBuffer> Allocate(int64_t bytes, MemCategory category, cudaStream_t stream);
  /// Returns the block at `ptr` (from Allocate) to its stream's pool, at once when no other stream
  /// used it, else once events recorded now on `also_used_on` have completed. Called by
  /// DeviceBuffer::Release; `allocated` drops at once either way.
  void Free(void* ptr, std::initializer_list<cudaStream_t> also_used_on);

  /// The phase the engine is in (core/phase.h), for the peak's report; numbers, as this is called
  /// around every unit's work.
  void set_phase(const Phase& phase) { phase_ = phase; }
  /// Names a phase in messages (the engine's PhaseName of its workload).
  void set_namer(std::function<std::string(const Phase&)> namer) { namer_ = std::move(namer); }
  /// How the out-of-memory retry waits for the device to finish its work before it returns the
  /// cache (cudaFree would wait for it anyway): the engine's waits, which poll NCCL for errors, so
  /// that a collective that can never finish ends the retry with NCCL's error instead of a hang.
  /// cudaDeviceSynchronize until set.
  void set_device_wait(std::function<Status()> wait) { device_wait_ = std::move(wait); }
  /// Rehearses an out-of-memory: allocated bytes may not exceed this (0: no limit).
  void set_limit(int64_t bytes) { limit_ = bytes; }
  /// PYTORCH_CUDA_ALLOC_CONF's settings, before the first allocation. BadInput for
  /// expandable_segments, which needs the driver's virtual-memory API this engine does not use yet.
  Status Configure(const AllocatorConfig& config);
  /// Returns every cached block (in the pools, not the pending ones) to the device with cudaFree,
  /// which waits for the device; RunFailed naming the call if one fails.
  Status EmptyCache();

  /// Bytes of the live requests (rounded to 512), now and at their highest.
  int64_t allocated() const { return allocated_; }
  int64_t peak_allocated() const { return peak_allocated_; }
  /// Bytes cudaMalloc gave and not freed, now and at their highest.
  int64_t reserved() const { return policy_->stats().reserved_bytes; }
  int64_t peak_reserved() const { return policy_->stats().reserved_peak_bytes; }
  /// cudaMalloc calls so far, and mallocs that freed the cache and retried (num_alloc_retries).
  int64_t device_mallocs() const { return policy_->stats().num_device_alloc; }
  int64_t alloc_retries() const { return policy_->stats().num_alloc_retries; }
  /// Allocated bytes by category, and the phase, at the allocated peak.
  const CategoryBytes& at_peak() const { return at_peak_; }
  const Phase& peak_phase() const { return peak_phase_; }
  int64_t live(MemCategory category) const { return live_[static_cast<int>(category)]; }

  /// PyTorch's kMinBlockSize rounding: the size a request of `bytes` is counted as.
  static int64_t RoundUp(int64_t bytes) { return (bytes + 511) / 512 * 512; }

 private:
  class CudaMemory;
  struct Live {
    CachingAllocator::Handle handle = CachingAllocator::kNoHandle;
    int64_t used = 0;  // the rounded request (counted as allocated)
    int stream = 0;
    MemCategory category = MemCategory::kTemporaries;
  };
  struct Pending {
    CachingAllocator::Handle handle;
    std::vector<cudaEvent_t> events;  // on other streams: the block is reusable once all completed
  };
  int StreamId(cudaStream_t stream);
  void ProcessPending(bool wait);
  void DropPendingAfterSync();
  Error OutOfMemory(int64_t size, MemCategory category, const std::string& why) const;

  std::unique_ptr<CudaMemory> memory_;
  std::unique_ptr<CachingAllocator> policy_;
  std::map<cudaStream_t, int> stream_ids_;
  std::map<void*, Live> live_blocks_;
  std::deque<Pending> pending_;  // freed, waiting on events, in order
  EventPool events_{cudaEventDisableTiming};
  CategoryBytes live_{}, at_peak_{};
  int64_t allocated_ = 0, peak_allocated_ = 0, limit_ = 0;
  std::function<Status()> device_wait_ = [] { return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); };
  Phase phase_{StepPhase::kInitialisation}, peak_phase_{StepPhase::kInitialisation};
  std::function<std::string(const Phase&)> namer_ = [](const Phase&) { return std::string("this phase"); };
};

}  // namespace fsdp::runtime::cuda

/// Declares `var`, a DeviceBuffer from an allocation, or returns the allocation's error.
#define FSDP_ALLOC(var, expr)                          \
  auto var##_result = (expr);                          \
  if (!var##_result.ok()) return var##_result.error(); \
  ::fsdp::runtime::cuda::DeviceBuffer var = std::move(var##_result).value()
