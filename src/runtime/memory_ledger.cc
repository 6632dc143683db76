#include "runtime/memory_ledger.h"

#include <malloc.h>

#include <fmt/format.h>

namespace fsdp::runtime {

const char* MemKey(Mem m) {
  static const char* kKeys[] = {"sharded_params", "unsharded_params", "gradients", "optimizer_states", "activations", "comm_buffers", "temporaries"};
  return kKeys[static_cast<int>(m)];
}

int64_t HeapInUse() {
  const struct mallinfo2 info = mallinfo2();
  return static_cast<int64_t>(info.uordblks + info.hblkhd);
}

MemoryLedger::MemoryLedger() : baseline_(HeapInUse()) {}

void MemoryLedger::Add(Mem category, int64_t bytes) { live_[static_cast<int>(category)] += bytes; }

Status MemoryLedger::Sample(const char* phase) {
  const int64_t heap = HeapInUse() - baseline_;
  if (limit_ > 0 && heap > limit_) {
    int largest = 0;
    for (int c = 1; c < kMemKinds - 1; ++c) if (live_[c] > live_[largest]) largest = c;
    return Error::RunFailed(fmt::format("out of memory at {}: {:.2f} MiB in use > --memory-limit {:.2f} MiB (largest category {} {:.2f} MiB)",
                                        phase, heap / 1048576.0, limit_ / 1048576.0, MemKey(static_cast<Mem>(largest)), live_[largest] / 1048576.0));
  }
  if (heap <= peak_bytes_) return {};
  peak_bytes_ = heap;
  peak_phase_ = phase;
  int64_t categorised = 0;
  for (int c = 0; c < kMemKinds - 1; ++c) {
    at_peak_[c] = live_[c];
    categorised += live_[c];
  }
  at_peak_[kMemKinds - 1] = heap - categorised;
  return {};
}

}  // namespace fsdp::runtime
