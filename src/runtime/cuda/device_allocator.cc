#include "runtime/cuda/device_allocator.h"

#include <algorithm>

#include <fmt/format.h>

namespace fsdp::runtime::cuda {

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

DeviceAllocator::~DeviceAllocator() {
  ProcessPending(true);
  (void)EmptyCache();
}

// Frees are queued in the order they happen and the GPU runs each stream in order, so, as in
// PyTorch's process_events, the queue is read from the front and the reading stops at the first
// block still in use: a query or two per allocation, not one per pending block.
void DeviceAllocator::ProcessPending(bool wait) {
  // a query that finds an event not ready records that as the last error, which would replace a
  // launch error the engine has not checked yet: leave the queue for the next allocation then
  if (!wait && cudaPeekAtLastError() != cudaSuccess) return;
  auto done = [&](Block* b) {
    for (cudaEvent_t e : b->pending) {
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
    Block* b = pending_.front();
    pending_.pop_front();
    for (cudaEvent_t e : b->pending) events_.Give(e);
    b->pending.clear();
    pools_[b->stream].emplace(b->size, b);
  }
}

DeviceAllocator::Block* DeviceAllocator::TakeCached(int64_t size, cudaStream_t stream) {
  auto& pool = pools_[stream];
  auto it = pool.lower_bound(size);
  // best fit, no splitting: accept at most 1/8 waste (blocks of a training step recur in few sizes)
  if (it == pool.end() || it->first > size + size / 8 + 512) return nullptr;
  Block* b = it->second;
  pool.erase(it);
  return b;
}

Error DeviceAllocator::OutOfMemory(int64_t size, MemCategory category, const std::string& why) const {
  int largest = 0;
  for (MemCategory c : kRuntimeCategories) {
    if (At(live_, c) > live_[largest]) largest = static_cast<int>(c);
  }
  return Error::OutOfMemory(fmt::format("out of memory at {}: {:.2f} MiB of {} requested with {:.2f} MiB allocated ({}; largest category {} "
                                      "{:.2f} MiB)",
                                      namer_(phase_), size / kMiB, MemCategoryKey(category), allocated_ / kMiB, why,
                                      MemCategoryKey(static_cast<MemCategory>(largest)), live_[largest] / kMiB));
}

Result<DeviceBuffer> DeviceAllocator::Allocate(int64_t bytes, MemCategory category, cudaStream_t stream) {
  const int64_t size = RoundUp(std::max<int64_t>(bytes, 1));
  if (limit_ > 0 && allocated_ + size > limit_) return OutOfMemory(size, category, fmt::format("--memory-limit {:.2f} MiB", limit_ / kMiB));
  ProcessPending(false);
  Block* b = TakeCached(size, stream);
  if (b == nullptr) {
    void* ptr = nullptr;
    cudaError_t code = cudaMalloc(&ptr, static_cast<size_t>(size));
    if (code != cudaSuccess) {  // as PyTorch: wait for pending frees, return the cache, try once more
      cudaGetLastError();
      if (Status s = device_wait_(); !s.ok()) {
        return Error::RunFailed(fmt::format("{} (the out-of-memory retry at {} waited for the device)", s.error().message, namer_(phase_)));
      }
      ProcessPending(true);  // every event has completed: no wait
      b = TakeCached(size, stream);
      if (b == nullptr) {
        if (Status s = EmptyCache(); !s.ok()) return s.error();
        code = cudaMalloc(&ptr, static_cast<size_t>(size));
        if (code != cudaSuccess) {
          cudaGetLastError();
          return OutOfMemory(size, category, "cudaMalloc failed");
        }
      }
    }
    if (b == nullptr) {
      b = &blocks_[ptr];
      *b = Block{ptr, size, size, stream, category, {}};
      reserved_ += size;
      peak_reserved_ = std::max(peak_reserved_, reserved_);
      ++mallocs_;
    }
  }
  b->category = category;
  b->used = size;  // a cached block may be up to 1/8 larger: count what was asked for, as the planner's replay does
  allocated_ += size;
  live_[static_cast<int>(category)] += size;
  if (allocated_ > peak_allocated_) {
    peak_allocated_ = allocated_;
    at_peak_ = live_;
    peak_phase_ = phase_;
  }
  return DeviceBuffer(this, b->ptr, bytes);
}

void DeviceAllocator::Free(void* ptr, std::initializer_list<cudaStream_t> also_used_on) {
  auto it = blocks_.find(ptr);
  if (it == blocks_.end()) return;
  Block& b = it->second;
  allocated_ -= b.used;
  live_[static_cast<int>(b.category)] -= b.used;
  for (cudaStream_t s : also_used_on) {
    if (s == b.stream) continue;
    auto e = events_.Take();
    if (!e.ok()) {
      cudaStreamSynchronize(s);  // no event to be had: make the stream's work complete instead
      continue;
    }
    cudaEventRecord(e.value(), s);
    b.pending.push_back(e.value());
  }
  if (b.pending.empty()) {
    pools_[b.stream].emplace(b.size, &b);
  } else {
    pending_.push_back(&b);
  }
}

Status DeviceAllocator::EmptyCache() {
  for (auto& [stream, pool] : pools_) {
    while (!pool.empty()) {  // each entry leaves the pool before its block is freed: none dangles if one fails
      const auto [size, block] = *pool.begin();
      pool.erase(pool.begin());
      void* ptr = block->ptr;
      blocks_.erase(ptr);
      reserved_ -= size;
      const cudaError_t code = cudaFree(ptr);
      if (code != cudaSuccess) return Error::RunFailed(fmt::format("cudaFree: {}", cudaGetErrorString(code)));
    }
  }
  return {};
}

}  // namespace fsdp::runtime::cuda
