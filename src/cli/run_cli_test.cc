#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include "cli/run_cli.h"

namespace fsdp {
namespace {

TEST_CASE("CUDA device names map to the hardware catalog; unknown and look-alike GPUs are refused") {
  CHECK(HardwareIdForDevice("NVIDIA H200").value() == "h200-sxm");
  CHECK(HardwareIdForDevice("NVIDIA H100 80GB HBM3").value() == "h100-sxm");
  CHECK(HardwareIdForDevice("NVIDIA H100 PCIe").value() == "h100-pcie");
  CHECK(HardwareIdForDevice("NVIDIA A100-SXM4-80GB").value() == "a100-80gb-sxm");
  CHECK(HardwareIdForDevice("NVIDIA A100-SXM4-40GB").value() == "a100-40gb-sxm");
  CHECK(HardwareIdForDevice("NVIDIA A100 80GB PCIe").value() == "a100-80gb-pcie");
  CHECK(HardwareIdForDevice("NVIDIA GeForce RTX 4090").value() == "rtx-4090");
  for (const char* name : {"NVIDIA GH200 480GB", "NVIDIA H100 NVL", "Tesla V100-SXM2-16GB", "NVIDIA A100-PCIE-40GB"}) {
    auto id = HardwareIdForDevice(name);
    REQUIRE_FALSE(id.ok());
    CHECK(id.error().message.find("not in the hardware catalog") != std::string::npos);
  }
}

TEST_CASE("The largest peak over ranks travels exactly through the float collectives") {
  auto comm = runtime::MakeSingleComm();
  for (int64_t value : {int64_t{0}, int64_t{16777217}, int64_t{21474836481}, (int64_t{1} << 47) + 12345}) {
    CHECK(MaxOverRanks(*comm, value).value() == value);
  }
}

}  // namespace
}  // namespace fsdp
