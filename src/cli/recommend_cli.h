// fsdp-plan's "recommend" and "advise" subcommands.
#pragma once

#include <map>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "cli/plan_cli.h"
#include "core/status.h"

namespace fsdp {

struct RecommendFlags {
  std::string model;
  std::string gpu_types;                 ///< comma-separated ids; empty: every catalog GPU
  int64_t seq_len = 0;
  std::optional<int64_t> global_batch_tokens, global_batch;
  int64_t gpus_min = 1;
  int64_t gpus_max = 64;
  std::optional<double> budget_per_hour;
  std::string objective = "throughput";
  std::optional<double> tokens;
  std::vector<std::string> prices;       ///< "id=usd" overrides
  std::string framework = "fsdp1";
  std::string impl = "transformers";    ///< --impl (core/fsdp_config.h Impl)
  std::string transformers_version = "5.24";  ///< --transformers-version (core/fsdp_config.h TransformersVersion)
  std::string attention;                 ///< empty: flash, or eager where SDPA cannot run the model (SdpaRuledOut)
  bool loop_holds_outputs = false;       ///< FsdpConfig::loop_holds_outputs for every candidate
  bool use_cache = false;                ///< FsdpConfig::use_cache for every candidate
  LoraConfig lora;                       ///< LoRA / QLoRA for every candidate (rank 0: full fine-tuning)
  std::string qlora_compute_dtype;       ///< --qlora-compute-dtype; empty: LoraConfig::compute_dtype unset
  int64_t top = 10;
  std::string export_format;
  bool json = false;
  bool quiet = false;
  bool exhaustive = false;              ///< SearchOptions::exhaustive
};

void AddRecommendFlags(CLI::App& app, RecommendFlags& flags);
Status RunRecommend(const RecommendFlags& flags, std::ostream& out);

/// advise: the plan flags; prints the smallest changes that make the configuration fit.
Status RunAdvise(const PlanFlags& flags, std::ostream& out);

}  // namespace fsdp
