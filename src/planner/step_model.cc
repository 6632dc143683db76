#include "planner/step_model.h"

#include <algorithm>
#include <cmath>
#include <deque>

namespace fsdp {
namespace {

class StepTimer {
 public:
  StepTimer(const Workload& w, const ComputeModel& cm, const CommModel& comm, bool fast_forward)
      : w_(w), cm_(cm), comm_(comm), fast_forward_(fast_forward), gathered_(w.units.size(), 0), gather_end_(w.units.size(), 0.0),
        exposed_(w.units.size(), 0.0) {
    children_.resize(w.units.size());
    for (int u = 1; u < static_cast<int>(w.units.size()); ++u) children_[w.units[u].parent_unit].push_back(u);
  }

  StepEstimate Run() {
    StepEstimate e;
    const int accum = w_.config.grad_accum;
    std::vector<double> previous;
    for (micro_ = 0; micro_ < accum; ++micro_) {
      exposed_before_ = exposed_;
      const double start_c = compute_end_;
      const double fwd_start = compute_end_;
      for (int u = 0; u < static_cast<int>(w_.units.size()); ++u) ForwardUnit(u);
      const double fwd = compute_end_ - fwd_start;
      const double bwd_start = compute_end_;
      BackwardUnit(0);
      last_backward_compute_ = compute_end_;
      // The post-backward callback makes the compute stream wait for the reductions
      // (FSDP1 _post_backward_final_callback: current_stream.wait_stream(post_backward_stream);
      // FSDP2's root waits for its last reduce-scatter).
      if (ReducesNow()) compute_end_ = std::max(compute_end_, comm_free_);
      const double bwd = compute_end_ - bwd_start;
      e.forward_s += fwd;
      e.backward_s += bwd;
      // When the state seen from the compute clock repeats, so does every following micro-batch
      // before the last: shift every clock by their total instead of replaying them.
      const double period = compute_end_ - start_c;
      const int middle_left = accum - 2 - micro_;
      if (!fast_forward_ || middle_left <= 0) continue;
      std::vector<double> state = RelativeState();
      if (SameState(state, previous, period)) {
        // the skipped micro-batches wait exactly as this one did
        for (size_t u = 0; u < exposed_.size(); ++u) exposed_[u] += middle_left * (exposed_[u] - exposed_before_[u]);
        Shift(static_cast<double>(middle_left) * period);
        e.forward_s += middle_left * fwd;
        e.backward_s += middle_left * bwd;
        micro_ += middle_left;
      }
      previous = std::move(state);
    }
    const double opt_start = std::max(compute_end_, comm_free_);
    e.last_reduce_s = opt_start - last_backward_compute_;
    e.optimizer_s = cm_.optimizer_s;
    e.step_s = opt_start + cm_.optimizer_s;
    e.compute_s = cm_.compute_s_per_step;
    e.comm_s = comm_.volume.total_comm_s;
    e.exposed_comm_s = std::max(0.0, e.step_s - e.compute_s);
    e.first_all_gather_s = first_gather_s_;
    e.unit_exposed_s = exposed_;
    const double tokens = static_cast<double>(w_.TokensPerMicroBatch() * w_.config.grad_accum);
    e.tokens_per_s_per_gpu = tokens / e.step_s;
    e.tflops_per_gpu = cm_.model_flops_per_token * e.tokens_per_s_per_gpu / 1e12;
    e.mfu = e.tflops_per_gpu * 1e12 / w_.hardware.PeakFlops(w_.config.param_dtype);
    return e;
  }

 private:
  bool Sharded() const { return w_.config.strategy != Strategy::kNoShard; }
  bool Limited() const { return w_.config.framework == Framework::kFsdp1 && w_.config.limit_all_gathers; }
  bool ReducesNow() const { return !w_.config.no_sync || micro_ == w_.config.grad_accum - 1; }

