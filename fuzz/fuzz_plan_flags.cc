// fsdp-plan's command line: one argument per input line, parsed by the tool's own flag table and
// run; an accepted plan's text may not show nan or inf. A crash found with the shared table is
// rerun alone (a fresh process builds it anew), so no state carried between inputs can hide one.
#include <cstdint>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "cli/plan_cli.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp;
  static const bool ready = (fuzz::UseSourceCatalog(), true);
  (void)ready;
  std::vector<std::string> args = {"fsdp-plan"};
  std::string arg;
  for (size_t i = 0; i < size && args.size() < 40; ++i) {
    if (data[i] == '\n') { args.push_back(arg); arg.clear(); } else { arg += static_cast<char>(data[i]); }
  }
  if (!arg.empty()) args.push_back(arg);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  // One flag table for every input (building CLI11's ~100 options took a third of an execution):
  // its results are cleared and the flags it writes back to their defaults before each parse.
  static PlanFlags flags;
  static CLI::App app;
  static const bool table = (AddPlanFlags(app, flags), true);
  (void)table;
  flags = PlanFlags{};
  app.clear();
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;
  }
  FinishPlanFlags(app, flags);
  if (flags.model.empty() || flags.timeline) return 0;  // the default scenario is fixed; timelines are long
  std::ostringstream out;
  if (!RunPlan(flags, out).ok()) return 0;
  static const std::regex bad(R"(\b-?(nan|inf)\b)");
  fuzz::Require(!std::regex_search(out.str(), bad), "no nan or inf in an accepted plan");
  return 0;
}
