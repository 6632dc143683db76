// Collectives on device buffers for fsdp-run's GPU engine, enqueued on a CUDA stream: NCCL
// (ncclAllGather, ncclReduceScatter, ncclAllReduce; one process per GPU, the communicator's
// unique id broadcast over the host Comm, so one binary runs on one node or many under mpirun),
// and a "virtual world": rank 0 of N ranks on one GPU, every collective replaced by device copies
// of the sizes the real one writes, so an N-GPU plan's per-GPU memory and compute run on one card.
// Each call is timed with CUDA events; CollectTimes() adds the elapsed times once the work is done.
// A communicator runs its collectives one after another whatever stream they are issued on (NCCL
// does; so does PyTorch, which issues every collective of a process group on one stream): each
// call's stream first waits for the previous call's end, so a timed interval is the collective's
// own and not a wait for the one before it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "runtime/comm.h"
#include "runtime/cuda/cuda_check.h"

namespace fsdp::runtime::cuda {

class DeviceComm {
 public:
  virtual ~DeviceComm();
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// out (size() * count) = every rank's in (count), in rank order.
  Status AllGather(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream);
  /// out (count) = sum over ranks of in[rank() * count, (rank() + 1) * count).
  Status ReduceScatter(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream);
  /// data (count) = sum over ranks, in place.
  Status AllReduce(void* data, int64_t count, DType dtype, cudaStream_t stream);
  /// The ranks with the same color, ordered by key.
  virtual Result<std::unique_ptr<DeviceComm>> Split(int color, int key) = 0;
  /// Adds the elapsed times of completed collectives to stats(); call after synchronizing.
  Status CollectTimes();
  /// After a failure: stops this rank's pending collectives (ncclCommAbort) so that freeing device
  /// memory and exiting cannot wait for peers that will never join; the communicator is unusable.
  virtual void Abort() {}
  /// RunFailed naming an asynchronous failure of this communicator's collectives (NCCL's
  /// ncclCommGetAsyncError: a peer that died, a broken network), which would otherwise leave them
  /// waiting forever; ok while there is none.
  virtual Status AsyncError() { return {}; }
  const CommStats& stats() const { return stats_; }
  /// Forgets the counts and times so far (after a warm-up); pending timings are dropped.
  Status ClearStats();

 protected:
  enum class Kind { kAllGather, kReduceScatter, kAllReduce };
  virtual Status DoAllGather(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) = 0;
  virtual Status DoReduceScatter(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream) = 0;
  virtual Status DoAllReduce(void* data, int64_t count, DType dtype, cudaStream_t stream) = 0;

 private:
  struct Timed {
    Kind kind;
    cudaEvent_t start, end;
  };
  template <typename Call>
  Status Time(Kind kind, int64_t bytes, cudaStream_t stream, Call&& call);
  std::vector<Timed> timed_;
  EventPool events_{cudaEventDefault};  // timing events
  cudaEvent_t last_end_ = nullptr;      // the end of the latest collective, whatever its stream
  CommStats stats_;
};

/// Waits until `event` has completed, polling `comms` (null entries skipped) for asynchronous NCCL
/// errors every 256 queries, as PyTorch's NCCL watchdog does, so that a collective that can never
/// finish (a peer that died, a broken network) ends the wait with NCCL's error instead of a hang.
/// A launch error pending before the wait is returned first (a not-ready query would replace it).
/// Spins (with yields) as cudaEventSynchronize does by default. *found_busy, when given, says
/// whether the first query found the work unfinished.
Status WaitForEvent(cudaEvent_t event, std::initializer_list<DeviceComm*> comms, bool* found_busy = nullptr);

/// One communicator over every rank of `host` (bootstrap), on the current device.
Result<std::unique_ptr<DeviceComm>> MakeNcclComm(Comm& host);
/// Rank 0 of `virtual_size` ranks on this GPU.
std::unique_ptr<DeviceComm> MakeVirtualComm(int virtual_size);

}  // namespace fsdp::runtime::cuda
