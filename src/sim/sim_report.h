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
///  "memory": {"peak_bytes", "peak_time_s", "peak_phase", "capacity_bytes"}, "streams": {...}, ...}
Json SimResultToJson(const Workload& workload, const SimResult& result);

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

/// Writes `text` to `path`; BadInput naming the path when it cannot be written.
Status WriteText(const std::string& path, const std::string& text);

}  // namespace fsdp::sim
