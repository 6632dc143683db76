// Per-GPU (and host) memory of one FSDP training step, by category, with the peak and when it
// happens. The step is played out as a sequence of allocations and frees in PyTorch's order of
// operations (docs/memory-model.md gives each one and its source).
#pragma once

#include <array>
#include <limits>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/allocator_history.h"
#include "core/caching_allocator.h"
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
  int64_t cublas_workspace_bytes = 0;         ///< allocated through the caching allocator (sum of the blocks below)
  std::vector<int64_t> cublas_workspace_blocks;  ///< the workspaces as allocated: per BLAS thread, cuBLAS's then cuBLASLt's
  double fragmentation_fraction = 0.0;        ///< an extra reserve, as a share of the reserved peak (default 0: none)
  int64_t allocation_rounding_bytes = 512;    ///< block rounding of the tensor view (kMinBlockSize)
  AllocatorConfig allocator;                  ///< PYTORCH_CUDA_ALLOC_CONF (--alloc-conf)
  /// false: no caching allocator, the tensors alone are the peak (PYTORCH_NO_CUDA_MEMORY_CACHING=1,
  /// at 512-byte rounding); the hand-counted tests of the tensor replay use it.
  bool caching_allocator = true;
  /// true: every request on one stream, as PyTorch makes them on a CPU device (fsdp-plan
  /// --one-stream), to compare with a CPU recording of the same step; not a GPU's figure.
  bool one_stream = false;
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
  int64_t reserved_bytes = 0;  ///< the caching allocator's reserved bytes then
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
  /// The tensors at their peak, each rounded to the allocator's 512 bytes: PyTorch's
  /// requested_bytes.all.peak, rounded (FSDPMemTracker's figure)
  int64_t allocated_peak_bytes = 0;
  std::string allocated_peak_phase;
  /// torch.cuda.max_memory_allocated() itself, allocated_bytes.all.peak: the allocator's blocks at
  /// their peak, where a block cut from a segment is counted whole when the rest was too small to
  /// split off (CUDACachingAllocator.cpp, malloc: `stats.allocated_bytes[...].increase(
  /// block->size)` after should_split). The replay's; without the allocator, allocated_peak_bytes.
  int64_t allocated_blocks_peak_bytes = 0;
  /// torch.cuda.memory_stats()["active_bytes.all.peak"]: the allocated blocks and the freed ones
  /// still awaiting another stream's event (FSDP1's record_stream'd unsharded parameters and
  /// gradients), at their peak; what torchtune's logs and FSDP's authors call "peak active". Equal
  /// to allocated_blocks_peak_bytes where no block waits (FSDP2). The replay's; without the
  /// allocator, the tensors and the pending buffers at their peak.
  int64_t active_peak_bytes = 0;
  /// The caching allocator's replay (docs/memory-model.md, "The caching allocator"): the steady-state
  /// step's torch.cuda.max_memory_reserved(), when it is reached, reserved minus the allocated blocks
  /// then, and the mallocs that had to free the cache and retry on this card (num_alloc_retries).
  int64_t reserved_peak_bytes = 0;
  std::string reserved_peak_phase;
  int64_t fragmentation_bytes = 0;
  int64_t alloc_retries = 0;
  /// The replay's per-pool reserved bytes and segments at their steady-state peaks
  /// (reserved_bytes.small_pool.peak, segment.large_pool.peak, ...), and its cudaMalloc (or page
  /// map) calls over both steps (num_device_alloc): what torch.cuda.memory_stats() reports.
  PoolStats small_pool, large_pool;
  int64_t device_allocs = 0;
  bool allocator_out_of_memory = false;  ///< a malloc failed even after freeing the cache
  int64_t pending_free_bytes_at_peak = 0;  ///< freed buffers another stream still uses at the peak (FSDP1 record_stream)
  int64_t capacity_bytes = 0;
  bool fits = false;
  /// capacity - peak, or where per_process_memory_fraction caps the allocator lower, that cap -
  /// the reserved peak (and --fragmentation's extra). Negative when it does not fit, but for one
  /// case: the replay on the card ran out of memory where the unlimited one stayed under (fits
  /// false, headroom >= 0)
  int64_t headroom_bytes = 0;
  /// per_process_memory_fraction x capacity: what the caching allocator may reserve (-1: no fraction set)
  int64_t allocator_cap_bytes = -1;
  CategoryBytes host{};              ///< host bytes per rank (CPU offload)
  int64_t host_bytes = 0;
  FrameworkOverheads overheads;
  CheckpointMemory checkpoint;
  std::vector<MemoryPoint> timeline; ///< filled when requested
  /// Every allocator request of the replay, both steps, each named "phase / category"
  /// (ReplayOptions::record_requests); AllocatorHistoryJson writes them.
  std::vector<HistoryEvent> requests;
};

/// What the caching allocator holds over the tensors: the reserved peak minus the allocated peak
/// (max_memory_reserved - max_memory_allocated; the two peaks may fall at different moments).
/// fragmentation_bytes, reserved minus allocated at the reserved peak, is larger wherever little is
/// allocated when reserved peaks (FSDP1's post-backward stream at the backward's end).
inline int64_t ReservedOverAllocatedPeakBytes(const MemoryEstimate& m) { return m.reserved_peak_bytes - m.allocated_peak_bytes; }

struct MemoryOptions {
  FrameworkOverheads overheads;
  bool record_timeline = false;
};

