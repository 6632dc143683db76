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

// Emits one micro-batch's actions from the module walk (its hooks and segments in execution
// order), applying the configuration's FSDP rules.
class Builder {
 public:
  Builder(const Workload& w, const std::vector<int>& backward_prefetch_target)
      : w_(w), c_(w.config), backward_prefetch_target_(backward_prefetch_target) {
    state_.units.assign(w.units.size(), UnitState::kSharded);
  }

  const BuilderState& state() const { return state_; }

  std::vector<Action> MicroBatch(bool reduces, bool last) {
    actions_.clear();
    forward_ = true;
    hooked_.assign(w_.units.size(), 0);
    for (const ModuleWalk::Entry& e : w_.walk->forward) {
      switch (e.step) {
        case ModuleWalk::Step::kPreHook: PreForward(e.index); break;
        case ModuleWalk::Step::kSegment: Segment(ActionKind::kForward, e.index); break;
        case ModuleWalk::Step::kPostHook: PostForward(e.index); break;
      }
    }
    Action end{ActionKind::kEndForward};
    end.releases_all_gather_state = Fsdp2() && w_.shard_world > 1;
    Emit(end);
    forward_ = false;
    hooked_.assign(w_.units.size(), 0);
    pre_backwards_.assign(w_.units.size(), 0);
    for (const ModuleWalk::Entry& e : w_.walk->backward) {
      switch (e.step) {
        case ModuleWalk::Step::kPreHook: PreBackward(e.index); break;
        case ModuleWalk::Step::kSegment: Segment(ActionKind::kBackward, e.index); break;
        case ModuleWalk::Step::kPostHook: PostBackward(e.index, e.site, reduces); break;
      }
    }
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

  void PreForward(int u) {
    Hook(ActionKind::kPreForward, u);
    Unshard(u, false);
    Wait(u);
    if (c_.forward_prefetch && u + 1 < static_cast<int>(w_.units.size())) Prefetch(u + 1);
  }

  void PostForward(int u) {
    Hook(ActionKind::kPostForward, u);
    if (ReshardsAfterForward(w_, u)) Reshard(u);
  }

  // A group hooked at several modules ran its post-forward once per module, and FSDP2's
  // _backward_prefetch pops one of those records per pre-backward: all but the last target the
  // group itself (nothing to fetch).
  void PreBackward(int u) {
    Hook(ActionKind::kPreBackward, u);
    Unshard(u, false);
    Wait(u);
    const bool last_record = ++pre_backwards_[u] >= w_.units[u].HookSites();
    if (c_.backward_prefetch == BackwardPrefetch::kPre && last_record) Prefetch(backward_prefetch_target_[u]);
  }

  // FSDP1 _post_backward_hook / FSDP2 post_backward: reshard, then the BACKWARD_POST prefetch
  // (_post_backward_reshard), then the reduction unless no_sync keeps the gradient.
  // A group hooked at several modules (WrapUnit::hook_nodes) reduces at each what its module's
  // backward computed (FSDPParamGroup.post_backward: the parameters whose gradient is set).
  void PostBackward(int u, int site, bool reduces) {
    Action a = HookAction(ActionKind::kPostBackward, u);
    a.reduces = reduces;
    a.site = site;
    Emit(a);
    if (FreesInBackward(c_, reduces)) Reshard(u);
    if (c_.backward_prefetch == BackwardPrefetch::kPost) Prefetch(backward_prefetch_target_[u]);
    if (!reduces || w_.units[u].SiteGradPaddedNumel(site) == 0) return;  // nothing trainable: nothing to reduce
    Action r{ActionKind::kReduce};
    r.unit = u;
    r.site = site;
    r.reduce_scatter = Sharded();
    r.all_reduce = !Sharded() || (c_.strategy == Strategy::kHybridShard && w_.replicas > 1);
    r.to_host = c_.cpu_offload;
    r.waits_previous_reduce_scatter = Fsdp2() && r.reduce_scatter;
    Emit(r);
  }

  void Segment(ActionKind kind, int segment) {
    Action a{kind};
    a.segment = segment;
    Emit(a);
  }

  // FSDP1 _get_handle_to_prefetch: only a unit whose own pre-forward (pre-backward) hook has not
  // run yet in this pass; so the root's BACKWARD_POST prefetch, which targets the last block after
  // its backward, does nothing.
  void Prefetch(int u) {
    if (u >= 0 && !hooked_[u]) Unshard(u, true);
  }

  Action HookAction(ActionKind kind, int u) const {
    Action a{kind};
    a.unit = u;
    a.node = w_.units[u].node;
    return a;
  }
  void Hook(ActionKind kind, int u) {
    if (kind == ActionKind::kPreForward || kind == ActionKind::kPreBackward) hooked_[u] = 1;
    Emit(HookAction(kind, u));
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

  void Emit(Action a) {
    a.forward = forward_;
    actions_.push_back(a);
  }

  static constexpr int64_t kMaxInflightAllGathers = 2;  // _limiter_utils._FreeEventQueue

  const Workload& w_;
  const FsdpConfig& c_;
  const std::vector<int>& backward_prefetch_target_;
  BuilderState state_;
  std::vector<Action> actions_;
  bool forward_ = true;        // building the forward pass
  std::vector<char> hooked_;   // per unit: its pre-forward (pre-backward) hook ran in this pass
  std::vector<int> pre_backwards_;  // per unit: pre-backward hooks run in this backward
};

}  // namespace

bool FreesInBackward(const FsdpConfig& c, bool reduces_now) {
  return reduces_now || c.framework == Framework::kFsdp2 || c.strategy != Strategy::kShardGradOp;
}

bool ReshardsAfterForward(const Workload& w, int u) {
  if (w.config.strategy == Strategy::kNoShard) return true;
  if (w.units[u].is_root || !w.units[u].reshard_after_forward) return false;
  return w.config.strategy == Strategy::kFullShard || w.config.strategy == Strategy::kHybridShard;
}

int Schedule::ProgramOf(int64_t micro) const {
  if (micro == micro_batches_ - 1) return set_->last;
  if (micro < static_cast<int64_t>(set_->head.size())) return set_->head[micro];
  return set_->repeat;
}

int64_t Schedule::ProgramRuns(int index) const {
  int64_t runs = index == set_->last ? 1 : 0;
  const int64_t head = std::min<int64_t>(static_cast<int64_t>(set_->head.size()), micro_batches_ - 1);
  for (int64_t m = 0; m < head; ++m) runs += set_->head[m] == index ? 1 : 0;
  if (index == set_->repeat) runs += micro_batches_ - 1 - head;
  return runs;
}

std::optional<Schedule> Schedule::WithMicroBatches(int64_t micro_batches) const {
  const auto head = static_cast<int64_t>(set_->head.size());
  // the last program starts from the state after the head (and any repeats): the same only when
  // the head ran whole and, for more micro-batches, its program repeats
  const bool covered = micro_batches == micro_batches_ || (set_->repeat >= 0 && micro_batches >= head + 1) ||
                       (set_->repeat < 0 && micro_batches == head + 1);
  if (!covered) return std::nullopt;
  Schedule s = *this;
  s.micro_batches_ = micro_batches;
  return s;
}

int64_t Schedule::Reductions() const { return set_->fixed_reductions + set_->extra_reductions * Extra(); }

Schedule BuildSchedule(const Workload& w) {
  auto set = std::make_shared<Schedule::ProgramSet>();
  set->walk = w.walk;
  set->backward_prefetch_target.assign(w.units.size(), -1);
  for (size_t i = 1; i < w.post_forward_order.size(); ++i) set->backward_prefetch_target[w.post_forward_order[i]] = w.post_forward_order[i - 1];
  Builder builder(w, set->backward_prefetch_target);
  const int64_t accum = w.config.grad_accum;
  // Micro-batches before the last: one program each until a micro-batch starts from the state the
  // previous one started from; that program then repeats, and the last micro-batch starts from
  // the same state.
  BuilderState previous_start;
  for (int64_t m = 0; m < accum - 1; ++m) {
    BuilderState start = builder.state();
    if (m > 0 && start == previous_start) {
      set->repeat = set->head.back();
      break;
    }
    previous_start = std::move(start);
    set->programs.push_back(builder.MicroBatch(!w.config.no_sync, false));
    set->head.push_back(static_cast<int>(set->programs.size() - 1));
  }
  set->programs.push_back(builder.MicroBatch(true, true));
  set->last = static_cast<int>(set->programs.size() - 1);
  for (auto& c : set->fixed) c.assign(w.units.size(), 0);
  for (auto& c : set->per_extra) c.assign(w.units.size(), 0);
  for (int p = 0; p < static_cast<int>(set->programs.size()); ++p) {
    // runs of program p in a step of head + 1 micro-batches, and per micro-batch beyond
    const int64_t fixed = (p == set->last ? 1 : 0) + std::count(set->head.begin(), set->head.end(), p);
    const int64_t extra = p == set->repeat ? 1 : 0;
    std::vector<Action>& work = set->work.emplace_back();
    for (const Action& a : set->programs[p]) {
      const bool hook = a.kind == ActionKind::kPreForward || a.kind == ActionKind::kPostForward || a.kind == ActionKind::kPreBackward ||
                        a.kind == ActionKind::kPostBackward;
      if (!hook) work.push_back(a);
      auto count = [&](Schedule::Count c) {
        set->fixed[static_cast<int>(c)][a.unit] += fixed;
        set->per_extra[static_cast<int>(c)][a.unit] += extra;
      };
      if (a.kind == ActionKind::kUnshard) {
        if (a.all_gather) count(a.forward ? Schedule::Count::kForwardGathers : Schedule::Count::kBackwardGathers);
        count(Schedule::Count::kUnshards);
      }
      if (a.kind == ActionKind::kEndBackward && a.waits_for_reductions) {
        set->fixed_reductions += fixed;
        set->extra_reductions += extra;
      }
    }
  }
  Schedule s;
  s.set_ = std::move(set);
  s.micro_batches_ = accum;
  return s;
}

}  // namespace fsdp
