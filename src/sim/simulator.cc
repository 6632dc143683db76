#include "sim/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <random>

#include <fmt/format.h>

#include "planner/collective_model.h"
#include "planner/comm_model.h"
#include "planner/compute_model.h"

namespace fsdp::sim {
namespace {

TimeNs Ns(double seconds) { return static_cast<TimeNs>(std::llround(std::max(0.0, seconds) * 1e9)); }

enum MarkerType { kFwdMarker = 0, kBwdMarker = 1, kPostMarker = 2 };

int MarkerKey(const Workload& w, int micro, int u, MarkerType type) {
  return ((micro * static_cast<int>(w.units.size())) + u) * 3 + type;
}
int OptimizerMarker(const Workload& w) { return MarkerKey(w, static_cast<int>(w.config.grad_accum), 0, kFwdMarker); }

// Durations of one unit's collectives, split into a fixed latency and a bandwidth part.
struct UnitCollectives {
  CollectiveEstimate all_gather, reduce_scatter, all_reduce;
  double host_copy_s = 0;
};

// Builds the ops and the CPU program of one rank, in FSDP's order (docs/simulator.md).
class RankBuilder {
 public:
  RankBuilder(const Workload& w, const SimOptions& o, const ComputeModel& cm, const std::vector<UnitCollectives>& coll, Engine& e,
              int rank, std::vector<OpId>& collective_ops, std::vector<char>& kinds)
      : w_(w), o_(o), cm_(cm), coll_(coll), e_(e), rank_(rank), collective_ops_(collective_ops), kinds_(kinds),
        rng_(o.seed * 1000003ULL + static_cast<uint64_t>(rank)), gathered_(w.units.size(), false), gather_event_(w.units.size(), kNoEvent) {
    const std::string r = fmt::format("rank {} ", rank);
    compute_ = e.AddStream(r + "compute", rank);
    if (o.blocking_collectives) {
      ag_stream_ = rs_stream_ = compute_;
    } else {
      ag_stream_ = e.AddStream(r + (o.separate_process_groups ? "all-gather" : "nccl"), rank);
      rs_stream_ = o.separate_process_groups ? e.AddStream(r + "reduce-scatter", rank) : ag_stream_;
    }
    if (w.config.cpu_offload) {
      h2d_ = e.AddStream(r + "host-to-device", rank);
      d2h_ = e.AddStream(r + "device-to-host", rank);
    }
    link_ = e.AddLink();
    auto slow = o.slow_ranks.find(rank);
    compute_factor_ = o.compute_scale * (slow == o.slow_ranks.end() ? 1.0 : slow->second);
    children_.resize(w.units.size());
    for (int u = 1; u < static_cast<int>(w.units.size()); ++u) children_[w.units[u].parent_unit].push_back(u);
  }

  std::vector<CpuAction> Build() {
    for (micro_ = 0; micro_ < w_.config.grad_accum; ++micro_) {
      for (int u = 0; u < static_cast<int>(w_.units.size()); ++u) Forward(u);
      last_reduce_ = kNoEvent;
      Backward(0);
      if (ReducesNow() && last_reduce_ != kNoEvent) {
        // post-backward final callback: the compute stream waits for the reductions
        Launch(Make(compute_, "wait for reductions", 0, 0, {last_reduce_}), 'W');
      }
    }
    Optimizer();
    return std::move(program_);
  }

  StreamId compute_stream() const { return compute_; }

 private:
  bool Sharded() const { return w_.config.strategy != Strategy::kNoShard; }
  bool Fsdp1Limited() const { return w_.config.framework == Framework::kFsdp1 && w_.config.limit_all_gathers; }
  bool ReducesNow() const { return !w_.config.no_sync || micro_ == w_.config.grad_accum - 1; }
  void Mark(int u, MarkerType type) { if (rank_ == 0) program_.push_back(Marker{MarkerKey(w_, micro_, u, type)}); }

