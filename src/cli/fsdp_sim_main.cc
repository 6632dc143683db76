// fsdp-sim: discrete-event simulation of one FSDP step, what-if sweeps, comparisons (thin main).
#include <iostream>

#include "cli/cli_util.h"
#include "cli/sim_cli.h"

int main(int argc, char** argv) {
  CLI::App app{"fsdp-sim: discrete-event simulation of one PyTorch FSDP training step (same flags as fsdp-plan)."};
  fsdp::SimFlags flags;
  fsdp::AddSimFlags(app, flags);
  fsdp::SimFlags whatif_flags;
  CLI::App* whatif = app.add_subcommand("what-if", "vary one or two parameters and tabulate the simulated step");
  fsdp::AddSimFlags(*whatif, whatif_flags);
  whatif->add_option("--vary", whatif_flags.vary, "PARAM=v1,v2,... (bandwidth, gpus, strategy, prefetch, limit_all_gathers, micro-batch, seq-len)");
  whatif->add_option("--chart", whatif_flags.chart_path, "write the sweep as an HTML chart");
  std::vector<std::string> compare_files;
  CLI::App* compare = app.add_subcommand("compare", "two fsdp-sim --json results side by side with deltas");
  compare->add_option("files", compare_files, "A.json B.json")->expected(2);
  if (int code = fsdp::ParseOrExitCode(app, argc, argv, "fsdp-sim"); code >= 0) return code;
  fsdp::Status status;
  if (whatif->parsed()) {
    fsdp::FinishPlanFlags(*whatif, whatif_flags.plan);
    status = fsdp::RunWhatIf(whatif_flags, std::cout);
  } else if (compare->parsed()) {
    status = fsdp::RunCompare(compare_files, std::cout);
  } else {
    fsdp::FinishPlanFlags(app, flags.plan);
    status = fsdp::RunSim(flags, std::cout);
  }
  const bool json = whatif->parsed() ? whatif_flags.plan.json : !compare->parsed() && flags.plan.json;
  if (!status.ok()) return fsdp::ReportError("fsdp-sim", status.error(), json);
  return fsdp::kExitOk;
}
