#include "planner/search.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include <fmt/format.h>

#include "planner/memory_model.h"
#include "planner/step_model.h"

namespace fsdp {
namespace {

constexpr int64_t kMicroBatches[] = {1, 2, 4, 8, 16, 32};
constexpr WrapPolicy kWraps[] = {WrapPolicy::kBlock, WrapPolicy::kNone};
constexpr Strategy kStrategies[] = {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard, Strategy::kHybridShard};

std::vector<int64_t> GpuCounts(int64_t min, int64_t max) {
  std::vector<int64_t> counts;
  for (int64_t n = 1; n <= max; n *= 2) if (n >= min) counts.push_back(n);
  if (counts.empty() || counts.back() != max) counts.push_back(max);
  return counts;
}

std::vector<Checkpointing> CheckpointModes(const FsdpConfig& base, const ModelSpec& model) {
  std::vector<Checkpointing> modes = {Checkpointing::kNone};
  // with flash attention selective saves only the LSE and still reruns the attention: not worth searching
  if (base.attention == Attention::kEager) modes.push_back(Checkpointing::kSelective);
  if (OpCheckpointingModelled(model)) modes.push_back(Checkpointing::kSelectiveOp);  // where fsdpkit models it
  modes.push_back(Checkpointing::kFull);
  return modes;
}

// Tensor memory does not depend on the GPU type, and from the second micro-batch on every
// micro-batch looks the same: cache it by what it depends on.
using MemoryKey = std::tuple<int, int64_t, int64_t, int, int, int64_t, bool, int64_t>;

// One point of the search space: GPU type (an index into SearchOptions::gpu_types), count,
// strategy, checkpointing, micro-batch, offload and wrap (an index into the searcher's workloads).
struct SearchPoint {
  size_t g;
  int64_t gpus;
  Strategy strategy;
  Checkpointing checkpointing;
  int64_t micro_batch;
  bool cpu_offload;
  size_t wi;
};

class Searcher {
 public:
  Searcher(const ModelSpec& model, const SearchOptions& o) : o_(o), checkpoint_modes_(CheckpointModes(o.base, model)) {
    std::vector<WrapPolicy> wraps(std::begin(kWraps), std::end(kWraps));
    if (o.base.lora.rank > 0) wraps.push_back(WrapPolicy::kPeft);  // FSDP1 needs the adapters in units of their own
    for (WrapPolicy wrap : wraps) {
      FsdpConfig c = o.base;
      c.wrap = wrap;
      c.gpus = 1;
      c.gpus_per_node = 1;
      auto w = BuildWorkload(model, o.gpu_types.front(), c);
      if (w.ok()) workloads_.push_back(std::move(w).value());
    }
  }

  template <typename Visit>
  void ForEach(Visit&& visit) {
    for (size_t g = 0; g < o_.gpu_types.size(); ++g)
      for (int64_t gpus : GpuCounts(o_.gpus_min, o_.gpus_max))
        for (Strategy s : kStrategies)
          for (Checkpointing ac : checkpoint_modes_)
            for (int64_t mb : kMicroBatches)
              for (bool offload : {false, true})
                for (size_t wi = 0; wi < workloads_.size(); ++wi) visit(SearchPoint{g, gpus, s, ac, mb, offload, wi});
  }

  // The command line of a point of the search (its accumulation still to be set).
  FsdpConfig ConfigAt(const SearchPoint& p) const {
    FsdpConfig c = o_.base;
    c.gpus = p.gpus;
    c.gpus_per_node = std::min(o_.gpu_types[p.g].gpus_per_node, p.gpus);
    c.strategy = p.strategy;
    c.checkpointing = p.checkpointing;
    c.micro_batch = p.micro_batch;
    c.cpu_offload = p.cpu_offload;
    c.wrap = workloads_[p.wi].config.wrap;
    return c;
  }

