#include "cli/run_report.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "planner/plan_report.h"

namespace fsdp {
namespace {

std::string Figure(const std::optional<double>& v, int decimals) { return v ? fmt::format("{:.{}f}", *v, decimals) : "-"; }

double MiB(int64_t bytes) { return static_cast<double>(bytes) / kMiB; }

std::optional<double> MiBOf(const std::optional<int64_t>& bytes) {
  if (!bytes) return std::nullopt;
  return MiB(*bytes);
}

bool Predicts(const RunPrediction& p, MemCategory c) {
  for (MemCategory x : p.categories_compared) {
    if (x == c) return true;
  }
  return false;
}

ComparisonTable MemoryTable(const RunReport& r) {
  const RunMeasurement& m = r.measured;
  const RunPrediction& p = r.predicted;
  ComparisonTable t{"rank 0 at peak", "MiB", "predicted", 3, {}};
  for (MemCategory c : kRuntimeCategories) {
    t.rows.push_back({std::string(MemCategoryKey(c)), MiB(At(m.rank0.categories, c)),
                      Predicts(p, c) ? std::optional<double>(MiB(At(p.memory.categories, c))) : std::nullopt, ""});
  }
  t.rows.push_back({"peak", MiB(m.rank0.peak_bytes), MiB(p.memory.peak_bytes),
                    fmt::format("(measured at {}, predicted at {})", m.rank0.phase, p.memory.phase)});
  if (m.rank0_reserved_bytes) {
    const std::string range = p.reserved_lagging_bytes ? fmt::format("; predicted if the GPU keeps up with the host, {:.1f} if the host runs a step ahead",
                                                                      static_cast<double>(*p.reserved_lagging_bytes) / kMiB)
                                                       : "";
    t.rows.push_back({"peak reserved", MiBOf(m.rank0_reserved_bytes), MiBOf(p.reserved_bytes),
                      fmt::format("({} cudaMalloc calls{})", m.device_mallocs.value_or(0), range)});
  }
  t.rows.insert(t.rows.end(), r.extra_memory_rows.begin(), r.extra_memory_rows.end());
  return t;
}

ComparisonTable TimeTable(const RunReport& r) {
  ComparisonTable t{"step time", "s", "predicted", 4, {}};
  const double measured = r.measured.step_s;
  if (r.predicted.step_s) {
    t.rows.push_back({"step time", measured, r.predicted.step_s, fmt::format("({})", r.predicted.time_basis)});
  } else {
    t.rows.push_back({"step time", measured, std::nullopt, fmt::format("({})", r.predicted.no_time_note)});
  }
  if (r.predicted.sim_step_s) t.rows.push_back({"step time", measured, r.predicted.sim_step_s, "(fsdp-sim)"});
  t.rows.insert(t.rows.end(), r.extra_time_rows.begin(), r.extra_time_rows.end());
  return t;
}

double BusBandwidthGBs(Collective c, int64_t bytes, double seconds, int64_t group) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds * BusFactor(c, group) / kGB : 0.0;
}

double PerCallMB(int64_t bytes, int64_t count) { return static_cast<double>(bytes) / kMB / static_cast<double>(std::max<int64_t>(1, count)); }

void PrintComm(const RunReport& r, std::ostream& out) {
  const RunMeasurement& m = r.measured;
  const runtime::CommStats& s = m.shard;
  fmt::print(out, "  all-gathers {} x {:.3f} MB in {:.4f} s (busbw {:.2f} GB/s), reduce-scatters {} x {:.3f} MB in {:.4f} s (busbw {:.2f} GB/s){}\n",
             s.all_gather_count, PerCallMB(s.all_gather_bytes, s.all_gather_count), s.all_gather_s,
             BusBandwidthGBs(Collective::kAllGather, s.all_gather_bytes, s.all_gather_s, m.shard_group), s.reduce_scatter_count,
             PerCallMB(s.reduce_scatter_bytes, s.reduce_scatter_count), s.reduce_scatter_s,
             BusBandwidthGBs(Collective::kReduceScatter, s.reduce_scatter_bytes, s.reduce_scatter_s, m.shard_group),
             m.collectives_are_copies ? " (device copies standing in for collectives)" : "");
  const runtime::CommStats& a = m.replica;
  if (a.all_reduce_count > 0) {
    fmt::print(out, "  gradient all-reduces across {} replicas: {} x {:.3f} MB in {:.4f} s (busbw {:.2f} GB/s)\n", m.replica_group, a.all_reduce_count,
               PerCallMB(a.all_reduce_bytes, a.all_reduce_count), a.all_reduce_s,
               BusBandwidthGBs(Collective::kAllReduce, a.all_reduce_bytes, a.all_reduce_s, m.replica_group));
  }
  const RunPrediction& p = r.predicted;
  std::string predicted;
  auto add = [&](const char* what, const std::optional<double>& bytes) {
    if (bytes) predicted += fmt::format("{}{} {:.3f} MB", predicted.empty() ? "" : ", ", what, *bytes / kMB);
  };
  add("all-gathers", p.all_gather_bytes);
  add("reduce-scatters", p.reduce_scatter_bytes);
  add("all-reduces", p.all_reduce_bytes);
  if (!predicted.empty()) fmt::print(out, "  predicted collective bytes over the {} steps: {}\n", m.losses.size(), predicted);
}

Json OrNull(const std::optional<double>& v) { return v ? Json(*v) : Json(nullptr); }

Json CategoriesJson(const CategoryBytes& bytes, const std::vector<MemCategory>& categories) {
  Json j = Json::object();
  for (MemCategory c : categories) j[std::string(MemCategoryKey(c)) + "_bytes"] = At(bytes, c);
  return j;
}

Json PredictedJson(const RunReport& r) {
  const RunPrediction& p = r.predicted;
  Json time = {{"step_s", OrNull(p.step_s)}, {"sim_step_s", OrNull(p.sim_step_s)},
               {"tokens_per_s_per_gpu", p.step_s ? Json(r.TokensPerSecondPerGpu(*p.step_s)) : Json(nullptr)}};
  if (!p.step_s) time["note"] = p.no_time_note;
  Json j = {{"memory", {{"peak_bytes", p.memory.peak_bytes}, {"peak_phase", p.memory.phase}, {"categories", CategoriesJson(p.memory.categories, p.categories_compared)}}},
            {"time", time}};
  if (p.reserved_bytes) j["memory"]["reserved_peak_bytes"] = *p.reserved_bytes;
  if (p.reserved_lagging_bytes) j["memory"]["reserved_peak_lagging_bytes"] = *p.reserved_lagging_bytes;
  j.update(r.predicted_extra);
  return j;
}

Json MeasuredJson(const RunReport& r) {
  const RunMeasurement& m = r.measured;
  const std::vector<MemCategory> all(kRuntimeCategories.begin(), kRuntimeCategories.end());
  Json memory = {{"peak_bytes", m.peak_bytes}, {"rank0_peak_bytes", m.rank0.peak_bytes}, {"rank0_peak_phase", m.rank0.phase},
                 {"rank0_categories", CategoriesJson(m.rank0.categories, all)}};
  if (m.rank0_reserved_bytes) memory["rank0_peak_reserved_bytes"] = *m.rank0_reserved_bytes;
  memory.update(r.measured_memory_extra);
  Json time = {{"step_s", m.step_s}, {"steps_s", m.steps_s}, {"forward_s", m.forward_s}, {"backward_s", m.backward_s}, {"optimizer_s", m.optimizer_s}};
  if (m.host_waits_per_step) time["host_waits_per_step"] = *m.host_waits_per_step;
  const RunPrediction& p = r.predicted;
  Json comm = {{"shard", CommStatsJson(m.shard, m.shard_group)},
               {"replica", CommStatsJson(m.replica, m.replica_group)},
               {"predicted_all_gather_bytes", OrNull(p.all_gather_bytes)},
               {"predicted_reduce_scatter_bytes", OrNull(p.reduce_scatter_bytes)},
               {"predicted_all_reduce_bytes", OrNull(p.all_reduce_bytes)}};
  return Json{{"loss", m.losses}, {"loss_scaling", LossScalingJson(m.loss_scaler)}, {"memory", memory}, {"time", time},
              {"tokens_per_s_per_gpu", r.TokensPerSecondPerGpu(m.step_s)}, {"comm", comm}};
}

}  // namespace

