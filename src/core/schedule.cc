#include "core/schedule.h"

#include <algorithm>

namespace fsdp {
namespace {

// Where a unit's parameters are between actions.
enum class UnitState : uint8_t { kSharded, kGathering, kUnsharded };

// What decides the next micro-batch's program: equal states give equal programs.
struct BuilderState {
  std::vector<UnitState> units;
  int64_t queued_free_events = 0;  // FSDP1 rate limiter (_FreeEventQueue)
  bool operator==(const BuilderState&) const = default;
};

// Walks the module tree once per distinct micro-batch, emitting PyTorch's hooks in order.
class Builder {
 public:
  Builder(const Workload& w, std::vector<ComputeSegment>& segments, std::vector<NodeVisit>& visits,
          const std::vector<int>& backward_prefetch_target)
      : w_(w), c_(w.config), segments_(segments), visits_(visits), backward_prefetch_target_(backward_prefetch_target) {
    state_.units.assign(w.units.size(), UnitState::kSharded);
  }

  const BuilderState& state() const { return state_; }

  std::vector<Action> MicroBatch(bool reduces, bool last) {
    actions_.clear();
    segment_cursor_ = 0;
    forward_ = true;
    hooked_.assign(w_.units.size(), 0);
    Forward(0);
    Action end{ActionKind::kEndForward};
    end.releases_all_gather_state = Fsdp2() && w_.shard_world > 1;
    Emit(end);
    forward_ = false;
    hooked_.assign(w_.units.size(), 0);
    Backward(0, reduces);
    Action done{ActionKind::kEndBackward};
    done.waits_for_reductions = reduces;
    Emit(done);
    if (last) Emit(Action{ActionKind::kOptimizer});
    return std::move(actions_);
  }

 private:
  bool Fsdp2() const { return c_.framework == Framework::kFsdp2; }
  bool Sharded() const { return c_.strategy != Strategy::kNoShard; }
  bool RateLimited() const { return !Fsdp2() && c_.limit_all_gathers && Sharded(); }

  void Forward(int node_id) {
    const ModuleNode& node = w_.nodes[node_id];
    const int u = node.unit;
    if (u >= 0) {
      Hook(ActionKind::kPreForward, u, node_id);
      Unshard(u, false);
      Wait(u);
      if (c_.forward_prefetch && u + 1 < static_cast<int>(w_.units.size())) Prefetch(u + 1);
    }
    for (int child : node.children) Forward(child);
    Visit(node_id, false);
    if (u < 0) return;
    Hook(ActionKind::kPostForward, u, node_id);
    if (ReshardsAfterForward(w_, u)) Reshard(u);
  }

  void Backward(int node_id, bool reduces) {
    const ModuleNode& node = w_.nodes[node_id];
    const int u = node.unit;
    if (u >= 0) {
      Hook(ActionKind::kPreBackward, u, node_id);
      Unshard(u, false);
      Wait(u);
      if (c_.backward_prefetch == BackwardPrefetch::kPre) Prefetch(backward_prefetch_target_[u]);
    }
    Visit(node_id, true);
    for (auto it = node.children.rbegin(); it != node.children.rend(); ++it) Backward(*it, reduces);
    Visit(node_id, false);
    if (u >= 0) PostBackward(u, node_id, reduces);
  }

  // FSDP1 _post_backward_hook / FSDP2 post_backward: reshard, then the BACKWARD_POST prefetch
  // (_post_backward_reshard), then the reduction unless no_sync keeps the gradient.
  void PostBackward(int u, int node_id, bool reduces) {
    Action a = HookAction(ActionKind::kPostBackward, u, node_id);
    a.reduces = reduces;
    Emit(a);
    if (FreesInBackward(c_, reduces)) Reshard(u);
    if (c_.backward_prefetch == BackwardPrefetch::kPost) Prefetch(backward_prefetch_target_[u]);
    if (!reduces || w_.units[u].numel == 0) return;
    Action r{ActionKind::kReduce};
    r.unit = u;
    r.reduce_scatter = Sharded();
    r.all_reduce = !Sharded() || (c_.strategy == Strategy::kHybridShard && w_.replicas > 1);
    r.to_host = c_.cpu_offload;
    r.waits_previous_reduce_scatter = Fsdp2() && r.reduce_scatter;
    Emit(r);
  }

