// "Pick GPUs and strategy": enumerate GPU type x count x strategy x checkpointing x micro-batch x
// CPU offload x wrap, keep what fits and reaches the global batch, rank by an objective; and, for
// a configuration that does not fit, the smallest changes that make it fit.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/workload.h"

namespace fsdp {

enum class Objective { kThroughput, kCost, kTimeToTrain };
Result<Objective> ParseObjective(std::string_view text);

struct SearchOptions {
  std::vector<HardwareSpec> gpu_types;
  std::map<std::string, double> price_per_gpu_hour;  ///< overrides of the hardware files' prices, by id
  int64_t gpus_min = 1;                   ///< GPU counts searched: powers of two from gpus_min, and gpus_max
  int64_t gpus_max = 64;
  int64_t global_batch_seqs = 0;          ///< sequences per optimizer step (required)
  std::optional<double> budget_per_hour;  ///< USD per hour for the whole cluster
  Objective objective = Objective::kThroughput;
  double train_tokens = 0;                ///< for kTimeToTrain (and the cost to train)
  FsdpConfig base;                        ///< seq_len, dtypes, framework, attention, optimizer...
  size_t top = 10;
  /// Replay every candidate's memory (exact `feasible` count) instead of only those whose fit could
  /// change the result; the top, the Pareto front and the rejections listed are the same either way.
  bool exhaustive = false;
  /// Return every candidate in SearchResult::candidates (tests: the ranking recomputed from them).
  bool keep_candidates = false;
};

/// One evaluated candidate.
struct Candidate {
  std::string gpu_id;
  FsdpConfig config;
  bool feasible = false;
  enum class Reason { kNone, kBatch, kMemory, kBudget, kInvalid };
  Reason reason = Reason::kNone;          ///< why not feasible
  std::string rejection;                  ///< the same, in words
  int64_t peak_bytes = 0, capacity_bytes = 0;
  double step_s = 0, tokens_per_s = 0, tokens_per_s_per_gpu = 0, mfu = 0;
  double usd_per_hour = 0, usd_per_million_tokens = 0;
  double time_to_train_s = 0, usd_to_train = 0;
  double score = 0;                       ///< larger is better, for the chosen objective
};

struct SearchResult {
  std::vector<Candidate> top;             ///< best feasible, by score
  std::vector<Candidate> pareto;          ///< feasible and not beaten on both cost per token and throughput
  std::vector<Candidate> best_rejected;   ///< best-scoring candidates that were rejected, with why
  int64_t evaluated = 0;                 ///< candidates searched: each with its step time and cost
  int64_t memory_checked = 0;            ///< of those, whose memory was replayed (every runnable one with SearchOptions::exhaustive)
  int64_t memory_checked_feasible = 0;   ///< of those, that fit within the budget
  std::optional<int64_t> feasible;       ///< with SearchOptions::exhaustive: every candidate that fits within the budget
  /// With SearchOptions::keep_candidates: every candidate in the search's order, as evaluated
  /// before the lazy replay (Reason::kNone: runnable, memory not judged) or, with exhaustive, judged.
  std::vector<Candidate> candidates;
};

using ProgressFn = std::function<void(int64_t done, int64_t total)>;

/// Runs the search. BadInput when nothing is feasible, with what to relax (global batch not
/// divisible, no GPU type fits, budget too low).
Result<SearchResult> Recommend(const ModelSpec& model, const SearchOptions& options, const ProgressFn& progress);

/// The workload PyTorch runs for `workload`'s command line: FSDP1 on one GPU as NO_SHARD
/// (ApplyFsdp1WorldOfOne); otherwise `workload` itself.
Workload AsPyTorchRuns(const Workload& workload);

/// Number of candidates Recommend would evaluate.
int64_t CountCandidates(const ModelSpec& model, const SearchOptions& options);

/// One change to a configuration that does not fit, with its effect.
struct Advice {
  std::string change;        ///< e.g. "--ac full", "--gpus 16", "--seq-len 2048"
  bool fits = false;
  int64_t peak_bytes = 0;
  double step_s = 0;         ///< step time after the change
  double slowdown_pct = 0;   ///< tokens/s per GPU lost vs the original configuration
  int64_t saves_bytes = 0;   ///< peak of the original configuration minus this one's
};

/// For `workload` (which may not fit), single and paired changes of the seeds' OOM checklist
/// (micro-batch, sequence length, activation checkpointing, strategy, more GPUs, CPU offload,
/// FSDP2), the fitting ones ranked by the throughput they cost.
std::vector<Advice> AdviseFit(const Workload& workload);

/// Training fewer parameters instead, for a configuration that does not fit: LoRA r=16 on every
/// linear of the blocks (attention's four on MoE models), unless already LoRA, and QLoRA on the
/// same (dense models), unless already QLoRA; each also with full checkpointing; under FSDP1 with
/// peft's wrap. Fitting or not, in that order: they change what is trained, so they are not
/// ranked with AdviseFit's. None under --impl torchtitan, which trains every parameter.
std::vector<Advice> FineTuningAdvice(const Workload& workload);

/// The caching allocator's settings alone (expandable segments, max_split_size_mb, FSDP1's rate
/// limiter), fitting or not, with the bytes each saves: what to try when the tensors fit and the
/// allocator's cache is what does not.
std::vector<Advice> AllocatorAdvice(const Workload& workload);

}  // namespace fsdp
