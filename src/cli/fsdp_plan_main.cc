// fsdp-plan: per-GPU memory of a model under an FSDP configuration (thin main; logic in plan_cli).
#include <iostream>

#include "cli/cli_util.h"
#include "cli/plan_cli.h"

int main(int argc, char** argv) {
  CLI::App app{"fsdp-plan: per-GPU memory of a PyTorch FSDP training step.\n"
               "With no --model it answers the DDP-vs-FSDP question for 7B/13B/34B/70B models on 4 GPUs."};
  fsdp::PlanFlags flags;
  fsdp::AddPlanFlags(app, flags);
  if (int code = fsdp::ParseOrExitCode(app, argc, argv, "fsdp-plan"); code >= 0) return code;
  fsdp::FinishPlanFlags(app, flags);
  fsdp::Status status = flags.model.empty() ? fsdp::RunDefaultScenario(flags, std::cout) : fsdp::RunPlan(flags, std::cout);
  if (!status.ok()) return fsdp::ReportError("fsdp-plan", status.error());
  return fsdp::kExitOk;
}
