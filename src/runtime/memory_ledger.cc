#include "runtime/memory_ledger.h"

#include <malloc.h>

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

void MemoryLedger::Sample(const char* phase) {
  const int64_t heap = HeapInUse() - baseline_;
  if (heap <= peak_bytes_) return;
  peak_bytes_ = heap;
  peak_phase_ = phase;
  int64_t categorised = 0;
  for (int c = 0; c < kMemKinds - 1; ++c) {
    at_peak_[c] = live_[c];
    categorised += live_[c];
  }
  at_peak_[kMemKinds - 1] = heap - categorised;
}

}  // namespace fsdp::runtime
