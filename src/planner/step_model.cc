#include "planner/step_model.h"

#include <algorithm>
#include <deque>

namespace fsdp {
namespace {

class StepTimer {
 public:
  StepTimer(const Workload& w, const ComputeModel& cm, const CommModel& comm)
      : w_(w), cm_(cm), comm_(comm), gathered_(w.units.size(), false), gather_end_(w.units.size(), 0.0) {
    children_.resize(w.units.size());
    for (int u = 1; u < static_cast<int>(w.units.size()); ++u) children_[w.units[u].parent_unit].push_back(u);
  }

  StepEstimate Run() {
    StepEstimate e;
    const int accum = w_.config.grad_accum;
    for (micro_ = 0; micro_ < accum; ++micro_) {
      if (micro_ == 2 && accum > 3) {
        // Micro-batches 1 .. accum-2 are identical (steady state): play micro-batch 1, then
        // shift every clock by the remaining ones' duration and play the last one.
        const double repeats = static_cast<double>(accum - 3);
        Shift(repeats * last_micro_s_);
        e.forward_s += repeats * last_forward_s_;
        e.backward_s += repeats * last_backward_s_;
        micro_ = accum - 1;
      }
      const double micro_start = compute_end_;
      const double fwd_start = compute_end_;
      for (int u = 0; u < static_cast<int>(w_.units.size()); ++u) ForwardUnit(u);
      last_forward_s_ = compute_end_ - fwd_start;
      const double bwd_start = compute_end_;
      BackwardUnit(0);
      last_backward_s_ = compute_end_ - bwd_start;
      last_micro_s_ = compute_end_ - micro_start;
      e.forward_s += last_forward_s_;
      e.backward_s += last_backward_s_;
    }
    const double last_compute = compute_end_;
    const double opt_start = std::max(compute_end_, comm_free_);
    e.last_reduce_s = opt_start - last_compute;
    e.optimizer_s = cm_.optimizer_s;
    e.step_s = opt_start + cm_.optimizer_s;
    e.compute_s = cm_.compute_s_per_step;
    e.comm_s = comm_.volume.total_comm_s;
    e.exposed_comm_s = std::max(0.0, e.step_s - e.compute_s);
    e.first_all_gather_s = first_gather_s_;
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
    gathered_[u] = true;
  }

  void Compute(int u, double seconds) {
    const double ready = gathered_[u] ? gather_end_[u] : 0.0;
    compute_end_ = std::max(compute_end_, ready) + seconds;
  }

  void Free(int u) {
    gathered_[u] = false;
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
    if (Sharded()) Free(u);
    if (w_.config.backward_prefetch == BackwardPrefetch::kPost && w_.BackwardPrefetchTarget(u) >= 0) Gather(w_.BackwardPrefetchTarget(u));
    if (ReducesNow()) {
      const UnitComm& c = comm_.units[u];
      comm_free_ = std::max(comm_free_, compute_end_) + c.reduce_scatter_s + c.all_reduce_s + c.device_to_host_s;
    }
  }

  const Workload& w_;
  const ComputeModel& cm_;
  const CommModel& comm_;
  std::vector<bool> gathered_;
  std::vector<double> gather_end_;
  std::vector<std::vector<int>> children_;
  std::deque<double> free_events_;
  double comm_free_ = 0, compute_end_ = 0, first_gather_s_ = 0;
  double last_micro_s_ = 0, last_forward_s_ = 0, last_backward_s_ = 0;
  int micro_ = 0;
};

}  // namespace

StepEstimate EstimateStep(const Workload& w, const ComputeModel& cm, const CommModel& comm) {
  return StepTimer(w, cm, comm).Run();
}

TimeEstimate EstimateTime(const Workload& w) {
  TimeEstimate t;
  t.compute = EstimateCompute(w);
  t.comm = EstimateComm(w);
  t.step = EstimateStep(w, t.compute, t.comm);
  return t;
}

}  // namespace fsdp
