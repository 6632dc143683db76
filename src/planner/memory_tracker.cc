#include "planner/memory_tracker.h"

#include <limits>

#include "core/dtype.h"
#include "planner/activation_model.h"

namespace fsdp {

MemoryTracker::MemoryTracker(int64_t rounding_bytes, bool record_timeline)
    : rounding_(rounding_bytes > 0 ? rounding_bytes : 1), record_(record_timeline) {
  blocks_.reserve(1024);
}

MemoryTracker::MemoryTracker(int64_t rounding_bytes, bool record_timeline, const AllocatorConfig& config, int64_t limit_bytes,
                             int64_t device_bytes, bool one_stream)
    : MemoryTracker(rounding_bytes, record_timeline) {
  one_stream_ = one_stream;
  device_memory_ = std::make_unique<CountingDeviceMemory>(limit_bytes, device_bytes);
  allocator_ = std::make_unique<CachingAllocator>(config, *device_memory_);
}

MemoryTracker::~MemoryTracker() = default;

// The stream that uses a pool's buffers after they are freed: FSDP1 record_stream()s an all-gather
// output to the compute stream at its reshard, autograd's gradient to the post-backward stream, an
// all-gather's input to the unshard stream.
static Stream UserOf(MemoryTracker::Pool pool) {
  switch (pool) {
    case MemoryTracker::Pool::kAllGather: return Stream::kCompute;
    case MemoryTracker::Pool::kPostBackward: return Stream::kReduce;
    case MemoryTracker::Pool::kAllGatherInput: return Stream::kUnshard;
  }
  return Stream::kCompute;
}

BlockId MemoryTracker::Alloc(MemCategory category, int64_t bytes, Stream stream) {
  if (bytes <= 0) return kNoBlock;
  int64_t rounded = RoundUp(bytes, rounding_);
  CachingAllocator::Handle handle = CachingAllocator::kNoHandle;
  int64_t reserved_peak_before = 0;
  bool synchronized = false;
  if (allocator_ && !oom_) {  // PyTorch raises at the first failed malloc: the replay stops there
    reserved_peak_before = allocator_->stats().reserved_peak_bytes;
    const int64_t retries_before = allocator_->stats().num_alloc_retries;
    handle = allocator_->Malloc(bytes, AllocatorStream(stream));
    if (handle == CachingAllocator::kNoHandle && !oom_) {
      oom_ = true;
      oom_phase_ = phase_;
    }
    synchronized = allocator_->stats().num_alloc_retries > retries_before;  // the retry synchronized the device
  }
  // ids are never reused: the replay compares handles to tell whether a reduction returned the
  // block it was given (MemoryModel's Reduce), which a reused id would fake
  const auto id = static_cast<BlockId>(blocks_.size());
  blocks_.push_back(Block{category, rounded, handle, id, stream});
  Log(HistoryEvent::Action::kAlloc, id, bytes, stream, category);
  // the pending buffers' releases logged after the malloc that synchronized, which a replay of the
  // log then retries the same way (AllocatorOnly logs its mallocs first too)
  if (synchronized) ReleaseAllPending();
  live_[static_cast<int>(category)] += rounded;
  allocated_total_ += rounded;
  Changed();
  if (allocator_ && allocator_->stats().reserved_peak_bytes > reserved_peak_before) {
    reserved_peak_phase_ = phase_;
    reserved_peak_before_reset_ = false;
  }
  return id;
}

void MemoryTracker::AllocatorOnly(const std::vector<int64_t>& bytes, Stream stream) {
  if (!allocator_ || oom_) return;
  const int64_t reserved_peak_before = allocator_->stats().reserved_peak_bytes;
  std::vector<CachingAllocator::Handle> handles;
  handles.reserve(bytes.size());
  const int64_t first_address = kAllocatorOnlyAddress + allocator_only_blocks_;
  for (int64_t b : bytes) {
    if (b <= 0) continue;
    Log(HistoryEvent::Action::kAlloc, kAllocatorOnlyAddress + allocator_only_blocks_++, b, stream, MemCategory::kFramework);
    const int64_t retries_before = allocator_->stats().num_alloc_retries;
    const CachingAllocator::Handle h = allocator_->Malloc(b, AllocatorStream(stream));
    if (allocator_->stats().num_alloc_retries > retries_before) ReleaseAllPending();  // the retry synchronized the device
    if (h == CachingAllocator::kNoHandle) {  // PyTorch would raise here as at any malloc
      oom_ = true;
      oom_phase_ = phase_;
      break;
    }
    handles.push_back(h);
  }
  for (CachingAllocator::Handle h : handles) allocator_->Free(h);
  for (int64_t a = first_address; a < kAllocatorOnlyAddress + allocator_only_blocks_; ++a) {
    Log(HistoryEvent::Action::kFreeCompleted, a, 0, stream, MemCategory::kFramework);
  }
  if (allocator_->stats().reserved_peak_bytes > reserved_peak_before) {
    reserved_peak_phase_ = phase_;
    reserved_peak_before_reset_ = false;
  }
}

void MemoryTracker::Recategorize(BlockId block, MemCategory category) {
  if (block == kNoBlock) return;
  Block& b = blocks_[block];
  live_[static_cast<int>(b.category)] -= b.bytes;
  b.category = category;
  live_[static_cast<int>(category)] += b.bytes;
  Changed();
}

void MemoryTracker::Free(BlockId& block) {
  if (block == kNoBlock) return;
  Block& b = blocks_[block];
  Log(HistoryEvent::Action::kFreeCompleted, b.id, b.bytes, b.stream, b.category);
  FreeBlock(b);
  block = kNoBlock;
}

void MemoryTracker::FreeBlock(Block& b) {
  live_[static_cast<int>(b.category)] -= b.bytes;
  allocated_total_ -= b.bytes;
  b.bytes = 0;
  if (allocator_ && b.handle != CachingAllocator::kNoHandle) allocator_->Free(b.handle);
  Changed();
}

void MemoryTracker::FreeToPending(BlockId& block, Pool pool) {
  if (block == kNoBlock) return;
  Block& b = blocks_[block];
  if (allocator_ && b.handle != CachingAllocator::kNoHandle) allocator_->RecordStream(b.handle, AllocatorStream(UserOf(pool)));
  // a use on its own stream needs no event (one_stream; an all-gather output the compute stream
  // made): the block is back in its pool at once, as after Free
  Log(Deferred(pool, b) ? HistoryEvent::Action::kFreeRequested : HistoryEvent::Action::kFreeCompleted, b.id, b.bytes, b.stream, b.category);
  pending_[static_cast<int>(pool)].push_back(b);
  pending_bytes_[static_cast<int>(b.category)] += b.bytes;
  pending_total_ += b.bytes;
  FreeBlock(b);
  block = kNoBlock;
}

CategoryBytes MemoryTracker::DeviceNow() const {
  CategoryBytes now = live_;
  for (size_t c = 0; c < now.size(); ++c) now[c] += pending_bytes_[c];
  return now;
}

bool MemoryTracker::Deferred(Pool pool, const Block& block) const { return AllocatorStream(UserOf(pool)) != AllocatorStream(block.stream); }

void MemoryTracker::Release(Pool pool, const Block& block) {
  if (Deferred(pool, block)) Log(HistoryEvent::Action::kFreeCompleted, block.id, block.bytes, block.stream, block.category);
  pending_bytes_[static_cast<int>(block.category)] -= block.bytes;
  pending_total_ -= block.bytes;
  if (allocator_) allocator_->EventsPassed(block.handle);
}

int64_t MemoryTracker::ReservedNow(const CategoryBytes& device) const {
  return allocator_ ? allocator_->stats().reserved_bytes : TotalBytes(device);
}

void MemoryTracker::ResetPeaks() {
  allocated_peak_ = allocated_total_;
  allocated_peak_phase_ = phase_;
  device_peak_ = DeviceNow();
  device_peak_total_ = allocated_total_ + pending_total_;
  device_peak_phase_ = phase_;
  pending_at_peak_ = pending_total_;
  timeline_.clear();
  if (record_) timeline_.push_back(TrackedPoint{phase_, device_peak_, ReservedNow(device_peak_)});  // where the measured step starts
  if (allocator_) {
    allocator_->ResetPeaks();
    reserved_peak_before_reset_ = true;
  }
}

void MemoryTracker::ReleaseOldestPending(Pool pool) {
  auto& queue = pending_[static_cast<int>(pool)];
  if (queue.empty()) return;
  Release(pool, queue.front());
  queue.pop_front();
  Changed();
}

void MemoryTracker::ReleaseAllButNewest(Pool pool) {
  while (PendingCount(pool) >= 2) ReleaseOldestPending(pool);
}

std::vector<size_t> MemoryTracker::PendingCounts() const {
  std::vector<size_t> counts;
  for (const auto& queue : pending_) counts.push_back(queue.size());
  return counts;
}

void MemoryTracker::ReleaseAllPending(Pool pool) {
  for (const Block& b : pending_[static_cast<int>(pool)]) Release(pool, b);
  pending_[static_cast<int>(pool)].clear();
  Changed();
}

void MemoryTracker::ReleaseAllPending() {
  for (int p = 0; p < kPoolCount; ++p) ReleaseAllPending(static_cast<Pool>(p));
}

void MemoryTracker::Changed() {
  const int64_t allocated = allocated_total_;
  if (allocated > allocated_peak_) {
    allocated_peak_ = allocated;
    allocated_peak_phase_ = phase_;
  }
  const int64_t total = allocated + pending_total_;
  if (total > device_peak_total_ || record_) {
    CategoryBytes device = live_;
    for (int c = 0; c < kMemCategoryCount; ++c) device[c] += pending_bytes_[c];
    if (total > device_peak_total_) {
      device_peak_total_ = total;
      device_peak_ = device;
      device_peak_phase_ = phase_;
      pending_at_peak_ = pending_total_;
    }
    if (record_) timeline_.push_back(TrackedPoint{phase_, device, ReservedNow(device)});
  }
}

TransientsBetween::~TransientsBetween() {
  for (Pending& p : pending_) mem_.Free(p.block);
}

BlockId TransientsBetween::AllocAfterFrees(int64_t bytes) {
  for (Pending& p : pending_) {
    if (p.left-- == 0) mem_.Free(p.block);
  }
  std::erase_if(pending_, [](const Pending& p) { return p.block == kNoBlock; });
  return mem_.Alloc(MemCategory::kActivations, bytes);
}

void TransientsBetween::AllocTransient(int64_t bytes) { pending_.push_back({AllocAfterFrees(bytes), std::numeric_limits<int>::max()}); }

BlockId TransientsBetween::Alloc(const SavedTensor& tensor) {
  for (const SavedTensor::Transient& t : tensor.made_before) pending_.push_back({AllocAfterFrees(t.bytes), t.outlives});
  const BlockId saved = AllocAfterFrees(tensor.bytes);
  if (tensor.then_transient_bytes > 0) {
    pending_.push_back({mem_.Alloc(MemCategory::kActivations, tensor.then_transient_bytes), tensor.then_transient_spans});
  }
  return saved;
}

}  // namespace fsdp
