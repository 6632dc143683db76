// fsdp-run's command line: train a configuration for a few steps on CPU ranks (single process or
// MPI) and report the losses and step times.
#pragma once

#include <functional>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/plan_cli.h"
#include "cli/run_report.h"
#include "core/json_io.h"
#include "runtime/comm.h"
#include "runtime/fsdp_engine.h"

namespace fsdp {

struct RunFlags {
  PlanFlags plan;
  int64_t steps = 3;
  uint64_t seed = 1;
  double lr = 1e-3;
  std::string json_path;
  bool quiet = false;
  double memory_limit_mib = 0;  ///< --memory-limit: rehearse an out-of-memory
  double timeout_s = 600;  ///< a step that takes longer stops every rank (a peer died or hangs)
  std::string tokens_path; ///< whitespace-separated token ids instead of synthetic tokens
  std::string init_from;   ///< safetensors checkpoint (file or directory) to start from instead of seeded weights
  int hang_rank = -1;      ///< fault injection for tests: this rank stops responding at fail_step
  int fail_rank = -1;      ///< fault injection for tests: this rank exits abruptly...
  int64_t fail_step = 0;   ///< ...at the start of this step
  std::string device = "cpu";  ///< cpu (Eigen, MPI) or cuda (one GPU per rank: CUDA, cuBLAS, NCCL)
  int virtual_world = 0;       ///< cuda: run rank 0 of this many ranks on one GPU
  std::string loss_scale = "auto";    ///< auto (dynamic for fp16 parameters) | none | dynamic
  float loss_scale_init = 65536.0f;   ///< ShardedGradScaler's init_scale
  int64_t loss_scale_interval = 2000; ///< ShardedGradScaler's growth_interval
};

void AddRunFlags(CLI::App& app, RunFlags& flags);

/// Largest --timeout, seconds.
constexpr double kMaxTimeoutS = 1e7;
/// --timeout over the whole run: from this call (in main, before MPI_Init) each stage (start-up,
/// every step, the final report) must finish within timeout_s, or the process exits 1 with one line
/// naming the stage. A rank that never joins thus ends the job in bounded time. No-op for a bad value.
void StartRunDeadline(double timeout_s);
/// A new stage begins: its clock restarts (no-op before StartRunDeadline).
void ArmRunDeadline(const std::string& stage);

/// The workload and training options of a run, after checking --steps, --lr, --memory-limit,
/// --timeout and reading --tokens.
struct PreparedRun {
  Workload workload;
  runtime::TrainOptions options;
};
Result<PreparedRun> PrepareRun(const RunFlags& flags, PlanFlags plan);

/// A hash of everything that changes what a rank runs: the whole FsdpConfig (wrap, strategy, node
/// layout, prefetch, no_sync, dtypes, ...), the model config's contents, steps, seed, lr, memory
/// limit, loss scaling, fault injections, the checkpoint's fingerprint and the token ids.
uint64_t RunFingerprint(const RunFlags& flags, const PreparedRun& run);
/// BadInput on every rank when the ranks' RunFingerprint differ; call before any other collective.
Status CheckRanksAgree(const RunFlags& flags, const PreparedRun& run, runtime::Comm& comm);
/// RunFailed naming the step when a loss is not finite and no loss scaler skips such steps.
struct StepLog;
Status CheckLossesFinite(const StepLog& log, const runtime::TrainOptions& options);
/// BadInput when the planner's predicted peak per rank times the ranks on this host exceeds its
/// physical memory: checked before the engine allocates anything.
Status CheckHostMemory(const Workload& workload, int ranks_on_host);

/// What fsdp-run trained from, for --out: {"init_from", "tokens"} (paths or null), "seed", "lr".
Json RunInputsJson(const RunFlags& flags);

/// The largest `value` (0 <= value < 2^48) over the ranks of `comm`, exactly (the host Comm moves
/// floats: the value travels as two 24-bit halves).
Result<int64_t> MaxOverRanks(runtime::Comm& comm, int64_t value);

/// Losses and wall times of the steps run so far.
struct StepLog {
  Json losses = Json::array(), times = Json::array();
  double total_s = 0;
};
/// A report's header and what every engine measures alike: the model, hardware, ranks, world,
/// configuration, inputs, losses and step times (run_report.h).
RunReport NewRunReport(const RunFlags& flags, const Workload& workload, const StepLog& log, int ranks);
/// The shard group's and the replica group's collectives of rank 0 (`world` ranks in all).
void SetMeasuredComm(const runtime::CommStats& shard, const runtime::CommStats& replica, int64_t shard_group, int64_t world, RunMeasurement& m);
/// fsdp-plan's collective bytes for `steps` steps of `workload` (in the dtypes the engine moves), in
/// the groups of more than one rank.
void SetPredictedComm(const Workload& workload, const RunMeasurement& m, int64_t steps, RunPrediction& p);
/// Runs --steps steps of `step` under the --timeout watchdog, with the fault injections and the
/// progress line on stderr (rank 0).
Result<StepLog> RunSteps(const RunFlags& flags, int rank, const std::function<Result<float>(int64_t)>& step);
/// fsdp-run calibrate: measures this machine and writes a hardware JSON (rank 0).
Status RunCalibrate(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

/// Builds the workload, trains `steps` steps on `comm` and prints (rank 0) the losses.
Status RunTraining(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

/// --device cuda: the same on the GPU engine; prints measured against predicted memory (the
/// engine's own profile and fsdp-plan's PyTorch profile), the device's framework memory, step
/// time, tokens/s and collective bandwidth. In run_gpu_cli.cc.
Status RunTrainingGpu(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

/// fsdp-run calibrate --device cuda: the device's catalog entry with measured efficiencies (and
/// NCCL collectives under mpirun), written to --out (default calibrated-<gpu>.json). In run_gpu_cli.cc.
Status RunCalibrateGpu(const RunFlags& flags, runtime::Comm& comm, std::ostream& out);

/// The hardware file id for a CUDA device name ("NVIDIA H200" -> "h200-sxm"); BadInput when unknown.
Result<std::string> HardwareIdForDevice(const std::string& device_name);

}  // namespace fsdp
