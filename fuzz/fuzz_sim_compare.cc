// An fsdp-sim --json result as `fsdp-sim compare` reads it.
#include <cstdint>
#include <string>

#include "core/json_io.h"
#include "fuzz/fuzz_common.h"
#include "sim/sim_report.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp;
  auto json = ParseJson(std::string(reinterpret_cast<const char*>(data), size), "a.json");
  if (!json.ok()) return 0;
  auto summary = sim::SimSummaryFromJson(json.value(), "a.json");
  if (!summary.ok()) return 0;
  const std::string table = sim::CompareTable("a.json", summary.value(), "b.json", summary.value());
  fuzz::Require(table.find("nan") == std::string::npos && table.find("inf") == std::string::npos, "no nan or inf in the table");
  return 0;
}
