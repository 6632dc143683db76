#include "planner/comm_model.h"

#include <algorithm>

namespace fsdp {
namespace {

CommGroup ShardGroup(const Workload& w) {
  return {w.shard_world, std::min(w.shard_world, w.config.gpus_per_node)};
}

// Replicas of one shard: one per shard group. Shard groups of at least a node put one replica per
// node; smaller ones put gpus_per_node / W replicas on each node.
CommGroup ReplicaGroup(const Workload& w) {
  if (w.config.strategy == Strategy::kNoShard) return {w.config.gpus, std::min(w.config.gpus, w.config.gpus_per_node)};
  const int64_t per_node = std::max<int64_t>(1, w.config.gpus_per_node / w.shard_world);
  return {w.replicas, std::min(w.replicas, per_node)};
}

// Decoder blocks have identical sizes: remember the last answer per collective.
class CollectiveCache {
 public:
  CollectiveCache(const CommGroup& group, const HardwareSpec& hw) : group_(group), hw_(hw) {}
  CollectiveEstimate Get(Collective c, int64_t bytes) {
    Entry& e = entries_[static_cast<int>(c)];
    if (e.bytes != bytes) e = {bytes, EstimateCollective(c, bytes, group_, hw_)};
    return e.estimate;
  }

 private:
  struct Entry {
    int64_t bytes = -1;
    CollectiveEstimate estimate;
  };
  CommGroup group_;
  const HardwareSpec& hw_;
  Entry entries_[3];
};

}  // namespace

bool RegathersInBackward(const Workload& w, int u) {
  if (w.units[u].is_root) return false;
  return w.config.strategy == Strategy::kFullShard || w.config.strategy == Strategy::kHybridShard;
}

int64_t AllGathersPerStep(const Workload& w, int u) {
  return w.ForwardGathersPerStep() + (RegathersInBackward(w, u) ? w.config.grad_accum : 0);
}

CommModel EstimateComm(const Workload& w) {
  CommModel cm;
  cm.shard_group = ShardGroup(w);
  cm.replica_group = ReplicaGroup(w);
  const FsdpConfig& c = w.config;
  const int64_t p = BytesPerElement(c.param_dtype), r = BytesPerElement(c.reduce_dtype), m = BytesPerElement(c.master_dtype);
  const int64_t micro = c.grad_accum;
  const int64_t reductions = c.no_sync ? 1 : micro;  // no_sync reduces once per step
  const bool no_shard = c.strategy == Strategy::kNoShard;
  CommVolume& v = cm.volume;
  CollectiveCache shard_cache(cm.shard_group, w.hardware), replica_cache(cm.replica_group, w.hardware);
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const WrapUnit& unit = w.units[u];
    UnitComm uc;
    if (unit.numel == 0) { cm.units.push_back(uc); continue; }
    const int64_t gathers = AllGathersPerStep(w, u);  // forward and backward, every micro-batch
    if (no_shard) {
      auto ar = replica_cache.Get(Collective::kAllReduce, unit.numel * r);
      uc.all_reduce_s = ar.time_s;
      v.all_reduce_bytes += reductions * unit.numel * r;
      v.all_reduce_count += ar.time_s > 0 ? reductions : 0;
      v.sent_bytes += static_cast<double>(reductions * unit.numel * r) * BusFactor(Collective::kAllReduce, cm.replica_group.ranks);
    } else {
      auto ag = shard_cache.Get(Collective::kAllGather, unit.padded_numel * p);
      auto rs = shard_cache.Get(Collective::kReduceScatter, unit.padded_numel * r);
      uc.all_gather_s = ag.time_s;
      uc.reduce_scatter_s = rs.time_s;
      const int64_t gathers_bwd = RegathersInBackward(w, u) ? micro : 0;
      if (ag.time_s > 0) {
        const int64_t gathers_fwd = w.ForwardGathersPerStep();
        v.forward_all_gather_bytes += gathers_fwd * unit.padded_numel * p;
        v.forward_all_gather_count += gathers_fwd;
        v.backward_all_gather_bytes += gathers_bwd * unit.padded_numel * p;
        v.backward_all_gather_count += gathers_bwd;
        v.reduce_scatter_bytes += reductions * unit.padded_numel * r;
        v.reduce_scatter_count += reductions;
      }
      const double ag_factor = BusFactor(Collective::kAllGather, cm.shard_group.ranks);
      v.sent_bytes += static_cast<double>(gathers * unit.padded_numel * p + reductions * unit.padded_numel * r) * ag_factor;
      if (c.strategy == Strategy::kHybridShard && w.replicas > 1) {
        auto ar = replica_cache.Get(Collective::kAllReduce, unit.shard_numel * r);
        uc.all_reduce_s = ar.time_s;
        v.all_reduce_bytes += reductions * unit.shard_numel * r;
        v.all_reduce_count += reductions;
        v.sent_bytes += static_cast<double>(reductions * unit.shard_numel * r) * BusFactor(Collective::kAllReduce, cm.replica_group.ranks);
      }
    }
    if (c.cpu_offload) {
      uc.host_to_device_s = HostCopySeconds(unit.shard_numel * m, w.hardware);
      uc.device_to_host_s = HostCopySeconds(unit.shard_numel * m, w.hardware);
      v.host_to_device_bytes += gathers * unit.shard_numel * m;
      v.device_to_host_bytes += reductions * unit.shard_numel * m;
    }
    const int64_t device_gathers = no_shard ? 0 : gathers;
    v.total_comm_s += static_cast<double>(device_gathers) * uc.all_gather_s +
                      static_cast<double>(reductions) * (uc.reduce_scatter_s + uc.all_reduce_s + uc.device_to_host_s) +
                      static_cast<double>(c.cpu_offload ? device_gathers : 0) * uc.host_to_device_s;
    cm.units.push_back(uc);
  }
  return cm;
}

}  // namespace fsdp