  // FSDP1 _get_handle_to_prefetch: only a unit whose own pre-forward (pre-backward) hook has not
  // run yet in this pass; so the root's BACKWARD_POST prefetch, which targets the last block after
  // its backward, does nothing.
  void Prefetch(int u) {
    if (u >= 0 && !hooked_[u]) Unshard(u, true);
  }

  static Action HookAction(ActionKind kind, int u, int node_id) {
    Action a{kind};
    a.unit = u;
    a.node = node_id;
    return a;
  }
  void Hook(ActionKind kind, int u, int node_id) {
    if (kind == ActionKind::kPreForward || kind == ActionKind::kPreBackward) hooked_[u] = 1;
    Emit(HookAction(kind, u, node_id));
  }

  // A unit without parameters has no FlatParameter (FSDP1) or parameter group (FSDP2): nothing to
  // gather; one already gathered or being gathered is not gathered again.
  void Unshard(int u, bool prefetch) {
    if (u < 0 || w_.units[u].numel == 0 || state_.units[u] != UnitState::kSharded) return;
    Action a{ActionKind::kUnshard};
    a.unit = u;
    a.prefetch = prefetch;
    a.all_gather = Sharded();
    a.host_to_device = c_.cpu_offload;
    a.rate_limited = RateLimited();
    if (a.rate_limited && state_.queued_free_events >= kMaxInflightAllGathers) {
      a.rate_limit_wait = true;
      --state_.queued_free_events;
    }
    state_.units[u] = UnitState::kGathering;
    Emit(a);
  }

  void Wait(int u) {
    if (u < 0 || state_.units[u] != UnitState::kGathering) return;
    Action a{ActionKind::kWaitUnshard};
    a.unit = u;
    if (Fsdp2()) a.copy_out_wait = forward_ && w_.shard_world > 1 ? CopyOutWait::kPrevious : CopyOutWait::kThis;
    state_.units[u] = UnitState::kUnsharded;
    Emit(a);
  }

  void Reshard(int u) {
    if (state_.units[u] != UnitState::kUnsharded) return;
    Action a{ActionKind::kReshard};
    a.unit = u;
    a.queues_free_event = RateLimited();
    if (a.queues_free_event) ++state_.queued_free_events;
    state_.units[u] = UnitState::kSharded;
    Emit(a);
  }

  void Visit(int node_id, bool enter) { pending_.push_back(NodeVisit{node_id, enter}); }

  // Closes the visits since the last hook into a compute segment; the same walk gives the same
  // segments in every micro-batch, so they are made once.
  void Flush() {
    if (pending_.empty()) return;
    if (segment_cursor_ == segments_.size()) {
      ComputeSegment s;
      s.unit = OwningUnit(pending_.front().node);
      s.forward = forward_;
      s.first_visit = static_cast<int>(visits_.size());
      s.visit_count = static_cast<int>(pending_.size());
      visits_.insert(visits_.end(), pending_.begin(), pending_.end());
      segments_.push_back(s);
    }
    Action a{forward_ ? ActionKind::kForward : ActionKind::kBackward};
    a.segment = static_cast<int>(segment_cursor_++);
    a.forward = forward_;
    pending_.clear();
    actions_.push_back(a);
  }

  void Emit(Action a) {
    Flush();
    a.forward = forward_;
    actions_.push_back(a);
  }

  int OwningUnit(int node_id) const {
    while (w_.nodes[node_id].unit < 0) node_id = w_.nodes[node_id].parent;
    return w_.nodes[node_id].unit;
  }

  static constexpr int64_t kMaxInflightAllGathers = 2;  // _limiter_utils._FreeEventQueue

