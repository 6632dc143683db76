#include "runtime/cuda/device_allocator.h"

#include <algorithm>

#include <fmt/format.h>

#ifdef FSDP_CUDA_EMU
#include "runtime/cuda/emu/emu.h"
#endif

namespace fsdp::runtime::cuda {

// The device side of the policy: segments from cudaMalloc, returned with cudaFree; the first
// failure of either is kept for the caller to report. Expandable segments are refused up front
// (DeviceAllocator::Configure), so the virtual-memory calls are never made.
class DeviceAllocator::CudaMemory final : public DeviceMemory {
 public:
  explicit CudaMemory(const std::function<Status()>* wait) : wait_(wait) {}
  std::optional<uint64_t> Malloc(int64_t bytes) override {
    void* ptr = nullptr;
    if (cudaMalloc(&ptr, static_cast<size_t>(bytes)) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory: PyTorch clears it and frees the cache first
      return std::nullopt;
    }
    return reinterpret_cast<uint64_t>(ptr);
  }
  void Free(uint64_t address, int64_t) override {
    const cudaError_t code = cudaFree(reinterpret_cast<void*>(address));
    if (code != cudaSuccess && error_.ok()) error_ = Error::RunFailed(fmt::format("cudaFree: {}", cudaGetErrorString(code)));
  }
  uint64_t ReserveAddressRange(int64_t) override { return 0; }
  bool Map(uint64_t, int64_t) override { return false; }
  void Unmap(uint64_t, int64_t) override {}
  // Asked for a per_process_memory_fraction, at the policy's construction (and for expandable
  // segments, refused here); cudaMemGetInfo makes the context if none exists yet.
  int64_t TotalBytes() const override {
    size_t free_bytes = 0, total_bytes = 0;
    const bool ok = cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess;
    (void)cudaGetLastError();
    return ok ? static_cast<int64_t>(total_bytes) : int64_t{80} << 30;
  }
  bool Synchronize() override {
    Status s = (*wait_)();
    synchronized_ = true;
    if (!s.ok() && error_.ok()) error_ = s;
    return s.ok();
  }
  /// Whether Synchronize ran since the last call (every recorded event has completed then).
  bool TakeSynchronized() { return std::exchange(synchronized_, false); }
  Status TakeError() { return std::exchange(error_, Status::Ok()); }

