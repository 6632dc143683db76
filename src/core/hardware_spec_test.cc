#include "core/hardware_spec.h"

#include <algorithm>

#include <doctest/doctest.h>

#include "core/catalog.h"
#include "core/json_io.h"

namespace fsdp {
namespace {

TEST_CASE("every catalog GPU loads with positive figures") {
  const char* ids[] = {"rtx-3090", "rtx-4090", "rtx-a6000", "l40s", "a100-40gb-sxm", "a100-80gb-sxm",
                       "a100-80gb-pcie", "h100-sxm", "h100-pcie", "h200-sxm", "b200", "mi300x"};
  for (const char* id : ids) {
    CAPTURE(id);
    auto hw = LoadHardware(id);
    REQUIRE_MESSAGE(hw.ok(), (hw.ok() ? "" : hw.error().message));
    CHECK(hw.value().id == id);
    CHECK(hw.value().memory_bytes > 16LL << 30);
    CHECK(hw.value().peak_flops_bf16 > hw.value().peak_flops_fp32);
    CHECK(hw.value().memory_bandwidth_bytes_per_s > 5e11);
    CHECK(hw.value().pcie_bandwidth_bytes_per_s > 1e10);
    CHECK(hw.value().gpus_per_node >= 1);
    CHECK(hw.value().price_per_gpu_hour_usd > 0);
  }
  auto h100 = LoadHardware("h100-sxm").value();
  CHECK(h100.memory_bytes == 81559LL * 1024 * 1024);
  CHECK(h100.peak_flops_bf16 == doctest::Approx(989.4e12));
  CHECK(h100.intra_node_switched);
  CHECK(h100.intra_node_bandwidth_bytes_per_s == doctest::Approx(450e9));
  CHECK(h100.gpus_per_node == 8);
}

TEST_CASE("an unlisted card loads by its id and stays out of the catalog recommend searches") {
  auto h96 = LoadHardware("h100-96gb");  // hardware/unlisted/h100-96gb.json
  REQUIRE_MESSAGE(h96.ok(), (h96.ok() ? "" : h96.error().message));
  CHECK(h96.value().DeviceTotalBytes() == int64_t{95} << 30);  // torchtitan's "95.00GiB" capacity
  CHECK(h96.value().price_per_gpu_hour_usd == 0);
  const auto ids = ListCatalogIds("hardware");
  CHECK(std::find(ids.begin(), ids.end(), "h100-96gb") == ids.end());
  CHECK(std::find(ids.begin(), ids.end(), "h100-sxm") != ids.end());
}

Result<HardwareSpec> FromText(const std::string& text) {
  auto json = ParseJson(text, "gpu.json");
  REQUIRE(json.ok());
  return HardwareFromJson(json.value(), "gpu", "gpu.json");
}

TEST_CASE("bad hardware files name the key") {
  const std::string good_links =
      R"("intra_node_link": {"type": "none", "bandwidth_bytes_per_s": 0}, "pcie": {"generation": 4, "bandwidth_bytes_per_s": 31.5e9},)"
      R"("node": {"gpus_per_node": 8, "inter_node_bandwidth_per_gpu_bytes_per_s": 1e9, "inter_node_latency_s": 1e-5}, "cuda_context_bytes": 0,)"
      R"("efficiency": {"matmul": 0.7, "memory_bandwidth": 0.8})";
  auto ok = FromText(R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14, "fp16": 1e14, "fp32": 1e13}, "memory_bandwidth_bytes_per_s": 1e12, )" + good_links + "}");
  CHECK_MESSAGE(ok.ok(), (ok.ok() ? "" : ok.error().message));

  auto negative = FromText(R"({"name": "x", "memory_bytes": -5, "peak_flops": {}, )" + good_links + "}");
  REQUIRE_FALSE(negative.ok());
  CHECK(negative.error().message == "gpu.json: key 'memory_bytes': must be between 1.05e+06 and 1.13e+15 bytes, got -5");
  // 1e19 bytes once wrapped to a card of -8589934592 GiB that "fit"
  auto huge = FromText(R"({"name": "x", "memory_bytes": 1e19, "peak_flops": {}, )" + good_links + "}");
  CHECK(huge.error().message == "gpu.json: key 'memory_bytes': must be between 1.05e+06 and 1.13e+15 bytes, got 1e+19");
  // a rate so small that a step would take longer than the simulator's clock holds
  auto slow = FromText(R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e-3, "fp16": 1e14, "fp32": 1e13}, )" + good_links + "}");
  CHECK(slow.error().message == "gpu.json: peak_flops: key 'bf16': must be between 1e+09 and 1e+18 FLOP/s, got 0.001");

  // CUDA's own total: optional, at most nvidia-smi's, and what "fits" is judged on
  const std::string card = R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14, "fp16": 1e14, "fp32": 1e13}, "memory_bandwidth_bytes_per_s": 1e12, )";
  CHECK(ok.value().cuda_total_bytes == 0);
  CHECK(ok.value().DeviceTotalBytes() == 10000000000);
  auto cuda_total = FromText(card + R"("cuda_total_bytes": 9.5e9, )" + good_links + "}");
  REQUIRE(cuda_total.ok());
  CHECK(cuda_total.value().DeviceTotalBytes() == 9500000000);
  CHECK(cuda_total.value().memory_bytes == 10000000000);
  auto above = FromText(card + R"("cuda_total_bytes": 1.1e10, )" + good_links + "}");
  REQUIRE_FALSE(above.ok());
  CHECK(above.error().message == "gpu.json: key 'cuda_total_bytes': must be between 1048576 and memory_bytes (10000000000) bytes, got 11000000000");
  auto text = FromText(card + R"("cuda_total_bytes": "lots", )" + good_links + "}");
  REQUIRE_FALSE(text.ok());
  CHECK(text.error().message.find("cuda_total_bytes") != std::string::npos);

  auto no_fp32 = FromText(R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14, "fp16": 1e14}, )" + good_links + "}");
  REQUIRE_FALSE(no_fp32.ok());
  CHECK(no_fp32.error().message == "gpu.json: peak_flops: key 'fp32': missing");

  auto zero_link = FromText(R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14, "fp16": 1e14, "fp32": 1e13}, "memory_bandwidth_bytes_per_s": 1e12, "intra_node_link": {"type": "nvlink4", "bandwidth_bytes_per_s": 0}})");
  REQUIRE_FALSE(zero_link.ok());
  CHECK(zero_link.error().message == "gpu.json: intra_node_link: key 'bandwidth_bytes_per_s': must be between 1e+06 and 1e+15 bytes/s, got 0");

  auto over = FromText(R"({"name": "x", "memory_bytes": 1e10, "peak_flops": {"bf16": 1e14, "fp16": 1e14, "fp32": 1e13}, "memory_bandwidth_bytes_per_s": 1e12, )" +
                       good_links.substr(0, good_links.find("\"efficiency\"")) + R"("efficiency": {"matmul": 1.5, "memory_bandwidth": 0.8}})");
  REQUIRE_FALSE(over.ok());
  CHECK(over.error().message == "gpu.json: efficiency: key 'matmul': must be between 1e-06 and 1, got 1.5");

  auto unknown = LoadHardware("h100");
  REQUIRE_FALSE(unknown.ok());
  CHECK(unknown.error().message.starts_with("unknown GPU 'h100' (did you mean h100-sxm, h100-pcie"));
}

}  // namespace
}  // namespace fsdp
