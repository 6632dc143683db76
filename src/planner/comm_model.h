// The collectives of one training step, per GPU: what FSDP issues for each wrap unit, their sizes
// (nccl-tests convention) and their times from the collective model.
#pragma once

#include <cstdint>
#include <vector>

#include "core/schedule.h"
#include "core/workload.h"
#include "planner/collective_model.h"

namespace fsdp {

/// The time of one collective, and the part of it that does not depend on bandwidth.
struct CollectiveTime {
  double time_s = 0;
  double latency_s = 0;
};

/// One unit's collectives and copies, each once (time 0 when the strategy issues none).
struct UnitComm {
  CollectiveTime all_gather;      ///< the unit's all-gather (shard group, param_dtype)
  CollectiveTime reduce_scatter;  ///< its gradient's reduce-scatter (shard group, reduce_dtype)
  CollectiveTime all_reduce;      ///< NO_SHARD's all-reduce, or HYBRID_SHARD's replica all-reduce of the shard
  double host_to_device_s = 0;        ///< CPU offload: the shard copied to the GPU before each unshard
  double device_to_host_s = 0;        ///< CPU offload: the gradient shard copied to the host
  /// A group hooked at several modules (WrapUnit::hook_nodes) reduces once per module: each
  /// site's reduce-scatter, replica all-reduce and host copy (empty: the unit's, above)
  std::vector<CollectiveTime> site_reduce_scatter{}, site_all_reduce{};
  std::vector<double> site_device_to_host_s{};
  const CollectiveTime& ReduceScatterAt(int site) const { return site_reduce_scatter.empty() ? reduce_scatter : site_reduce_scatter.at(static_cast<size_t>(site)); }
  const CollectiveTime& AllReduceAt(int site) const { return site_all_reduce.empty() ? all_reduce : site_all_reduce.at(static_cast<size_t>(site)); }
  double DeviceToHostAt(int site) const { return site_device_to_host_s.empty() ? device_to_host_s : site_device_to_host_s.at(static_cast<size_t>(site)); }
};

/// Totals per optimizer step and per GPU. Sizes follow nccl-tests (all-gather output,
/// reduce-scatter input, all-reduce buffer); sent_bytes are what the GPU puts on its links.
struct CommVolume {
  int64_t forward_all_gather_bytes = 0, forward_all_gather_count = 0;
  int64_t backward_all_gather_bytes = 0, backward_all_gather_count = 0;
  int64_t reduce_scatter_bytes = 0, reduce_scatter_count = 0;
  int64_t all_reduce_bytes = 0, all_reduce_count = 0;   ///< NO_SHARD gradients, HYBRID_SHARD replicas
  int64_t host_to_device_bytes = 0, device_to_host_bytes = 0;
  double sent_bytes = 0;          ///< sum of size * BusFactor over all collectives
  double total_comm_s = 0;        ///< sum of all collective and copy times (no overlap)
  /// Of the all-gather and reduce-scatter (NO_SHARD: all-reduce) bytes above, the routed experts'
  /// elements (TensorSpec::active_share < 1): FSDP moves every expert of a unit whichever experts
  /// the tokens pick
  int64_t routed_expert_gather_bytes = 0, routed_expert_reduce_bytes = 0;
};

struct CommModel {
  std::vector<UnitComm> units;    ///< indexed like Workload::units
  CommVolume volume;
  CommGroup shard_group;          ///< ranks of the all-gathers and reduce-scatters
  CommGroup replica_group;        ///< HYBRID_SHARD's replica all-reduce / NO_SHARD's all-reduce
};

/// Builds the per-unit collective times and the per-step volume: as many collectives as the
/// schedule issues.
CommModel EstimateComm(const Workload& workload, const Schedule& schedule);
CommModel EstimateComm(const Workload& workload);

}  // namespace fsdp