  // The candidate's configuration, price, step time and score; its memory is not replayed yet
  // (CheckMemory). Candidates that cannot run at all (HYBRID_SHARD on one node, a global batch the
  // GPUs and micro-batch do not divide) come back rejected.
  Candidate EvaluateTime(const SearchPoint& p) {
    const HardwareSpec& hw = o_.gpu_types[p.g];
    Candidate cand;
    cand.gpu_id = hw.id;
    FsdpConfig c = ConfigAt(p);
    cand.config = c;
    auto price = o_.price_per_gpu_hour.find(hw.id);
    cand.usd_per_hour = (price != o_.price_per_gpu_hour.end() ? price->second : hw.price_per_gpu_hour_usd) * static_cast<double>(p.gpus);
    if (p.strategy == Strategy::kHybridShard && p.gpus <= c.gpus_per_node) return Reject(cand, Candidate::Reason::kInvalid, "HYBRID_SHARD needs more than one node");
    if (Fsdp1SwitchesToNoShard(c)) {
      return Reject(cand, Candidate::Reason::kInvalid, "FSDP1 runs every strategy as NO_SHARD on one GPU (the NO_SHARD candidate covers it)");
    }
    if (o_.global_batch_seqs % (p.gpus * p.micro_batch) != 0) {
      return Reject(cand, Candidate::Reason::kBatch,
                    fmt::format("global batch of {} sequences is not divisible by {} GPUs x micro-batch {}", o_.global_batch_seqs, p.gpus, p.micro_batch));
    }
    c.grad_accum = o_.global_batch_seqs / (p.gpus * p.micro_batch);
    Workload& w = workloads_[p.wi];
    if (Status st = Reconfigure(w, hw, c); !st.ok()) return Reject(cand, Candidate::Reason::kInvalid, st.error().message);
    cand.config = w.config;
    ComputeModel& compute = UnitCompute(w, p.g, p.wi);
    FinishCompute(w, compute);  // the per-step totals of this configuration, on the cached per-unit part
    const Schedule schedule = CachedSchedule(w, p.wi);
    TimeEstimate t;
    t.comm = EstimateComm(w, schedule);
    t.step = EstimateStep(w, compute, t.comm, schedule);
    cand.step_s = t.step.step_s;
    cand.tokens_per_s_per_gpu = t.step.tokens_per_s_per_gpu;
    cand.tokens_per_s = t.step.tokens_per_s_per_gpu * static_cast<double>(p.gpus);
    cand.mfu = t.step.mfu;
    cand.usd_per_million_tokens = cand.usd_per_hour / 3600.0 / cand.tokens_per_s * 1e6;
    if (o_.train_tokens > 0) {
      cand.time_to_train_s = o_.train_tokens / cand.tokens_per_s;
      cand.usd_to_train = cand.time_to_train_s / 3600.0 * cand.usd_per_hour;
    }
    cand.score = Score(cand);
    return cand;
  }

  // Replays the memory of a candidate EvaluateTime accepted, then judges it: out of memory, over
  // budget, or feasible.
  void CheckMemory(Candidate& cand, const SearchPoint& p) {
    Workload& w = workloads_[p.wi];
    FsdpConfig c = ConfigAt(p);
    c.grad_accum = o_.global_batch_seqs / (p.gpus * p.micro_batch);
    (void)Reconfigure(w, o_.gpu_types[p.g], c);  // accepted by EvaluateTime
    const MemoryEstimate mem = Memory(w, p.wi);
    cand.peak_bytes = mem.peak_bytes;
    cand.capacity_bytes = mem.capacity_bytes;
    if (!mem.fits) {
      const std::string by = mem.headroom_bytes < 0 ? fmt::format(" by {:.2f} GiB", -mem.headroom_bytes / kGiB)
                                                    : std::string(": the caching allocator's, on the card");  // MemoryEstimate::headroom_bytes
      cand = Reject(cand, Candidate::Reason::kMemory, fmt::format("out of memory{} ({:.2f} GiB needed, {:.2f} GiB card)", by,
                                                                  mem.peak_bytes / kGiB, mem.capacity_bytes / kGiB));
    } else if (OverBudget(cand)) {
      cand = Reject(cand, Candidate::Reason::kBudget, fmt::format("over budget: ${:.2f}/h > ${:.2f}/h", cand.usd_per_hour, *o_.budget_per_hour));
    } else {
      cand.feasible = true;
    }
  }

  bool OverBudget(const Candidate& c) const { return o_.budget_per_hour && c.usd_per_hour > *o_.budget_per_hour; }

 private:
  Candidate Reject(Candidate c, Candidate::Reason reason, std::string why) {
    c.feasible = false;
    c.reason = reason;
    c.rejection = std::move(why);
    return c;
  }

  double Score(const Candidate& c) const {
    switch (o_.objective) {
      case Objective::kThroughput: return c.tokens_per_s;
      case Objective::kCost: return -c.usd_per_million_tokens;
      case Objective::kTimeToTrain: return -c.time_to_train_s;
    }
    return 0;
  }