 private:
  const std::function<Status()>* wait_;
  bool synchronized_ = false;
  Status error_;
};

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = other.owner_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.owner_ = nullptr;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Release(std::initializer_list<cudaStream_t> also_used_on) {
  if (owner_ != nullptr && ptr_ != nullptr) owner_->Free(ptr_, also_used_on);
  owner_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceAllocator::DeviceAllocator()
    : memory_(std::make_unique<CudaMemory>(&device_wait_)), policy_(std::make_unique<CachingAllocator>(AllocatorConfig{}, *memory_)) {}

DeviceAllocator::~DeviceAllocator() {
  // the engine's wait may poll communicators already destroyed: wait for the device itself
  device_wait_ = [] { return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); };
  ProcessPending(true);
  (void)EmptyCache();
}

Status DeviceAllocator::Configure(const AllocatorConfig& config) {
  if (config.expandable_segments) {
    return Error::BadInput("--alloc-conf expandable_segments:True: fsdp-run's GPU engine allocates with cudaMalloc, not the driver's "
                           "virtual-memory API that expandable segments need (fsdp-plan and fsdp-sim model it)");
  }
  if (!live_blocks_.empty() || policy_->stats().reserved_bytes > 0) return Error::RunFailed("the allocator is configured before its first allocation");
  policy_ = std::make_unique<CachingAllocator>(config, *memory_);
  return {};
}

int DeviceAllocator::StreamId(cudaStream_t stream) {
  auto [it, added] = stream_ids_.emplace(stream, static_cast<int>(stream_ids_.size()));
  return it->second;
}

// Frees are queued in the order they happen and the GPU runs each stream in order, so, as in
// PyTorch's process_events, the queue is read from the front and the reading stops at the first
// block still in use: a query or two per allocation, not one per pending block.
void DeviceAllocator::ProcessPending(bool wait) {
  // a query that finds an event not ready records that as the last error, which would replace a
  // launch error the engine has not checked yet: leave the queue for the next allocation then
  if (!wait && cudaPeekAtLastError() != cudaSuccess) return;
  auto done = [&](const Pending& p) {
    for (cudaEvent_t e : p.events) {
      const cudaError_t code = wait ? cudaEventSynchronize(e) : cudaEventQuery(e);
      if (code == cudaErrorNotReady) {
        (void)cudaGetLastError();  // not an error, but the runtime records it as the last one (as PyTorch clears it)
        return false;
      }
      if (code != cudaSuccess) return false;
    }
    return true;
  };
  while (!pending_.empty() && done(pending_.front())) {
    for (cudaEvent_t e : pending_.front().events) events_.Give(e);
    policy_->EventsPassed(pending_.front().handle);
    pending_.pop_front();
  }
}

// The policy's out-of-memory path waited for the device and returned every pending block to its
// pool: the events are spent, and their handles may already serve new blocks.
void DeviceAllocator::DropPendingAfterSync() {
  if (!memory_->TakeSynchronized()) return;
  for (Pending& p : pending_) {
    for (cudaEvent_t e : p.events) events_.Give(e);
  }
  pending_.clear();
}

Error DeviceAllocator::OutOfMemory(int64_t size, MemCategory category, const std::string& why) const {
  int largest = 0;
  for (MemCategory c : kRuntimeCategories) {
    if (At(live_, c) > live_[largest]) largest = static_cast<int>(c);
  }
  return Error::OutOfMemory(fmt::format("out of memory at {}: {:.2f} MiB of {} requested with {:.2f} MiB allocated, {:.2f} MiB reserved ({}; "
                                        "largest category {} {:.2f} MiB)",
                                        namer_(phase_), size / kMiB, MemCategoryKey(category), allocated_ / kMiB, reserved() / kMiB, why,
                                        MemCategoryKey(static_cast<MemCategory>(largest)), live_[largest] / kMiB));
}

Result<DeviceBuffer> DeviceAllocator::Allocate(int64_t bytes, MemCategory category, cudaStream_t stream) {
  const int64_t size = RoundUp(std::max<int64_t>(bytes, 1));
  if (limit_ > 0 && allocated_ + size > limit_) return OutOfMemory(size, category, fmt::format("--memory-limit {:.2f} MiB", limit_ / kMiB));
  ProcessPending(false);
  const int sid = StreamId(stream);
  const CachingAllocator::Handle h = policy_->Malloc(std::max<int64_t>(bytes, 1), sid);
  DropPendingAfterSync();
  if (Status s = memory_->TakeError(); !s.ok()) {
    return Error::RunFailed(fmt::format("{} (the out-of-memory retry at {} waited for the device)", s.error().message, namer_(phase_)));
  }
  if (h == CachingAllocator::kNoHandle) return OutOfMemory(size, category, "cudaMalloc failed after the cache was freed");
  void* ptr = reinterpret_cast<void*>(policy_->BlockAddress(h));
#ifdef FSDP_CUDA_EMU
  fsdp::emu::RegisterBlock(ptr, static_cast<size_t>(policy_->BlockBytes(h)));  // stream order per block, not per segment
#endif
  live_blocks_[ptr] = Live{h, size, sid, category};
  allocated_ += size;
  live_[static_cast<int>(category)] += size;
  if (allocated_ > peak_allocated_) {
    peak_allocated_ = allocated_;
    at_peak_ = live_;
    peak_phase_ = phase_;
  }
  return DeviceBuffer(this, ptr, bytes);
}

void DeviceAllocator::Free(void* ptr, std::initializer_list<cudaStream_t> also_used_on) {
  auto it = live_blocks_.find(ptr);
  if (it == live_blocks_.end()) return;
  const Live b = it->second;
  live_blocks_.erase(it);
  allocated_ -= b.used;
  live_[static_cast<int>(b.category)] -= b.used;
  Pending pending{b.handle, {}};
  for (cudaStream_t s : also_used_on) {
    const int sid = StreamId(s);
    if (sid == b.stream) continue;
    auto e = events_.Take();
    if (!e.ok()) {
      cudaStreamSynchronize(s);  // no event to be had: make the stream's work complete instead
      continue;
    }
    cudaEventRecord(e.value(), s);
    pending.events.push_back(e.value());
    policy_->RecordStream(b.handle, sid);
  }
  policy_->Free(b.handle);
  if (!pending.events.empty()) pending_.push_back(std::move(pending));
}

Status DeviceAllocator::EmptyCache() {
  ProcessPending(true);
  policy_->EmptyCache();
  DropPendingAfterSync();
  return memory_->TakeError();
}

}  // namespace fsdp::runtime::cuda
