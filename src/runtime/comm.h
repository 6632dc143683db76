// Collective communication for fsdp-run: an abstract interface with a single-process backend and
// an MPI backend (NCCL will implement the same interface). Every call reports failures as a
// Status instead of aborting, so every rank can print one line and exit.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace fsdp::runtime {

/// Bytes moved and time spent per collective kind, for nccl-tests style reporting.
struct CommStats {
  int64_t all_gather_bytes = 0, reduce_scatter_bytes = 0, all_reduce_bytes = 0;  ///< nccl-tests sizes
  int64_t all_gather_count = 0, reduce_scatter_count = 0, all_reduce_count = 0;
  double all_gather_s = 0, reduce_scatter_s = 0, all_reduce_s = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// out (size() * n) = every rank's `in` (n floats), in rank order.
  virtual Status AllGather(const float* in, float* out, int64_t n) = 0;
  /// Non-blocking AllGather (prefetch): `in` and `out` must stay alive until Wait(handle).
  virtual Result<int> StartAllGather(const float* in, float* out, int64_t n) = 0;
  virtual Status Wait(int handle) = 0;
  /// out (n) = sum over ranks of their in[rank() * n, (rank() + 1) * n).
  virtual Status ReduceScatter(const float* in, float* out, int64_t n) = 0;
  /// data (n) = sum over ranks, in place.
  virtual Status AllReduce(float* data, int64_t n) = 0;
  /// data (bytes) = rank `root`'s data on every rank (NCCL's unique id travels this way).
  virtual Status Broadcast(void* data, int64_t bytes, int root) = 0;
  /// BadInput on every rank when the ranks pass different values (started with different configurations).
  virtual Status CheckSame(uint64_t value, const std::string& what) = 0;
  /// A communicator of the ranks with the same `color`, ordered by `key`.
  virtual Result<std::unique_ptr<Comm>> Split(int color, int key) = 0;
  const CommStats& stats() const { return stats_; }

 protected:
  CommStats stats_;
};

/// One process: collectives are copies.
std::unique_ptr<Comm> MakeSingleComm();

/// MPI_COMM_WORLD (MPI_Init must have been called); RunFailed when fsdp-run was built without MPI.
Result<std::unique_ptr<Comm>> MakeMpiComm();
bool MpiAvailable();

}  // namespace fsdp::runtime