  // Tensor memory and the unlimited allocator replay depend on the shard world size, not on the
  // GPU count (NO_SHARD and HYBRID_SHARD keep it across counts) nor on HYBRID_SHARD vs FULL_SHARD
  // (the replica all-reduce is in place); of the GPU type only on its cuBLAS workspace size.
  // Screens with the tensors alone (reserved memory is never below them, so a configuration whose
  // tensors do not fit cannot fit) and replays the caching allocator for the rest.
  MemoryEstimate Memory(Workload& w, size_t wi) {
    FrameworkOverheads o = FrameworkOverheadsFor(w);
    o.caching_allocator = false;
    MemoryEstimate lower = AddFrameworkTerms(w, o, TensorMemory(w, wi, o), /*with_timeline=*/false);
    if (!lower.fits) return lower;
    o.caching_allocator = true;
    const MemoryEstimate tensors = TensorMemory(w, wi, o);
    if (!NeedsReplayOnCard(w, o, tensors)) return AddFrameworkTerms(w, o, tensors, /*with_timeline=*/false);
    // the replay on the card depends on what the allocator may reserve there, not on the rest of the card
    // (and, with a per_process_memory_fraction, on the card's memory, which the cap is a share of)
    const auto key = std::make_tuple(KeyOf(w, wi, o, IsolatedWorkspaceBytes(o) >= 0), o.cublas_workspace_bytes, ReserveLimitBytes(w, o),
                                     w.hardware.DeviceTotalBytes());
    auto it = on_card_cache_.find(key);
    if (it == on_card_cache_.end()) {
      FsdpConfig& c = w.config;
      const int64_t saved_accum = c.grad_accum;
      c.grad_accum = std::min<int64_t>(c.grad_accum, 2);
      it = on_card_cache_.emplace(key, ReplayOnCard(w, o, false)).first;
      c.grad_accum = saved_accum;
    }
    return AddFrameworkTerms(w, o, tensors, /*with_timeline=*/false, &it->second);
  }

  // The replay of a key with the cuBLAS workspaces it shares with other GPU types (when they sit in
  // segments of their own: IsolatedWorkspaceBytes) added back for this one.
  MemoryEstimate TensorMemory(Workload& w, size_t wi, const FrameworkOverheads& o) {
    const int64_t isolated = IsolatedWorkspaceBytes(o);
    MemoryEstimate e = CachedTensorMemory(w, wi, o, isolated >= 0);
    if (isolated > 0) AddHeldBytes(e, isolated);
    return e;
  }

  // The replay's cache key: what it depends on (above), the accumulation up to the second micro-batch.
  MemoryKey KeyOf(const Workload& w, size_t wi, const FrameworkOverheads& o, bool without_workspaces) const {
    const FsdpConfig& c = w.config;
    const Strategy strategy = c.strategy == Strategy::kHybridShard ? Strategy::kFullShard : c.strategy;
    return MemoryKey{static_cast<int>(wi) * 2 + o.caching_allocator, w.shard_world, without_workspaces ? 0 : o.cublas_workspace_bytes,
                     static_cast<int>(strategy), static_cast<int>(c.checkpointing), c.micro_batch, c.cpu_offload,
                     std::min<int64_t>(c.grad_accum, 2)};
  }

  const MemoryEstimate& CachedTensorMemory(Workload& w, size_t wi, FrameworkOverheads o, bool without_workspaces) {
    const MemoryKey key = KeyOf(w, wi, o, without_workspaces);
    auto it = memory_cache_.find(key);
    if (it != memory_cache_.end()) return it->second;
    if (without_workspaces) o.cublas_workspace_blocks.clear();
    FsdpConfig& c = w.config;
    const int64_t saved_accum = c.grad_accum;
    c.grad_accum = std::get<7>(key);
    MemoryEstimate tensors = EstimateTensorMemory(w, CachedSchedule(w, wi), ReplayOptionsFor(o, false));
    c.grad_accum = saved_accum;
    return memory_cache_.emplace(key, std::move(tensors)).first->second;
  }

  // The schedule depends on the wrap, strategy and offload, on whether the shard group and the
  // replicas have more than one rank, and on the accumulation only up to the micro-batch from
  // which one program repeats: one template per key serves every longer accumulation
  // (Schedule::WithMicroBatches), so the cache stays small enough to stay in the CPU's caches.
  Schedule CachedSchedule(Workload& w, size_t wi) {
    FsdpConfig& c = w.config;
    const int64_t accum = c.grad_accum;
    auto key = std::make_tuple(wi, static_cast<int>(c.strategy), c.cpu_offload, w.shard_world > 1, w.replicas > 1, int64_t{0});
    auto it = schedule_cache_.find(key);
    if (it == schedule_cache_.end()) {
      c.grad_accum = std::max<int64_t>(accum, 8);
      it = schedule_cache_.emplace(key, BuildSchedule(w)).first;
      c.grad_accum = accum;
    }
    if (auto s = it->second.WithMicroBatches(accum)) return *s;
    std::get<5>(key) = accum;  // fewer micro-batches than the template's first few
    it = schedule_cache_.find(key);
    if (it == schedule_cache_.end()) it = schedule_cache_.emplace(key, BuildSchedule(w)).first;
    return it->second;
  }

