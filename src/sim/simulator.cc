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
#include "core/limits.h"
#include "core/schedule.h"

namespace fsdp::sim {
namespace {

TimeNs Ns(double seconds) { return static_cast<TimeNs>(std::llround(std::max(0.0, seconds) * 1e9)); }

// Where one schedule action sits on rank 0's GPU timeline, for placing memory: the start of the op
// it launched, or (an action that launches nothing) the end of the last op the compute stream had
// been given by then.
struct ActionPlace {
  OpId op = -1;
  bool at_end = false;
};

// Kernels the CPU launches for a compute segment: a block's forward `kernels_per_block` (its
// backward twice as many), the embedding 2, the final norm 3, lm_head with the loss 3 (the 8 of
// the root's own forward), a linear wrapped on its own 1.
int SegmentKernels(const Workload& w, const Schedule& schedule, const ComputeSegment& segment, int kernels_per_block) {
  int kernels = 0;
  for (const NodeVisit& v : schedule.Visits(segment)) {
    if (!segment.forward && !v.enter) continue;
    const ModuleNode& n = w.nodes[v.node];
    switch (n.role) {
      case ModuleNode::Role::kBlock: kernels += kernels_per_block; break;
      case ModuleNode::Role::kEmbedding: kernels += 2; break;
      case ModuleNode::Role::kFinalNorm:
      case ModuleNode::Role::kLmHead: kernels += 3; break;
      case ModuleNode::Role::kOther: kernels += n.unit >= 0 && !n.tensors.empty() ? 1 : 0; break;
    }
  }
  return std::max(1, kernels) * (segment.forward ? 1 : 2);
}

// "root (embedding)", "model.layers.3", "root (norm, lm_head + loss)": the unit, and for a unit
// that is not a block the role modules the segment runs.
std::string SegmentLabel(const Workload& w, const Schedule& schedule, const ComputeSegment& segment) {
  std::string label = w.units[segment.unit].name;
  if (w.nodes[w.units[segment.unit].node].role == ModuleNode::Role::kBlock) return label;
  std::string parts;
  int blocks = 0;
  for (const NodeVisit& v : schedule.Visits(segment)) {
    if (!segment.forward && !v.enter) continue;
    const ModuleNode& n = w.nodes[v.node];
    const char* part = n.role == ModuleNode::Role::kEmbedding ? "embedding" : n.role == ModuleNode::Role::kFinalNorm ? "norm"
                     : n.role == ModuleNode::Role::kLmHead ? "lm_head + loss" : nullptr;
    if (n.role == ModuleNode::Role::kBlock) ++blocks;
    if (part == nullptr) continue;
    if (blocks > 0) parts += fmt::format("{}{} blocks", parts.empty() ? "" : ", ", std::exchange(blocks, 0));
    parts += fmt::format("{}{}", parts.empty() ? "" : ", ", part);
  }
  if (blocks > 0) parts += fmt::format("{}{} blocks", parts.empty() ? "" : ", ", blocks);
  return parts.empty() ? label : fmt::format("{} ({})", label, parts);
}

// What every rank's compute segment runs alike: its seconds, its kernel launches, its label.
struct SegmentOps {
  std::vector<double> seconds;
  std::vector<int> kernels;
  std::vector<std::string> labels;
};

SegmentOps SegmentOpsOf(const Workload& w, const Schedule& schedule, const std::vector<double>& seconds, int kernels_per_block) {
  SegmentOps ops{seconds, {}, {}};
  for (const ComputeSegment& seg : schedule.segments()) {
    ops.kernels.push_back(SegmentKernels(w, schedule, seg, kernels_per_block));
    ops.labels.push_back(SegmentLabel(w, schedule, seg));
  }
  return ops;
}

// Builds the ops and the CPU program of one rank from the schedule (docs/simulator.md).
class RankBuilder {
 public:
  RankBuilder(const Workload& w, const SimOptions& o, const ComputeModel& cm, const std::vector<UnitComm>& coll, const Schedule& schedule,
              const SegmentOps& segments, Engine& e, int rank, std::vector<OpId>& collective_ops, std::vector<char>& kinds,
              std::vector<ActionPlace>* places)
      : w_(w), o_(o), cm_(cm), coll_(coll), schedule_(schedule), segments_(segments), e_(e), rank_(rank), collective_ops_(collective_ops),
        kinds_(kinds), places_(places), rng_(o.seed * 1000003ULL + static_cast<uint64_t>(rank)), gather_event_(w.units.size(), kNoEvent) {
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
  }

