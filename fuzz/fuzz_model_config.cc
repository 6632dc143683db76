// A HuggingFace config.json of any family: parsed, bounded, and (when small) planned on 8 H100s.
#include <cstdint>
#include <string>

#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "core/model_spec.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp;
  static const HardwareSpec h100 = (fuzz::UseSourceCatalog(), LoadHardware("h100-sxm").value());
  auto json = ParseJson(std::string(reinterpret_cast<const char*>(data), size), "config.json");
  if (!json.ok()) return 0;
  auto model = ModelFromHfConfig(json.value(), "fuzz", "config.json");
  if (!model.ok()) return 0;
  fuzz::Require(!model.value().tensors.empty() && static_cast<double>(model.value().tensors.size()) <= limits::kMaxTensors, "tensor bound holds");
  if (model.value().tensors.size() > 5000) return 0;  // parsed and bounded; planning it is the slow part
  FsdpConfig config;
  config.gpus = 8;
  auto w = BuildWorkload(model.value(), h100, config);
  if (w.ok()) fuzz::CheckPlan(w.value());
  return 0;
}
