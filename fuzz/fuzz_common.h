// What every harness shares: the catalog (models/, hardware/) found from the source tree, and the
// invariant checks on what the tools would print. A failed check aborts: libFuzzer reports it as a
// crash with the input that caused it.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/workload.h"
#include "planner/memory_model.h"
#include "planner/step_model.h"

namespace fsdp::fuzz {

inline void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz invariant broken: %s\n", what);
    std::abort();
  }
}

/// Points FSDPKIT_DATA_DIR at the source tree (FSDP_SOURCE_DIR, set by fuzz/CMakeLists.txt).
inline void UseSourceCatalog() { setenv("FSDPKIT_DATA_DIR", FSDP_SOURCE_DIR, 0); }

/// The planner's figures of an accepted workload: finite, non-negative, MFU at most 1 (the
/// numeric boundary's promise: no inf, nan or wrapped number reaches an output).
inline void CheckPlan(const Workload& w) {
  const MemoryEstimate m = EstimateMemory(w);
  Require(m.peak_bytes >= 0 && m.allocated_peak_bytes >= 0 && m.capacity_bytes > 0, "memory figures are non-negative");
  Require(m.fragmentation_bytes >= 0 && m.reserved_peak_bytes <= m.peak_bytes, "reserved memory is within the peak, fragmentation >= 0");
  Require(m.capacity_bytes == w.hardware.DeviceTotalBytes() && m.capacity_bytes <= w.hardware.memory_bytes, "fits is judged on CUDA's total, at most nvidia-smi's");
  const TimeEstimate t = EstimateTime(w);
  const StepEstimate& s = t.step;
  Require(std::isfinite(s.step_s) && s.step_s > 0, "step time is finite and positive");
  Require(std::isfinite(s.compute_s) && s.compute_s >= 0 && std::isfinite(s.exposed_comm_s) && s.exposed_comm_s >= 0, "compute and exposed communication are finite, >= 0");
  Require(std::isfinite(s.tokens_per_s_per_gpu) && s.tokens_per_s_per_gpu > 0, "tokens/s is finite");
  Require(s.mfu >= 0 && s.mfu <= 1, "MFU is within [0, 1]");
}

}  // namespace fsdp::fuzz
