// A hardware JSON (and the same bytes as a cluster JSON): parsed, range-checked, and planned for
// tiny-llama on 8 of those GPUs.
#include <cstdint>
#include <string>

#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "core/model_spec.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp;
  static const ModelSpec tiny = (fuzz::UseSourceCatalog(), LoadModel("tiny-llama").value());
  auto json = ParseJson(std::string(reinterpret_cast<const char*>(data), size), "gpu.json");
  if (!json.ok()) return 0;
  if (auto cluster = ClusterFromJson(json.value(), "fuzz", "cluster.json"); cluster.ok()) {
    fuzz::Require(cluster.value().Gpus() >= 1 && cluster.value().Gpus() <= limits::kMaxGpus, "cluster GPU count in range");
  }
  auto hw = HardwareFromJson(json.value(), "fuzz", "gpu.json");
  if (!hw.ok()) return 0;
  FsdpConfig config;
  config.gpus = 8;
  config.seq_len = 256;
  auto w = BuildWorkload(tiny, hw.value(), config);
  if (w.ok()) fuzz::CheckPlan(w.value());
  return 0;
}
