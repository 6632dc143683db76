#include "planner/step_model.h"

#include <algorithm>
#include <cmath>
#include <deque>

namespace fsdp {
namespace {

// Plays the schedule on two clocks: the compute stream and the communication stream (one NCCL
// stream per process group: all-gathers, reduce-scatters and all-reduces in issue order).
class StepTimer {
 public:
  StepTimer(const Workload& w, const ComputeModel& cm, const CommModel& comm, const Schedule& schedule, bool fast_forward)
      : w_(w), cm_(cm), comm_(comm), schedule_(schedule), segment_s_(cm.segments_s), fast_forward_(fast_forward),
        pending_(w.units.size(), 0), gather_end_(w.units.size(), 0.0), exposed_(w.units.size(), 0.0) {}

  StepEstimate Run() {
    const int64_t accum = schedule_.micro_batches();
    std::vector<double> previous;
    for (micro_ = 0; micro_ < accum; ++micro_) {
      exposed_before_ = exposed_;
      const double start_c = compute_end_;
      forward_before_ = e_.forward_s;
      backward_before_ = e_.backward_s;
      for (const Action& a : schedule_.MicroBatchWork(micro_)) Play(a);
      // When the state seen from the compute clock repeats, so does every following micro-batch
      // before the last, if they run this micro-batch's program: shift every clock by their total
      // instead of replaying them.
      if (!fast_forward_) continue;
      const int64_t middle_left = accum - 2 - micro_;
      const double period = compute_end_ - start_c;
      std::vector<double> state = RelativeState();
      if (middle_left > 0 && schedule_.ProgramOf(micro_ + 1) == schedule_.ProgramOf(micro_) && SameState(state, previous, period)) {
        // the skipped micro-batches wait exactly as this one did
        for (size_t u = 0; u < exposed_.size(); ++u) exposed_[u] += static_cast<double>(middle_left) * (exposed_[u] - exposed_before_[u]);
        Shift(static_cast<double>(middle_left) * period);
        e_.forward_s += static_cast<double>(middle_left) * (e_.forward_s - forward_before_);
        e_.backward_s += static_cast<double>(middle_left) * (e_.backward_s - backward_before_);
        micro_ += middle_left;
      }
      previous = std::move(state);
    }
    e_.compute_s = cm_.compute_s_per_step;
    e_.comm_s = comm_.volume.total_comm_s;
    e_.exposed_comm_s = std::max(0.0, e_.step_s - e_.compute_s);
    e_.first_all_gather_s = first_gather_s_;
    e_.unit_exposed_s = exposed_;
    const double tokens = static_cast<double>(w_.TokensPerMicroBatch() * w_.config.grad_accum);
    e_.tokens_per_s_per_gpu = tokens / e_.step_s;
    e_.tflops_per_gpu = cm_.model_flops_per_token * e_.tokens_per_s_per_gpu / 1e12;
    const double peak = w_.hardware.PeakFlops(w_.config.param_dtype);
    e_.mfu = e_.tflops_per_gpu * 1e12 / peak;
    e_.mfu_capped = e_.mfu > 1;
    e_.mfu = std::min(e_.mfu, 1.0);
    e_.hfu = cm_.executed_flops_per_step / e_.step_s / peak;
    return e_;
  }

 private:
  void Play(const Action& a) {
    switch (a.kind) {
      case ActionKind::kUnshard: Gather(a); break;
      case ActionKind::kWaitUnshard:
        WaitGathered(a.unit);
        CopyOut(a.copy_out_wait);
        break;
      case ActionKind::kForward: compute_end_ += segment_s_[a.segment]; break;
      case ActionKind::kBackward:
        compute_end_ += segment_s_[a.segment];
        last_backward_compute_ = compute_end_;
        break;
      case ActionKind::kReshard:
        if (a.queues_free_event) free_events_.push_back(compute_end_);  // recorded on the compute stream
        break;
      case ActionKind::kReduce: Reduce(a); break;
      case ActionKind::kEndForward:
        e_.forward_s += compute_end_ - pass_start_;
        pass_start_ = compute_end_;
        if (a.releases_all_gather_state) ReleaseHeldCopyOut();
        last_reduce_scatter_ = -1;
        break;
      case ActionKind::kEndBackward:
        // The post-backward callback makes the compute stream wait for the reductions
        // (FSDP1 _post_backward_final_callback: current_stream.wait_stream(post_backward_stream);
        // FSDP2's root waits for its last reduce-scatter).
        if (a.waits_for_reductions) compute_end_ = std::max(compute_end_, comm_free_);
        e_.backward_s += compute_end_ - pass_start_;
        pass_start_ = compute_end_;
        break;
      case ActionKind::kOptimizer: {
        const double opt_start = std::max(compute_end_, comm_free_);
        e_.last_reduce_s = opt_start - last_backward_compute_;
        e_.optimizer_s = cm_.optimizer_s;
        e_.step_s = opt_start + cm_.optimizer_s;
        break;
      }
      case ActionKind::kPreForward:
      case ActionKind::kPostForward:
      case ActionKind::kPreBackward:
      case ActionKind::kPostBackward: break;  // the hooks themselves take no time
    }
  }