  // Everything that decides the future, relative to the compute clock. A time further in the past
  // than one step's worth of communication cannot delay anything any more, nor can a finished
  // all-gather: such values are clamped so that idle streams do not look like changing state.
  std::vector<double> RelativeState() const {
    const double floor = -(comm_.volume.total_comm_s + 1e-9);
    std::vector<double> state;
    state.push_back(std::max(comm_free_ - compute_end_, floor));
    state.push_back(static_cast<double>(free_events_.size()));
    for (double t : free_events_) state.push_back(std::max(t - compute_end_, floor));
    for (size_t u = 0; u < gathered_.size(); ++u) {
      if (!gathered_[u]) continue;
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
    for (double& t : free_events_) t += dt;
    for (double& t : gather_end_) t += dt;
  }

  // Issues unit u's all-gather on the communication stream (and its host copy under offload).
  void Gather(int u) {
    if (!Sharded() || gathered_[u] || w_.units[u].numel == 0) return;
    double start = comm_free_;
    if (Limited() && free_events_.size() >= 2) {
      start = std::max(start, free_events_.front());
      free_events_.pop_front();
    }
    start += comm_.units[u].host_to_device_s;
    comm_free_ = start + comm_.units[u].all_gather_s;
    if (first_gather_s_ == 0 && comm_free_ > 0) first_gather_s_ = comm_free_;
    gather_end_[u] = comm_free_;
    gathered_[u] = 1;
  }

  void Compute(int u, double seconds) {
    const double ready = gathered_[u] ? gather_end_[u] : 0.0;
    if (ready > compute_end_) exposed_[u] += (ready - compute_end_);
    compute_end_ = std::max(compute_end_, ready) + seconds;
  }

  void Free(int u) {
    gathered_[u] = 0;
    if (Limited()) free_events_.push_back(compute_end_);
  }

  void ForwardUnit(int u) {
    Gather(u);
    Compute(u, cm_.units[u].forward_s);
    const bool reshard = !w_.units[u].is_root &&
                         (w_.config.strategy == Strategy::kFullShard || w_.config.strategy == Strategy::kHybridShard);
    if (reshard) Free(u);
  }

  void BackwardUnit(int u) {
    Gather(u);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPre || w_.config.framework == Framework::kFsdp2) {
      const int target = w_.BackwardPrefetchTarget(u);
      if (target >= 0 && w_.config.backward_prefetch != BackwardPrefetch::kNone) Gather(target);
    }
    Compute(u, cm_.units[u].backward_s + cm_.units[u].recompute_s);
    for (auto it = children_[u].rbegin(); it != children_[u].rend(); ++it) BackwardUnit(*it);
    if (Sharded() && w_.FreesInBackward(ReducesNow())) Free(u);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPost && w_.BackwardPrefetchTarget(u) >= 0) Gather(w_.BackwardPrefetchTarget(u));
    if (ReducesNow()) {
      const UnitComm& c = comm_.units[u];
      comm_free_ = std::max(comm_free_, compute_end_) + c.reduce_scatter_s + c.all_reduce_s + c.device_to_host_s;
    }
  }

  const Workload& w_;
  const ComputeModel& cm_;
  const CommModel& comm_;
  bool fast_forward_;
  std::vector<char> gathered_;
  std::vector<double> gather_end_;
  std::vector<double> exposed_, exposed_before_;
  std::vector<std::vector<int>> children_;
  std::deque<double> free_events_;
  double comm_free_ = 0, compute_end_ = 0, first_gather_s_ = 0, last_backward_compute_ = 0;
  int micro_ = 0;
};

}  // namespace

StepEstimate EstimateStep(const Workload& w, const ComputeModel& cm, const CommModel& comm, bool fast_forward) {
  return StepTimer(w, cm, comm, fast_forward).Run();
}

TimeEstimate EstimateTime(const Workload& w, double traffic_per_saved_byte) {
  TimeEstimate t;
  t.compute = EstimateCompute(w, traffic_per_saved_byte);
  t.comm = EstimateComm(w);
  t.step = EstimateStep(w, t.compute, t.comm);
  return t;
}

}  // namespace fsdp