  std::vector<CpuAction> Build() {
    for (int64_t micro = 0; micro < schedule_.micro_batches(); ++micro) {
      for (const Action& a : schedule_.MicroBatch(micro)) {
        launched_ = -1;
        Play(a);
        if (places_ != nullptr) places_->push_back(launched_ >= 0 ? ActionPlace{launched_, false} : ActionPlace{last_compute_op_, true});
      }
    }
    return std::move(program_);
  }

 private:
  void Play(const Action& a) {
    switch (a.kind) {
      case ActionKind::kUnshard: Gather(a); break;
      case ActionKind::kWaitUnshard: WaitUnshard(a); break;
      case ActionKind::kForward:
      case ActionKind::kBackward: ComputeSegmentOp(a); break;
      case ActionKind::kReshard:
        // _limiter_utils: the free event is recorded on the compute stream
        if (a.queues_free_event) free_events_.push_back(last_compute_event_);
        break;
      case ActionKind::kEndForward:
        last_reduce_ = last_reduce_scatter_ = kNoEvent;
        if (a.releases_all_gather_state) ReleaseHeldCopyOut();
        break;
      case ActionKind::kReduce: Reduce(a); break;
      case ActionKind::kEndBackward:
        // post-backward final callback: the compute stream waits for the reductions
        if (a.waits_for_reductions && last_reduce_ != kNoEvent) LaunchCompute(Make(compute_, "wait for reductions", 0, 0, {last_reduce_}), 'W');
        break;
      case ActionKind::kOptimizer: Optimizer(); break;
      case ActionKind::kPreForward:
      case ActionKind::kPostForward:
      case ActionKind::kPreBackward:
      case ActionKind::kPostBackward: break;
    }
  }

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
    if (launched_ < 0) launched_ = id;
    return ev;
  }

  // Every op of the compute stream carries the waits queued for it (an all-gather, FSDP2's
  // previous reduce-scatter).
  EventId LaunchCompute(Op op, char kind) {
    op.waits.insert(op.waits.end(), compute_waits_.begin(), compute_waits_.end());
    compute_waits_.clear();
    const EventId ev = Launch(std::move(op), kind);
    last_compute_event_ = ev;
    last_compute_op_ = static_cast<OpId>(e_.ops().size()) - 1;
    return ev;
  }

  EventId LaunchCollective(StreamId s, const char* what, int u, const CollectiveTime& c, std::vector<EventId> waits, char kind) {
    const double latency = c.latency_s * o_.latency_scale;
    return Launch(Make(s, fmt::format("{} {}", what, w_.units[u].name), latency, c.time_s - c.latency_s, std::move(waits)), kind,
                  o_.ranks > 0);
  }

  double Jitter() {
    if (o_.jitter <= 0) return 1.0;
    std::uniform_real_distribution<double> d(-o_.jitter, o_.jitter);
    return 1.0 + d(rng_);
  }

  // The CPU issues a segment's kernels one by one: all but the last launch's cost as host work.
  void IssueKernels(int kernels) {
    if (kernels > 1) program_.push_back(CpuWork{Ns(o_.launch_overhead_s * (kernels - 1)), "launch kernels"});
  }

