// Time of one NCCL collective: latency + bytes / bus bandwidth, with the algorithm and protocol
// NCCL's own tuning model would pick (docs/time-model.md gives every constant and its source).
#pragma once

#include <cstdint>
#include <string_view>

#include "core/hardware_spec.h"
#include "core/vocabulary.h"

namespace fsdp {

/// The ranks taking part: `ranks` in total, `ranks_per_node` of them on each node.
struct CommGroup {
  int64_t ranks = 1;
  int64_t ranks_per_node = 1;
  int64_t Nodes() const { return (ranks + ranks_per_node - 1) / ranks_per_node; }
};

struct CollectiveEstimate {
  double time_s = 0;
  double latency_s = 0;           ///< the part of time_s that does not depend on bandwidth
  double algbw_bytes_per_s = 0;   ///< nccl-tests algbw = size / time
  double busbw_bytes_per_s = 0;   ///< algbw * BusFactor
  std::string_view algorithm = "none";  ///< "ring", "tree", "nvls", or "none" for one rank
  std::string_view protocol = "none";   ///< "LL", "LL128", "Simple"
};

/// `size_bytes` is nccl-tests' size: the all-gather output, the reduce-scatter input, the
/// all-reduce buffer. One rank (or zero bytes) costs nothing.
CollectiveEstimate EstimateCollective(Collective c, int64_t size_bytes, const CommGroup& group, const HardwareSpec& hw);

/// Host<->device copy of `bytes` over PCIe (CPU offload), with the same efficiency curve.
double HostCopySeconds(int64_t bytes, const HardwareSpec& hw);

}  // namespace fsdp
