#include "runtime/memory_ledger.h"

#include <malloc.h>

#include <fmt/format.h>

namespace fsdp::runtime {

int64_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

MemoryLedger::MemoryLedger() : baseline_(HeapInUse()) {}

void MemoryLedger::Add(MemCategory category, int64_t bytes) { live_[static_cast<int>(category)] += bytes; }

Status MemoryLedger::Sample() {
  const int64_t heap = HeapInUse() - baseline_;
  if (limit_ > 0 && heap > limit_) {
    int largest = 0;
    for (MemCategory c : kRuntimeCategories) {
      if (c != MemCategory::kTemporaries && At(live_, c) > live_[largest]) largest = static_cast<int>(c);
    }
    return Error::OutOfMemory(fmt::format("out of memory at {}: {:.2f} MiB in use > --memory-limit {:.2f} MiB (largest category {} {:.2f} MiB)",
                                        namer_(phase_), heap / kMiB, limit_ / kMiB, MemCategoryKey(static_cast<MemCategory>(largest)), live_[largest] / kMiB));
  }
  if (heap <= peak_bytes_) return {};
  peak_bytes_ = heap;
  peak_phase_ = phase_;
  int64_t categorised = 0;
  for (MemCategory c : kRuntimeCategories) {
    if (c == MemCategory::kTemporaries) continue;
    At(at_peak_, c) = At(live_, c);
    categorised += At(live_, c);
  }
  At(at_peak_, MemCategory::kTemporaries) = heap - categorised;
  return {};
}

}  // namespace fsdp::runtime
