#include "core/hardware_spec.h"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "core/catalog.h"
#include "core/json_io.h"

namespace fsdp {
namespace {

Status ReadLinks(const JsonReader& r, HardwareSpec& hw) {
  auto link = r.Object("intra_node_link");
  if (!link.ok()) return link.error();
  FSDP_ASSIGN(hw.intra_node_link, link.value().String("type"));
  FSDP_ASSIGN(hw.intra_node_bandwidth_bytes_per_s, link.value().NumberIn("bandwidth_bytes_per_s", {0, limits::kBytesPerS.max, "bytes/s"}));
  auto switched = link.value().OptionalBool("switched");
  if (!switched.ok()) return switched.error();
  hw.intra_node_switched = switched.value().value_or(false);
  // a real link needs a real bandwidth; "none" (one GPU per node) may say 0
  if (hw.intra_node_link != "none") FSDP_ASSIGN(hw.intra_node_bandwidth_bytes_per_s, link.value().NumberIn("bandwidth_bytes_per_s", limits::kBytesPerS));
  auto pcie = r.Object("pcie");
  if (!pcie.ok()) return pcie.error();
  int64_t generation = 0;
  FSDP_ASSIGN(generation, pcie.value().IntIn("generation", 1, 100));
  hw.pcie_generation = static_cast<int>(generation);
  FSDP_ASSIGN(hw.pcie_bandwidth_bytes_per_s, pcie.value().NumberIn("bandwidth_bytes_per_s", limits::kBytesPerS));
  auto node = r.Object("node");
  if (!node.ok()) return node.error();
  FSDP_ASSIGN(hw.gpus_per_node, node.value().IntIn("gpus_per_node", 1, limits::kMaxGpus));
  FSDP_ASSIGN(hw.inter_node_bandwidth_per_gpu_bytes_per_s, node.value().NumberIn("inter_node_bandwidth_per_gpu_bytes_per_s", limits::kBytesPerS));
  FSDP_ASSIGN(hw.inter_node_latency_s, node.value().NumberIn("inter_node_latency_s", limits::kLatencyS));
  return {};
}

Status ReadMeasuredCollectives(const JsonReader& r, HardwareSpec& hw) {
  auto it = r.json().find("measured_collectives");
  if (it == r.json().end()) return {};
  if (!it->is_array()) return r.KeyError("measured_collectives", "expected an array");
  for (const auto& row : *it) {
    if (!row.is_object()) return r.KeyError("measured_collectives", "expected objects");
    JsonReader rr(row, r.origin() + ": measured_collectives");
    HardwareSpec::MeasuredCollective m;
    FSDP_ASSIGN(m.ranks, rr.IntIn("ranks", 2, limits::kMaxGpus));
    FSDP_ASSIGN(m.bytes, rr.IntIn("bytes", 1, static_cast<int64_t>(limits::kDeviceBytes.max)));
    FSDP_ASSIGN(m.all_gather_s, rr.NumberIn("all_gather_s", limits::kMeasuredSeconds));
    FSDP_ASSIGN(m.reduce_scatter_s, rr.NumberIn("reduce_scatter_s", limits::kMeasuredSeconds));
    FSDP_ASSIGN(m.all_reduce_s, rr.NumberIn("all_reduce_s", limits::kMeasuredSeconds));
    hw.measured_collectives.push_back(m);
  }
  std::sort(hw.measured_collectives.begin(), hw.measured_collectives.end(),
            [](const auto& a, const auto& b) { return a.bytes < b.bytes; });
  return {};
}

}  // namespace

double HardwareSpec::PeakFlops(DType dtype) const {
  switch (dtype) {
    case DType::kBf16: return peak_flops_bf16;
    case DType::kFp16: return peak_flops_fp16;
    case DType::kFp32: return peak_flops_fp32;
  }
  return 0;
}

Result<HardwareSpec> HardwareFromJson(const Json& json, const std::string& id, const std::string& origin) {
  if (!json.is_object()) return Error::BadInput(fmt::format("{}: expected a JSON object describing a GPU", origin));
  JsonReader r(json, origin);
  HardwareSpec hw;
  auto json_id = r.OptionalString("id");
  if (!json_id.ok()) return json_id.error();
  hw.id = json_id.value().value_or(id);
  FSDP_ASSIGN(hw.name, r.String("name"));
  auto vendor = r.OptionalString("vendor");
  if (!vendor.ok()) return vendor.error();
  hw.vendor = vendor.value().value_or("");
  auto arch = r.OptionalString("architecture");
  if (!arch.ok()) return arch.error();
  hw.architecture = arch.value().value_or("");
  double memory = 0;
  FSDP_ASSIGN(memory, r.NumberIn("memory_bytes", limits::kDeviceBytes));
  hw.memory_bytes = static_cast<int64_t>(memory);
  auto cuda_total = r.OptionalNumber("cuda_total_bytes");
  if (!cuda_total.ok()) return cuda_total.error();
  if (cuda_total.value()) {
    if (*cuda_total.value() < limits::kDeviceBytes.min || *cuda_total.value() > memory)
      return r.KeyError("cuda_total_bytes", fmt::format("must be between {:.0f} and memory_bytes ({:.0f}) bytes, got {:.0f}", limits::kDeviceBytes.min, memory,
                                                        *cuda_total.value()));
    hw.cuda_total_bytes = static_cast<int64_t>(*cuda_total.value());
  }
  auto flops = r.Object("peak_flops");
  if (!flops.ok()) return flops.error();
  FSDP_ASSIGN(hw.peak_flops_bf16, flops.value().NumberIn("bf16", limits::kFlopsPerS));
  FSDP_ASSIGN(hw.peak_flops_fp16, flops.value().NumberIn("fp16", limits::kFlopsPerS));
  FSDP_ASSIGN(hw.peak_flops_fp32, flops.value().NumberIn("fp32", limits::kFlopsPerS));
  FSDP_ASSIGN(hw.memory_bandwidth_bytes_per_s, r.NumberIn("memory_bandwidth_bytes_per_s", limits::kBytesPerS));
  if (Status s = ReadLinks(r, hw); !s.ok()) return s.error();
  double context = 0;
  FSDP_ASSIGN(context, r.NumberIn("cuda_context_bytes", limits::kOverheadBytes));
  hw.cuda_context_bytes = static_cast<int64_t>(context);
  if (r.json().contains("price_per_gpu_hour_usd") && !r.json()["price_per_gpu_hour_usd"].is_null()) {
    FSDP_ASSIGN(hw.price_per_gpu_hour_usd, r.NumberIn("price_per_gpu_hour_usd", limits::kUsdPerGpuHour));
  }
  auto eff = r.Object("efficiency");
  if (!eff.ok()) return eff.error();
  FSDP_ASSIGN(hw.matmul_efficiency, eff.value().NumberIn("matmul", limits::kShare));
  FSDP_ASSIGN(hw.memory_efficiency, eff.value().NumberIn("memory_bandwidth", limits::kShare));
  auto attention = eff.value().OptionalNumber("attention");
  if (!attention.ok()) return attention.error();
  hw.attention_efficiency = attention.value().value_or(0.0);
  if (hw.attention_efficiency < 0 || hw.attention_efficiency > 1) return eff.value().KeyError("attention", "an efficiency is a share of the peak, between 0 and 1");
  if (Status s = ReadMeasuredCollectives(r, hw); !s.ok()) return s.error();
  return hw;
}

Result<HardwareSpec> LoadHardware(const std::string& id_or_path) {
  auto path = ResolveCatalogPath("hardware", "GPU", id_or_path);
  if (!path.ok()) return path.error();
  auto json = LoadJsonFile(path.value());
  if (!json.ok()) return json.error();
  return HardwareFromJson(json.value(), std::filesystem::path(path.value()).stem().string(), path.value());
}

Result<ClusterSpec> ClusterFromJson(const Json& json, const std::string& id, const std::string& origin) {
  if (!json.is_object()) return Error::BadInput(fmt::format("{}: expected a JSON object describing a cluster", origin));
  JsonReader r(json, origin);
  ClusterSpec c;
  c.id = id;
  FSDP_ASSIGN(c.gpu, r.String("gpu"));
  FSDP_ASSIGN(c.gpus_per_node, r.IntIn("gpus_per_node", 1, limits::kMaxGpus));
  FSDP_ASSIGN(c.nodes, r.IntIn("nodes", 1, limits::kMaxGpus));
  if (c.nodes > limits::kMaxGpus / c.gpus_per_node) {
    return Error::BadInput(fmt::format("{}: nodes {} x gpus_per_node {} is more than {} GPUs", origin, c.nodes, c.gpus_per_node, limits::kMaxGpus));
  }
  FSDP_ASSIGN(c.inter_node_bandwidth_per_gpu_bytes_per_s, r.NumberIn("inter_node_bandwidth_per_gpu_bytes_per_s", limits::kBytesPerS));
  FSDP_ASSIGN(c.inter_node_latency_s, r.NumberIn("inter_node_latency_s", limits::kLatencyS));
  return c;
}

Result<ClusterSpec> LoadCluster(const std::string& id_or_path) {
  auto path = ResolveCatalogPath("hardware/clusters", "cluster", id_or_path);
  if (!path.ok()) return path.error();
  auto json = LoadJsonFile(path.value());
  if (!json.ok()) return json.error();
  return ClusterFromJson(json.value(), std::filesystem::path(path.value()).stem().string(), path.value());
}

void ApplyCluster(const ClusterSpec& cluster, HardwareSpec& hw) {
  hw.gpus_per_node = cluster.gpus_per_node;
  hw.inter_node_bandwidth_per_gpu_bytes_per_s = cluster.inter_node_bandwidth_per_gpu_bytes_per_s;
  hw.inter_node_latency_s = cluster.inter_node_latency_s;
}

}  // namespace fsdp