  // The unit's all-gather (after its host-to-device copy under offload); with FSDP1's limiter the
  // CPU first synchronises on the oldest queued free event.
  void Gather(const Action& a) {
    if (a.rate_limit_wait) {
      program_.push_back(SyncEvent{free_events_.front()});
      free_events_.pop_front();
    }
    if (!a.all_gather) return;
    const int u = a.unit;
    std::vector<EventId> waits = std::exchange(all_gather_waits_, {});
    if (a.host_to_device) waits.push_back(Launch(Make(h2d_, "H2D " + w_.units[u].name, coll_[u].host_to_device_s, 0, {}), 'H'));
    gather_event_[u] = LaunchCollective(ag_stream_, "AG", u, coll_[u].all_gather, std::move(waits), 'A');
  }

  void ComputeSegmentOp(const Action& a) {
    IssueKernels(segments_.kernels[a.segment]);
    const ComputeSegment& seg = schedule_.segments()[a.segment];
    bool recomputes = false;
    if (!seg.forward) {
      for (const NodeVisit& v : schedule_.Visits(seg)) recomputes = recomputes || (v.enter && cm_.nodes[v.node].recompute_s > 0);
    }
    const char* what = seg.forward ? "FWD" : recomputes ? "BWD+RECOMPUTE" : "BWD";
    LaunchCompute(Make(compute_, fmt::format("{} {}", what, segments_.labels[a.segment]), segments_.seconds[a.segment] * compute_factor_ * Jitter(), 0, {}),
                  'C');
  }

  // The compute stream waits for the unit's all-gather; FSDP2 then copies the parameters out on
  // it, and the all-gather streams wait on a copy-out event (the previous one in forward, so at
  // most two all-gathers run ahead of the compute stream).
  void WaitUnshard(const Action& a) {
    const EventId gathered = std::exchange(gather_event_[a.unit], kNoEvent);
    if (gathered != kNoEvent) compute_waits_.push_back(gathered);
    if (a.copy_out_wait == CopyOutWait::kNone) return;
    const EventId copied = LaunchCompute(Make(compute_, "copy-out " + w_.units[a.unit].name, 0, 0, {}), 'C');
    if (a.copy_out_wait == CopyOutWait::kThis) {
      all_gather_waits_.push_back(copied);
      return;
    }
    ReleaseHeldCopyOut();
    held_copy_out_ = copied;
  }
  void ReleaseHeldCopyOut() {
    if (held_copy_out_ != kNoEvent) all_gather_waits_.push_back(std::exchange(held_copy_out_, kNoEvent));
  }

  void Reduce(const Action& a) {
    const int u = a.unit;
    // FSDP2: the compute stream waits for the previous reduce-scatter before this one is issued
    if (a.waits_previous_reduce_scatter && last_reduce_scatter_ != kNoEvent) compute_waits_.push_back(last_reduce_scatter_);
    EventId reduced = last_compute_event_;
    if (a.reduce_scatter) reduced = last_reduce_scatter_ = LaunchCollective(rs_stream_, "RS", u, coll_[u].ReduceScatterAt(a.site), {reduced}, 'R');
    if (a.all_reduce && coll_[u].AllReduceAt(a.site).time_s > 0) reduced = LaunchCollective(rs_stream_, "AR", u, coll_[u].AllReduceAt(a.site), {reduced}, 'D');
    if (a.to_host) reduced = Launch(Make(d2h_, "D2H " + w_.units[u].name, coll_[u].DeviceToHostAt(a.site), 0, {reduced}), 'h');
    last_reduce_ = reduced;
  }

  void Optimizer() {
    if (w_.config.cpu_offload) {
      if (last_reduce_ != kNoEvent) program_.push_back(SyncEvent{last_reduce_});
      program_.push_back(CpuWork{Ns(cm_.optimizer_s), "CPU AdamW"});
      return;
    }
    LaunchCompute(Make(compute_, "optimizer step", cm_.optimizer_s * compute_factor_, 0, {}), 'O');
  }

