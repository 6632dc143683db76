// fsdp-sim: one FSDP training step played out on the discrete-event engine, in PyTorch's order of
// operations (docs/simulator.md), from the same Workload, compute and collective models as fsdp-plan.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/workload.h"
#include "planner/comm_model.h"
#include "planner/compute_model.h"
#include "planner/memory_model.h"
#include "sim/engine.h"

namespace fsdp::sim {

struct SimOptions {
  double launch_overhead_s = 5e-6;       ///< CPU time per launched kernel or collective
  int kernels_per_block = 25;            ///< kernels a block's forward launches (backward: twice)
  bool separate_process_groups = false;  ///< all-gathers and reduce-scatters on separate NCCL streams
  bool blocking_collectives = false;     ///< collectives on the compute stream (engines without overlap, e.g. fsdp-run on CPU)
  double bandwidth_override = 0;         ///< > 0: intra- and inter-node bandwidth per GPU, bytes/s (what-if)
  double latency_scale = 1.0;            ///< multiplies collective latencies (0 for the bandwidth-only limit)
  double compute_scale = 1.0;            ///< multiplies compute times (0: communication only)
  // per-rank mode
  int64_t ranks = 0;                     ///< 0: aggregate (one rank stands for all); > 0 simulate that many ranks
  double jitter = 0;                     ///< per-rank, per-op compute time spread (uniform +-jitter)
  uint64_t seed = 1;
  std::map<int64_t, double> slow_ranks;  ///< rank -> compute time factor (1.1 = 10% slower)
  // known durations instead of the models' (golden tests)
  std::optional<ComputeModel> compute_override;               ///< per-unit compute and optimizer times
  std::optional<std::vector<UnitComm>> collective_override;   ///< per-unit collective times, latency 0
};

struct OpRecord {
  std::string name;
  int stream = 0;
  int rank = 0;
  double start_s = 0, end_s = 0;
  char kind = 'C';                       ///< C compute, A all-gather, R reduce-scatter, D all-reduce, H/h host copies, O optimizer, W wait
};

/// Rank 0's CPU thread: launches, waits (the rate limiter, stream syncs) and host work.
struct CpuRecord {
  double start_s = 0, end_s = 0;
  char kind = 'L';   ///< L launch, W wait, H host work
  std::string name;  ///< the op launched, or the host work
};

struct MemorySample {
  double time_s = 0;
  int64_t bytes = 0;                     ///< allocated: the tensors' device bytes plus the terms outside the allocator
  int64_t reserved_bytes = 0;            ///< reserved: the caching allocator's segments plus the same terms
};

struct SimResult {
  double step_s = 0;
  double compute_s = 0;                  ///< rank 0's compute-stream busy time
  double comm_s = 0;                     ///< rank 0's collective busy time (union of the comm streams)
  double exposed_comm_s = 0;             ///< step - compute
  double overlap_pct = 0;                ///< share of communication hidden behind compute
  double cpu_blocked_s = 0;              ///< rank 0's CPU time blocked by the rate limiter or syncs
  std::vector<std::string> stream_names; ///< per stream
  std::vector<double> stream_utilization;
  int64_t peak_bytes = 0;                ///< reserved + outside-allocator terms at the steady-state peak (fsdp-plan's peak)
  int64_t allocated_peak_bytes = 0;      ///< the highest `bytes` sample
  /// The caching allocator's figures of the same replay, as fsdp-plan reports them
  /// (MemoryEstimate): tensors only, the allocator's blocks (torch.cuda.max_memory_allocated),
  /// active blocks (active_bytes.all.peak), reserved, fragmentation, cache over the tensors, retries.
  struct Allocator {
    int64_t allocated_peak_bytes = 0;
    int64_t allocated_blocks_peak_bytes = 0;
    int64_t active_peak_bytes = 0;
    int64_t reserved_peak_bytes = 0;
    std::string reserved_peak_phase;
    int64_t fragmentation_bytes = 0;
    int64_t reserved_over_allocated_peak_bytes = 0;
    int64_t alloc_retries = 0;
  } allocator;
  double peak_time_s = 0;
  std::string peak_phase;
  int64_t capacity_bytes = 0;
  std::vector<OpRecord> ops;
  std::vector<MemorySample> memory;
  std::vector<CpuRecord> cpu;            ///< rank 0's CPU thread
  int64_t events = 0;
  double wall_s = 0;                     ///< real time the simulation took
};

/// Simulates one optimizer step. BadInput for inconsistent options (negative bandwidth, ...).
Result<SimResult> Simulate(const Workload& workload, const SimOptions& options);

}  // namespace fsdp::sim
