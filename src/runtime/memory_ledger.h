// Measured memory of one fsdp-run rank: live bytes of the engine's own buffers by category, the
// process heap in use (glibc mallinfo2) sampled at every phase, and the categories at the heap's
// peak. What the heap holds beyond the categorised buffers is reported as temporaries.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/status.h"

namespace fsdp::runtime {

enum class Mem { kShardedParams, kUnshardedParams, kGradients, kOptimizerStates, kActivations, kCommBuffers, kTemporaries };
constexpr int kMemKinds = 7;
const char* MemKey(Mem m);  ///< "sharded_params", ..., "temporaries"

class MemoryLedger {
 public:
  MemoryLedger();
  void Add(Mem category, int64_t bytes);
  void Sub(Mem category, int64_t bytes) { Add(category, -bytes); }
  /// Samples the heap; remembers the categories if this is the highest heap seen. With a limit
  /// set, returns RunFailed naming the phase and the largest category when the heap exceeds it.
  Status Sample(const char* phase);
  /// Rehearses an out-of-memory: bytes above the baseline the rank may use (0: no limit).
  void set_limit(int64_t bytes) { limit_ = bytes; }

  int64_t peak_bytes() const { return peak_bytes_; }   ///< heap in use at its highest sample, minus the baseline
  const std::array<int64_t, kMemKinds>& at_peak() const { return at_peak_; }
  const std::string& peak_phase() const { return peak_phase_; }
  int64_t live(Mem category) const { return live_[static_cast<int>(category)]; }

 private:
  int64_t baseline_ = 0;
  int64_t limit_ = 0;   // heap in use before the engine allocated anything
  std::array<int64_t, kMemKinds> live_{};
  std::array<int64_t, kMemKinds> at_peak_{};
  int64_t peak_bytes_ = 0;
  std::string peak_phase_;
};

/// Bytes of the process heap in use now (glibc mallinfo2().uordblks + hblkhd).
int64_t HeapInUse();

}  // namespace fsdp::runtime
