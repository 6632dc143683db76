// fsdp-sim's command line: simulate one configuration, sweep parameters (what-if), compare runs.
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/plan_cli.h"
#include "sim/simulator.h"

namespace fsdp {

struct SimFlags {
  PlanFlags plan;
  sim::SimOptions options;
  bool per_rank = false;
  std::vector<std::string> slow_ranks;  ///< "RANK=FACTOR"
  std::string trace_path, report_path, chart_path;
  std::vector<std::string> vary;        ///< what-if: "param=v1,v2,..."
  std::vector<std::string> compare;     ///< compare: two result JSON files
};

/// Registers the plan flags plus the simulator's own on `app`.
void AddSimFlags(CLI::App& app, SimFlags& flags);
Status RunSim(SimFlags flags, std::ostream& out);
Status RunWhatIf(SimFlags flags, std::ostream& out);
/// Side by side with deltas: two files written by `fsdp-sim --json`.
Status RunCompare(const std::vector<std::string>& files, std::ostream& out);

}  // namespace fsdp
