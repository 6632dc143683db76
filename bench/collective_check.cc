// Compares the collective model with the published nccl-tests points of docs/data/nccl_reference.json:
// one row per point, then the mean absolute percentage error of the bus bandwidth.
//   build/bench/collective_check [path/to/nccl_reference.json]
#include <cmath>
#include <cstdio>
#include <string>

#include "core/catalog.h"
#include "planner/validation.h"

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : fsdp::DataDir() + "/docs/data/nccl_reference.json";
  auto doc = fsdp::LoadJsonFile(path);
  if (!doc.ok()) { std::fprintf(stderr, "%s\n", doc.error().message.c_str()); return 2; }
  const auto rows = fsdp::CompareNcclTests(doc.value());
  std::printf("%-16s %5s %5s %-14s %12s %10s %10s %7s  %s\n", "gpu", "ranks", "nodes", "collective", "size_bytes", "meas_GB/s",
              "model_GB/s", "err%", "algo/proto");
  std::vector<fsdp::CollectiveComparison> large;
  for (const auto& r : rows) {
    const double model = r.model.busbw_bytes_per_s / 1e9;
    std::printf("%-16s %5lld %5lld %-14s %12lld %10.1f %10.1f %+7.1f  %s/%s\n", r.gpu.c_str(), static_cast<long long>(r.ranks),
                static_cast<long long>(r.nodes), std::string(fsdp::CollectiveName(r.collective)).c_str(), static_cast<long long>(r.size_bytes),
                r.measured_busbw, model, 100.0 * (model / r.measured_busbw - 1.0), std::string(r.model.algorithm).c_str(),
                std::string(r.model.protocol).c_str());
    if (r.size_bytes >= (16 << 20)) large.push_back(r);
  }
  std::printf("points %zu, mean absolute error of busbw %.1f%%; points >= 16 MiB %zu, mean absolute error %.1f%%\n", rows.size(),
              100 * fsdp::MeanAbsoluteError(rows), large.size(), 100 * fsdp::MeanAbsoluteError(large));
  return 0;
}