double PercentError(double measured, double predicted) { return measured > 0 ? 100.0 * (predicted - measured) / measured : 0.0; }

double RunReport::TokensPerSecondPerGpu(double step_s) const {
  return step_s > 0 ? static_cast<double>(config.micro_batch * config.seq_len * config.grad_accum) / step_s : 0.0;
}

void PrintComparison(const ComparisonTable& t, std::ostream& out) {
  fmt::print(out, "  {:<22}{:>14}{:>16}{:>9}\n", t.title, fmt::format("measured {}", t.unit), fmt::format("{} {}", t.predicted_label, t.unit), "error");
  for (const ComparisonRow& row : t.rows) {
    const std::string error = row.measured && row.predicted && *row.measured > 0 ? fmt::format("{:.1f}%", PercentError(*row.measured, *row.predicted)) : "";
    fmt::print(out, "  {:<22}{:>14}{:>16}{:>9}{}{}\n", row.name, Figure(row.measured, t.decimals), Figure(row.predicted, t.decimals), error,
               row.note.empty() ? "" : "   ", row.note);
  }
}

void PrintRunReport(const RunReport& r, std::ostream& out) {
  const RunMeasurement& m = r.measured;
  const std::string where = r.device == "cpu" ? fmt::format("{} rank(s)", r.ranks)
                            : r.virtual_world > 0 ? fmt::format("{} (rank 0 of a virtual world of {} ranks)", r.device_name, r.world)
                                                  : fmt::format("{} ({} ranks)", r.device_name, r.ranks);
  // the CPU engine computes and communicates in fp32 whatever the configuration's dtypes
  const std::string dtypes = r.device == "cpu" ? "" : fmt::format(", {}/{}", DTypeName(r.config.param_dtype), DTypeName(r.config.reduce_dtype));
  fmt::print(out, "{} on {}, {}{}: losses", r.model, where, StrategyName(r.config.strategy), dtypes);
  for (double l : m.losses) fmt::print(out, " {:.6f}", l);
  fmt::print(out, "\n");
  PrintLossScaling(m.loss_scaler, out);
  fmt::print(out, "  step {:.4f} s ({}), {:.0f} tokens/s per GPU\n", m.step_s, m.step_basis, r.TokensPerSecondPerGpu(m.step_s));
  PrintComparison(MemoryTable(r), out);
  for (const ComparisonTable& t : r.extra_tables) PrintComparison(t, out);
  PrintComparison(TimeTable(r), out);
  fmt::print(out, "  time per step: forward {:.4f} s, backward {:.4f} s, optimizer {:.4f} s{}\n", m.forward_s, m.backward_s, m.optimizer_s,
             m.host_waits_per_step ? fmt::format(" (CUDA events); host waits per step: at most {}", *m.host_waits_per_step) : "");
  PrintComm(r, out);
}

