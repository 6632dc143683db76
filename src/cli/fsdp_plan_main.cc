// fsdp-plan: per-GPU memory, communication and step time of an FSDP configuration; the search for
// GPUs and strategy; advice for configurations that do not fit (thin main; logic in src/cli).
#include <iostream>

#include "cli/cli_util.h"
#include "cli/plan_cli.h"
#include "cli/recommend_cli.h"

int main(int argc, char** argv) {
  CLI::App app{"fsdp-plan: per-GPU memory, communication and step time of a PyTorch FSDP training step.\n"
               "With no --model it answers the DDP-vs-FSDP question for 7B/13B/34B/70B models on 4 GPUs."};
  fsdp::PlanFlags flags;
  fsdp::AddPlanFlags(app, flags);
  fsdp::AddReplayFlags(app, flags);
  fsdp::RecommendFlags recommend_flags;
  CLI::App* recommend = app.add_subcommand("recommend", "search GPU type x count x strategy x checkpointing x micro-batch x offload x wrap");
  fsdp::AddRecommendFlags(*recommend, recommend_flags);
  fsdp::PlanFlags advise_flags;
  CLI::App* advise = app.add_subcommand("advise", "for a configuration that does not fit: the smallest changes that make it fit");
  fsdp::AddPlanFlags(*advise, advise_flags);
  if (int code = fsdp::ParseOrExitCode(app, argc, argv, "fsdp-plan"); code >= 0) return code;
  fsdp::Status status;
  if (recommend->parsed()) {
    status = fsdp::RunRecommend(recommend_flags, std::cout);
  } else if (advise->parsed()) {
    fsdp::FinishPlanFlags(*advise, advise_flags);
    status = advise_flags.model.empty() ? fsdp::Status(fsdp::Error::BadInput("advise needs --model"))
                                        : fsdp::RunAdvise(advise_flags, std::cout);
  } else {
    fsdp::FinishPlanFlags(app, flags);
    status = flags.model.empty() ? fsdp::RunDefaultScenario(flags, std::cout) : fsdp::RunPlan(flags, std::cout);
  }
  const bool json = recommend->parsed() ? recommend_flags.json : advise->parsed() ? advise_flags.json : flags.json;
  if (!status.ok()) return fsdp::ReportError("fsdp-plan", status.error(), json);
  return fsdp::kExitOk;
}
