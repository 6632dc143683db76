// Measured memory of one fsdp-run rank: live bytes of the engine's own buffers by category, the
// process heap in use (glibc mallinfo2) sampled at every phase, and the categories at the heap's
// peak. What the heap holds beyond the categorised buffers is reported as temporaries.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>

#include "core/phase.h"
#include "core/status.h"
#include "core/vocabulary.h"

namespace fsdp::runtime {

class MemoryLedger {
 public:
  MemoryLedger();
  void Add(MemCategory category, int64_t bytes);
  void Sub(MemCategory category, int64_t bytes) { Add(category, -bytes); }
  /// The phase the engine is in (core/phase.h); samples are taken in it.
  void set_phase(const Phase& phase) { phase_ = phase; }
  /// Names a phase in messages (the engine's PhaseName of its workload).
  void set_namer(std::function<std::string(const Phase&)> namer) { namer_ = std::move(namer); }
  /// Samples the heap; remembers the categories if this is the highest heap seen. With a limit
  /// set, returns OutOfMemory naming the phase and the largest category when the heap exceeds it.
  Status Sample();
  /// Rehearses an out-of-memory: bytes above the baseline the rank may use (0: no limit).
  void set_limit(int64_t bytes) { limit_ = bytes; }

  int64_t peak_bytes() const { return peak_bytes_; }   ///< heap in use at its highest sample, minus the baseline
  const CategoryBytes& at_peak() const { return at_peak_; }
  const Phase& peak_phase() const { return peak_phase_; }
  int64_t live(MemCategory category) const { return live_[static_cast<int>(category)]; }

 private:
  int64_t baseline_ = 0;
  int64_t limit_ = 0;   // heap in use before the engine allocated anything
  CategoryBytes live_{};
  CategoryBytes at_peak_{};
  int64_t peak_bytes_ = 0;
  Phase phase_{StepPhase::kInitialisation}, peak_phase_{StepPhase::kInitialisation};
  std::function<std::string(const Phase&)> namer_ = [](const Phase&) { return std::string("this phase"); };
};

/// Bytes of the process heap in use now (glibc mallinfo2().uordblks + hblkhd).
int64_t HeapInUse();

}  // namespace fsdp::runtime
