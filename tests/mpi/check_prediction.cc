// check_prediction results.json [--exact-categories]: exit 0 when fsdp-run's measured rank-0 peak is
// within 3% of the planner's prediction for its engine, the collective bytes match the prediction
// exactly and the inputs (default seed and learning rate, no checkpoint, no token file) are
// recorded; with --exact-categories, every category the prediction has equals rank 0's at its peak
// to the byte.
#include <cmath>
#include <cstdio>
#include <string>

#include "core/json_io.h"

int main(int argc, char** argv) {
  const bool exact = argc == 3 && std::string(argv[2]) == "--exact-categories";
  if (argc != 2 && !exact) { std::fprintf(stderr, "usage: check_prediction results.json [--exact-categories]\n"); return 2; }
  auto doc = fsdp::LoadJsonFile(argv[1]);
  if (!doc.ok()) { std::fprintf(stderr, "%s\n", doc.error().message.c_str()); return 2; }
  const auto& j = doc.value();
  const double measured = j["measured"]["memory"]["rank0_peak_bytes"].get<double>();
  const double predicted = j["predicted"]["memory"]["peak_bytes"].get<double>();
  const double error = std::fabs(predicted - measured) / measured;
  const auto& c = j["measured"]["comm"];
  const double ag = c["shard"]["all_gather_bytes"].get<double>(), ag_pred = c["predicted_all_gather_bytes"].get<double>();
  const double rs = c["shard"]["reduce_scatter_bytes"].get<double>(), rs_pred = c["predicted_reduce_scatter_bytes"].get<double>();
  std::printf("peak measured %.0f predicted %.0f (%.2f%%); all-gather %.0f vs %.0f; reduce-scatter %.0f vs %.0f bytes\n", measured, predicted,
              100 * error, ag, ag_pred, rs, rs_pred);
  if (error > 0.03) { std::fprintf(stderr, "peak memory off by %.2f%% (> 3%%)\n", 100 * error); return 1; }
  if (ag != ag_pred || rs != rs_pred) { std::fprintf(stderr, "collective bytes differ from the prediction\n"); return 1; }
  for (const auto& [name, bytes] : j["predicted"]["memory"]["categories"].items()) {
    const auto& got = j["measured"]["memory"]["rank0_categories"][name];
    if (exact && got != bytes) {
      std::fprintf(stderr, "%s: measured %s, predicted %s\n", name.c_str(), got.dump().c_str(), bytes.dump().c_str());
      return 1;
    }
  }
  const auto& in = j["inputs"];  // seeded weights and tokens unless told otherwise
  if (!in.is_object() || !in["init_from"].is_null() || !in["tokens"].is_null() || in["seed"] != 1 || in["lr"] != 0.001) {
    std::fprintf(stderr, "inputs not recorded as {init_from: null, tokens: null, seed: 1, lr: 0.001}: %s\n", in.dump().c_str());
    return 1;
  }
  return 0;
}