  Op Make(StreamId s, std::string name, double fixed_s, double link_s, std::vector<EventId> waits) {
    Op op;
    op.stream = s;
    op.name = std::move(name);
    op.fixed_ns = Ns(fixed_s);
    op.link_solo_s = link_s;
    op.link = link_s > 0 ? link_ : -1;
    op.waits = std::move(waits);
    op.records = e_.AddEvent();
    return op;
  }

  EventId Launch(Op op, char kind, bool collective = false) {
    const EventId ev = op.records;
    const OpId id = e_.AddOp(std::move(op));
    kinds_.resize(id + 1, 'C');
    kinds_[id] = kind;
    if (collective) collective_ops_.push_back(id);
    program_.push_back(LaunchOp{id});
    return ev;
  }

  EventId LaunchCollective(StreamId s, const char* what, int u, const CollectiveEstimate& c, std::vector<EventId> waits, char kind) {
    const double latency = c.latency_s * o_.latency_scale;
    return Launch(Make(s, fmt::format("{} {}", what, w_.units[u].name), latency, c.time_s - c.latency_s, std::move(waits)), kind,
                  o_.ranks > 0);
  }

  double Jitter() {
    if (o_.jitter <= 0) return 1.0;
    std::uniform_real_distribution<double> d(-o_.jitter, o_.jitter);
    return 1.0 + d(rng_);
  }

  // The CPU issues a unit's kernels one by one: all but the last launch's cost as host work.
  void IssueKernels(int kernels) {
    if (kernels > 1) program_.push_back(CpuWork{Ns(o_.launch_overhead_s * (kernels - 1)), "launch kernels"});
  }

  void Gather(int u) {
    if (u < 0 || !Sharded() || gathered_[u] || w_.units[u].numel == 0) return;
    if (Fsdp1Limited() && free_events_.size() >= 2) {
      // _limiter_utils: the CPU synchronises on the oldest free event
      program_.push_back(SyncEvent{free_events_.front()});
      free_events_.pop_front();
    }
    std::vector<EventId> waits;
    if (w_.config.cpu_offload) waits.push_back(Launch(Make(h2d_, "H2D " + w_.units[u].name, coll_[u].host_copy_s, 0, {}), 'H'));
    gather_event_[u] = LaunchCollective(ag_stream_, "AG", u, coll_[u].all_gather, std::move(waits), 'A');
    gathered_[u] = true;
  }

  void Reshard(int u, EventId compute_done) {
    gathered_[u] = false;
    if (Fsdp1Limited()) free_events_.push_back(compute_done);
  }

  EventId ComputeOp(int u, const char* what, double seconds, int kernels) {
    IssueKernels(kernels);
    std::vector<EventId> waits;
    if (gather_event_[u] != kNoEvent) waits.push_back(gather_event_[u]);
    return Launch(Make(compute_, fmt::format("{} {}", what, w_.units[u].name), seconds * compute_factor_ * Jitter(), 0, std::move(waits)), 'C');
  }

  int Kernels(int u) const { return w_.units[u].is_root ? 8 : o_.kernels_per_block; }

  void Forward(int u) {
    Mark(u, kFwdMarker);
    Gather(u);
    if (w_.config.forward_prefetch && u + 1 < static_cast<int>(w_.units.size())) Gather(u + 1);
    const EventId done = ComputeOp(u, "FWD", cm_.units[u].forward_s, Kernels(u));
    const bool reshard = !w_.units[u].is_root &&
                         (w_.config.strategy == Strategy::kFullShard || w_.config.strategy == Strategy::kHybridShard);
    if (reshard) Reshard(u, done);
  }

