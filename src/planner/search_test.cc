#include "planner/search.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "planner/memory_model.h"
#include "planner/step_model.h"

namespace fsdp {
namespace {

SearchOptions Options(std::vector<const char*> gpus, int64_t gpus_max, int64_t global_batch) {
  SearchOptions o;
  for (const char* id : gpus) o.gpu_types.push_back(LoadHardware(id).value());
  o.gpus_max = gpus_max;
  o.global_batch_seqs = global_batch;
  o.base.seq_len = 4096;
  return o;
}

ModelSpec Model(const char* id) {
  auto m = LoadModel(id);
  REQUIRE(m.ok());
  return m.value();
}

TEST_CASE("recommend: every listed configuration fits, reaches the global batch, and is ranked") {
  SearchOptions o = Options({"a100-80gb-sxm", "h100-sxm"}, 16, 64);
  auto r = Recommend(Model("llama-2-7b"), o, nullptr);
  REQUIRE(r.ok());
  const SearchResult& s = r.value();
  // 2 GPU types x 5 counts (1..16) x 4 strategies x 3 checkpointing modes (flash: none, selective-op, full) x 6 micro-batches x
  // 2 offload x 2 wraps
  CHECK(s.evaluated == 2 * 5 * 4 * 3 * 6 * 2 * 2);
  CHECK(s.evaluated == CountCandidates(Model("llama-2-7b"), o));
  REQUIRE(!s.top.empty());
  for (size_t i = 0; i < s.top.size(); ++i) {
    const Candidate& c = s.top[i];
    CHECK(c.feasible);
    CHECK(c.peak_bytes <= c.capacity_bytes);
    CHECK(c.config.gpus * c.config.micro_batch * c.config.grad_accum == 64);
    if (i > 0) CHECK(s.top[i - 1].tokens_per_s >= c.tokens_per_s);
  }
  // Pareto front: each entry is cheaper per token than every faster one
  for (size_t i = 1; i < s.pareto.size(); ++i) {
    CHECK(s.pareto[i].tokens_per_s <= s.pareto[i - 1].tokens_per_s);
    CHECK(s.pareto[i].usd_per_million_tokens < s.pareto[i - 1].usd_per_million_tokens);
  }
  // the best-scoring rejections say why
  for (const auto& c : s.best_rejected) CHECK_FALSE(c.rejection.empty());
}

// The same candidate, figure for figure.
void CheckSame(const std::vector<Candidate>& lazy, const std::vector<Candidate>& all) {
  REQUIRE(lazy.size() == all.size());
  for (size_t i = 0; i < lazy.size(); ++i) {
    const Candidate &a = lazy[i], &b = all[i];
    CHECK(a.gpu_id == b.gpu_id);
    CHECK(a.config.gpus == b.config.gpus);
    CHECK(a.config.strategy == b.config.strategy);
    CHECK(a.config.checkpointing == b.config.checkpointing);
    CHECK(a.config.micro_batch == b.config.micro_batch);
    CHECK(a.config.cpu_offload == b.config.cpu_offload);
    CHECK(a.config.wrap == b.config.wrap);
    CHECK(a.feasible == b.feasible);
    CHECK(a.rejection == b.rejection);
    CHECK(a.peak_bytes == b.peak_bytes);
    CHECK(a.step_s == b.step_s);
    CHECK(a.usd_per_million_tokens == b.usd_per_million_tokens);
  }
}

// The ranking as Recommend computed it before it replayed memory lazily (f70b0d3's SortBest,
// ParetoFront and best_rejected), over every candidate judged: the reference the lazy search must
// equal.
struct Ranking {
  std::vector<Candidate> top, pareto, best_rejected;
};
double Quantized(double x) {
  if (x == 0 || !std::isfinite(x)) return x;
  const int e = std::ilogb(x);
  return std::ldexp(std::nearbyint(std::ldexp(x, 30 - e)), e - 30);
}
template <typename Key>
void SortBest(std::vector<Candidate>& c, Key key) {
  std::stable_sort(c.begin(), c.end(), [&](const Candidate& a, const Candidate& b) {
    const double ka = Quantized(key(a)), kb = Quantized(key(b));
    return ka != kb ? ka > kb : a.peak_bytes < b.peak_bytes;
  });
}
Ranking ReferenceRanking(const std::vector<Candidate>& all, size_t top) {
  std::vector<Candidate> feasible, rejected;
  for (const Candidate& c : all) (c.feasible ? feasible : rejected).push_back(c);
  auto score = [](const Candidate& c) { return c.score; };
  SortBest(feasible, score);
  SortBest(rejected, score);
  Ranking r;
  r.top.assign(feasible.begin(), feasible.begin() + static_cast<std::ptrdiff_t>(std::min(top, feasible.size())));
  for (const Candidate& c : rejected) {
    const bool judged = c.reason == Candidate::Reason::kMemory || c.reason == Candidate::Reason::kBudget;
    if (judged && c.score > feasible.front().score && r.best_rejected.size() < 5) r.best_rejected.push_back(c);
  }
  std::vector<Candidate> by_speed = feasible;
  SortBest(by_speed, [](const Candidate& c) { return c.tokens_per_s; });
  double best_cost = INFINITY;
  for (const Candidate& c : by_speed) {
    if (c.usd_per_million_tokens < best_cost * (1 - 1e-9)) {
      best_cost = c.usd_per_million_tokens;
      r.pareto.push_back(c);
    }
  }
  return r;
}

TEST_CASE("recommend replays only what could rank, and lists exactly what replaying every candidate lists") {
  const ModelSpec model = Model("llama-2-7b");
  SearchOptions base = Options({"a100-80gb-sxm", "h100-sxm", "rtx-4090", "b200"}, 64, 256);
  base.base.attention = Attention::kEager;  // selective checkpointing searched too
  std::vector<std::pair<std::string, SearchOptions>> cases;
  cases.emplace_back("throughput", base);
  cases.emplace_back("cost", base);
  cases.back().second.objective = Objective::kCost;
  cases.emplace_back("time to train", base);
  cases.back().second.objective = Objective::kTimeToTrain;
  cases.back().second.train_tokens = 1e11;
  cases.emplace_back("budget", base);
  cases.back().second.budget_per_hour = 60;
  cases.emplace_back("top 1", base);
  cases.back().second.top = 1;
  cases.emplace_back("LoRA", base);
  cases.back().second.base.lora.rank = 16;
  cases.back().second.base.lora.targets = "all-linear";
  for (auto& [name, o] : cases) {
    CAPTURE(name);
    auto lazy = Recommend(model, o, nullptr);
    o.exhaustive = true;
    o.keep_candidates = true;
    auto all = Recommend(model, o, nullptr);
    REQUIRE(lazy.ok());
    REQUIRE(all.ok());
    CHECK(lazy.value().evaluated == all.value().evaluated);
    CHECK(lazy.value().memory_checked * 2 < all.value().memory_checked);  // the point of it
    CHECK_FALSE(lazy.value().feasible.has_value());
    REQUIRE(all.value().feasible.has_value());
    CHECK(*all.value().feasible > lazy.value().memory_checked_feasible);
    const Ranking reference = ReferenceRanking(all.value().candidates, o.top);
    CheckSame(lazy.value().top, reference.top);
    CheckSame(lazy.value().pareto, reference.pareto);
    CheckSame(lazy.value().best_rejected, reference.best_rejected);
    CheckSame(all.value().top, reference.top);
    CheckSame(all.value().pareto, reference.pareto);
  }
}

TEST_CASE("on one GPU, FSDP1 candidates are NO_SHARD only (FSDP1 switches every strategy to it)") {
  SearchOptions o = Options({"h100-sxm"}, 1, 8);
  o.base.seq_len = 1024;
  auto r = Recommend(Model("llama-100m"), o, nullptr);
  REQUIRE(r.ok());
  REQUIRE(!r.value().top.empty());
  for (const Candidate& c : r.value().top) CHECK(c.config.strategy == Strategy::kNoShard);
  o.base.framework = Framework::kFsdp2;  // FSDP2 keeps its strategy on one GPU
  auto fsdp2 = Recommend(Model("llama-100m"), o, nullptr);
  REQUIRE(fsdp2.ok());
  bool sharded = false;
  for (const Candidate& c : fsdp2.value().top) sharded |= c.config.strategy != Strategy::kNoShard;
  CHECK(sharded);
}

TEST_CASE("a recommended configuration re-evaluates to the same figures") {
  SearchOptions o = Options({"h100-sxm"}, 8, 32);
  auto r = Recommend(Model("llama-2-7b"), o, nullptr);
  REQUIRE(r.ok());
  const Candidate& best = r.value().top.front();
  auto w = BuildWorkload(Model("llama-2-7b"), LoadHardware("h100-sxm").value(), best.config);
  REQUIRE(w.ok());
  CHECK(EstimateMemory(w.value()).peak_bytes == best.peak_bytes);
  CHECK(EstimateTime(w.value()).step.step_s == doctest::Approx(best.step_s));
}

TEST_CASE("the search's screens and shared replays never change a figure: every candidate re-evaluates alike") {
  // h100-sxm's cuBLAS workspaces sit in segments of their own (one replay per key serves it and
  // b200), a100's share a 20 MiB segment (replayed with them); the tensors' lower bound screens
  // out what cannot fit before any allocator replay
  SearchOptions o = Options({"h100-sxm", "a100-80gb-sxm", "rtx-4090"}, 8, 16);
  o.base.seq_len = 2048;
  o.top = 1000;
  const ModelSpec model = Model("llama-2-7b");
  auto r = Recommend(model, o, nullptr);
  REQUIRE(r.ok());
  int checked = 0;
  for (const Candidate& c : r.value().top) {
    auto w = BuildWorkload(model, LoadHardware(c.gpu_id).value(), c.config);
    REQUIRE(w.ok());
    const MemoryEstimate direct = EstimateMemory(AsPyTorchRuns(w.value()));
    CHECK(direct.fits);  // nothing that does not fit is recommended
    if (c.config.grad_accum <= 2) {  // the search replays two micro-batches of longer accumulations
      CHECK(direct.peak_bytes == c.peak_bytes);
      ++checked;
    }
  }
  CHECK(checked > 20);
  for (const Candidate& c : r.value().best_rejected) {
    if (c.reason != Candidate::Reason::kMemory) continue;
    auto w = BuildWorkload(model, LoadHardware(c.gpu_id).value(), c.config);
    REQUIRE(w.ok());
    CHECK_FALSE(EstimateMemory(AsPyTorchRuns(w.value())).fits);
  }
}

TEST_CASE("objectives: cost ranks by dollars per token, time-to-train needs --tokens") {
  SearchOptions o = Options({"a100-80gb-sxm", "h100-sxm"}, 16, 64);
  o.objective = Objective::kCost;
  auto r = Recommend(Model("llama-2-7b"), o, nullptr);
  REQUIRE(r.ok());
  // (costs equal to 1e-9 are ties, broken towards less memory)
  for (size_t i = 1; i < r.value().top.size(); ++i) {
    const Candidate& a = r.value().top[i - 1];
    const Candidate& b = r.value().top[i];
    CHECK(a.usd_per_million_tokens <= b.usd_per_million_tokens * (1 + 1e-9));
    if (a.usd_per_million_tokens > b.usd_per_million_tokens) CHECK(a.peak_bytes <= b.peak_bytes);
  }
  o.objective = Objective::kTimeToTrain;
  CHECK_FALSE(Recommend(Model("llama-2-7b"), o, nullptr).ok());
  o.train_tokens = 1e12;
  auto t = Recommend(Model("llama-2-7b"), o, nullptr);
  REQUIRE(t.ok());
  CHECK(t.value().top.front().time_to_train_s == doctest::Approx(1e12 / t.value().top.front().tokens_per_s));
}

TEST_CASE("impossible targets say what to relax") {
  // one 24 GB card cannot hold a 405B block unit plus the 4.2B-parameter root unit, even offloaded
  SearchOptions o = Options({"rtx-3090"}, 1, 64);
  auto no_fit = Recommend(Model("llama-3.1-405b"), o, nullptr);
  REQUIRE_FALSE(no_fit.ok());
  CHECK(no_fit.error().message.starts_with("no GPU type fits with up to 1 GPUs"));

  SearchOptions odd = Options({"h100-sxm"}, 8, 63);
  odd.base.seq_len = 1024;
  auto r = Recommend(Model("gpt2"), odd, nullptr);
  REQUIRE(r.ok());  // 1 GPU x micro-batch 1 reaches 63
  SearchOptions odd2 = Options({"h100-sxm"}, 8, 63);
  odd2.gpus_min = 2;  // 63 sequences cannot be split over 2, 4 or 8 GPUs
  auto r2 = Recommend(Model("llama-2-7b"), odd2, nullptr);
  REQUIRE_FALSE(r2.ok());
  CHECK(r2.error().message.starts_with("global batch not reachable"));

  SearchOptions poor = Options({"h100-sxm"}, 64, 64);
  poor.budget_per_hour = 1.0;
  auto b = Recommend(Model("llama-2-7b"), poor, nullptr);
  REQUIRE_FALSE(b.ok());
  CHECK(b.error().message.starts_with("budget too low"));
}

// `model` on 4 x RTX 4090 at `seq_len` tokens, the other settings the defaults.
Result<Workload> OnFourRtx4090(const char* model, int64_t seq_len) {
  FsdpConfig c;
  c.gpus = 4;
  c.seq_len = seq_len;
  return BuildWorkload(Model(model), LoadHardware("rtx-4090").value(), c);
}

TEST_CASE("advise: the changes that make llama-2-13b fit on 4 x RTX 4090, cheapest in speed first") {
  auto w = OnFourRtx4090("llama-2-13b", 4096);
  REQUIRE(w.ok());
  CHECK_FALSE(EstimateMemory(w.value()).fits);
  std::vector<Advice> advice = AdviseFit(w.value());
  REQUIRE(!advice.empty());
  for (size_t i = 0; i < advice.size(); ++i) {
    CHECK(advice[i].fits);
    CHECK(advice[i].peak_bytes <= w.value().hardware.DeviceTotalBytes());
    if (i > 0) CHECK(advice[i - 1].slowdown_pct <= advice[i].slowdown_pct);
  }
}

TEST_CASE("advise: dropping the cache or the held output, which cost no time, come first when they fit") {
  // llama-recipes' LoRA run of 2023 (docs/accuracy.md) on a 20 GiB card: use_cache=True under
  // torch's checkpoint wrapper keeps 4 GiB of keys and values, the held output the fp32 logits
  FsdpConfig c;
  c.gpus = 4;
  c.seq_len = 2048;
  c.micro_batch = 4;
  c.attention = Attention::kEager;
  c.checkpointing = Checkpointing::kFull;
  c.transformers = {4, 31};
  c.use_cache = true;
  c.loop_holds_outputs = true;
  c.master_dtype = DType::kBf16;
  c.reduce_dtype = DType::kBf16;
  c.wrap = WrapPolicy::kPeft;
  c.lora.rank = 8;
  c.lora.targets = "q_proj,v_proj";
  HardwareSpec card = LoadHardware("a100-40gb-sxm").value();
  card.memory_bytes = int64_t{20} << 30;
  auto w = BuildWorkload(Model("llama-2-7b"), card, c);
  REQUIRE(w.ok());
  REQUIRE_FALSE(EstimateMemory(w.value()).fits);
  const std::vector<Advice> advice = AdviseFit(w.value());
  REQUIRE(!advice.empty());
  const auto find = [&](const std::string& change) {
    return std::find_if(advice.begin(), advice.end(), [&](const Advice& a) { return a.change == change; });
  };
  const auto no_cache = find("without --use-cache (use_cache=False)");
  REQUIRE(no_cache != advice.end());
  CHECK(no_cache->slowdown_pct == doctest::Approx(0).epsilon(1e-9));
  FsdpConfig without = c;
  without.use_cache = false;
  auto direct = BuildWorkload(Model("llama-2-7b"), card, without);
  REQUIRE(direct.ok());
  CHECK(no_cache->peak_bytes == EstimateMemory(direct.value()).peak_bytes);
  CHECK(no_cache->saves_bytes > (int64_t{4} << 30));  // at least the 32 layers' keys and values
  CHECK(advice.front().slowdown_pct <= 1e-9);  // a change that costs nothing leads
}

TEST_CASE("advise's fine-tuning changes: LoRA then QLoRA, each with full checkpointing, each re-evaluated as its own model") {
  auto w = OnFourRtx4090("llama-2-70b", 2048);
  REQUIRE(w.ok());
  const std::vector<Advice> advice = FineTuningAdvice(w.value());
  REQUIRE(advice.size() == 4);
  CHECK(advice[0].change == "--lora-rank 16 --lora-targets all-linear --base-dtype bf16 --wrap peft");
  CHECK(advice[3].change == "--ac full --lora-rank 16 --lora-targets all-linear --qlora --wrap peft");
  // each equals a plan of the same flags built from scratch
  FsdpConfig qlora;
  qlora.gpus = 4;
  qlora.seq_len = 2048;
  qlora.checkpointing = Checkpointing::kFull;
  qlora.wrap = WrapPolicy::kPeft;
  qlora.lora.rank = 16;
  qlora.lora.targets = "all-linear";
  qlora.lora.qlora = true;
  auto direct = BuildWorkload(Model("llama-2-70b"), LoadHardware("rtx-4090").value(), qlora);
  REQUIRE(direct.ok());
  CHECK(advice[3].peak_bytes == EstimateMemory(direct.value()).peak_bytes);
  // a frozen base needs less than full training, a 4-bit one less again
  const int64_t full = EstimateMemory(w.value()).peak_bytes;
  CHECK(advice[1].peak_bytes < full);
  CHECK(advice[3].peak_bytes < advice[1].peak_bytes);
  // an MoE model: LoRA on the attention only, no QLoRA (fsdpkit refuses it there)
  auto moe = OnFourRtx4090("mixtral-8x7b", 2048);
  REQUIRE(moe.ok());
  const std::vector<Advice> moe_advice = FineTuningAdvice(moe.value());
  REQUIRE(moe_advice.size() == 2);
  CHECK(moe_advice[0].change == "--lora-rank 16 --lora-targets q_proj,k_proj,v_proj,o_proj --base-dtype bf16 --wrap peft");
}

TEST_CASE("progress is reported and ends at the total") {
  SearchOptions o = Options({"h100-sxm"}, 8, 32);
  o.base.seq_len = 1024;
  int64_t last = 0, total = 0;
  auto r = Recommend(Model("gpt2"), o, [&](int64_t done, int64_t t) { last = done; total = t; });
  REQUIRE(r.ok());
  CHECK(last == total);
  CHECK(total == r.value().evaluated);
}

}  // namespace
}  // namespace fsdp
