// Per-GPU (and host) memory of one FSDP training step, by category, with the peak and when it
// happens. The step is played out as a sequence of allocations and frees in PyTorch's order of
// operations (docs/memory-model.md gives each one and its source).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/phase.h"
#include "core/schedule.h"
#include "core/vocabulary.h"
#include "core/workload.h"

namespace fsdp {

/// Framework terms that are not tensors of the model. Defaults come from the hardware file and
/// documented PyTorch / NCCL constants (FrameworkOverheadsFor); each can be overridden.
struct FrameworkOverheads {
  int64_t cuda_context_bytes = 0;             ///< outside PyTorch's allocator
  int64_t nccl_bytes_per_communicator = 0;    ///< NCCL channel buffers, outside PyTorch's allocator
  int64_t cublas_workspace_bytes = 0;         ///< allocated through the caching allocator
  double fragmentation_fraction = 0.0;        ///< reserved-but-unallocated share of the allocated peak
  int64_t allocation_rounding_bytes = 512;    ///< caching-allocator block rounding (kMinBlockSize)
};

/// Defaults for a workload: context from the hardware file, NCCL buffers from NCCL's default
/// buffer sizes, cuBLAS workspace from PyTorch's CublasHandlePool.cpp for the architecture.
FrameworkOverheads FrameworkOverheadsFor(const Workload& workload);

/// One point of the memory timeline: device bytes by category after an event.
struct MemoryPoint {
  std::string phase;
  StepPhase kind = StepPhase::kStart;
  int node = -1;        ///< module-tree node the phase belongs to (-1: none)
  int micro = 0;        ///< micro-batch
  int64_t action = -1;  ///< the schedule action (counted over the step's micro-batches) that made the change
  CategoryBytes device{};
};

/// Extra memory and file sizes of saving a checkpoint after the step.
struct CheckpointMemory {
  int64_t full_gpu_extra_bytes = 0;            ///< FULL_STATE_DICT, offload_to_cpu=False: per rank
  int64_t full_offload_gpu_extra_bytes = 0;    ///< FULL_STATE_DICT, offload_to_cpu=True: per rank
  int64_t full_offload_host_rank0_bytes = 0;   ///< host memory of rank 0 with offload_to_cpu
  int64_t full_offload_host_per_node_bytes = 0;  ///< host memory per node with offload_to_cpu, rank0_only=False
  int64_t full_optim_host_rank0_bytes = 0;     ///< full optimizer state dict gathered on rank 0
  int64_t sharded_gpu_extra_bytes = 0;         ///< SHARDED_STATE_DICT (DCP): writes from the shards in place
  int64_t model_file_bytes = 0;                ///< model state dict on disk (master dtype)
  int64_t optimizer_file_bytes = 0;            ///< optimizer state on disk
  int64_t sharded_file_bytes_per_rank = 0;     ///< DCP files written by each rank (model + optimizer)
};

struct MemoryEstimate {
  CategoryBytes peak{};              ///< device bytes by category at the peak (framework included)
  int64_t peak_bytes = 0;            ///< sum of `peak`: what the GPU must hold
  std::string peak_phase;            ///< when the peak happens
  int64_t allocated_peak_bytes = 0;  ///< tensors only: torch.cuda.max_memory_allocated()
  std::string allocated_peak_phase;
  int64_t pending_free_bytes_at_peak = 0;  ///< freed unsharded buffers still in use by the GPU at the peak
  int64_t capacity_bytes = 0;
  bool fits = false;
  int64_t headroom_bytes = 0;        ///< capacity - peak (negative when it does not fit)
  CategoryBytes host{};              ///< host bytes per rank (CPU offload)
  int64_t host_bytes = 0;
  FrameworkOverheads overheads;
  CheckpointMemory checkpoint;
  std::vector<MemoryPoint> timeline; ///< filled when requested
};

struct MemoryOptions {
  FrameworkOverheads overheads;
  bool record_timeline = false;
};

/// Plays out one optimizer step (grad_accum micro-batches + optimizer step) at steady state
/// (optimizer states exist, gradients were set to None by zero_grad) and returns the memory.
MemoryEstimate EstimateMemory(const Workload& workload, const MemoryOptions& options);

/// The tensors alone (no framework terms; capacity and fits not set): what depends on the model and
/// configuration but not on the GPU type, so that a search can reuse it across GPU types.
MemoryEstimate EstimateTensorMemory(const Workload& workload, int64_t rounding_bytes, bool record_timeline);
/// The same on a schedule already built for `workload` (BuildSchedule), as a search reuses one.
MemoryEstimate EstimateTensorMemory(const Workload& workload, const Schedule& schedule, int64_t rounding_bytes, bool record_timeline);

/// Adds the framework terms (cuBLAS workspaces, CUDA context, NCCL buffers, fragmentation) to a
/// tensor estimate and compares the peak with the workload's GPU.
/// `with_timeline` false skips copying the timeline (searches do not keep it).
MemoryEstimate AddFrameworkTerms(const Workload& workload, const FrameworkOverheads& overheads, const MemoryEstimate& tensors,
                                 bool with_timeline = true);

/// Same with FrameworkOverheadsFor(workload).
MemoryEstimate EstimateMemory(const Workload& workload);

/// Optimizer state bytes per element of the sharded parameters (AdamW/Adam 8, SGD momentum 4, SGD 0).
int64_t OptimizerStateBytesPerParam(Optimizer optimizer);

}  // namespace fsdp