Json RunReportJson(const RunReport& r) {
  Json doc = {{"model", r.model}, {"device", r.device}, {"hardware", r.hardware}, {"ranks", r.ranks}, {"virtual_world", r.virtual_world},
              {"config", ConfigToJson(r.config)}, {"inputs", r.inputs}, {"predicted", PredictedJson(r)}, {"measured", MeasuredJson(r)}};
  if (!r.device_name.empty()) doc["device_name"] = r.device_name;
  return doc;
}

Json CommStatsJson(const runtime::CommStats& cs, int64_t group) {
  auto busbw = [&](Collective c, int64_t bytes, double s) { return s > 0 ? bytes / s * BusFactor(c, group) : 0.0; };
  return Json{{"group_size", group},
              {"all_gather_bytes", cs.all_gather_bytes}, {"all_gather_count", cs.all_gather_count}, {"all_gather_s", cs.all_gather_s},
              {"all_gather_busbw_bytes_per_s", busbw(Collective::kAllGather, cs.all_gather_bytes, cs.all_gather_s)},
              {"reduce_scatter_bytes", cs.reduce_scatter_bytes}, {"reduce_scatter_count", cs.reduce_scatter_count},
              {"reduce_scatter_s", cs.reduce_scatter_s}, {"reduce_scatter_busbw_bytes_per_s", busbw(Collective::kReduceScatter, cs.reduce_scatter_bytes, cs.reduce_scatter_s)},
              {"all_reduce_bytes", cs.all_reduce_bytes}, {"all_reduce_count", cs.all_reduce_count}, {"all_reduce_s", cs.all_reduce_s},
              {"all_reduce_busbw_bytes_per_s", busbw(Collective::kAllReduce, cs.all_reduce_bytes, cs.all_reduce_s)}};
}

void PrintLossScaling(const runtime::LossScaler& scaler, std::ostream& out) {
  if (!scaler.enabled()) return;
  std::string skipped;
  for (int64_t s : scaler.skipped_steps()) skipped += fmt::format("{}{}", skipped.empty() ? "" : ", ", s + 1);
  fmt::print(out, "  loss scaling: dynamic, scale {:g} after {} steps, {}\n", scaler.scale(), scaler.steps(),
             skipped.empty() ? "no step skipped" : fmt::format("skipped steps {} (inf/NaN gradients)", skipped));
}

Json LossScalingJson(const runtime::LossScaler& scaler) {
  Json skipped = Json::array();
  for (int64_t s : scaler.skipped_steps()) skipped.push_back(s + 1);
  return Json{{"mode", std::string(runtime::LossScalingName(scaler.mode()))},
              {"final_scale", scaler.scale()},
              {"skipped_steps", skipped}};
}

}  // namespace fsdp
