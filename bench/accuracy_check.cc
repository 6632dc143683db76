// The planner against published FSDP training results (docs/data/published_results.json): for every
// llama-architecture result with tokens/s per GPU (without torch.compile), predicted vs published
// tokens/s per GPU and peak memory, the mean absolute percentage error, and per GPU type the single
// matmul efficiency that fits best with its leave-one-out error.
//   build/bench/accuracy_check [published_results.json]
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/catalog.h"
#include "planner/validation.h"

namespace {

// The matmul efficiency (0.30 .. 0.95) minimising the mean absolute error over `rows`, without row `skip`.
double FitEfficiency(const std::vector<const fsdp::ThroughputComparison*>& rows, size_t skip) {
  double best = 0, best_err = 1e300;
  for (int e = 30; e <= 95; ++e) {
    double err = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      if (i != skip) err += std::fabs(fsdp::PredictTokensPerGpu(rows[i]->workload, e / 100.0) / rows[i]->published_tokens_per_s_per_gpu - 1.0);
    }
    if (err < best_err) { best_err = err; best = e / 100.0; }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : fsdp::DataDir() + "/docs/data/published_results.json";
  auto doc = fsdp::LoadJsonFile(path);
  if (!doc.ok()) { std::fprintf(stderr, "%s\n", doc.error().message.c_str()); return 2; }
  const auto rows = fsdp::ComparePublishedResults(doc.value());
  std::printf("%-32s %-14s %5s %5s %3s %-13s %-9s %9s %7s %7s %7s %8s\n", "result", "model", "gpus", "seq", "mb", "strategy", "AC",
              "pub tok/s", "pred", "err%", "pub GiB", "pred GiB");
  std::map<std::string, std::vector<const fsdp::ThroughputComparison*>> per_gpu;
  for (const auto& r : rows) {
    const fsdp::FsdpConfig& c = r.workload.config;
    const std::string pub_mem = r.published_memory_gib < 0 ? "-" : std::to_string(r.published_memory_gib).substr(0, 5);
    std::printf("%-32s %-14s %5lld %5lld %3lld %-13s %-9s %9.0f %7.0f %+7.1f %7s %8.1f\n", r.id.c_str(), r.workload.model.id.c_str(),
                static_cast<long long>(c.gpus), static_cast<long long>(c.seq_len), static_cast<long long>(c.micro_batch),
                std::string(fsdp::StrategyName(c.strategy)).c_str(), std::string(fsdp::CheckpointingName(c.checkpointing)).c_str(),
                r.published_tokens_per_s_per_gpu, r.predicted_tokens_per_s_per_gpu,
                100.0 * (r.predicted_tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1.0), pub_mem.c_str(), r.predicted_memory_gib);
    per_gpu[r.workload.hardware.id].push_back(&r);
  }
  std::printf("results %zu, mean absolute percentage error of tokens/s per GPU: %.1f%%\n", rows.size(), 100 * fsdp::MeanAbsoluteError(rows));
  for (const auto& [gpu, list] : per_gpu) {
    const double fitted = FitEfficiency(list, list.size());
    double in_sample = 0, held_out = 0, current = 0;
    for (size_t i = 0; i < list.size(); ++i) {
      const double pub = list[i]->published_tokens_per_s_per_gpu;
      current += std::fabs(list[i]->predicted_tokens_per_s_per_gpu / pub - 1.0);
      in_sample += std::fabs(fsdp::PredictTokensPerGpu(list[i]->workload, fitted) / pub - 1.0);
      held_out += std::fabs(fsdp::PredictTokensPerGpu(list[i]->workload, FitEfficiency(list, i)) / pub - 1.0);
    }
    const double n = static_cast<double>(list.size());
    std::printf("  %s: %zu results, MAPE %.1f%% with the hardware file's matmul efficiency %.2f; best fit %.2f (MAPE %.1f%%), leave-one-out MAPE %.1f%%\n",
                gpu.c_str(), list.size(), 100 * current / n, list.front()->workload.hardware.matmul_efficiency, fitted, 100 * in_sample / n,
                100 * held_out / n);
  }
  return 0;
}
