// The FSDP schedule of one optimizer step: the typed actions PyTorch FSDP1 or FSDP2 issues, in the
// CPU's issue order, built once from a Workload. Every rule of *when* something happens lives here
// and only here: which hooks unshard or prefetch which unit, reshard after forward (never the
// root), FSDP1's rate limiter, FSDP2's all-gather state, no_sync, HYBRID_SHARD's replica
// all-reduce, CPU offload's copies. Executors (the planner's memory replay and step timer, fsdp-sim,
// fsdp-run's CPU and GPU engines, the runtime profiles) interpret the actions; none re-decides a
// rule (docs/schedule.md). Like ninja's Plan, the schedule says what runs in which order; the
// executors are the swappable runners.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "core/workload.h"

namespace fsdp {

enum class ActionKind : uint8_t {
  kPreForward,     ///< a unit's pre-forward hook begins (phase "forward: unshard <unit>")
  kUnshard,        ///< issue a unit's all-gather (own hook, or a prefetch from another unit's hook)
  kWaitUnshard,    ///< the compute stream waits for the unit's all-gather (FSDP2: then its copy-out)
  kForward,        ///< compute: a forward segment
  kPostForward,    ///< a unit's post-forward hook (its module's forward returned)
  kReshard,        ///< free the unit's unsharded parameters
  kEndForward,     ///< the root's post-forward returned: the loss exists
  kPreBackward,    ///< a unit's pre-backward hook begins
  kBackward,       ///< compute: a backward segment (with the recomputation of checkpointed blocks)
  kPostBackward,   ///< the unit's gradients are complete (its post-backward hook)
  kReduce,         ///< the unit's gradient reduction: reduce-scatter, replica all-reduce, copy to host
  kEndBackward,    ///< the root's post-backward callback (FSDP1 _post_backward_final_callback)
  kOptimizer,      ///< optimizer.step(), then zero_grad(set_to_none=True)
};

/// What the all-gather streams wait on when a unit's unshard completes (FSDP2's
/// FSDPParamGroup.wait_for_unshard): in forward the *previous* group's copy-out event (the
/// all_gather_state it held), so that the next all-gather cannot start before the copy-out two
/// groups back has run and at most two forward all-gathers are ahead of the compute stream; in
/// backward this group's own copy-out event. FSDP1 has none.
enum class CopyOutWait : uint8_t { kNone, kPrevious, kThis };

struct Action {
  ActionKind kind = ActionKind::kForward;
  CopyOutWait copy_out_wait = CopyOutWait::kNone;  ///< kWaitUnshard: FSDP2's all-gather stream wait
  bool forward : 1 = true;        ///< in the forward pass (false: backward, optimizer)
  // kUnshard
  bool prefetch : 1 = false;      ///< issued ahead, from another unit's hook (forward_prefetch, BACKWARD_PRE/POST)
  bool all_gather : 1 = false;    ///< a collective runs (false: NO_SHARD's local low-precision copy)
  bool host_to_device : 1 = false;  ///< CPU offload: the fp32 shard is copied to the GPU first (NO_SHARD's local copy too)
  /// FSDP1 limit_all_gathers governs this all-gather (_runtime_utils._unshard)...
  bool rate_limited : 1 = false;
  /// ...and the CPU first synchronises on the oldest queued free event: one, once
  /// _max_num_inflight_all_gathers = 2 are queued (_FreeEventQueue.dequeue_if_needed). The queue
  /// starts the step empty and runs on across micro-batches.
  bool rate_limit_wait : 1 = false;
  // kReshard
  bool queues_free_event : 1 = false;  ///< FSDP1 limit_all_gathers: the free event joins the rate limiter's queue
  // kPostBackward
  bool reduces : 1 = true;        ///< false under no_sync before the last micro-batch: the gradient is kept unsharded
  // kReduce
  bool reduce_scatter : 1 = false;  ///< reduce-scatter in the shard group
  bool all_reduce : 1 = false;      ///< NO_SHARD's all-reduce, or HYBRID_SHARD's all-reduce of the shard across replicas
  bool to_host : 1 = false;         ///< CPU offload: the gradient shard is copied to the host
  /// FSDP2 post_backward: the compute stream first waits for the previous unit's reduce-scatter
  /// of this backward (reduce_scatter_state), so the next backward compute cannot run ahead of it.
  bool waits_previous_reduce_scatter : 1 = false;
  // kEndForward
  bool releases_all_gather_state : 1 = false;  ///< FSDP2: the root frees the all-gather result it held
  // kEndBackward
  bool waits_for_reductions : 1 = false;  ///< the compute stream waits for this micro-batch's reductions
  int unit = -1;              ///< hooks, kUnshard, kWaitUnshard, kReshard, kPostBackward, kReduce
  /// kPostBackward, kReduce: the unit's hook site whose gradient it takes and reduces
  /// (WrapUnit::SiteGradPaddedNumel; 0 for a unit of one module, whose whole gradient it is)
  int site = 0;
  int node = -1;              ///< hooks: the unit's module node; compute: -1
  int segment = -1;           ///< kForward / kBackward: index into Schedule::segments()
};

/// The step: micro-batch programs, and which program each micro-batch runs. Micro-batches that
/// start from the same state run the same program, so a step of 1000 micro-batches holds three.
/// Copies share their programs.
class Schedule {
 public:
  int64_t micro_batches() const { return micro_batches_; }
  /// The actions of micro-batch `micro` (0 <= micro < micro_batches()); the last one ends with
  /// the optimizer step.
  std::span<const Action> MicroBatch(int64_t micro) const { return set_->programs[ProgramOf(micro)]; }
  /// The same actions without the four hook markers (kPreForward, kPostForward, kPreBackward,
  /// kPostBackward): for executors that only need what moves data or time.
  std::span<const Action> MicroBatchWork(int64_t micro) const { return set_->work[ProgramOf(micro)]; }
  /// Index of the program micro-batch `micro` runs: equal indices, equal actions.
  int ProgramOf(int64_t micro) const;
  int program_count() const { return static_cast<int>(set_->programs.size()); }
  std::span<const Action> Program(int index) const { return set_->programs[index]; }
  /// How many micro-batches of the step run program `index`.
  int64_t ProgramRuns(int index) const;