  void Backward(int u) {
    Mark(u, kBwdMarker);
    Gather(u);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPre) Gather(w_.BackwardPrefetchTarget(u));
    const UnitCompute& c = cm_.units[u];
    EventId done = ComputeOp(u, c.recompute_s > 0 ? "BWD+RECOMPUTE" : "BWD", c.backward_s + c.recompute_s, 2 * Kernels(u));
    for (auto it = children_[u].rbegin(); it != children_[u].rend(); ++it) Backward(*it);
    Mark(u, kPostMarker);
    if (Sharded() && w_.FreesInBackward(ReducesNow())) Reshard(u, done);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPost) Gather(w_.BackwardPrefetchTarget(u));
    if (!ReducesNow() || w_.units[u].numel == 0) return;
    EventId reduced = done;
    if (Sharded()) reduced = LaunchCollective(rs_stream_, "RS", u, coll_[u].reduce_scatter, {done}, 'R');
    if (coll_[u].all_reduce.time_s > 0) reduced = LaunchCollective(rs_stream_, "AR", u, coll_[u].all_reduce, {reduced}, 'D');
    if (w_.config.cpu_offload) reduced = Launch(Make(d2h_, "D2H " + w_.units[u].name, coll_[u].host_copy_s, 0, {reduced}), 'h');
    last_reduce_ = reduced;
  }

  void Optimizer() {
    if (rank_ == 0) program_.push_back(Marker{OptimizerMarker(w_)});
    if (w_.config.cpu_offload) {
      if (last_reduce_ != kNoEvent) program_.push_back(SyncEvent{last_reduce_});
      program_.push_back(CpuWork{Ns(cm_.optimizer_s), "CPU AdamW"});
      return;
    }
    Launch(Make(compute_, "optimizer step", cm_.optimizer_s * compute_factor_, 0, {}), 'O');
  }

  const Workload& w_;
  const SimOptions& o_;
  const ComputeModel& cm_;
  const std::vector<UnitCollectives>& coll_;
  Engine& e_;
  int rank_;
  std::vector<OpId>& collective_ops_;
  std::vector<char>& kinds_;
  std::mt19937_64 rng_;
  StreamId compute_ = 0, ag_stream_ = 0, rs_stream_ = 0, h2d_ = -1, d2h_ = -1;
  int link_ = 0;
  double compute_factor_ = 1.0;
  std::vector<CpuAction> program_;
  std::vector<bool> gathered_;
  std::vector<EventId> gather_event_;
  std::vector<std::vector<int>> children_;
  std::deque<EventId> free_events_;
  EventId last_reduce_ = kNoEvent;
  int micro_ = 0;
};

Status Validate(const Workload& w, const SimOptions& o) {
  if (!(o.bandwidth_override >= 0) || !std::isfinite(o.bandwidth_override)) {
    return Error::BadInput(fmt::format("bandwidth must be a positive number of bytes/s, got {}", o.bandwidth_override));
  }
  if (!(o.launch_overhead_s >= 0) || o.launch_overhead_s > 1) return Error::BadInput(fmt::format("launch overhead must be between 0 and 1 s, got {}", o.launch_overhead_s));
  if (!(o.latency_scale >= 0) || !(o.compute_scale >= 0)) return Error::BadInput("latency and compute scales must be >= 0");
  if (!(o.jitter >= 0) || o.jitter >= 1) return Error::BadInput(fmt::format("--jitter must be in [0, 1), got {}", o.jitter));
  if (o.ranks < 0 || o.ranks > 65536) return Error::BadInput(fmt::format("--per-rank needs between 1 and 65536 ranks, got {}", o.ranks));
  if (o.ranks > 0 && o.ranks != w.config.gpus) {
    return Error::BadInput(fmt::format("--per-rank simulates every rank: {} ranks given for --gpus {}", o.ranks, w.config.gpus));
  }
  for (const auto& [rank, factor] : o.slow_ranks) {
    if (rank < 0 || rank >= std::max<int64_t>(1, o.ranks)) return Error::BadInput(fmt::format("slow rank {} is not one of the {} simulated ranks", rank, std::max<int64_t>(1, o.ranks)));
    if (!(factor > 0) || factor > 100) return Error::BadInput(fmt::format("slow rank {} factor must be in (0, 100], got {}", rank, factor));
  }
  return {};
}

