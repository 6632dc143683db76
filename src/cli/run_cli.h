// fsdp-run's command line: train a configuration for a few steps on CPU ranks (single process or
// MPI) and report the losses and step times.
#pragma once

#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/plan_cli.h"
#include "runtime/comm.h"

namespace fsdp {

struct RunFlags {
  PlanFlags plan;
  int64_t steps = 3;
  uint64_t seed = 1;
  float lr = 1e-3f;
  std::string json_path;
  bool quiet = false;
  double memory_limit_mib = 0;  ///< --memory-limit: rehearse an out-of-memory
  double timeout_s = 600;  ///< a step that takes longer stops every rank (a peer died or hangs)
  std::string tokens_path; ///< whitespace-separated token ids instead of synthetic tokens
  int hang_rank = -1;      ///< fault injection for tests: this rank stops responding at fail_step
  int fail_rank = -1;      ///< fault injection for tests: this rank exits abruptly...
  int64_t fail_step = 0;   ///< ...at the start of this step
};

void AddRunFlags(CLI::App& app, RunFlags& flags);
/// fsdp-run calibrate: measures this machine and writes a hardware JSON (rank 0).
Status RunCalibrate(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

/// Builds the workload, trains `steps` steps on `comm` and prints (rank 0) the losses.
Status RunTraining(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

}  // namespace fsdp