  const Workload& w_;
  const FsdpConfig& c_;
  std::vector<ComputeSegment>& segments_;
  std::vector<NodeVisit>& visits_;
  const std::vector<int>& backward_prefetch_target_;
  BuilderState state_;
  std::vector<Action> actions_;
  std::vector<NodeVisit> pending_;
  size_t segment_cursor_ = 0;
  bool forward_ = true;        // walking the forward pass
  std::vector<char> hooked_;   // per unit: its pre-forward (pre-backward) hook ran in this pass
};

}  // namespace

bool FreesInBackward(const FsdpConfig& c, bool reduces_now) {
  return reduces_now || c.framework == Framework::kFsdp2 || c.strategy != Strategy::kShardGradOp;
}

bool ReshardsAfterForward(const Workload& w, int u) {
  if (w.config.strategy == Strategy::kNoShard) return true;
  if (w.units[u].is_root) return false;
  return w.config.strategy == Strategy::kFullShard || w.config.strategy == Strategy::kHybridShard;
}

std::span<const Action> Schedule::MicroBatch(int64_t micro) const { return programs_[ProgramOf(micro)]; }

int Schedule::ProgramOf(int64_t micro) const {
  if (micro == micro_batches_ - 1) return last_;
  if (micro < static_cast<int64_t>(head_.size())) return head_[micro];
  return repeat_;
}

int64_t Schedule::ProgramRuns(int index) const {
  int64_t runs = index == last_ ? 1 : 0;
  for (int p : head_) runs += p == index ? 1 : 0;
  if (index == repeat_ && index != last_) runs += micro_batches_ - 1 - static_cast<int64_t>(head_.size());
  return runs;
}

int Schedule::ForwardPrefetchTarget(int u) const { return u + 1 < unit_count_ ? u + 1 : -1; }

Schedule BuildSchedule(const Workload& w) {
  Schedule s;
  s.micro_batches_ = w.config.grad_accum;
  s.unit_count_ = static_cast<int>(w.units.size());
  s.backward_prefetch_target_.assign(w.units.size(), -1);
  for (size_t i = 1; i < w.post_forward_order.size(); ++i) s.backward_prefetch_target_[w.post_forward_order[i]] = w.post_forward_order[i - 1];
  Builder builder(w, s.segments_, s.visits_, s.backward_prefetch_target_);
  const int64_t accum = w.config.grad_accum;
  // Micro-batches before the last: one program each until a micro-batch starts from the state the
  // previous one started from; that program then repeats, and the last micro-batch starts from
  // the same state.
  BuilderState previous_start;
  for (int64_t m = 0; m < accum - 1; ++m) {
    BuilderState start = builder.state();
    if (m > 0 && start == previous_start) {
      s.repeat_ = s.head_.back();
      break;
    }
    previous_start = std::move(start);
    s.programs_.push_back(builder.MicroBatch(!w.config.no_sync, false));
    s.head_.push_back(static_cast<int>(s.programs_.size() - 1));
  }
  s.programs_.push_back(builder.MicroBatch(true, true));
  s.last_ = static_cast<int>(s.programs_.size() - 1);
  if (s.head_.empty()) s.repeat_ = s.last_;
  // Collective counts per step.
  s.forward_gathers_.assign(w.units.size(), 0);
  s.backward_gathers_.assign(w.units.size(), 0);
  s.unshards_.assign(w.units.size(), 0);
  for (int p = 0; p < s.program_count(); ++p) {
    const int64_t runs = s.ProgramRuns(p);
    for (const Action& a : s.programs_[p]) {
      if (a.kind == ActionKind::kUnshard && a.all_gather) (a.forward ? s.forward_gathers_ : s.backward_gathers_)[a.unit] += runs;
      if (a.kind == ActionKind::kUnshard) s.unshards_[a.unit] += runs;
      if (a.kind == ActionKind::kEndBackward && a.waits_for_reductions) s.reductions_ += runs;
    }
  }
  return s;
}

}  // namespace fsdp
