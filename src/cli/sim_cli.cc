#include "cli/sim_cli.h"

#include <cmath>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "cli/cli_util.h"
#include "core/json_io.h"
#include "sim/sim_report.h"
#include "core/vocabulary.h"

namespace fsdp {
namespace {

Status ParseSlowRanks(const std::vector<std::string>& specs, std::map<int64_t, double>& out) {
  for (const auto& s : specs) {
    auto eq = s.find('=');
    char* end = nullptr;
    const long long rank = eq == std::string::npos ? -1 : std::strtoll(s.c_str(), &end, 10);
    if (eq == std::string::npos || end != s.c_str() + eq) return Error::BadInput(fmt::format("--slow-rank expects RANK=FACTOR (e.g. 3=1.1), got '{}'", s));
    const double factor = std::strtod(s.c_str() + eq + 1, &end);
    if (*end != '\0' || end == s.c_str() + eq + 1) return Error::BadInput(fmt::format("--slow-rank expects RANK=FACTOR (e.g. 3=1.1), got '{}'", s));
    out[rank] = factor;
  }
  return {};
}

Result<sim::SimResult> SimulateFlags(const SimFlags& f) {
  auto w = WorkloadFromFlags(f.plan);
  if (!w.ok()) return w.error();
  sim::SimOptions o = f.options;
  if (f.per_rank) o.ranks = w.value().config.gpus;
  if (Status s = ParseSlowRanks(f.slow_ranks, o.slow_ranks); !s.ok()) return s.error();
  return sim::Simulate(w.value(), o);
}

void PrintSummary(const Workload& w, const sim::SimResult& r, std::ostream& out) {
  fmt::print(out, "{} on {} x {}, {}: simulated step {:.2f} ms\n", w.model.id, w.config.gpus, w.hardware.id, StrategyName(w.config.strategy),
             r.step_s * 1e3);
  fmt::print(out, "  compute {:.2f} ms, communication busy {:.2f} ms, exposed {:.2f} ms, overlap {:.1f}%, CPU blocked {:.2f} ms\n",
             r.compute_s * 1e3, r.comm_s * 1e3, r.exposed_comm_s * 1e3, r.overlap_pct, r.cpu_blocked_s * 1e3);
  for (size_t s = 0; s < r.stream_names.size(); ++s) fmt::print(out, "  {:<24} {:5.1f}% busy\n", r.stream_names[s], 100 * r.stream_utilization[s]);
  fmt::print(out, "  peak memory {:.2f} GiB of {:.2f} GiB (reserved + context + NCCL); tensors {:.2f} GiB at {:.2f} ms ({})\n",
             r.peak_bytes / kGiB, r.capacity_bytes / kGiB, r.allocated_peak_bytes / kGiB, r.peak_time_s * 1e3, r.peak_phase);
  fmt::print(out, "  caching allocator: {}\n", sim::AllocatorSummary(r));
  fmt::print(out, "  {} events in {:.1f} ms\n", r.events, r.wall_s * 1e3);
}

// Applies one what-if parameter value to the flags.
Status Apply(const std::string& param, const std::string& value, SimFlags& f) {
  char* end = nullptr;
  const double number = std::strtod(value.c_str(), &end);
  const bool numeric = end != value.c_str() && *end == '\0';
  auto need_number = [&]() -> Status {
    if (!numeric || !(number > 0)) return Error::BadInput(fmt::format("--vary {}: '{}' is not a positive number", param, value));
    return {};
  };
  // gpus, micro-batch, seq-len: a whole number an int64 holds (the config's own range check follows)
  auto need_count = [&]() -> Status {
    if (!numeric || !(number >= 1 && number <= 1e12) || number != std::floor(number)) {
      return Error::BadInput(fmt::format("--vary {}: '{}' is not a whole number between 1 and 1e12", param, value));
    }
    return {};
  };
  if (param == "bandwidth") {
    if (Status s = need_number(); !s.ok()) return s;
    f.options.bandwidth_override = number;
  } else if (param == "gpus") {
    if (Status s = need_count(); !s.ok()) return s;
    f.plan.config.gpus = static_cast<int64_t>(number);
  } else if (param == "micro-batch") {
    if (Status s = need_count(); !s.ok()) return s;
    f.plan.config.micro_batch = static_cast<int64_t>(number);
  } else if (param == "seq-len") {
    if (Status s = need_count(); !s.ok()) return s;
    f.plan.config.seq_len = static_cast<int64_t>(number);
  } else if (param == "strategy") {
    f.plan.strategy = value;
  } else if (param == "prefetch") {
    f.plan.backward_prefetch = value;
  } else if (param == "limit_all_gathers") {
    if (value != "true" && value != "false") return Error::BadInput(fmt::format("--vary limit_all_gathers takes true,false, got '{}'", value));
    f.plan.no_limit_all_gathers = value == "false";
  } else {
    return Error::BadInput(fmt::format("--vary: unknown parameter '{}' (bandwidth, gpus, strategy, prefetch, limit_all_gathers, micro-batch, seq-len)", param));
  }
  return {};
}

}  // namespace

void AddSimFlags(CLI::App& app, SimFlags& f) {
  AddPlanFlags(app, f.plan);
  app.add_flag("--per-rank", f.per_rank, "simulate every rank (collectives wait for the slowest)");
  app.add_option("--jitter", f.options.jitter, "per-rank compute time spread, uniform +-fraction (with --per-rank)");
  app.add_option("--seed", f.options.seed, "seed of the jitter")->capture_default_str();
  app.add_option("--slow-rank", f.slow_ranks, "RANK=FACTOR: a rank whose compute is FACTOR times slower (repeatable)");
  app.add_flag("--separate-process-groups", f.options.separate_process_groups, "all-gathers and reduce-scatters on separate NCCL streams");
  app.add_option("--launch-overhead", f.options.launch_overhead_s, "CPU seconds per launched kernel or collective")->capture_default_str();
  app.add_option("--bandwidth", f.options.bandwidth_override, "override the GPU's intra- and inter-node bandwidth, bytes/s");
  app.add_option("--trace", f.trace_path, "write a Chrome trace (Perfetto, chrome://tracing)");
  app.add_option("--report", f.report_path, "write a self-contained HTML report");
}

Status RunSim(SimFlags f, std::ostream& out) {
  auto w = WorkloadFromFlags(f.plan);
  if (!w.ok()) return w.error();
  auto r = SimulateFlags(f);
  if (!r.ok()) return r.error();
  if (!f.trace_path.empty()) {
    if (Status s = WriteTextFile(f.trace_path, DumpJson(sim::ChromeTrace(r.value()))); !s.ok()) return s;
  }
  if (!f.report_path.empty()) {
    if (Status s = WriteTextFile(f.report_path, sim::HtmlReport(w.value(), r.value())); !s.ok()) return s;
  }
  if (f.plan.json) {
    out << DumpJson(sim::SimResultToJson(w.value(), r.value()), 2) << "\n";
  } else {
    PrintSummary(w.value(), r.value(), out);
  }
  return {};
}

Status RunWhatIf(SimFlags f, std::ostream& out) {
  if (f.vary.empty() || f.vary.size() > 2) return Error::BadInput("what-if takes one or two --vary PARAM=v1,v2,...");
  std::vector<std::string> params;
  std::vector<std::vector<std::string>> values;
  for (const auto& v : f.vary) {
    auto eq = v.find('=');
    if (eq == std::string::npos || eq + 1 >= v.size()) return Error::BadInput(fmt::format("--vary expects PARAM=v1,v2,..., got '{}'", v));
    params.push_back(v.substr(0, eq));
    values.push_back(Split(v.substr(eq + 1), ','));
  }
  std::vector<sim::WhatIfRow> rows;
  const std::vector<std::string> second = values.size() > 1 ? values[1] : std::vector<std::string>{""};
  for (const auto& a : values[0]) {
    for (const auto& b : second) {
      SimFlags g = f;
      if (Status s = Apply(params[0], a, g); !s.ok()) return s;
      if (params.size() > 1) {
        if (Status s = Apply(params[1], b, g); !s.ok()) return s;
      }
      auto r = SimulateFlags(g);
      if (!r.ok()) return r.error();
      rows.push_back({params.size() > 1 ? std::vector<std::string>{a, b} : std::vector<std::string>{a}, std::move(r).value()});
    }
  }
  if (f.plan.json) {
    Json table = Json::array();
    for (const sim::WhatIfRow& row : rows) {
      const sim::SimResult& r = row.result;
      table.push_back({{"values", row.values}, {"step_s", r.step_s}, {"compute_s", r.compute_s}, {"exposed_comm_s", r.exposed_comm_s},
                       {"overlap_pct", r.overlap_pct}, {"peak_bytes", r.peak_bytes}});
    }
    out << DumpJson(Json{{"params", params}, {"rows", table}}, 2) << "\n";
  } else {
    out << sim::WhatIfTable(params, rows);
  }
  if (!f.chart_path.empty()) return WriteTextFile(f.chart_path, sim::WhatIfHtml(params, rows));
  return {};
}

Status RunCompare(const std::vector<std::string>& files, std::ostream& out) {
  if (files.size() != 2) return Error::BadInput("compare takes two result files written by fsdp-sim --json");
  sim::SimSummary summaries[2];
  for (int i = 0; i < 2; ++i) {
    FSDP_ASSIGN_OR_RETURN(const Json j, LoadJsonFile(files[i]));
    FSDP_ASSIGN(summaries[i], sim::SimSummaryFromJson(j, files[i]));
  }
  auto base_name = [](const std::string& path) { return path.substr(path.find_last_of('/') + 1); };
  out << sim::CompareTable(base_name(files[0]), summaries[0], base_name(files[1]), summaries[1]);
  return {};
}

}  // namespace fsdp
