// A HuggingFace config.json of any family: parsed and bounded, then planned on 8 H100s with its
// first 2 blocks (every figure but the layer count's linear scaling is exercised, at a tenth of the
// cost of planning 32 or 80 blocks per input).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

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
  ModelSpec shallow = std::move(model).value();  // not a copy: the full inventory may hold a million tensors
  shallow.num_layers = std::min<int64_t>(shallow.num_layers, 2);
  shallow.tensors = BuildInventory(shallow);
  if (shallow.tensors.size() > 5000) return 0;  // thousands of experts: parsed and bounded is enough
  FsdpConfig config;
  config.gpus = 8;
  auto w = BuildWorkload(shallow, h100, config);
  if (w.ok()) fuzz::CheckPlan(w.value());
  return 0;
}
