// fsdp-plan's command line: flags, the single-configuration report and the built-in default scenario.
#pragma once

#include <optional>
#include <ostream>
#include <string>

#include <CLI/CLI.hpp>

#include "core/fsdp_config.h"
#include "core/status.h"
#include "core/workload.h"

namespace fsdp {

/// Raw flag values as typed by the user; converted by ConfigFromFlags.
struct PlanFlags {
  std::string model;
  std::string gpu = "h100-sxm";
  std::string cluster;           ///< hardware/clusters id or path; sets GPU, GPUs per node and count
  bool gpu_given = false, gpus_given = false, attention_given = false, model_given = false, wrap_given = false;
  FsdpConfig config;
  std::string strategy = "full_shard", wrap = "block", ac = "none", attention = "flash";
  std::string param_dtype = "bf16", reduce_dtype = "fp32", buffer_dtype = "bf16", master_dtype = "fp32";
  std::string base_dtype;  ///< --base-dtype; empty: LoraConfig::base_dtype unset
  std::string qlora_compute_dtype;  ///< --qlora-compute-dtype; empty: LoraConfig::compute_dtype unset
  std::string optimizer = "adamw", framework = "fsdp1", backward_prefetch = "pre";
  std::string impl = "transformers";  ///< --impl: whose model code runs (core/fsdp_config.h Impl)
  std::string transformers_version = "5.24";  ///< --transformers-version (core/fsdp_config.h TransformersVersion)
  bool no_limit_all_gathers = false;
  std::optional<int64_t> cuda_context_bytes, nccl_bytes, cublas_workspace_bytes;
  std::optional<double> fragmentation;
  bool one_stream = false;       ///< --one-stream (fsdp-plan's own command only: AddReplayFlags)
  std::string torch_device = "cuda";  ///< --torch-device (fsdp-plan's own command only: AddReplayFlags)
  std::string alloc_trace_path;  ///< --alloc-trace (fsdp-plan's own command only: AddReplayFlags)
  bool json = false;
  bool timeline = false;
  std::string export_format;     ///< pytorch | fsdp2 | accelerate | lightning: print code instead of the report
  /// Plan what PyTorch runs: FSDP1 on one GPU as NO_SHARD (ApplyFsdp1WorldOfOne), with a note on
  /// stderr. fsdp-run turns it off: it executes the strategy it is given.
  bool fsdp1_world_of_one = true;
};

/// Registers every fsdp-plan flag on `app`, bound to `flags`.
void AddPlanFlags(CLI::App& app, PlanFlags& flags);

/// The flags that inspect the allocator's replay, on fsdp-plan's own command: --one-stream (the
/// replay as a CPU device makes it: FrameworkOverheads::one_stream), --torch-device cpu (PyTorch's
/// CPU kernels' working buffers: FsdpConfig::torch_device) and --alloc-trace FILE (its requests
/// written as an allocator history: core/allocator_history.h).
void AddReplayFlags(CLI::App& app, PlanFlags& flags);

/// Records which flags were given explicitly (a cluster only fills in what was not). Call after parsing.
void FinishPlanFlags(const CLI::App& app, PlanFlags& flags);

/// Converts the textual flags into an FsdpConfig (BadInput on unknown names or inconsistent flags).
Result<FsdpConfig> ConfigFromFlags(const PlanFlags& flags);
/// What a model changes in the flags' defaults: eager attention for a model SDPA cannot run
/// (SdpaRuledOut) when --attention was not given.
void ApplyModelDefaults(const PlanFlags& flags, const ModelSpec& model, FsdpConfig& config);

/// Loads model and GPU (or cluster) and builds the workload the flags describe.
Result<Workload> WorkloadFromFlags(const PlanFlags& flags);

/// Runs the plan for one configuration and prints the table (or JSON) to `out`.
Status RunPlan(const PlanFlags& flags, std::ostream& out);

/// No --model given: the seeds' question, DDP vs FSDP per-card memory for 7B/13B/34B/70B models
/// on 4 GPUs, done with every term counted.
Status RunDefaultScenario(const PlanFlags& flags, std::ostream& out);

}  // namespace fsdp
