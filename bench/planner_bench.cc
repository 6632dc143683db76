// Configurations evaluated per second by fsdp-plan's search (issue target: >= 100,000 per second
// on one core). Runs the search several times and prints the median rate: as `recommend` runs it
// (every candidate's step time, the memory replayed for those whose fit could change the result),
// and with every candidate's memory replayed (--exhaustive).
//   build/bench/planner_bench [model] [gpus_max] [repeats]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/catalog.h"
#include "planner/search.h"

int main(int argc, char** argv) {
  const std::string model_id = argc > 1 ? argv[1] : "llama-3.1-70b";
  const int64_t gpus_max = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  auto model = fsdp::LoadModel(model_id);
  if (!model.ok()) { std::fprintf(stderr, "%s\n", model.error().message.c_str()); return 2; }
  fsdp::SearchOptions o;
  for (const auto& id : fsdp::ListCatalogIds("hardware")) o.gpu_types.push_back(fsdp::LoadHardware(id).value());
  o.gpus_max = gpus_max;
  o.base.seq_len = 4096;
  o.base.attention = fsdp::Attention::kEager;  // three checkpointing modes
  o.global_batch_seqs = 4096;
  for (bool exhaustive : {false, true}) {
    o.exhaustive = exhaustive;
    std::vector<double> rates;
    fsdp::SearchResult result;
    for (int i = 0; i < repeats; ++i) {
      const auto start = std::chrono::steady_clock::now();
      auto r = fsdp::Recommend(model.value(), o, nullptr);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!r.ok()) { std::fprintf(stderr, "%s\n", r.error().message.c_str()); return 1; }
      result = r.value();
      rates.push_back(static_cast<double>(result.evaluated) / s);
    }
    std::sort(rates.begin(), rates.end());
    std::printf("%s: model %s, %zu GPU types, up to %lld GPUs: %lld configurations per search, memory replayed for %lld (%lld fit)\n",
                exhaustive ? "exhaustive" : "recommend", model_id.c_str(), o.gpu_types.size(), static_cast<long long>(gpus_max),
                static_cast<long long>(result.evaluated), static_cast<long long>(result.memory_checked), static_cast<long long>(result.memory_checked_feasible));
    std::printf("  median %.0f configurations/s over %d runs (min %.0f, max %.0f)\n", rates[rates.size() / 2], repeats, rates.front(), rates.back());
  }
  return 0;
}
