// fsdp-run's report: what one run measured beside what fsdp-plan and fsdp-sim predicted for it.
// The CPU engine (run_cli.cc) and the GPU engine (run_gpu_cli.cc) fill the same two structures;
// this module alone prints the comparison tables and writes the --out JSON (docs/cli.md, "fsdp-run
// --out"), so that the two reports have the same fields, rows and keys.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/json_io.h"
#include "core/vocabulary.h"
#include "runtime/comm.h"
#include "runtime/loss_scaler.h"

namespace fsdp {

/// One line of a comparison: a measured and a predicted figure (either may be absent), their error.
struct ComparisonRow {
  std::string name;
  std::optional<double> measured, predicted;
  std::string note;  ///< printed after the error
};

/// Rows under a header: `title`, "measured <unit>", "<predicted_label> <unit>", "error".
struct ComparisonTable {
  std::string title, unit = "MiB", predicted_label = "predicted";
  int decimals = 3;
  std::vector<ComparisonRow> rows;
};

/// Prints a table with `decimals` digits; the error is 100 (predicted - measured) / measured where
/// both are there.
void PrintComparison(const ComparisonTable& table, std::ostream& out);

/// Memory by category at a peak, and where the peak was.
struct MemoryAtPeak {
  int64_t peak_bytes = 0;
  std::string phase;           ///< the peak's phase, named as PhaseName names it
  CategoryBytes categories{};  ///< bytes by category at the peak
};

/// What a run measured: losses and step times of rank 0 (every rank agrees on the losses), rank 0's
/// memory and collectives, and the largest peak over the ranks.
struct RunMeasurement {
  std::vector<double> losses;
  std::vector<double> steps_s;       ///< wall time of each step
  double step_s = 0;                 ///< the step time compared (CPU: the mean; GPU: the median of steps 2..n)
  std::string step_basis;            ///< how step_s was taken, e.g. "mean of 3 steps", "median of steps 2..3"
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  ///< per step, the same way
  std::optional<int64_t> host_waits_per_step;  ///< GPU: the most waits of the host for the device in a step
  int64_t peak_bytes = 0;            ///< the largest peak over the ranks
  MemoryAtPeak rank0;                ///< CPU: heap; GPU: the caching allocator's allocated bytes
  std::optional<int64_t> rank0_reserved_bytes;  ///< GPU: the caching allocator's peak reserved bytes
  std::optional<int64_t> device_mallocs;        ///< GPU: cudaMalloc calls behind the reserved bytes
  runtime::CommStats shard, replica; ///< rank 0's collectives within its shard group and across replicas
  int64_t shard_group = 1, replica_group = 1;
  bool collectives_are_copies = false;  ///< a virtual world: device copies stand in for the collectives
  runtime::LossScaler loss_scaler{runtime::LossScalerOptions{}};
};

/// What the models predicted for the same run.
struct RunPrediction {
  MemoryAtPeak memory;            ///< fsdp-plan's replay of this engine (planner/runtime_profile.h)
  /// GPU: the same replay's caching-allocator reserve if the GPU keeps up with the host, and if the
  /// host runs a whole step ahead (RuntimeProfile's two ends)
  std::optional<int64_t> reserved_bytes, reserved_lagging_bytes;
  std::vector<MemCategory> categories_compared;  ///< the categories that replay predicts
  std::optional<double> step_s;   ///< fsdp-plan's step model of this engine on the run's hardware file
  std::optional<double> sim_step_s;  ///< fsdp-sim on the same
  std::string time_basis;         ///< what step_s models, e.g. "fsdp-plan, fsdp-run's kernels, h200-sxm"
  std::string no_time_note;       ///< why there is no step_s, when there is none
  /// Over the steps run; none where fsdp-plan counts no collective (a group of one rank).
  std::optional<double> all_gather_bytes, reduce_scatter_bytes, all_reduce_bytes;
};

/// A report's header and the device-specific sections beside the comparison.
struct RunReport {
  std::string model;
  std::string device = "cpu";  ///< cpu | cuda
  std::string device_name;     ///< cuda: cudaDeviceProp::name
  std::string hardware;        ///< the hardware file the predictions used
  int ranks = 1;               ///< processes that ran
  int64_t world = 1;           ///< ranks of the configuration (a virtual world's size)
  int virtual_world = 0;
  FsdpConfig config;
  Json inputs;                 ///< RunInputsJson
  RunMeasurement measured;
  RunPrediction predicted;
  /// What only one engine has (the GPU's framework memory, fsdp-plan's PyTorch profile): rows
  /// after the memory and the step-time rows, tables after the memory table, JSON merged into
  /// "measured.memory" and "predicted".
  std::vector<ComparisonRow> extra_memory_rows, extra_time_rows;
  std::vector<ComparisonTable> extra_tables;
  Json measured_memory_extra = Json::object(), predicted_extra = Json::object();

  /// Tokens a rank trains per second: micro-batch x sequence x accumulation per step / step_s.
  double TokensPerSecondPerGpu(double step_s) const;
};

/// 100 * (predicted - measured) / measured; 0 when nothing was measured.
double PercentError(double measured, double predicted);

/// The text report (rank 0): losses, loss scaling, step time and tokens/s, memory by category,
/// step time against fsdp-plan and fsdp-sim, the phases' times, the collectives.
void PrintRunReport(const RunReport& report, std::ostream& out);

/// The --out document: {"model", "device", "device_name", "hardware", "ranks", "virtual_world",
/// "config", "inputs", "predicted": {"memory", "time", ...}, "measured": {"loss", "loss_scaling",
/// "memory", "time", "tokens_per_s_per_gpu", "comm"}} (docs/cli.md).
Json RunReportJson(const RunReport& report);

/// A communicator's collectives as JSON: bytes (nccl-tests sizes), counts, seconds and bus
/// bandwidth for all-gather, reduce-scatter and all-reduce over a group of `group` ranks.
Json CommStatsJson(const runtime::CommStats& stats, int64_t group);

/// The loss scaling of a run, when it has one: a report line ("  loss scaling: dynamic, scale
/// 32768 after 3 steps, skipped steps 1 (inf/NaN gradients)") and {"mode", "final_scale",
/// "skipped_steps" (1-based)} for --out.
void PrintLossScaling(const runtime::LossScaler& scaler, std::ostream& out);
Json LossScalingJson(const runtime::LossScaler& scaler);

}  // namespace fsdp
