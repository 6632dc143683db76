// Compares the collective model with the published nccl-tests points of docs/data/nccl_reference.json
// and prints one row per point plus the mean absolute percentage error of the bus bandwidth.
//   build/bench/collective_check [path/to/nccl_reference.json]
#include <cmath>
#include <cstdio>
#include <string>

#include "core/catalog.h"
#include "core/json_io.h"
#include "planner/collective_model.h"

namespace {

struct Platform {
  const char* match;       // substring of the point's "gpu" text
  const char* gpu;         // hardware id
  double nic_per_gpu;      // inter-node bytes/s per GPU of that platform
};

// The platforms behind the published points (their NICs from the vendors' instance specifications).
constexpr Platform kPlatforms[] = {
    {"DGX H100", "h100-sxm", 50e9},          {"8 H100, NVLink", "h100-sxm", 50e9},
    {"p5.48xlarge", "h100-sxm", 50e9},       {"GCP A3", "h100-sxm", 25e9},
    {"RoCE", "h100-sxm", 50e9},              {"ND96asr_v4", "a100-40gb-sxm", 25e9},
    {"ND96amsr", "a100-80gb-sxm", 25e9},     {"p4de", "a100-80gb-sxm", 6.25e9},
    {"OCI", "a100-40gb-sxm", 25e9},
};

fsdp::Collective ParseCollective(const std::string& name) {
  if (name == "all_gather") return fsdp::Collective::kAllGather;
  if (name == "reduce_scatter") return fsdp::Collective::kReduceScatter;
  return fsdp::Collective::kAllReduce;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : fsdp::DataDir() + "/docs/data/nccl_reference.json";
  auto doc = fsdp::LoadJsonFile(path);
  if (!doc.ok()) { std::fprintf(stderr, "%s\n", doc.error().message.c_str()); return 2; }
  double abs_pct = 0, abs_pct_large = 0;
  int n = 0, n_large = 0;
  std::printf("%-16s %5s %5s %-14s %12s %10s %10s %7s  %s\n", "gpu", "ranks", "nodes", "collective", "size_bytes", "meas_GB/s",
              "model_GB/s", "err%", "algo/proto");
  for (const auto& p : doc.value()["nccl_tests_results"]) {
    const std::string text = p["gpu"].get<std::string>();
    const Platform* platform = nullptr;
    for (const auto& candidate : kPlatforms) if (text.find(candidate.match) != std::string::npos) platform = &candidate;
    if (platform == nullptr) continue;
    auto hw = fsdp::LoadHardware(platform->gpu);
    if (!hw.ok()) return 2;
    hw.value().inter_node_bandwidth_per_gpu_bytes_per_s = platform->nic_per_gpu;
    const int64_t ranks = p["gpus"].get<int64_t>(), nodes = p["nodes"].get<int64_t>();
    const auto c = ParseCollective(p["collective"].get<std::string>());
    const auto e = fsdp::EstimateCollective(c, p["size_bytes"].get<int64_t>(), {ranks, ranks / nodes}, hw.value());
    const double measured = p["busbw_GBps"].get<double>(), model = e.busbw_bytes_per_s / 1e9;
    const double err = 100.0 * (model - measured) / measured;
    abs_pct += std::fabs(err);
    ++n;
    if (p["size_bytes"].get<int64_t>() >= (16 << 20)) {
      abs_pct_large += std::fabs(err);
      ++n_large;
    }
    std::printf("%-16s %5lld %5lld %-14s %12lld %10.1f %10.1f %+7.1f  %s/%s\n", platform->gpu, static_cast<long long>(ranks),
                static_cast<long long>(nodes), std::string(fsdp::CollectiveName(c)).c_str(), static_cast<long long>(p["size_bytes"].get<int64_t>()),
                measured, model, err, std::string(e.algorithm).c_str(), std::string(e.protocol).c_str());
  }
  std::printf("points %d, mean absolute error of busbw %.1f%%; points >= 16 MiB %d, mean absolute error %.1f%%\n", n,
              n > 0 ? abs_pct / n : 0.0, n_large, n_large > 0 ? abs_pct_large / n_large : 0.0);
  return 0;
}
