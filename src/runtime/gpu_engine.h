// fsdp-run's FSDP engine on an NVIDIA GPU (CUDA + cuBLAS + NCCL), built when CMake finds the CUDA
// toolkit. The same FSDP semantics as the CPU engine (fsdp_engine.h), executed as PyTorch FSDP
// does on a GPU: parameters gathered in param_dtype into flat per-unit buffers on an all-gather
// stream, gradients reduce-scattered in reduce_dtype on a reduce-scatter stream, both
// synchronised with the compute stream through CUDA events; forward and backward prefetch; the
// limit_all_gathers rate limiter (at most two resharded-but-unfinished units before the CPU
// waits); fp32 sharded parameters, gradients and AdamW states; dynamic loss scaling for fp16
// (ShardedGradScaler's: loss gradient scaled, shards unscaled, a step with inf/NaN on any rank
// skipped); full (block) and selective (attention probabilities) activation checkpointing.
// Memory comes from a caching allocator with per-category accounting, plus the device's own view
// (cudaMemGetInfo) of the CUDA context, cuBLAS and NCCL. Times come from CUDA events.
//
// virtual_world N > 0 runs rank 0 of an N-GPU configuration on one GPU: shards, buffers and
// activations sized for N ranks, collectives replaced by device copies of the same sizes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/json_io.h"
#include "core/workload.h"
#include "runtime/comm.h"
#include "runtime/fsdp_engine.h"
#include "runtime/loss_scaler.h"
#include "runtime/memory_ledger.h"

namespace fsdp::runtime {

struct GpuMemoryReport {
  int64_t peak_allocated_bytes = 0, peak_reserved_bytes = 0, device_mallocs = 0;
  CategoryBytes at_peak{};  ///< allocated bytes by category at the allocated peak
  std::string peak_phase;
  int64_t device_total_bytes = 0;
  int64_t context_bytes = 0;    ///< device memory in use once the CUDA context exists (cudaMemGetInfo)
  int64_t cublas_bytes = 0;     ///< growth after creating the cuBLAS handle and a first product
  int64_t nccl_bytes = 0;       ///< growth after creating the NCCL communicators and a first collective on each
  int nccl_communicators = 0;   ///< how many NCCL communicators nccl_bytes covers (0 in a virtual world)
  int64_t device_used_bytes = 0;  ///< in use at the end (total - free): context, libraries and the allocator's reserve
};

/// Per step, from CUDA events on the compute stream: the first micro-batch's forward; the rest
/// of the micro-batches through the last gradient reduction; the optimizer step.
struct GpuPhaseTimes {
  std::vector<double> forward_s, backward_s, optimizer_s;
  /// Per step, how often the host found the device still working and waited: the end of the
  /// step (its three streams), the fp16 inf check, FSDP1's rate limiter, the caching allocator's
  /// out-of-memory retry; never per micro-batch.
  std::vector<int64_t> host_waits;
};

class GpuEngine {
 public:
  virtual ~GpuEngine() = default;
  /// One optimizer step; synchronizes the device before returning the loss averaged over every rank's tokens.
  virtual Result<float> Step(int64_t step_index) = 0;
  virtual void set_memory_limit(int64_t bytes) = 0;
  virtual GpuMemoryReport memory() const = 0;
  virtual GpuPhaseTimes times() const = 0;
  virtual const CommStats& shard_stats() const = 0;
  virtual const CommStats& replica_stats() const = 0;
  virtual int64_t shard_world() const = 0;
  virtual std::string device_name() const = 0;
  /// The loss scale and the steps skipped for inf/NaN gradients (every rank agrees).
  virtual const LossScaler& loss_scaler() const = 0;
};

/// True when fsdp-run was built with the CUDA backend.
bool GpuBackendBuilt();
/// The number of CUDA devices; RunFailed naming the reason when there is none or no CUDA backend.
Result<int> GpuDeviceCount();

/// The GPU of a rank: its rank on this node (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
/// MPI_LOCALRANKID or LOCAL_RANK) modulo the devices, else its global rank modulo the devices.
int GpuDeviceOfRank(int rank, int devices);

/// cudaDeviceProp::name of the device rank `rank` would use, e.g. "NVIDIA H200".
Result<std::string> GpuDeviceName(int rank);

/// fsdp-run calibrate --device cuda: measures on this rank's GPU, in `dtype`, the GEMMs at the
/// model's linear shapes (forward and both backward products, `tokens` rows), the engine's
/// attention (forward and backward at batch x seq), a 1 GiB device-to-device copy, and (with more
/// than one rank) NCCL all-gather, reduce-scatter and all-reduce from 4 KiB to max_collective_bytes.
/// Returns `catalog` (the GPU's hardware JSON, already validated) with the measured efficiencies
/// (matmul and attention: their rates over the datasheet peak of `dtype`; memory_bandwidth),
/// measured_collectives and sources; rank 0's is the result. Operands are random (N(0, 1)).
Result<Json> CalibrateGpu(const ModelSpec& model, Comm& host, const Json& catalog, DType dtype, int64_t tokens, int64_t seq_len, int repeats,
                          int64_t max_collective_bytes);

/// One process per GPU: a rank uses device local_rank % devices (OMPI_COMM_WORLD_LOCAL_RANK,
/// SLURM_LOCALID, MPI_LOCALRANKID or LOCAL_RANK), else rank % devices. virtual_world > 0 needs a
/// single process and stands for that many ranks.
Result<std::unique_ptr<GpuEngine>> CreateGpuEngine(const Workload& workload, Comm& host, const TrainOptions& options, int virtual_world);

}  // namespace fsdp::runtime
