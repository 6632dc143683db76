#include "planner/validation.h"

#include <cmath>
#include <map>

#include "core/catalog.h"
#include "planner/memory_model.h"
#include "planner/step_model.h"
#include "core/vocabulary.h"

namespace fsdp {
namespace {

struct Platform {
  const char* match;     // substring of the point's "gpu" text
  const char* gpu;       // hardware id
  double nic_per_gpu;    // inter-node bytes/s per GPU (the vendors' instance specifications)
};

constexpr Platform kPlatforms[] = {
    {"DGX H100", "h100-sxm", 50e9},      {"8 H100, NVLink", "h100-sxm", 50e9}, {"p5.48xlarge", "h100-sxm", 50e9},
    {"GCP A3", "h100-sxm", 25e9},        {"RoCE", "h100-sxm", 50e9},           {"ND96asr_v4", "a100-40gb-sxm", 25e9},
    {"ND96amsr", "a100-80gb-sxm", 25e9}, {"p4de", "a100-80gb-sxm", 6.25e9},    {"OCI", "a100-40gb-sxm", 25e9},
};

// Published model names -> catalog ids with the same architecture (fms-fsdp's 34B is CodeLlama-34B's shape).
std::string CatalogModel(const std::string& published) {
  static const std::map<std::string, std::string> kModels = {
      {"llama-2-7b", "llama-2-7b"},   {"llama-2-13b", "llama-2-13b"},   {"llama-2-70b", "llama-2-70b"},
      {"llama-3-8b", "llama-3.1-8b"}, {"llama-3.1-8b", "llama-3.1-8b"}, {"llama-3-70b", "llama-3.1-70b"}};
  if (published.starts_with("llama-2-34b-style")) return "codellama-34b";
  auto it = kModels.find(published);
  return it == kModels.end() ? "" : it->second;
}


Result<Workload> WorkloadOf(const Json& r) {
  auto model = LoadModel(CatalogModel(r["model"].get<std::string>()));
  if (!model.ok()) return model.error();
  auto hw = LoadHardware(r["gpu"].get<std::string>());
  if (!hw.ok()) return hw.error();
  FsdpConfig c;
  c.gpus = r["gpus"].get<int64_t>();
  c.gpus_per_node = r["gpus_per_node"].get<int64_t>();
  c.seq_len = r["seq_len"].get<int64_t>();
  c.micro_batch = r["micro_batch"].get<int64_t>();
  c.grad_accum = std::max<int64_t>(1, r["global_batch"].get<int64_t>() / (c.gpus * c.micro_batch));
  auto strategy = ParseStrategy(r["strategy"].get<std::string>());
  if (!strategy.ok()) return strategy.error();
  c.strategy = strategy.value();
  // "modelled_as" holds a reading of the source's checkpointing that its own figures support (e.g.
  // IBM's "selective": full checkpointing of every other block, from its HFU / MFU ratio)
  const Json& ac = r.contains("modelled_as") ? r["modelled_as"] : r;
  auto checkpointing = ParseCheckpointing(ac["activation_checkpointing"].get<std::string>());
  if (!checkpointing.ok()) return checkpointing.error();
  c.checkpointing = checkpointing.value();
  if (ac.contains("ac_every")) c.ac_every = ac["ac_every"].get<int64_t>();
  c.framework = r["framework"] == "fsdp2" ? Framework::kFsdp2 : Framework::kFsdp1;
  return BuildWorkload(model.value(), hw.value(), c);
}

}  // namespace

std::vector<CollectiveComparison> CompareNcclTests(const Json& reference) {
  std::vector<CollectiveComparison> rows;
  for (const auto& p : reference["nccl_tests_results"]) {
    const std::string text = p["gpu"].get<std::string>();
    const Platform* platform = nullptr;
    for (const auto& candidate : kPlatforms) if (text.find(candidate.match) != std::string::npos) platform = &candidate;
    if (platform == nullptr) continue;
    auto hw = LoadHardware(platform->gpu);
    if (!hw.ok()) continue;
    hw.value().inter_node_bandwidth_per_gpu_bytes_per_s = platform->nic_per_gpu;
    CollectiveComparison row;
    row.gpu = platform->gpu;
    row.ranks = p["gpus"].get<int64_t>();
    row.nodes = p["nodes"].get<int64_t>();
    row.size_bytes = p["size_bytes"].get<int64_t>();
    const std::string name = p["collective"].get<std::string>();
    row.collective = name == "all_gather" ? Collective::kAllGather : name == "reduce_scatter" ? Collective::kReduceScatter : Collective::kAllReduce;
    row.measured_busbw = p["busbw_GBps"].get<double>();
    row.model = EstimateCollective(row.collective, row.size_bytes, {row.ranks, row.ranks / row.nodes}, hw.value());
    rows.push_back(row);
  }
  return rows;
}

std::vector<ThroughputComparison> ComparePublishedResults(const Json& results) {
  std::vector<ThroughputComparison> rows;
  for (const auto& r : results) {
    if (r["tokens_per_s_per_gpu"].is_null() || (r["compile"].is_boolean() && r["compile"].get<bool>())) continue;
    if (CatalogModel(r["model"].get<std::string>()).empty()) continue;
    auto w = WorkloadOf(r);
    if (!w.ok()) continue;
    ThroughputComparison row;
    row.id = r["id"].get<std::string>();
    row.workload = std::move(w).value();
    row.published_tokens_per_s_per_gpu = r["tokens_per_s_per_gpu"].get<double>();
    row.predicted_tokens_per_s_per_gpu = EstimateTime(row.workload).step.tokens_per_s_per_gpu;
    if (!r["memory_gib_per_gpu"].is_null()) row.published_memory_gib = r["memory_gib_per_gpu"].get<double>();
    row.predicted_memory_gib = EstimateMemory(row.workload).peak_bytes / kGiB;
    rows.push_back(std::move(row));
  }
  return rows;
}

double MeanAbsoluteError(const std::vector<ThroughputComparison>& rows) {
  double sum = 0;
  for (const auto& r : rows) sum += std::fabs(r.predicted_tokens_per_s_per_gpu / r.published_tokens_per_s_per_gpu - 1.0);
  return rows.empty() ? 0.0 : sum / static_cast<double>(rows.size());
}

double MeanAbsoluteError(const std::vector<CollectiveComparison>& rows) {
  double sum = 0;
  for (const auto& r : rows) sum += std::fabs(r.model.busbw_bytes_per_s / 1e9 / r.measured_busbw - 1.0);
  return rows.empty() ? 0.0 : sum / static_cast<double>(rows.size());
}

double PredictTokensPerGpu(Workload w, double matmul_efficiency) {
  w.hardware.matmul_efficiency = matmul_efficiency;
  return EstimateTime(w).step.tokens_per_s_per_gpu;
}

}  // namespace fsdp