  /// The same configuration with `micro_batches` micro-batches, sharing these programs: present
  /// when they cover it (the middle micro-batches repeat one program from a first few on).
  std::optional<Schedule> WithMicroBatches(int64_t micro_batches) const;

  const std::vector<ComputeSegment>& segments() const { return set_->walk->segments; }
  std::span<const NodeVisit> Visits(const ComputeSegment& s) const {
    return {set_->walk->visits.data() + s.first_visit, static_cast<size_t>(s.visit_count)};
  }

  /// The unit FSDP prefetches in backward for unit u: the one before u in post-forward order
  /// (FSDP1 _ExecOrderData.get_handle_to_backward_prefetch, FSDP2 _backward_prefetch); -1 none.
  int BackwardPrefetchTarget(int u) const { return set_->backward_prefetch_target[u]; }

  /// All-gathers issued per step (over every micro-batch): per unit, in forward and in backward.
  int64_t ForwardAllGathers(int u) const { return PerStep(Count::kForwardGathers, u); }
  int64_t BackwardAllGathers(int u) const { return PerStep(Count::kBackwardGathers, u); }
  /// Unshards of unit u per step: its all-gathers, or NO_SHARD's local low-precision copies (under
  /// CPU offload each copies the shard to the GPU first).
  int64_t Unshards(int u) const { return PerStep(Count::kUnshards, u); }
  /// Gradient reductions per step (every micro-batch, or once under no_sync).
  int64_t Reductions() const;

 private:
  friend Schedule BuildSchedule(const Workload& workload);
  enum class Count { kForwardGathers, kBackwardGathers, kUnshards };
  struct ProgramSet {
    std::vector<std::vector<Action>> programs, work;
    std::vector<int> head;  // programs of the first micro-batches
    int repeat = -1;        // program of the micro-batches after head, before the last (-1: none found)
    int last = 0;           // program of the last micro-batch
    std::shared_ptr<const ModuleWalk> walk;
    std::vector<int> backward_prefetch_target;
    // Per-step counts as fixed + per_extra x (micro-batches beyond head + 1): per Count, per unit
    std::vector<int64_t> fixed[3], per_extra[3];
    int64_t fixed_reductions = 0, extra_reductions = 0;
  };
  int64_t Extra() const { return micro_batches_ - 1 - static_cast<int64_t>(set_->head.size()); }
  int64_t PerStep(Count count, int u) const {
    const int c = static_cast<int>(count);
    return set_->fixed[c][u] + set_->per_extra[c][u] * Extra();
  }
  std::shared_ptr<const ProgramSet> set_;
  int64_t micro_batches_ = 1;
};

/// Builds the schedule of `workload`'s configuration (wrap units, strategy, framework, prefetch,
/// limit_all_gathers, no_sync, grad_accum, CPU offload).
Schedule BuildSchedule(const Workload& workload);

/// Whether a unit's backward frees its unsharded parameters, in a micro-batch that reduces its
/// gradients or not (no_sync). FSDP1's _should_free_in_backward keeps them under no_sync for
/// SHARD_GRAD_OP, so the next micro-batch's forward needs no all-gather; FULL_SHARD,
/// HYBRID_SHARD, NO_SHARD (its low-precision copy) and FSDP2 always free.
bool FreesInBackward(const FsdpConfig& config, bool reduces_now);

/// Whether unit u's post-forward frees its unsharded parameters: FULL_SHARD and HYBRID_SHARD
/// (RESHARD_AFTER_FORWARD_HANDLE_STRATEGIES; FSDP2's reshard_after_forward=True), never the
/// root (FSDP1 _post_forward_reshard; FSDP2's root keeps them for its backward) nor a unit
/// created with reshard_after_forward=False (WrapUnit::reshard_after_forward); NO_SHARD's
/// post_reshard frees every unit's low-precision copy, the root's too.
bool ReshardsAfterForward(const Workload& workload, int u);

}  // namespace fsdp
