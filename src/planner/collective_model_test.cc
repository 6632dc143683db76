#include "planner/collective_model.h"

#include <doctest/doctest.h>

#include <cmath>

#include "core/catalog.h"
#include "core/json_io.h"

namespace fsdp {
namespace {

HardwareSpec A100() {
  auto hw = LoadHardware("a100-80gb-sxm");
  REQUIRE(hw.ok());
  return hw.value();
}

TEST_CASE("nccl-tests bus-bandwidth factors") {
  CHECK(BusFactor(Collective::kAllGather, 8) == doctest::Approx(7.0 / 8));
  CHECK(BusFactor(Collective::kReduceScatter, 3) == doctest::Approx(2.0 / 3));
  CHECK(BusFactor(Collective::kAllReduce, 8) == doctest::Approx(14.0 / 8));
  CHECK(BusFactor(Collective::kAllReduce, 1) == 0.0);
}

TEST_CASE("one rank or zero bytes costs nothing") {
  CHECK(EstimateCollective(Collective::kAllGather, 1 << 30, {1, 1}, A100()).time_s == 0.0);
  CHECK(EstimateCollective(Collective::kAllGather, 0, {8, 8}, A100()).time_s == 0.0);
}

TEST_CASE("1 GiB all-gather on 8 A100s: NCCL ring latency plus bytes over the saturated NVLink bandwidth") {
  // Simple protocol: latency 8.4 + 7 x 3.4 us (tuning.cc); bus bytes 1 GiB x 7/8 over
  // 300 GB/s x 0.80 x S / (S + 6 MiB).
  const double size = 1 << 30;
  const double expected = (8.4 + 7 * 3.4) * 1e-6 + size * 7 / 8 / (300e9 * 0.80 * size / (size + 6.0 * (1 << 20)));
  CollectiveEstimate e = EstimateCollective(Collective::kAllGather, 1 << 30, {8, 8}, A100());
  CHECK(e.algorithm == "ring");
  CHECK(e.protocol == "Simple");
  CHECK(e.time_s == doctest::Approx(expected).epsilon(1e-9));
  CHECK(e.algbw_bytes_per_s == doctest::Approx(size / expected));
  CHECK(e.busbw_bytes_per_s == doctest::Approx(size / expected * 7 / 8));
}

TEST_CASE("small messages pick a low-latency protocol, large ones Simple") {
  CHECK(EstimateCollective(Collective::kAllGather, 64 << 10, {8, 8}, A100()).protocol != "Simple");
  CHECK(EstimateCollective(Collective::kAllGather, 1LL << 32, {8, 8}, A100()).protocol == "Simple");
}

TEST_CASE("crossing nodes: the NICs become the bottleneck, and all-reduce may use the tree") {
  HardwareSpec hw = A100();
  CollectiveEstimate intra = EstimateCollective(Collective::kAllGather, 1 << 30, {8, 8}, hw);
  CollectiveEstimate inter = EstimateCollective(Collective::kAllGather, 1 << 30, {16, 8}, hw);
  CHECK(inter.busbw_bytes_per_s < intra.busbw_bytes_per_s);
  // one GPU per node (HYBRID_SHARD replicas): bounded by that GPU's own NIC share
  CollectiveEstimate replicas = EstimateCollective(Collective::kAllReduce, 1 << 30, {4, 1}, hw);
  CHECK(replicas.busbw_bytes_per_s <= hw.inter_node_bandwidth_per_gpu_bytes_per_s * 1.0001 * 2 * 3 / 4);
}

TEST_CASE("NVLS all-reduce on an H100 NVSwitch node beats the ring at large sizes") {
  auto h100 = LoadHardware("h100-sxm");
  REQUIRE(h100.ok());
  CollectiveEstimate e = EstimateCollective(Collective::kAllReduce, 1LL << 30, {8, 8}, h100.value());
  CHECK(e.algorithm == "nvls");
  auto pcie = LoadHardware("rtx-4090");  // no NVLink: PCIe
  REQUIRE(pcie.ok());
  CHECK(EstimateCollective(Collective::kAllReduce, 1LL << 30, {4, 4}, pcie.value()).busbw_bytes_per_s < 31.5e9);
}

TEST_CASE("published nccl-tests results: mean absolute busbw error stays under 30%") {
  // The same comparison bench/collective_check prints row by row (docs/time-model.md).
  auto doc = LoadJsonFile(DataDir() + "/docs/data/nccl_reference.json");
  REQUIRE(doc.ok());
  struct Platform { const char* match; const char* gpu; double nic; };
  const Platform platforms[] = {{"DGX H100", "h100-sxm", 50e9}, {"8 H100, NVLink", "h100-sxm", 50e9}, {"p5.48xlarge", "h100-sxm", 50e9},
                                {"GCP A3", "h100-sxm", 25e9}, {"RoCE", "h100-sxm", 50e9}, {"ND96asr_v4", "a100-40gb-sxm", 25e9},
                                {"ND96amsr", "a100-80gb-sxm", 25e9}, {"p4de", "a100-80gb-sxm", 6.25e9}, {"OCI", "a100-40gb-sxm", 25e9}};
  double sum = 0;
  int n = 0;
  for (const auto& p : doc.value()["nccl_tests_results"]) {
    const std::string text = p["gpu"].get<std::string>();
    for (const auto& pl : platforms) {
      if (text.find(pl.match) == std::string::npos) continue;
      HardwareSpec hw = LoadHardware(pl.gpu).value();
      hw.inter_node_bandwidth_per_gpu_bytes_per_s = pl.nic;
      const int64_t ranks = p["gpus"].get<int64_t>(), nodes = p["nodes"].get<int64_t>();
      const Collective c = p["collective"] == "all_gather" ? Collective::kAllGather : Collective::kAllReduce;
      const double model = EstimateCollective(c, p["size_bytes"].get<int64_t>(), {ranks, ranks / nodes}, hw).busbw_bytes_per_s / 1e9;
      sum += std::fabs(model / p["busbw_GBps"].get<double>() - 1.0);
      ++n;
      break;
    }
  }
  CHECK(n >= 40);
  CHECK(sum / n < 0.30);
}

TEST_CASE("host copies over PCIe") {
  HardwareSpec hw = A100();
  CHECK(HostCopySeconds(0, hw) == 0.0);
  const double s = HostCopySeconds(1 << 30, hw);
  CHECK(s > (1 << 30) / 31.5e9);
  CHECK(s < 2.0 * (1 << 30) / 31.5e9);
}

}  // namespace
}  // namespace fsdp
