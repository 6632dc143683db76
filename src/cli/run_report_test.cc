#include "cli/run_report.h"

#include <doctest/doctest.h>

#include <sstream>

namespace fsdp {
namespace {

// A report as an engine fills it: 2 shard groups of 2 ranks (HYBRID_SHARD over 4), 2 steps.
RunReport HandReport() {
  RunReport r;
  r.model = "hand";
  r.hardware = "cpu-test";
  r.ranks = 4;
  r.world = 4;
  r.config.micro_batch = 2;
  r.config.seq_len = 64;
  r.config.grad_accum = 3;
  RunMeasurement& m = r.measured;
  m.losses = {2.5, 2.25};
  m.steps_s = {0.5, 0.25};
  m.step_s = 0.375;
  m.step_basis = "mean of 2 steps";
  m.peak_bytes = 3 * int64_t{1} << 20;
  m.rank0 = {2 * int64_t{1} << 20, "backward: model.layers.1", {}};
  At(m.rank0.categories, MemCategory::kGradients) = int64_t{1} << 20;
  At(m.rank0.categories, MemCategory::kTemporaries) = int64_t{1} << 20;
  m.shard.all_gather_bytes = 1000;
  m.shard.all_gather_count = 4;
  m.shard.all_gather_s = 0.5;
  m.shard_group = 2;
  m.replica_group = 2;
  RunPrediction& p = r.predicted;
  p.memory = {int64_t{5} << 19, "backward: model.layers.1", {}};  // 2.5 MiB
  At(p.memory.categories, MemCategory::kGradients) = int64_t{5} << 19;
  p.categories_compared = {MemCategory::kGradients};
  p.step_s = 0.5;
  p.time_basis = "calibrated cpu-test";
  p.all_gather_bytes = 1000;
  return r;
}

TEST_CASE("the comparison table prints the error only where both figures are there and something was measured") {
  std::ostringstream out;
  PrintComparison({"rank 0 at peak", "MiB", "predicted", 2,
                   {{"gradients", 1.0, 1.25, ""}, {"temporaries", 0.5, std::nullopt, ""}, {"context", 0.0, 476.8, "(none)"}}},
                  out);
  const std::string text = out.str();
  CHECK(text.find("measured MiB") != std::string::npos);
  CHECK(text.find("  gradients                       1.00            1.25    25.0%\n") != std::string::npos);
  CHECK(text.find("  temporaries                     0.50               -         \n") != std::string::npos);
  CHECK(text.find("  context                         0.00          476.80            (none)\n") != std::string::npos);
  CHECK(PercentError(4.0, 3.0) == -25.0);
  CHECK(PercentError(0.0, 3.0) == 0.0);
}

TEST_CASE("one JSON writer: both groups' collectives, nulls where fsdp-plan predicts none, tokens per second from the step") {
  const Json j = RunReportJson(HandReport());
  CHECK(j["device"] == "cpu");
  CHECK_FALSE(j.contains("device_name"));
  const Json& m = j["measured"];
  CHECK(m["memory"]["peak_bytes"] == 3 * (int64_t{1} << 20));
  CHECK(m["memory"]["rank0_peak_bytes"] == 2 * (int64_t{1} << 20));
  CHECK(m["memory"]["rank0_categories"]["temporaries_bytes"] == int64_t{1} << 20);
  CHECK(m["memory"]["rank0_categories"].size() == kRuntimeCategories.size());
  CHECK_FALSE(m["memory"].contains("rank0_peak_reserved_bytes"));
  CHECK(m["comm"]["shard"]["group_size"] == 2);
  // busbw = 1000 bytes / 0.5 s * (2 - 1) / 2
  CHECK(m["comm"]["shard"]["all_gather_busbw_bytes_per_s"].get<double>() == 1000.0);
  CHECK(m["comm"]["predicted_all_gather_bytes"] == 1000.0);
  CHECK(m["comm"]["predicted_reduce_scatter_bytes"].is_null());
  CHECK(m["time"]["step_s"] == 0.375);
  CHECK_FALSE(m["time"].contains("host_waits_per_step"));
  // 2 x 64 x 3 tokens per rank per step
  CHECK(m["tokens_per_s_per_gpu"].get<double>() == doctest::Approx(384 / 0.375));
  const Json& p = j["predicted"];
  CHECK(p["memory"]["categories"].size() == 1);
  CHECK(p["memory"]["peak_phase"] == "backward: model.layers.1");
  CHECK(p["time"]["tokens_per_s_per_gpu"].get<double>() == doctest::Approx(384 / 0.5));
  CHECK(p["time"]["sim_step_s"].is_null());
}

TEST_CASE("the text report: memory rows for every category, predicted ones only where modelled, and the collectives") {
  std::ostringstream out;
  PrintRunReport(HandReport(), out);
  const std::string text = out.str();
  CHECK(text.find("hand on 4 rank(s), FULL_SHARD: losses 2.500000 2.250000\n") == 0);
  CHECK(text.find("  step 0.3750 s (mean of 2 steps), 1024 tokens/s per GPU\n") != std::string::npos);
  CHECK(text.find("  gradients                      1.000           2.500   150.0%\n") != std::string::npos);
  CHECK(text.find("  temporaries                    1.000               -         \n") != std::string::npos);
  CHECK(text.find("  peak                           2.000           2.500    25.0%   (measured at backward: model.layers.1, predicted at backward: model.layers.1)\n") !=
        std::string::npos);
  CHECK(text.find("  step time                     0.3750          0.5000    33.3%   (calibrated cpu-test)\n") != std::string::npos);
  CHECK(text.find("  all-gathers 4 x 0.000 MB in 0.5000 s (busbw 0.00 GB/s)") != std::string::npos);
  CHECK(text.find("predicted collective bytes over the 2 steps: all-gathers 0.001 MB\n") != std::string::npos);
  CHECK(text.find("gradient all-reduces") == std::string::npos);  // none ran
}

}  // namespace
}  // namespace fsdp
