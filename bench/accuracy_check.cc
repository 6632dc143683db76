// The planner against published FSDP training results (docs/data/published_results.json): for every
// llama-architecture result with tokens/s per GPU (without torch.compile), predicted vs published
// tokens/s per GPU and peak memory, the mean absolute percentage error, per GPU type the single
// matmul efficiency that fits best with its leave-one-out error, and the leave-one-out error when the
// activation-traffic factor is refitted too.
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

using Rows = std::vector<const fsdp::ThroughputComparison*>;

// |predicted / published - 1| with the activation traffic scaled by `traffic_scale` (through the
// memory bandwidth efficiency, which also scales the optimizer's memory-bound step: a few % of a step).
double ScaledError(const fsdp::ThroughputComparison* r, double traffic_scale, double efficiency) {
  fsdp::Workload w = r->workload;
  w.hardware.memory_efficiency /= traffic_scale;
  return std::fabs(fsdp::PredictTokensPerGpu(w, efficiency) / r->published_tokens_per_s_per_gpu - 1.0);
}

// Summed error of one GPU type's rows (without `skip`) at the best efficiency in [0.30, 0.90]
// (ternary search; 0.90 is about what cuBLAS reaches on large GEMMs).
double BestSummedError(const Rows& rows, const fsdp::ThroughputComparison* skip, double traffic_scale, double* efficiency) {
  auto total = [&](double e) {
    double sum = 0;
    for (const auto* r : rows) sum += r == skip ? 0.0 : ScaledError(r, traffic_scale, e);
    return sum;
  };
  double lo = 0.30, hi = 0.90;
  for (int i = 0; i < 18; ++i) {
    const double a = lo + (hi - lo) / 3, b = hi - (hi - lo) / 3;
    if (total(a) < total(b)) hi = b; else lo = a;
  }
  *efficiency = (lo + hi) / 2;
  return total(*efficiency);
}

// Leave-one-out with the traffic factor refitted too: for each result, the traffic factor (5, 7.5,
// 8.75, 10 or 11.25 bytes per saved byte) and per-GPU efficiencies that fit the other results best
// predict it.
double JointLeaveOneOutError(const std::map<std::string, Rows>& per_gpu, size_t count) {
  constexpr double kScales[] = {0.5, 0.75, 0.875, 1.0, 1.125};  // x the model's 10 bytes per saved byte
  double held_out = 0;
  for (const auto& [gpu, list] : per_gpu) {
    for (const auto* skip : list) {
      double best = 1e300, best_scale = 1, best_eff = 0;
      for (double scale : kScales) {
        double sum = 0, eff_here = 0;
        for (const auto& [other_gpu, other] : per_gpu) {
          double eff;
          sum += BestSummedError(other, skip, scale, &eff);
          if (other_gpu == gpu) eff_here = eff;
        }
        if (sum < best) { best = sum; best_scale = scale; best_eff = eff_here; }
      }
      held_out += ScaledError(skip, best_scale, best_eff);
    }
  }
  return held_out / static_cast<double>(count);
}

// "full/2": full checkpointing of one block in two (--ac-every 2).
std::string AcLabel(const fsdp::FsdpConfig& c) {
  std::string label(fsdp::CheckpointingName(c.checkpointing));
  return c.ac_every > 1 ? label + "/" + std::to_string(c.ac_every) : label;
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
                std::string(fsdp::StrategyName(c.strategy)).c_str(), AcLabel(c).c_str(),
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
  std::printf("leave-one-out MAPE with the traffic factor (5 .. 11.25 bytes per saved byte) refitted too: %.1f%%\n",
              100 * JointLeaveOneOutError(per_gpu, rows.size()));
  return 0;
}
