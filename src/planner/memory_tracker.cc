#include "planner/memory_tracker.h"

#include "core/dtype.h"

namespace fsdp {

MemoryTracker::MemoryTracker(int64_t rounding_bytes, bool record_timeline)
    : rounding_(rounding_bytes > 0 ? rounding_bytes : 1), record_(record_timeline) {}

void MemoryTracker::SetPhase(std::string phase) { phase_ = std::move(phase); }

BlockId MemoryTracker::Alloc(MemCategory category, int64_t bytes) {
  if (bytes <= 0) return kNoBlock;
  int64_t rounded = RoundUp(bytes, rounding_);
  blocks_.push_back(Block{category, rounded});
  live_[static_cast<int>(category)] += rounded;
  Changed();
  return static_cast<BlockId>(blocks_.size() - 1);
}

void MemoryTracker::Free(BlockId& block) {
  if (block == kNoBlock) return;
  Block& b = blocks_[block];
  live_[static_cast<int>(b.category)] -= b.bytes;
  b.bytes = 0;
  block = kNoBlock;
  Changed();
}

void MemoryTracker::FreeToPending(BlockId& block) {
  if (block == kNoBlock) return;
  pending_.push_back(blocks_[block].bytes);
  pending_bytes_ += blocks_[block].bytes;
  Free(block);
}

void MemoryTracker::ReleaseOldestPending() {
  if (pending_.empty()) return;
  pending_bytes_ -= pending_.front();
  pending_.pop_front();
  Changed();
}

void MemoryTracker::ReleaseAllPending() {
  pending_.clear();
  pending_bytes_ = 0;
  Changed();
}

void MemoryTracker::Changed() {
  int64_t allocated = TotalBytes(live_);
  if (allocated > allocated_peak_) {
    allocated_peak_ = allocated;
    allocated_peak_phase_ = phase_;
  }
  CategoryBytes device = live_;
  device[static_cast<int>(MemCategory::kUnshardedParams)] += pending_bytes_;
  int64_t total = allocated + pending_bytes_;
  if (total > device_peak_total_) {
    device_peak_total_ = total;
    device_peak_ = device;
    device_peak_phase_ = phase_;
    pending_at_peak_ = pending_bytes_;
  }
  if (record_) timeline_.push_back(MemoryPoint{phase_, device});
}

}  // namespace fsdp
