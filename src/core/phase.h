// Where in the step something happens, named the same by every tool: fsdp-plan's memory timeline
// and peak ("backward: reduce-scatter model.layers.3 (micro-batch 2/4)"), fsdp-sim's memory
// track, and fsdp-run's measured peaks (its CPU ledger and GPU allocator).
#pragma once

#include <cstdint>
#include <string>

#include "core/schedule.h"
#include "core/workload.h"

namespace fsdp {

/// The kinds of phase, in the order a step meets them.
enum class StepPhase : uint8_t {
  kInitialisation,   ///< fsdp-run: before the first step (shards, optimizer states, buffers)
  kStart,            ///< start of a steady-state step (shards and optimizer states exist)
  kForwardUnshard,   ///< a unit's pre-forward hook: its all-gather, and what it prefetches
  kForward,          ///< a module's forward (the units and the modules that hold activations)
  kEndForward,       ///< the loss exists
  kBackwardUnshard,  ///< a unit's pre-backward hook
  kBackward,         ///< a module's backward
  kReduce,           ///< a unit's post-backward hook: reshard, prefetch, reduce-scatter
  kOptimizer,        ///< optimizer.step()
  kAfterZeroGrad,    ///< zero_grad(set_to_none=True) has dropped the gradients
};

/// A phase: its kind, the module-tree node it belongs to (-1: none), the micro-batch, and the
/// schedule action being played (counted over the step; -1 before any). Numbers, so that playing
/// a step formats no strings; PhaseName formats one for a report.
struct Phase {
  StepPhase kind = StepPhase::kStart;
  int node = -1;
  int micro = 0;
  int64_t action = -1;
  bool operator==(const Phase&) const = default;
};

/// "start of step", "forward: unshard model.layers.3", "forward: lm_head + loss", "backward:
/// reduce-scatter root", "optimizer step"; with several micro-batches " (micro-batch 2/4)".
std::string PhaseName(const Workload& workload, const Phase& phase);

/// Follows the phase through a walk of the schedule, so that every executor names its memory by
/// the same rule: a unit's hooks open its unshard / reduce-scatter phases, the forward and
/// backward of the units and of the modules that hold activations open theirs, the end of the
/// forward and the optimizer theirs. Other actions and visits stay in the phase they are in.
class PhaseTracker {
 public:
  explicit PhaseTracker(const Workload& workload) : w_(workload) {}
  /// Starts micro-batch `micro`.
  void StartMicroBatch(int micro) { phase_.micro = micro; }
  /// Starts a new step: the action count begins again.
  void StartStep() { phase_ = Phase{}; }
  /// Counts a schedule action and enters the phase it opens, if any; true when it opened one.
  /// kEndForward's phase opens here too: a caller with work to do before it calls this after.
  bool Enter(const Action& action);
  /// Enters the phase a segment's visit opens, if any (forward: every visit; backward: both ends):
  /// phases are named after units and after the modules that hold activations. Inline: the
  /// planner's search calls it for every visit of every configuration.
  bool Enter(const NodeVisit& visit, bool forward) {
    const ModuleNode& n = w_.nodes[visit.node];
    if (n.unit < 0 && n.role == ModuleNode::Role::kOther) return false;
    phase_ = Phase{forward ? StepPhase::kForward : StepPhase::kBackward, visit.node, phase_.micro, phase_.action};
    return true;
  }
  /// Enters a phase of no node (kInitialisation, kStart, kAfterZeroGrad).
  void Enter(StepPhase kind);
  const Phase& phase() const { return phase_; }
  std::string Name() const { return PhaseName(w_, phase_); }

 private:
  const Workload& w_;
  Phase phase_;
};

}  // namespace fsdp