  // Per-unit compute depends on the GPU type, wrap, micro-batch and checkpointing only.
  ComputeModel& UnitCompute(const Workload& w, size_t g, size_t wi) {
    const auto key = std::make_tuple(g, wi, w.config.micro_batch, static_cast<int>(w.config.checkpointing));
    auto it = compute_cache_.find(key);
    if (it != compute_cache_.end()) return it->second;
    return compute_cache_.emplace(key, EstimateUnitCompute(w)).first->second;
  }

  const SearchOptions& o_;
  std::vector<Checkpointing> checkpoint_modes_;  // the modes searched for this model and attention
  std::vector<Workload> workloads_;
  std::map<MemoryKey, MemoryEstimate> memory_cache_;
  std::map<std::tuple<MemoryKey, int64_t, int64_t, int64_t>, MemoryEstimate> on_card_cache_;
  std::map<std::tuple<size_t, size_t, int64_t, int>, ComputeModel> compute_cache_;
  std::map<std::tuple<size_t, int, bool, bool, bool, int64_t>, Schedule> schedule_cache_;
};

// A figure to 30 significant bits (about 1e-9 relative): configurations whose speed differs only in
// the last bits of a sum (FULL_SHARD and SHARD_GRAD_OP when compute-bound) compare equal, so that
// the tie goes to the one with less memory rather than to rounding.
double Quantized(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  const int e = std::ilogb(x);
  return std::ldexp(std::nearbyint(std::ldexp(x, 30 - e)), e - 30);
}

// The key candidates are ranked by: quantized, and NaN (never produced: the numeric boundary)
// below everything, so that the order stays a strict weak one.
double RankKey(double x) { return std::isnan(x) ? -INFINITY : Quantized(x); }

// The candidates of `subset` by `key`, higher first, in runs of equal RankKey; equal keys keep
// the search's order (indices are into `candidates`, in the search's order). `visit(run)`
// returns false to stop.
template <typename Key, typename Visit>
void ForEachRun(const std::vector<Candidate>& candidates, std::vector<size_t> subset, Key key, Visit&& visit) {
  std::vector<double> keys(candidates.size());
  for (size_t i : subset) keys[i] = RankKey(key(candidates[i]));
  std::stable_sort(subset.begin(), subset.end(), [&](size_t x, size_t y) { return keys[x] > keys[y]; });
  for (size_t begin = 0; begin < subset.size();) {
    size_t end = begin + 1;
    while (end < subset.size() && keys[subset[end]] == keys[subset[begin]]) ++end;
    if (!visit(std::vector<size_t>(subset.begin() + static_cast<std::ptrdiff_t>(begin), subset.begin() + static_cast<std::ptrdiff_t>(end)))) return;
    begin = end;
  }
}

// Ties of a run: less memory first, then the search's order.
void SortByMemory(const std::vector<Candidate>& candidates, std::vector<size_t>& run) {
  std::stable_sort(run.begin(), run.end(), [&](size_t x, size_t y) { return candidates[x].peak_bytes < candidates[y].peak_bytes; });
}

// Every candidate, best score first (ties: less memory, then the search's order).
std::vector<Candidate> SortedBest(std::vector<Candidate> candidates) {
  std::vector<size_t> all(candidates.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  std::vector<Candidate> sorted;
  sorted.reserve(candidates.size());
  ForEachRun(candidates, all, [](const Candidate& c) { return c.score; }, [&](std::vector<size_t> run) {
    SortByMemory(candidates, run);
    for (size_t i : run) sorted.push_back(std::move(candidates[i]));
    return true;
  });
  return sorted;
}

// What to relax when nothing is feasible, from the rejections.
Error NothingFeasible(const std::vector<Candidate>& rejected, const SearchOptions& o) {
  const Candidate* cheapest_fit = nullptr;
  int64_t smallest_excess = INT64_MAX;
  bool any_evaluated = false;
  for (const auto& c : rejected) {
    if (c.reason == Candidate::Reason::kMemory || c.reason == Candidate::Reason::kBudget) any_evaluated = true;
    if (c.reason == Candidate::Reason::kBudget && (cheapest_fit == nullptr || c.usd_per_hour < cheapest_fit->usd_per_hour)) cheapest_fit = &c;
    if (c.reason == Candidate::Reason::kMemory) smallest_excess = std::min(smallest_excess, c.peak_bytes - c.capacity_bytes);
  }
  if (!any_evaluated) {
    return Error::BadInput(fmt::format("global batch not reachable: no GPU count from {} to {} x micro-batch divides {} sequences; "
                                       "use a global batch that is a multiple of the GPU count",
                                       o.gpus_min, o.gpus_max, o.global_batch_seqs));
  }
  if (cheapest_fit != nullptr) {
    return Error::BadInput(fmt::format("budget too low: the cheapest configuration that fits ({} x {}) costs ${:.2f}/h, over --budget-per-hour {:.2f}",
                                       cheapest_fit->config.gpus, cheapest_fit->gpu_id, cheapest_fit->usd_per_hour, o.budget_per_hour.value_or(0)));
  }
  return Error::BadInput(fmt::format("no GPU type fits with up to {} GPUs (the closest misses by {:.2f} GiB); raise --gpus-max, shorten --seq-len or add GPU types",
                                     o.gpus_max, smallest_excess == INT64_MAX ? 0.0 : smallest_excess / kGiB));
}

}  // namespace

Result<Objective> ParseObjective(std::string_view t) {
  if (t == "throughput") return Objective::kThroughput;
  if (t == "cost") return Objective::kCost;
  if (t == "time-to-train") return Objective::kTimeToTrain;
  return Error::BadInput(fmt::format("unknown objective '{}' (expected throughput, cost or time-to-train)", t));
}

int64_t CountCandidates(const ModelSpec& model, const SearchOptions& o) {
  Searcher s(model, o);
  int64_t n = 0;
  s.ForEach([&](const SearchPoint&) { ++n; });
  return n;
}

Result<SearchResult> Recommend(const ModelSpec& model, const SearchOptions& o, const ProgressFn& progress) {
  if (o.gpu_types.empty()) return Error::BadInput("no GPU types to search");
  if (o.gpus_min < 1 || o.gpus_min > o.gpus_max) return Error::BadInput(fmt::format("--gpus-min {} must be between 1 and --gpus-max {}", o.gpus_min, o.gpus_max));
  if (o.global_batch_seqs < 1) return Error::BadInput("the global batch must be at least one sequence");
  if (o.objective == Objective::kTimeToTrain && o.train_tokens <= 0) return Error::BadInput("--objective time-to-train needs --tokens T (tokens to train on)");
  Searcher s(model, o);
  const int64_t count = CountCandidates(model, o);
  const int64_t total = o.exhaustive ? 2 * count : count;  // progress: the step times, then (--exhaustive) every replay
  SearchResult r;
  std::vector<Candidate> candidates;  // in the search's order
  std::vector<SearchPoint> points;    // of each candidate
  std::vector<size_t> runnable;       // step time known, memory replayed on demand
  s.ForEach([&](const SearchPoint& p) {
    candidates.push_back(s.EvaluateTime(p));
    points.push_back(p);
    if (candidates.back().reason == Candidate::Reason::kNone) runnable.push_back(candidates.size() - 1);
    ++r.evaluated;
    if (progress && r.evaluated % 4096 == 0) progress(r.evaluated, total);
  });
  if (progress) progress(r.evaluated, total);
  std::vector<bool> checked(candidates.size(), false);
  auto check = [&](size_t i) {
    if (checked[i]) return;
    s.CheckMemory(candidates[i], points[i]);
    checked[i] = true;
    ++r.memory_checked;
    r.memory_checked_feasible += candidates[i].feasible;
  };
  if (o.exhaustive) {
    for (size_t i : runnable) {
      check(i);
      if (progress && r.memory_checked % 4096 == 0) progress(count + r.memory_checked, total);
    }
    r.feasible = r.memory_checked_feasible;
    if (progress) progress(total, total);
  }
  if (o.keep_candidates) r.candidates = candidates;

  // The best by score: runs of equal scores, each replayed whole, until `top` fit. What is not
  // replayed scores below every configuration reported.
  std::vector<size_t> ranked;  // replayed, best first
  size_t fitting = 0;
  ForEachRun(candidates, runnable, [](const Candidate& c) { return c.score; }, [&](std::vector<size_t> run) {
    if (fitting >= std::max<size_t>(o.top, 1)) return false;
    for (size_t i : run) check(i);
    SortByMemory(candidates, run);
    for (size_t i : run) fitting += candidates[i].feasible;
    ranked.insert(ranked.end(), run.begin(), run.end());
    return true;
  });
  if (fitting == 0) return NothingFeasible(SortedBest(std::move(candidates)), o);  // every candidate replayed
  std::optional<double> best;  // the best feasible score
  for (size_t i : ranked) {
    if (!candidates[i].feasible) continue;
    if (!best) best = candidates[i].score;
    if (r.top.size() < o.top) r.top.push_back(candidates[i]);
  }
  for (size_t i : ranked) {
    const Candidate& c = candidates[i];
    const bool evaluated = c.reason == Candidate::Reason::kMemory || c.reason == Candidate::Reason::kBudget;
    if (evaluated && c.score > *best && r.best_rejected.size() < 5) r.best_rejected.push_back(c);
  }

  // The Pareto front, fastest first: in each run of equal throughput only a configuration cheaper
  // than every faster one that fits can join, so only those are replayed. Equal throughput: less
  // memory, then the better score, first.
  std::vector<size_t> in_budget;
  for (size_t i : runnable) if (!s.OverBudget(candidates[i])) in_budget.push_back(i);
  double best_cost = INFINITY;
  ForEachRun(candidates, in_budget, [](const Candidate& c) { return c.tokens_per_s; }, [&](std::vector<size_t> run) {
    std::vector<size_t> joining;
    for (size_t i : run) {
      if (!(candidates[i].usd_per_million_tokens < best_cost * (1 - 1e-9))) continue;
      check(i);
      if (candidates[i].feasible) joining.push_back(i);
    }
    std::stable_sort(joining.begin(), joining.end(), [&](size_t x, size_t y) {
      if (candidates[x].peak_bytes != candidates[y].peak_bytes) return candidates[x].peak_bytes < candidates[y].peak_bytes;
      return RankKey(candidates[x].score) > RankKey(candidates[y].score);
    });
    for (size_t i : joining) {
      if (candidates[i].usd_per_million_tokens < best_cost * (1 - 1e-9)) {  // cheaper, not merely by rounding
        best_cost = candidates[i].usd_per_million_tokens;
        r.pareto.push_back(candidates[i]);
      }
    }
    return true;
  });
  return r;
}

namespace {

struct Change {
  std::string text;
  FsdpConfig config;
  bool allocator_setting = false;  ///< changes how the caching allocator works, not what it holds
};

}  // namespace

Workload AsPyTorchRuns(const Workload& workload) {
  FsdpConfig runs = workload.config;
  if (!ApplyFsdp1WorldOfOne(runs)) return workload;
  Workload w = workload;
  if (!Reconfigure(w, workload.hardware, runs).ok()) return workload;  // NO_SHARD of a valid configuration is valid
  return w;
}

namespace {

// The seeds' OOM checklist as configuration changes of `c` (of a run of `model`).
std::vector<Change> SingleChanges(const FsdpConfig& c, const ModelSpec& model) {
  std::vector<Change> out;
  auto add = [&](std::string text, auto&& edit) {
    FsdpConfig n = c;
    edit(n);
    out.push_back({std::move(text), n});
  };
  for (int64_t mb = c.micro_batch / 2; mb >= 1; mb /= 2) {
    add(fmt::format("--micro-batch {} --grad-accum {}", mb, c.grad_accum * (c.micro_batch / mb)), [&](FsdpConfig& n) {
      n.grad_accum = c.grad_accum * (c.micro_batch / mb);
      n.micro_batch = mb;
    });
  }
  for (int64_t s = c.seq_len / 2; s >= 512 && s >= c.seq_len / 4; s /= 2) add(fmt::format("--seq-len {}", s), [&](FsdpConfig& n) { n.seq_len = s; });
  if (c.checkpointing != Checkpointing::kFull) add("--ac full", [](FsdpConfig& n) { n.checkpointing = Checkpointing::kFull; });
  // What the training code holds and need not: the keys and values of every layer (pass
  // use_cache=False, as llama-recipes' PR #165 did) and the output object (keep only the loss, its
  // PR #41), and under FSDP1 the inputs reentrant checkpointing leaves to frozen units' hooks
  // (gradient_checkpointing_kwargs={"use_reentrant": False}). None costs a step any time.
  if (c.use_cache) add("without --use-cache (use_cache=False)", [](FsdpConfig& n) { n.use_cache = false; });
  if (ReentrantHoldsInputs(c)) {
    add("without --ac-reentrant (gradient_checkpointing_kwargs={\"use_reentrant\": False})", [](FsdpConfig& n) { n.ac_reentrant = false; });
  }
  if (c.loop_holds_outputs) add("without --loop-holds-outputs (loss = model(**batch).loss)", [](FsdpConfig& n) { n.loop_holds_outputs = false; });
  // The allocator's own settings: expandable segments give back most of what fragmentation takes
  // (the per-stream cache and the holes left between differently sized blocks); max_split_size_mb
  // keeps large cached blocks whole for large requests; the rate limiter keeps FSDP1 from
  // reserving all-gather outputs faster than the compute stream frees them.
  const size_t first_allocator_setting = out.size();
  if (auto alloc = ParseAllocatorConfig(c.alloc_conf); alloc.ok()) {
    auto with = [&](const std::string& setting) { return c.alloc_conf.empty() ? setting : c.alloc_conf + "," + setting; };
    if (!alloc.value().expandable_segments) {
      const std::string conf = with("expandable_segments:True");
      add(fmt::format("--alloc-conf {}", conf), [&](FsdpConfig& n) { n.alloc_conf = conf; });
    }
    if (alloc.value().max_split_size_bytes == alloc::kNoMaxSplit && !alloc.value().expandable_segments) {
      // (at least the large segment, as PyTorch requires)
      const std::string conf = with(fmt::format("max_split_size_mb:{}", std::max<int64_t>(512, alloc.value().large_segment_bytes >> 20)));
      add(fmt::format("--alloc-conf {}", conf), [&](FsdpConfig& n) { n.alloc_conf = conf; });
    }
  }
  if (c.framework == Framework::kFsdp1 && !c.limit_all_gathers) {
    add("without --no-limit-all-gathers", [](FsdpConfig& n) { n.limit_all_gathers = true; });
  }
  for (size_t i = first_allocator_setting; i < out.size(); ++i) out[i].allocator_setting = true;
  if (c.checkpointing == Checkpointing::kFull && c.ac_every > 1) add("--ac-every 1", [](FsdpConfig& n) { n.ac_every = 1; });
  if (c.checkpointing == Checkpointing::kNone && c.attention == Attention::kEager) add("--ac selective", [](FsdpConfig& n) { n.checkpointing = Checkpointing::kSelective; });
  if (c.checkpointing == Checkpointing::kNone && OpCheckpointingModelled(model)) {
    add("--ac selective-op", [](FsdpConfig& n) { n.checkpointing = Checkpointing::kSelectiveOp; });
  }
  if (c.attention == Attention::kEager) add("--attention flash", [](FsdpConfig& n) { n.attention = Attention::kFlash; });
  if (c.strategy != Strategy::kFullShard) add("--strategy full_shard", [](FsdpConfig& n) { n.strategy = Strategy::kFullShard; n.shard_group_size = 0; });
  if (c.strategy == Strategy::kNoShard) add("--strategy shard_grad_op", [](FsdpConfig& n) { n.strategy = Strategy::kShardGradOp; });
  for (int64_t factor : {2, 4, 8}) {
    add(fmt::format("--gpus {} (x{} GPUs)", c.gpus * factor, factor), [&](FsdpConfig& n) {
      n.gpus = c.gpus * factor;
      n.grad_accum = std::max<int64_t>(1, c.grad_accum / factor);
      n.shard_group_size = 0;
      n.gpus_per_node = c.gpus >= c.gpus_per_node ? c.gpus_per_node : 0;  // 0: re-derived from the hardware
    });
  }
  if (!c.cpu_offload) add("--cpu-offload", [](FsdpConfig& n) { n.cpu_offload = true; });
  if (c.framework == Framework::kFsdp1 && c.strategy != Strategy::kNoShard) {
    add("--framework fsdp2", [](FsdpConfig& n) { n.framework = Framework::kFsdp2; n.backward_prefetch = BackwardPrefetch::kPre; });
  }
  return out;
}

// What a change is measured against: the configuration as PyTorch runs it.
struct Baseline {
  double tokens_per_s_per_gpu = 0;
  int64_t peak_bytes = 0;
};
Baseline BaselineOf(const Workload& workload) {
  const Workload runs = AsPyTorchRuns(workload);
  return {EstimateTime(runs).step.tokens_per_s_per_gpu, EstimateMemory(runs).peak_bytes};
}

Advice Try(const Workload& base, const Change& change, const Baseline& baseline) {
  Advice a;
  a.change = change.text;
  Workload w = base;
  FsdpConfig runs = change.config;  // the command line keeps its strategy; on one GPU FSDP1 runs NO_SHARD
  ApplyFsdp1WorldOfOne(runs);
  if (runs.lora != base.config.lora) {  // another model: the adapters and the frozen base rebuilt
    auto built = BuildWorkload(base.model, base.hardware, runs);
    if (!built.ok()) return a;
    w = std::move(built).value();
  } else if (!Reconfigure(w, base.hardware, runs).ok()) {
    return a;
  }
  const MemoryEstimate m = EstimateMemory(w);
  const TimeEstimate t = EstimateTime(w);
  a.fits = m.fits;
  a.peak_bytes = m.peak_bytes;
  a.step_s = t.step.step_s;
  a.slowdown_pct = 100.0 * (1.0 - t.step.tokens_per_s_per_gpu / baseline.tokens_per_s_per_gpu);
  a.saves_bytes = baseline.peak_bytes - m.peak_bytes;
  return a;
}

}  // namespace

std::vector<Advice> AllocatorAdvice(const Workload& workload) {
  const Baseline base = BaselineOf(workload);
  std::vector<Advice> out;
  for (const Change& c : SingleChanges(workload.config, workload.model)) {
    if (c.allocator_setting) out.push_back(Try(workload, c, base));
  }
  std::stable_sort(out.begin(), out.end(), [](const Advice& a, const Advice& b) { return a.saves_bytes > b.saves_bytes; });
  return out;
}

std::vector<Advice> FineTuningAdvice(const Workload& workload) {
  if (IsTorchtitan(workload.config.impl)) return {};  // torchtitan trains every parameter: no peft
  const Baseline base = BaselineOf(workload);
  const FsdpConfig& c = workload.config;
  const bool moe = workload.model.num_experts > 0;
  std::vector<Change> changes;
  auto add = [&](std::string text, const LoraConfig& lora) {
    FsdpConfig n = c;
    n.lora = lora;
    if (n.framework == Framework::kFsdp1 && n.wrap == WrapPolicy::kBlock) {
      n.wrap = WrapPolicy::kPeft;
      text += " --wrap peft";
    }
    changes.push_back({text, n});
    if (c.checkpointing == Checkpointing::kFull) return;
    n.checkpointing = Checkpointing::kFull;
    changes.push_back({"--ac full " + text, n});
  };
  LoraConfig lora = c.lora;
  if (lora.rank == 0) {
    lora.rank = 16;
    lora.targets = moe ? "q_proj,k_proj,v_proj,o_proj" : "all-linear";  // peft 0.21's all-linear adapts routed experts too
    // peft's usual recipe: the model loaded in the compute dtype, the adapters upcast to fp32
    const bool bf16_base = c.param_dtype == DType::kBf16 && c.master_dtype != DType::kBf16;
    if (bf16_base) lora.base_dtype = DType::kBf16;
    add(fmt::format("--lora-rank 16 --lora-targets {}{}", lora.targets, bf16_base ? " --base-dtype bf16" : ""), lora);
  }
  if (!lora.qlora && !moe) {
    const bool was_lora = c.lora.rank > 0;
    lora.qlora = true;
    lora.base_dtype = c.lora.base_dtype;  // QLoRA's base is packed in the param dtype
    add(was_lora ? "--qlora" : "--lora-rank 16 --lora-targets all-linear --qlora", lora);
  }
  std::vector<Advice> out;
  for (const Change& change : changes) out.push_back(Try(workload, change, base));
  return out;
}

std::vector<Advice> AdviseFit(const Workload& workload) {
  const Baseline base = BaselineOf(workload);
  std::vector<Change> changes = SingleChanges(workload.config, workload.model);
  // Pairs: checkpointing first, then one more change, for configurations far from fitting.
  FsdpConfig with_ac = workload.config;
  with_ac.checkpointing = Checkpointing::kFull;
  for (Change c : SingleChanges(with_ac, workload.model)) {
    if (c.text == "--ac full" || workload.config.checkpointing == Checkpointing::kFull) continue;
    c.text = "--ac full " + c.text;
    changes.push_back(c);
  }
  std::vector<Advice> fitting;
  for (const Change& c : changes) {
    Advice a = Try(workload, c, base);
    if (a.fits) fitting.push_back(a);
  }
  std::stable_sort(fitting.begin(), fitting.end(), [](const Advice& a, const Advice& b) { return a.slowdown_pct < b.slowdown_pct; });
  return fitting;
}

}  // namespace fsdp