  const Workload& w_;
  const SimOptions& o_;
  const ComputeModel& cm_;
  const std::vector<UnitComm>& coll_;
  const Schedule& schedule_;
  const SegmentOps& segments_;
  Engine& e_;
  int rank_;
  std::vector<OpId>& collective_ops_;
  std::vector<char>& kinds_;
  std::vector<ActionPlace>* places_;  // rank 0: where each action sits
  std::mt19937_64 rng_;
  StreamId compute_ = 0, ag_stream_ = 0, rs_stream_ = 0, h2d_ = -1, d2h_ = -1;
  int link_ = 0;
  double compute_factor_ = 1.0;
  std::vector<CpuAction> program_;
  std::vector<EventId> gather_event_;   // per unit: its pending all-gather
  std::vector<EventId> compute_waits_;     // events the next compute-stream op waits for
  std::vector<EventId> all_gather_waits_;  // FSDP2: copy-out events the next all-gather waits for
  std::deque<EventId> free_events_;        // FSDP1's rate limiter queue
  EventId held_copy_out_ = kNoEvent;       // FSDP2: the copy-out event of the all-gather result held in forward
  EventId last_reduce_ = kNoEvent, last_reduce_scatter_ = kNoEvent, last_compute_event_ = kNoEvent;
  OpId last_compute_op_ = -1, launched_ = -1;
};

Status Validate(const Workload& w, const SimOptions& o) {
  if (o.bandwidth_override != 0 && !(o.bandwidth_override >= limits::kBytesPerS.min && o.bandwidth_override <= limits::kBytesPerS.max)) {
    return Error::BadInput(fmt::format("bandwidth must be a positive number of bytes/s between {:.3g} and {:.3g}, got {}", limits::kBytesPerS.min,
                                       limits::kBytesPerS.max, o.bandwidth_override));
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

// Simulated seconds of the step with every operation end to end: no schedule of it can end later.
double SerialSeconds(const Workload& w, const SimOptions& o, const Schedule& schedule, const ComputeModel& cm, const std::vector<UnitComm>& coll) {
  double slowest = 1;
  for (const auto& [rank, factor] : o.slow_ranks) slowest = std::max(slowest, factor);
  double compute_s = 0;
  for (double s : cm.segments_s) compute_s += s;
  compute_s = compute_s * static_cast<double>(schedule.micro_batches()) * slowest * (1 + o.jitter) * o.compute_scale + cm.optimizer_s;
  double comm_s = 0;
  const double reductions = static_cast<double>(schedule.Reductions());
  for (int u = 0; u < static_cast<int>(w.units.size()); ++u) {
    const UnitComm& c = coll[u];
    const double gathers = static_cast<double>(schedule.ForwardAllGathers(u) + schedule.BackwardAllGathers(u));
    comm_s += gathers * (c.all_gather.time_s + c.all_gather.latency_s * o.latency_scale) +
              static_cast<double>(schedule.Unshards(u)) * c.host_to_device_s;
    for (int site = 0; site < w.units[u].HookSites(); ++site) {  // once, or once per module of a group
      const CollectiveTime &rs = c.ReduceScatterAt(site), &ar = c.AllReduceAt(site);
      comm_s += reductions * (rs.time_s + ar.time_s + (rs.latency_s + ar.latency_s) * o.latency_scale + c.DeviceToHostAt(site));
    }
  }
  return compute_s + comm_s;
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

// Places the planner's memory timeline (the same allocations in the same order) on rank 0's
// simulated GPU clock: each point at the time the action it belongs to runs on its stream (the
// op it launched starts, or the compute stream has passed the ops before it), so that a phase's
// memory sits inside that phase's ops.
void AddMemory(const Workload& w, const Engine& e, const std::vector<ActionPlace>& places, SimResult& r) {
  MemoryOptions options;
  options.overheads = FrameworkOverheadsFor(w);
  options.record_timeline = true;
  const MemoryEstimate m = EstimateMemory(w, options);
  const int64_t outside = m.peak_bytes - m.reserved_peak_bytes;  // CUDA context, NCCL buffers (and --fragmentation's reserve)
  r.peak_bytes = m.peak_bytes;
  r.peak_phase = m.peak_phase;
  r.capacity_bytes = m.capacity_bytes;
  r.allocator = {m.allocated_peak_bytes, m.allocated_blocks_peak_bytes, m.active_peak_bytes, m.reserved_peak_bytes, m.reserved_peak_phase, m.fragmentation_bytes, ReservedOverAllocatedPeakBytes(m),
                 m.alloc_retries};
  double clock = 0;
  int64_t best = -1;
  for (const auto& p : m.timeline) {
    if (p.action >= 0 && p.action < static_cast<int64_t>(places.size())) {
      const ActionPlace& place = places[static_cast<size_t>(p.action)];
      if (place.op >= 0) {
        const Op& op = e.ops()[place.op];
        const TimeNs t = place.at_end ? op.end_ns : op.start_ns;
        if (t != kNever) clock = std::max(clock, static_cast<double>(t) * 1e-9);
      }
    }
    const int64_t bytes = TotalBytes(p.device) + outside;
    r.memory.push_back({clock, bytes, p.reserved_bytes + outside});
    r.allocated_peak_bytes = std::max(r.allocated_peak_bytes, bytes);
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
  const Schedule schedule = BuildSchedule(w);
  double actions = 0;
  for (int p = 0; p < schedule.program_count(); ++p) actions += static_cast<double>(schedule.ProgramRuns(p)) * static_cast<double>(schedule.Program(p).size());
  actions *= static_cast<double>(std::max<int64_t>(1, o.ranks));
  if (actions > limits::kMaxSimulatedActions) {
    return Error::BadInput(fmt::format("simulating {} micro-batch(es) x {} rank(s) plays {:.3g} schedule actions, more than the {:.0e} fsdp-sim "
                                       "plays: lower --grad-accum (fsdp-plan handles any) or drop --per-rank",
                                       schedule.micro_batches(), std::max<int64_t>(1, o.ranks), actions, limits::kMaxSimulatedActions));
  }
  const ComputeModel cm = o.compute_override ? *o.compute_override : EstimateCompute(w);
  if (cm.nodes.size() != w.nodes.size()) return Error::BadInput("compute override needs one entry per module node");
  const std::vector<UnitComm> coll = o.collective_override ? *o.collective_override : EstimateComm(w, schedule).units;
  if (coll.size() != w.units.size()) return Error::BadInput("collective override needs one entry per unit");
  if (cm.segments_s.size() != schedule.segments().size()) return Error::BadInput("compute override needs one time per compute segment");
  if (const double serial_s = SerialSeconds(w, o, schedule, cm, coll); !(serial_s <= limits::kMaxSimulatedSeconds)) {
    return Error::BadInput(fmt::format("the step's operations add up to {:.3g} s of simulated time, past the simulator's {:.0e} s: "
                                       "check the GPU's FLOP/s and bandwidths (--gpu, --bandwidth)", serial_s, limits::kMaxSimulatedSeconds));
  }
  const SegmentOps segments = SegmentOpsOf(w, schedule, cm.segments_s, o.kernels_per_block);
  Engine e(Ns(o.launch_overhead_s));
  const int64_t ranks = std::max<int64_t>(1, o.ranks);
  std::vector<std::vector<OpId>> collective_ops(ranks);
  std::vector<char> kinds;
  std::vector<ActionPlace> places;
  for (int64_t r = 0; r < ranks; ++r) {
    RankBuilder b(w, o, cm, coll, schedule, segments, e, static_cast<int>(r), collective_ops[r], kinds, r == 0 ? &places : nullptr);
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
  e.RecordCpuSpans(0);
  e.Run();
  SimResult result;
  Summarise(e, kinds, result);
  for (const CpuSpan& c : e.CpuSpans()) {
    result.cpu.push_back({c.start_ns * 1e-9, c.end_ns * 1e-9, c.kind, c.op >= 0 ? e.ops()[c.op].name : c.name});
  }
  AddMemory(w, e, places, result);
  result.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return result;
}

}  // namespace fsdp::sim
