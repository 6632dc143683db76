#include "planner/collective_model.h"

#include <doctest/doctest.h>

#include <cmath>

#include "core/catalog.h"
#include "core/json_io.h"
#include "planner/validation.h"

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
  const auto rows = CompareNcclTests(doc.value());
  CHECK(rows.size() >= 40);
  CHECK(MeanAbsoluteError(rows) < 0.30);
}

TEST_CASE("published FSDP results: tokens/s per GPU within 15% on average") {
  // bench/accuracy_check prints the table quoted in docs/accuracy.md.
  auto doc = LoadJsonFile(DataDir() + "/docs/data/published_results.json");
  REQUIRE(doc.ok());
  const auto rows = ComparePublishedResults(doc.value());
  CHECK(rows.size() >= 16);
  CHECK(MeanAbsoluteError(rows) < 0.15);
}

TEST_CASE("measured collectives (fsdp-run calibrate) replace the model for the measured group size") {
  HardwareSpec hw = A100();
  hw.measured_collectives = {{2, 1000, 1e-5, 2e-5, 3e-5}, {2, 3000, 3e-5, 6e-5, 7e-5}};
  // halfway in size: halfway in time; beyond the last point: proportional to the size
  CHECK(EstimateCollective(Collective::kReduceScatter, 2000, {2, 2}, hw).time_s == doctest::Approx(4e-5));
  CHECK(EstimateCollective(Collective::kAllGather, 6000, {2, 2}, hw).time_s == doctest::Approx(6e-5));
  CHECK(EstimateCollective(Collective::kAllReduce, 10, {2, 2}, hw).time_s == doctest::Approx(3e-5));
  CHECK(EstimateCollective(Collective::kAllGather, 2000, {2, 2}, hw).algorithm == "measured");
  CHECK(EstimateCollective(Collective::kAllGather, 2000, {4, 4}, hw).algorithm != "measured");  // not measured for 4 ranks
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