std::vector<UnitCollectives> UnitCollectiveTimes(const Workload& w) {
  const CommModel comm = EstimateComm(w);
  const FsdpConfig& c = w.config;
  const int64_t p = BytesPerElement(c.param_dtype), r = BytesPerElement(c.reduce_dtype);
  std::vector<UnitCollectives> out(w.units.size());
  for (size_t u = 0; u < w.units.size(); ++u) {
    const WrapUnit& unit = w.units[u];
    UnitCollectives& uc = out[u];
    if (c.strategy == Strategy::kNoShard) {
      uc.all_reduce = EstimateCollective(Collective::kAllReduce, unit.numel * r, comm.replica_group, w.hardware);
    } else {
      uc.all_gather = EstimateCollective(Collective::kAllGather, unit.padded_numel * p, comm.shard_group, w.hardware);
      uc.reduce_scatter = EstimateCollective(Collective::kReduceScatter, unit.padded_numel * r, comm.shard_group, w.hardware);
      if (c.strategy == Strategy::kHybridShard && w.replicas > 1) {
        uc.all_reduce = EstimateCollective(Collective::kAllReduce, unit.shard_numel * r, comm.replica_group, w.hardware);
      }
    }
    uc.host_copy_s = HostCopySeconds(unit.shard_numel * BytesPerElement(c.master_dtype), w.hardware);
  }
  return out;
}

// Length of the union of [start, end) intervals.
double UnionSeconds(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0, start = -1, end = -1;
  for (const auto& [s, e] : intervals) {
    if (s > end) {
      total += end - start;
      start = s;
      end = e;
    } else {
      end = std::max(end, e);
    }
  }
  return total + (end - start);
}

int OwningUnit(const Workload& w, int node) {
  while (node > 0 && w.nodes[node].unit < 0) node = w.nodes[node].parent;
  return node < 0 ? 0 : std::max(0, w.nodes[node].unit);
}

// Places the planner's memory timeline (the same allocations in the same order) on the simulated
// clock: each point at the time the CPU reached its phase.
void AddMemory(const Workload& w, const Engine& e, SimResult& r) {
  MemoryOptions options;
  options.overheads = FrameworkOverheadsFor(w);
  options.record_timeline = true;
  const MemoryEstimate m = EstimateMemory(w, options);
  int64_t timeline_peak = 0;
  for (const auto& p : m.timeline) timeline_peak = std::max(timeline_peak, TotalBytes(p.device));
  const int64_t constant = m.peak_bytes - timeline_peak;  // context, NCCL buffers, fragmentation
  r.peak_bytes = m.peak_bytes;
  r.peak_phase = m.peak_phase;
  r.capacity_bytes = m.capacity_bytes;
  double clock = 0;
  int64_t best = -1;
  for (const auto& p : m.timeline) {
    TimeNs t = 0;
    const int u = p.node >= 0 ? OwningUnit(w, p.node) : 0;
    switch (p.kind) {
      case StepPhase::kStart: t = 0; break;
      case StepPhase::kForwardUnshard:
      case StepPhase::kForward: t = e.MarkerTime(MarkerKey(w, p.micro, u, kFwdMarker)); break;
      case StepPhase::kEndForward: t = e.MarkerTime(MarkerKey(w, p.micro, static_cast<int>(w.units.size()) - 1, kFwdMarker)); break;
      case StepPhase::kBackwardUnshard:
      case StepPhase::kBackward: t = e.MarkerTime(MarkerKey(w, p.micro, u, kBwdMarker)); break;
      case StepPhase::kReduce: t = e.MarkerTime(MarkerKey(w, p.micro, u, kPostMarker)); break;
      case StepPhase::kOptimizer:
      case StepPhase::kAfterZeroGrad: t = e.MarkerTime(OptimizerMarker(w)); break;
    }
    if (t != kNever) clock = std::max(clock, static_cast<double>(t) * 1e-9);
    const int64_t bytes = TotalBytes(p.device) + constant;
    r.memory.push_back({clock, bytes});
    if (bytes > best) {
      best = bytes;
      r.peak_time_s = clock;
    }
  }
}

