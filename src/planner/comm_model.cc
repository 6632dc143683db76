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
  CollectiveTime Get(Collective c, int64_t bytes) {
    Entry& e = entries_[static_cast<int>(c)];
    if (e.bytes != bytes) {
      const CollectiveEstimate estimate = EstimateCollective(c, bytes, group_, hw_);
      e = {bytes, {estimate.time_s, estimate.latency_s}};
    }
    return e.time;
  }

 private:
  struct Entry {
    int64_t bytes = -1;
    CollectiveTime time;
  };
  CommGroup group_;
  const HardwareSpec& hw_;
  Entry entries_[3];
};

}  // namespace

CommModel EstimateComm(const Workload& w, const Schedule& schedule) {
  CommModel cm;
  cm.shard_group = ShardGroup(w);
  cm.replica_group = ReplicaGroup(w);
  const FsdpConfig& c = w.config;
  const int64_t p = BytesPerElement(c.param_dtype), r = BytesPerElement(c.reduce_dtype), m = BytesPerElement(c.master_dtype);
  const int64_t step_reductions = schedule.Reductions();
  const bool no_shard = c.strategy == Strategy::kNoShard;
  CommVolume& v = cm.volume;
  CollectiveCache shard_cache(cm.shard_group, w.hardware), replica_cache(cm.replica_group, w.hardware);
  cm.units.reserve(w.units.size());
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const WrapUnit& unit = w.units[u];
    UnitComm uc;
    if (unit.numel == 0) { cm.units.push_back(uc); continue; }
    const int64_t gathers_fwd = schedule.ForwardAllGathers(u), gathers_bwd = schedule.BackwardAllGathers(u);
    const int64_t gathers = gathers_fwd + gathers_bwd;
    // only gradients are reduced: a unit with nothing to train has no reduction
    const int64_t reductions = unit.grad_padded_numel > 0 ? step_reductions : 0;
    int64_t experts = 0, trainable_experts = 0;  // the unit's routed-expert elements
    for (int t : unit.tensors) {
      const TensorSpec& ts = w.model.tensors[t];
      if (ts.active_share >= 1) continue;
      experts += ts.numel();
      trainable_experts += ts.trainable ? ts.numel() : 0;
    }
    if (no_shard) {
      v.routed_expert_reduce_bytes += reductions * trainable_experts * r;
      uc.all_reduce = replica_cache.Get(Collective::kAllReduce, unit.numel * r);  // the flat gradient, unpadded
      v.all_reduce_bytes += reductions * unit.numel * r;
      v.all_reduce_count += uc.all_reduce.time_s > 0 ? reductions : 0;
      v.sent_bytes += static_cast<double>(reductions * unit.numel * r) * BusFactor(Collective::kAllReduce, cm.replica_group.ranks);
    } else {
      uc.all_gather = shard_cache.Get(Collective::kAllGather, unit.padded_numel * p);
      uc.reduce_scatter = shard_cache.Get(Collective::kReduceScatter, unit.grad_padded_numel * r);
      if (uc.all_gather.time_s > 0) {
        v.forward_all_gather_bytes += gathers_fwd * unit.padded_numel * p;
        v.forward_all_gather_count += gathers_fwd;
        v.backward_all_gather_bytes += gathers_bwd * unit.padded_numel * p;
        v.backward_all_gather_count += gathers_bwd;
        v.reduce_scatter_bytes += reductions * unit.grad_padded_numel * r;  // the sites' sum, for a group of modules
        v.reduce_scatter_count += reductions * unit.HookSites();
        v.routed_expert_gather_bytes += gathers * experts * p;
        v.routed_expert_reduce_bytes += reductions * trainable_experts * r;
      }
      const double ag_factor = BusFactor(Collective::kAllGather, cm.shard_group.ranks);
      v.sent_bytes += static_cast<double>(gathers * unit.padded_numel * p + reductions * unit.grad_padded_numel * r) * ag_factor;
      for (size_t s = 0; s < unit.hook_nodes.size(); ++s) {
        uc.site_reduce_scatter.push_back(shard_cache.Get(Collective::kReduceScatter, unit.hook_grad_padded_numel[s] * r));
        if (c.strategy == Strategy::kHybridShard && w.replicas > 1) {
          uc.site_all_reduce.push_back(replica_cache.Get(Collective::kAllReduce, unit.hook_grad_shard_numel[s] * r));
        }
      }
      if (c.strategy == Strategy::kHybridShard && w.replicas > 1) {
        uc.all_reduce = replica_cache.Get(Collective::kAllReduce, unit.grad_shard_numel * r);
        v.all_reduce_bytes += reductions * unit.grad_shard_numel * r;
        v.all_reduce_count += reductions * unit.HookSites();
        v.sent_bytes += static_cast<double>(reductions * unit.grad_shard_numel * r) * BusFactor(Collective::kAllReduce, cm.replica_group.ranks);
      }
    }
    const int64_t copies_in = c.cpu_offload ? schedule.Unshards(u) : 0;
    if (c.cpu_offload) {
      uc.host_to_device_s = HostCopySeconds(unit.shard_bytes, w.hardware);
      uc.device_to_host_s = HostCopySeconds(unit.grad_shard_numel * m, w.hardware);
      v.host_to_device_bytes += copies_in * unit.shard_bytes;
      v.device_to_host_bytes += reductions * unit.grad_shard_numel * m;
      for (int64_t shard : unit.hook_grad_shard_numel) uc.site_device_to_host_s.push_back(HostCopySeconds(shard * m, w.hardware));
    }
    double reduce_s = 0;  // one micro-batch's reductions of the unit: once, or once per hook site
    for (int s = 0; s < unit.HookSites(); ++s) reduce_s += uc.ReduceScatterAt(s).time_s + uc.AllReduceAt(s).time_s + uc.DeviceToHostAt(s);
    v.total_comm_s += static_cast<double>(gathers) * uc.all_gather.time_s + static_cast<double>(reductions) * reduce_s +
                      static_cast<double>(copies_in) * uc.host_to_device_s;
    cm.units.push_back(uc);
  }
  return cm;
}

CommModel EstimateComm(const Workload& w) { return EstimateComm(w, BuildSchedule(w)); }

}  // namespace fsdp