  // Everything that decides the future, relative to the compute clock. A time further in the past
  // than one step's worth of communication cannot delay anything any more, nor can a finished
  // all-gather: such values are clamped so that idle streams do not look like changing state.
  std::vector<double> RelativeState() const {
    const double floor = -(comm_.volume.total_comm_s + 1e-9);
    std::vector<double> state;
    state.push_back(std::max(comm_free_ - compute_end_, floor));
    state.push_back(static_cast<double>(free_events_.size()));
    for (double t : free_events_) state.push_back(std::max(t - compute_end_, floor));
    // FSDP2's copy-out event matters only where it is later than the communication stream
    state.push_back(std::max(std::max(all_gather_ready_, comm_free_) - compute_end_, floor));
    state.push_back(held_copy_out_ < 0 ? 0.0 : 1.0);
    if (held_copy_out_ >= 0) state.push_back(std::max(held_copy_out_ - compute_end_, floor));
    for (size_t u = 0; u < pending_.size(); ++u) {
      if (!pending_[u]) continue;
      state.push_back(static_cast<double>(u));
      state.push_back(std::max(gather_end_[u] - compute_end_, 0.0));
    }
    return state;
  }

  static bool SameState(const std::vector<double>& a, const std::vector<double>& b, double period) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::fabs(a[i] - b[i]) > 1e-9 * std::max(period, 1e-12)) return false;
    }
    return true;
  }

  void Shift(double dt) {
    compute_end_ += dt;
    comm_free_ += dt;
    pass_start_ += dt;
    all_gather_ready_ += dt;
    if (held_copy_out_ >= 0) held_copy_out_ += dt;
    if (last_reduce_scatter_ >= 0) last_reduce_scatter_ += dt;
    for (double& t : free_events_) t += dt;
    for (double& t : gather_end_) t += dt;
  }

  // The unit's all-gather on the communication stream (after its host copy under offload); with
  // FSDP1's limiter the CPU first waits for the oldest free event, so the collective cannot start
  // before the compute stream reached it.
  void Gather(const Action& a) {
    double start = comm_free_;
    if (a.rate_limit_wait) {
      start = std::max(start, free_events_.front());
      free_events_.pop_front();
    }
    if (!a.all_gather) return;
    start = std::max(start, all_gather_ready_);
    const UnitComm& c = comm_.units[a.unit];
    if (a.host_to_device) start += c.host_to_device_s;
    comm_free_ = start + c.all_gather.time_s;
    if (first_gather_s_ == 0 && c.all_gather.time_s > 0) first_gather_s_ = comm_free_;
    gather_end_[a.unit] = comm_free_;
    pending_[a.unit] = 1;
  }

  // FSDP2's copy-out runs on the compute stream once the all-gather is waited for; the
  // all-gather streams then wait on a copy-out event (the previous one in forward).
  void CopyOut(CopyOutWait wait) {
    switch (wait) {
      case CopyOutWait::kNone: return;
      case CopyOutWait::kPrevious:
        ReleaseHeldCopyOut();
        held_copy_out_ = compute_end_;
        return;
      case CopyOutWait::kThis: all_gather_ready_ = std::max(all_gather_ready_, compute_end_); return;
    }
  }
  void ReleaseHeldCopyOut() {
    if (held_copy_out_ >= 0) all_gather_ready_ = std::max(all_gather_ready_, held_copy_out_);
    held_copy_out_ = -1;
  }

  void Reduce(const Action& a) {
    const UnitComm& c = comm_.units[a.unit];
    if (a.waits_previous_reduce_scatter && last_reduce_scatter_ >= 0) compute_end_ = std::max(compute_end_, last_reduce_scatter_);
    comm_free_ = std::max(comm_free_, compute_end_) + (a.reduce_scatter ? c.ReduceScatterAt(a.site).time_s : 0.0);
    if (a.reduce_scatter) last_reduce_scatter_ = comm_free_;
    comm_free_ += (a.all_reduce ? c.AllReduceAt(a.site).time_s : 0.0) + (a.to_host ? c.DeviceToHostAt(a.site) : 0.0);
  }

  void WaitGathered(int u) {
    if (!pending_[u]) return;
    pending_[u] = 0;
    const double ready = gather_end_[u];
    if (ready > compute_end_) exposed_[u] += ready - compute_end_;
    compute_end_ = std::max(compute_end_, ready);
  }

  const Workload& w_;
  const ComputeModel& cm_;
  const CommModel& comm_;
  const Schedule& schedule_;
  const std::vector<double>& segment_s_;
  bool fast_forward_;
  std::vector<char> pending_;  // all-gather issued, not yet waited for
  std::vector<double> gather_end_;
  std::vector<double> exposed_, exposed_before_;
  std::deque<double> free_events_;
  double comm_free_ = 0, compute_end_ = 0, first_gather_s_ = 0, last_backward_compute_ = 0, pass_start_ = 0;
  double forward_before_ = 0, backward_before_ = 0;
  double all_gather_ready_ = 0;     // FSDP2: the latest copy-out event the all-gather streams wait on
  double held_copy_out_ = -1;       // FSDP2: the copy-out event of the all-gather result held in forward (-1: none)
  double last_reduce_scatter_ = -1; // FSDP2: end of this backward's latest reduce-scatter (-1: none yet)
  StepEstimate e_;
  int64_t micro_ = 0;
};

}  // namespace

StepEstimate EstimateStep(const Workload& w, const ComputeModel& cm, const CommModel& comm, const Schedule& schedule, bool fast_forward) {
  return StepTimer(w, cm, comm, schedule, fast_forward).Run();
}

StepEstimate EstimateStep(const Workload& w, const ComputeModel& cm, const CommModel& comm, bool fast_forward) {
  return EstimateStep(w, cm, comm, BuildSchedule(w), fast_forward);
}

TimeEstimate EstimateTime(const Workload& w, double traffic_per_saved_byte) {
  const Schedule schedule = BuildSchedule(w);
  TimeEstimate t;
  t.compute = EstimateCompute(w, traffic_per_saved_byte);
  t.comm = EstimateComm(w, schedule);
  t.step = EstimateStep(w, t.compute, t.comm, schedule);
  return t;
}

}  // namespace fsdp
