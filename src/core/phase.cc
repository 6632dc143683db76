#include "core/phase.h"

#include <fmt/format.h>

namespace fsdp {
std::string PhaseName(const Workload& w, const Phase& p) {
  static constexpr const char* kWhat[] = {"initialisation",    "start of step", "forward: unshard",         "forward:",      "end of forward",
                                          "backward: unshard", "backward:",     "backward: reduce-scatter", "optimizer step", "after zero_grad"};
  std::string name = kWhat[static_cast<int>(p.kind)];
  if (p.node >= 0) {
    const ModuleNode& n = w.nodes[p.node];
    name += " ";
    name += p.node == 0 ? "root" : n.role == ModuleNode::Role::kLmHead ? "lm_head + loss" : n.path;
  }
  const bool step_level = p.kind == StepPhase::kOptimizer || p.kind == StepPhase::kAfterZeroGrad || p.kind == StepPhase::kStart ||
                          p.kind == StepPhase::kInitialisation;
  if (w.config.grad_accum > 1 && !step_level) name += fmt::format(" (micro-batch {}/{})", p.micro + 1, w.config.grad_accum);
  return name;
}

bool PhaseTracker::Enter(const Action& a) {
  ++phase_.action;
  switch (a.kind) {
    case ActionKind::kPreForward: phase_ = Phase{StepPhase::kForwardUnshard, a.node, phase_.micro, phase_.action}; return true;
    case ActionKind::kPreBackward: phase_ = Phase{StepPhase::kBackwardUnshard, a.node, phase_.micro, phase_.action}; return true;
    case ActionKind::kPostBackward: phase_ = Phase{StepPhase::kReduce, a.node, phase_.micro, phase_.action}; return true;
    case ActionKind::kEndForward: phase_ = Phase{StepPhase::kEndForward, -1, phase_.micro, phase_.action}; return true;
    case ActionKind::kOptimizer: phase_ = Phase{StepPhase::kOptimizer, -1, phase_.micro, phase_.action}; return true;
    default: return false;
  }
}

void PhaseTracker::Enter(StepPhase kind) { phase_ = Phase{kind, -1, phase_.micro, phase_.action}; }

}  // namespace fsdp