/// Plays out one optimizer step (grad_accum micro-batches + optimizer step) at steady state
/// (optimizer states exist, gradients were set to None by zero_grad) and returns the memory.
MemoryEstimate EstimateMemory(const Workload& workload, const MemoryOptions& options);

/// What the replay takes besides the workload.
struct ReplayOptions {
  int64_t rounding_bytes = 512;
  bool record_timeline = false;
  AllocatorConfig allocator;
  bool caching_allocator = true;                 ///< FrameworkOverheads::caching_allocator
  bool one_stream = false;                       ///< FrameworkOverheads::one_stream
  std::vector<int64_t> cublas_workspace_blocks;  ///< held by the allocator from the first GEMM on
  /// What the allocator may reserve; unlimited, the replay does not depend on the card (a search
  /// reuses it across GPU types of one BLAS workspace size).
  int64_t reserve_limit_bytes = std::numeric_limits<int64_t>::max() / 4;
  /// Sizes expandable segments' address ranges only (1 1/8 of it each). The unlimited replay's is
  /// 1 PiB, so that its ranges never end, as its reserve never does; a card's replay
  /// (ReplayOnCard) sets the card's.
  int64_t device_bytes = int64_t{1} << 50;
  /// Skip the micro-batches that repeat a cycle of states (StepPlayer::PlayMicroBatches); false
  /// plays every one (what tests compare the skipping with)
  bool skip_repeated_micro_batches = true;
  /// Fill MemoryEstimate::requests (every micro-batch played: skip_repeated_micro_batches is ignored)
  bool record_requests = false;
};

/// The tensors and the allocator (no outside-allocator terms; capacity and fits not set).
MemoryEstimate EstimateTensorMemory(const Workload& workload, const Schedule& schedule, const ReplayOptions& options);
MemoryEstimate EstimateTensorMemory(const Workload& workload, const ReplayOptions& options);
/// The replay options of a plan with these overheads (unlimited reserve).
ReplayOptions ReplayOptionsFor(const FrameworkOverheads& overheads, bool record_timeline);

/// Adds the terms outside the allocator (CUDA context, NCCL buffers, the extra reserve) to a
/// replay and judges fits on the reserved peak plus them. When the unlimited replay's reserve does
/// not fit but its tensors do, replays again on the card's memory: freeing the cache and retrying
/// (alloc_retries) may save it, as it does in PyTorch.
/// `with_timeline` false skips copying the timeline (searches do not keep it).
/// `on_card`: the result of ReplayOnCard when a caller has it (a search caches it).
MemoryEstimate AddFrameworkTerms(const Workload& workload, const FrameworkOverheads& overheads, const MemoryEstimate& tensors,
                                 bool with_timeline = true, const MemoryEstimate* on_card = nullptr);
/// The cuBLAS workspaces' bytes when they fill segments of their own (no expandable segments; each
/// large block a whole number of 2 MiB and at least 10 MiB, the small ones 1 MiB pairs filling 2 MiB
/// segments): then a replay without them plus these bytes is the replay with them, and a search
/// can share one replay across GPU types. -1 when they share segments with other allocations.
int64_t IsolatedWorkspaceBytes(const FrameworkOverheads& overheads);
/// Adds `bytes` held through the whole step (framework overhead) to a replay's peaks.
void AddHeldBytes(MemoryEstimate& estimate, int64_t bytes);

/// CUDA context and NCCL buffers: the device memory outside PyTorch's allocator.
int64_t OutsideAllocatorBytes(const Workload& workload, const FrameworkOverheads& overheads);
/// What the allocator may reserve on the workload's card: its memory less OutsideAllocatorBytes.
int64_t ReserveLimitBytes(const Workload& workload, const FrameworkOverheads& overheads);
/// Whether AddFrameworkTerms replays on the card's memory for these tensors, and that replay.
bool NeedsReplayOnCard(const Workload& workload, const FrameworkOverheads& overheads, const MemoryEstimate& tensors);
MemoryEstimate ReplayOnCard(const Workload& workload, const FrameworkOverheads& overheads, bool with_timeline);

/// Same with FrameworkOverheadsFor(workload).
MemoryEstimate EstimateMemory(const Workload& workload);

/// What a routed model's experts (TensorSpec::active_share < 1) keep on each rank between steps:
/// their shards of the parameters (in their storage dtype), and when they train, of the
/// gradients and optimizer states (master dtype). FSDP2's per-parameter shards; FSDP1's flat
/// parameter shards each element once, padding aside. With CPU offload these sit on the host.
struct RoutedExpertBytes {
  int64_t params = 0;            ///< the experts' elements (all of them)
  double active_params_per_token = 0;
  int64_t sharded_param_bytes = 0, gradient_bytes = 0, optimizer_state_bytes = 0;
};
RoutedExpertBytes RoutedExpertBytesPerGpu(const Workload& workload);

/// Optimizer states per parameter: AdamW/Adam 2 (exp_avg, exp_avg_sq), SGD momentum 1, SGD 0.
int OptimizerStateCount(Optimizer optimizer);
/// Optimizer state bytes per element of the sharded parameters: the states are created zeros_like
/// the parameter (torch/optim/adam.py _init_group), so in the master dtype: AdamW 8 on fp32, 4 on bf16.
int64_t OptimizerStateBytesPerParam(Optimizer optimizer, DType master_dtype);

}  // namespace fsdp
