// fsdp-sim's outputs: the summary as JSON, a Chrome trace (Perfetto / chrome://tracing), a
// self-contained HTML report (SVG timeline, memory chart, summary table) and what-if charts.
#pragma once

#include <string>
#include <vector>

#include "core/json_io.h"
#include "core/workload.h"
#include "sim/simulator.h"

namespace fsdp::sim {

/// {"time": {"step_s", "compute_s", "comm_s", "exposed_comm_s", "overlap_pct", "cpu_blocked_s"},
///  "memory": {"peak_bytes", "peak_time_s", "peak_phase", "capacity_bytes", "allocator": {...}},
///  "streams": {...}, ...}
Json SimResultToJson(const Workload& workload, const SimResult& result);

/// One line of the caching allocator's figures: "allocated peak 35.83 GiB, reserved peak 44.69
/// GiB (phase), fragmentation 1.20 GiB, cache over tensors 8.86 GiB, 0 retries".
std::string AllocatorSummary(const SimResult& result);

/// Chrome trace event format: one track per stream (complete "X" events named after their unit,
/// e.g. "AG model.layers.12") and a "memory" counter track.
Json ChromeTrace(const SimResult& result);

/// One HTML file with no external resources.
std::string HtmlReport(const Workload& workload, const SimResult& result);

/// A what-if sweep: one row per combination of the varied parameters.
struct WhatIfRow {
  std::vector<std::string> values;   ///< the varied parameters' values
  SimResult result;
};
std::string WhatIfTable(const std::vector<std::string>& params, const std::vector<WhatIfRow>& rows);
std::string WhatIfHtml(const std::vector<std::string>& params, const std::vector<WhatIfRow>& rows);

/// The figures `fsdp-sim compare` sets side by side, read back from a SimResultToJson document.
struct SimSummary {
  double step_s = 0, compute_s = 0, comm_s = 0, exposed_comm_s = 0;
  double overlap_pct = 0;   ///< 0..100
  double peak_bytes = 0;
};
/// BadInput "<origin>: not an fsdp-sim --json result (...)" for a document without the keys, or
/// "<origin>: time: key 'step_s': ..." for a value that is not a finite number in range.
Result<SimSummary> SimSummaryFromJson(const Json& document, const std::string& origin);
/// The comparison table: one row per figure, the two values and b's change relative to a.
std::string CompareTable(const std::string& name_a, const SimSummary& a, const std::string& name_b, const SimSummary& b);

}  // namespace fsdp::sim