void Summarise(const Engine& e, const std::vector<char>& kinds, SimResult& r) {
  double compute = 0;
  std::vector<std::pair<double, double>> comm;
  std::vector<double> busy(e.streams().size(), 0.0);
  for (size_t i = 0; i < e.ops().size(); ++i) {
    const Op& op = e.ops()[i];
    if (op.end_ns == kNever) continue;
    const double start = op.start_ns * 1e-9, end = op.end_ns * 1e-9;
    r.step_s = std::max(r.step_s, end);
    const int rank = e.streams()[op.stream].rank;
    if (rank != 0) continue;
    busy[op.stream] += end - start;
    const char kind = kinds[i];
    if (kind == 'C' || kind == 'O') compute += end - start;
    if (kind == 'A' || kind == 'R' || kind == 'D') comm.emplace_back(start, end);
    r.ops.push_back({op.name, op.stream, rank, start, end, kind});
  }
  r.step_s = std::max(r.step_s, e.CpuFinish(0) * 1e-9);
  r.compute_s = compute;
  r.comm_s = comm.empty() ? 0.0 : UnionSeconds(comm);
  r.exposed_comm_s = std::max(0.0, r.step_s - r.compute_s);
  r.overlap_pct = r.comm_s > 0 ? 100.0 * std::clamp((r.comm_s - r.exposed_comm_s) / r.comm_s, 0.0, 1.0) : 100.0;
  r.cpu_blocked_s = e.CpuBlocked(0) * 1e-9;
  for (size_t s = 0; s < e.streams().size(); ++s) {
    if (e.streams()[s].rank != 0) continue;
    r.stream_names.push_back(e.streams()[s].name);
    r.stream_utilization.push_back(r.step_s > 0 ? busy[s] / r.step_s : 0.0);
  }
  r.events = e.events_processed();
}

}  // namespace

Result<SimResult> Simulate(const Workload& workload, const SimOptions& o) {
  if (Status s = Validate(workload, o); !s.ok()) return s.error();
  const auto wall_start = std::chrono::steady_clock::now();
  Workload w = workload;
  if (o.bandwidth_override > 0) {
    w.hardware.intra_node_bandwidth_bytes_per_s = o.bandwidth_override;
    w.hardware.inter_node_bandwidth_per_gpu_bytes_per_s = o.bandwidth_override;
    w.hardware.pcie_bandwidth_bytes_per_s = std::max(w.hardware.pcie_bandwidth_bytes_per_s, o.bandwidth_override);
  }
  const ComputeModel cm = o.compute_override ? *o.compute_override : EstimateCompute(w);
  std::vector<UnitCollectives> coll = UnitCollectiveTimes(w);
  if (o.collective_override) {
    if (o.collective_override->size() != coll.size()) return Error::BadInput("collective override needs one entry per unit");
    for (size_t u = 0; u < coll.size(); ++u) {
      const UnitComm& k = (*o.collective_override)[u];
      coll[u].all_gather = {k.all_gather_s, 0, 0, 0};
      coll[u].reduce_scatter = {k.reduce_scatter_s, 0, 0, 0};
      coll[u].all_reduce = {k.all_reduce_s, 0, 0, 0};
      coll[u].host_copy_s = k.host_to_device_s;
    }
  }
  if (cm.units.size() != w.units.size()) return Error::BadInput("compute override needs one entry per unit");
  Engine e(Ns(o.launch_overhead_s));
  const int64_t ranks = std::max<int64_t>(1, o.ranks);
  std::vector<std::vector<OpId>> collective_ops(ranks);
  std::vector<char> kinds;
  for (int64_t r = 0; r < ranks; ++r) {
    RankBuilder b(w, o, cm, coll, e, static_cast<int>(r), collective_ops[r], kinds);
    e.AddCpuThread(b.Build());
  }
  if (ranks > 1) {
    for (size_t i = 0; i < collective_ops[0].size(); ++i) {
      std::vector<OpId> members;
      members.reserve(ranks);
      for (int64_t r = 0; r < ranks; ++r) members.push_back(collective_ops[r][i]);
      e.AddCollective(members);
    }
  }
  e.Run();
  SimResult result;
  Summarise(e, kinds, result);
  AddMemory(w, e, result);
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace fsdp::sim
