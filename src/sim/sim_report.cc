#include "sim/sim_report.h"
#include "core/vocabulary.h"

#include <algorithm>

#include <fmt/format.h>

namespace fsdp::sim {
namespace {

const char* KindColor(char kind) {
  switch (kind) {
    case 'C': return "#4e79a7";
    case 'O': return "#59a14f";
    case 'A': return "#f28e2b";
    case 'R': return "#e15759";
    case 'D': return "#b07aa1";
    case 'H':
    case 'h': return "#76b7b2";
    default: return "#bab0ac";
  }
}

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

std::string Timeline(const SimResult& r, double width) {
  const double step = std::max(r.step_s, 1e-12);
  const double row = 26, left = 170;
  std::string svg = fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{:.0f}' height='{:.0f}' font-family='sans-serif' font-size='11'>\n",
                                width + left + 10, row * (r.stream_names.size() + 1) + 10);
  for (size_t s = 0; s < r.stream_names.size(); ++s) {
    svg += fmt::format("<text x='4' y='{:.0f}'>{}</text>\n", row * s + 17, Escape(r.stream_names[s]));
  }
  for (const auto& op : r.ops) {
    const double x = left + op.start_s / step * width, w = std::max(0.5, (op.end_s - op.start_s) / step * width);
    svg += fmt::format("<rect x='{:.2f}' y='{:.0f}' width='{:.2f}' height='{:.0f}' fill='{}'><title>{} {:.3f}-{:.3f} ms</title></rect>\n", x,
                       row * op.stream + 4, w, row - 8, KindColor(op.kind), Escape(op.name), op.start_s * 1e3, op.end_s * 1e3);
  }
  const double axis = row * r.stream_names.size() + 14;
  for (int i = 0; i <= 10; ++i) {
    svg += fmt::format("<text x='{:.0f}' y='{:.0f}'>{:.1f} ms</text>\n", left + width * i / 10 - 10, axis, step * 1e3 * i / 10);
  }
  return svg + "</svg>\n";
}

// Allocated (tensors) and reserved (the caching allocator's segments) on the simulated clock, both
// with the terms outside the allocator, on a GiB axis up to the card's capacity.
std::string MemoryChart(const SimResult& r, double width) {
  const double height = 160, left = 170;
  const double step = std::max(r.step_s, 1e-12);
  int64_t highest = std::max(r.peak_bytes, r.capacity_bytes);
  for (const auto& m : r.memory) highest = std::max({highest, m.bytes, m.reserved_bytes});
  const double top = static_cast<double>(std::max<int64_t>(highest, 1));
  auto y_of = [&](double bytes) { return height - bytes / top * (height - 10); };
  auto series = [&](auto bytes_of) {
    std::string points;
    double last_y = height;
    for (const auto& m : r.memory) {
      const double x = left + m.time_s / step * width, y = y_of(static_cast<double>(bytes_of(m)));
      points += fmt::format("{:.2f},{:.2f} {:.2f},{:.2f} ", x, last_y, x, y);
      last_y = y;
    }
    return points;
  };
  // the axis: a tick every power-of-two GiB that gives at most 8 of them
  double tick_gib = 1;
  while (top / kGiB / tick_gib > 8) tick_gib *= 2;
  std::string axis;
  for (double g = 0; g * kGiB <= top; g += tick_gib) {
    axis += fmt::format("<line x1='{:.0f}' y1='{:.2f}' x2='{:.0f}' y2='{:.2f}' stroke='#ddd'/><text x='{:.0f}' y='{:.2f}' text-anchor='end'>{:g} GiB</text>\n",
                        left, y_of(g * kGiB), left + width, y_of(g * kGiB), left - 4, y_of(g * kGiB) + 4, g);
  }
  const double cap_y = y_of(static_cast<double>(r.capacity_bytes));
  return fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{:.0f}' height='{:.0f}' font-family='sans-serif' font-size='11'>\n"
                     "<text x='4' y='20'>device memory</text><text x='4' y='36'>peak {:.2f} GiB</text>\n"
                     "<text x='4' y='52' fill='#4e79a7'>allocated</text><text x='4' y='68' fill='#f28e2b'>reserved</text>\n{}"
                     "<line x1='{:.0f}' y1='{:.2f}' x2='{:.0f}' y2='{:.2f}' stroke='#e15759' stroke-dasharray='4'/>"
                     "<text x='{:.0f}' y='{:.2f}' fill='#e15759'>capacity {:.2f} GiB</text>\n"
                     "<polyline fill='none' stroke='#f28e2b' stroke-width='1.5' points='{}'/>\n"
                     "<polyline fill='none' stroke='#4e79a7' stroke-width='1.5' points='{}'/>\n</svg>\n",
                     width + left + 10, height + 10, r.peak_bytes / kGiB, axis, left, cap_y, left + width, cap_y, left + 4, cap_y + 12,
                     r.capacity_bytes / kGiB, series([](const MemorySample& m) { return m.reserved_bytes; }),
                     series([](const MemorySample& m) { return m.bytes; }));
}

}  // namespace

std::string AllocatorSummary(const SimResult& r) {
  const SimResult::Allocator& a = r.allocator;
  return fmt::format("allocated peak {:.2f} GiB, reserved peak {:.2f} GiB ({}), fragmentation {:.2f} GiB, cache over tensors {:.2f} GiB, {} {}",
                     a.allocated_peak_bytes / kGiB, a.reserved_peak_bytes / kGiB, a.reserved_peak_phase, a.fragmentation_bytes / kGiB,
                     a.reserved_over_allocated_peak_bytes / kGiB, a.alloc_retries, a.alloc_retries == 1 ? "retry" : "retries");
}

Json SimResultToJson(const Workload& w, const SimResult& r) {
  Json streams = Json::object();
  for (size_t s = 0; s < r.stream_names.size(); ++s) streams[r.stream_names[s]] = {{"utilization", r.stream_utilization[s]}};
  return {{"model", w.model.id},
          {"hardware", w.hardware.id},
          {"gpus", w.config.gpus},
          {"strategy", StrategyName(w.config.strategy)},
          {"time",
           {{"step_s", r.step_s},
            {"compute_s", r.compute_s},
            {"comm_s", r.comm_s},
            {"exposed_comm_s", r.exposed_comm_s},
            {"overlap_pct", r.overlap_pct},
            {"cpu_blocked_s", r.cpu_blocked_s}}},
          {"memory", {{"peak_bytes", r.peak_bytes}, {"allocated_peak_bytes", r.allocated_peak_bytes}, {"peak_time_s", r.peak_time_s},
                      {"peak_phase", r.peak_phase}, {"capacity_bytes", r.capacity_bytes},
                      {"allocator", {{"allocated_peak_bytes", r.allocator.allocated_peak_bytes},
                                     {"allocated_blocks_peak_bytes", r.allocator.allocated_blocks_peak_bytes},
                                     {"active_peak_bytes", r.allocator.active_peak_bytes},
                                     {"reserved_peak_bytes", r.allocator.reserved_peak_bytes},
                                     {"reserved_peak_phase", r.allocator.reserved_peak_phase},
                                     {"fragmentation_bytes", r.allocator.fragmentation_bytes},
                                     {"reserved_over_allocated_peak_bytes", r.allocator.reserved_over_allocated_peak_bytes},
                                     {"alloc_retries", r.allocator.alloc_retries}}}}},
          {"streams", streams},
          {"simulation", {{"events", r.events}, {"wall_s", r.wall_s}, {"ops", r.ops.size()}}}};
}

Json ChromeTrace(const SimResult& r) {
  Json events = Json::array();
  for (size_t s = 0; s < r.stream_names.size(); ++s) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", s}, {"args", {{"name", r.stream_names[s]}}}});
  }
  for (const auto& op : r.ops) {
    events.push_back({{"name", op.name}, {"ph", "X"}, {"pid", op.rank}, {"tid", op.stream}, {"ts", op.start_s * 1e6},
                      {"dur", (op.end_s - op.start_s) * 1e6}, {"cat", std::string(1, op.kind)}});
  }
  for (const auto& m : r.memory) {
    events.push_back({{"name", "memory"}, {"ph", "C"}, {"pid", 0}, {"ts", m.time_s * 1e6},
                      {"args", {{"allocated GiB", m.bytes / kGiB}, {"reserved GiB", m.reserved_bytes / kGiB}}}});
  }
  // rank 0's CPU thread beside its streams: what it launches, and where it waits
  const int cpu_tid = static_cast<int>(r.stream_names.size());
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", cpu_tid}, {"args", {{"name", "rank 0 CPU thread"}}}});
  for (const auto& c : r.cpu) {
    const std::string name = c.kind == 'L' ? "launch " + c.name : c.kind == 'W' ? std::string("wait") : c.name;
    events.push_back({{"name", name}, {"ph", "X"}, {"pid", 0}, {"tid", cpu_tid}, {"ts", c.start_s * 1e6},
                      {"dur", (c.end_s - c.start_s) * 1e6}, {"cat", c.kind == 'W' ? "cpu wait" : c.kind == 'L' ? "cpu launch" : "cpu work"}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

std::string HtmlReport(const Workload& w, const SimResult& r) {
  const double width = 1100;
  std::string rows;
  auto row = [&](const std::string& k, const std::string& v) { rows += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", k, v); };
  row("model / GPUs", fmt::format("{} on {} x {}, {}", w.model.id, w.config.gpus, w.hardware.id, StrategyName(w.config.strategy)));
  row("step time", fmt::format("{:.2f} ms", r.step_s * 1e3));
  row("compute", fmt::format("{:.2f} ms", r.compute_s * 1e3));
  row("communication (busy)", fmt::format("{:.2f} ms", r.comm_s * 1e3));
  row("exposed communication", fmt::format("{:.2f} ms", r.exposed_comm_s * 1e3));
  row("overlap", fmt::format("{:.1f}%", r.overlap_pct));
  row("peak memory", fmt::format("{:.2f} GiB at {:.2f} ms ({})", r.peak_bytes / kGiB, r.peak_time_s * 1e3, Escape(r.peak_phase)));
  row("caching allocator", Escape(AllocatorSummary(r)));
  for (size_t s = 0; s < r.stream_names.size(); ++s) row(Escape(r.stream_names[s]) + " utilisation", fmt::format("{:.1f}%", 100 * r.stream_utilization[s]));
  return fmt::format("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>fsdp-sim report</title>\n"
                     "<style>body{{font-family:sans-serif;margin:20px}} td{{padding:2px 12px}} table{{border-collapse:collapse}} "
                     "tr:nth-child(even){{background:#f2f2f2}}</style></head><body>\n"
                     "<h1>fsdp-sim: {}</h1>\n<h2>Summary</h2><table>\n{}</table>\n<h2>Timeline</h2>\n{}"
                     "<p>blue: compute, green: optimizer, orange: all-gather, red: reduce-scatter, purple: all-reduce, teal: host copies</p>\n"
                     "<h2>Memory</h2>\n{}</body></html>\n",
                     Escape(w.model.id), rows, Timeline(r, width), MemoryChart(r, width));
}

std::string WhatIfTable(const std::vector<std::string>& params, const std::vector<WhatIfRow>& rows) {
  std::string out;
  std::vector<size_t> widths;
  for (const auto& p : params) widths.push_back(std::max<size_t>(14, p.size() + 2));
  for (size_t i = 0; i < params.size(); ++i) out += fmt::format("{:>{}}", params[i], widths[i]);
  out += fmt::format("{:>12}{:>12}{:>12}{:>10}{:>12}\n", "step ms", "compute ms", "exposed ms", "overlap", "peak GiB");
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.values.size(); ++i) out += fmt::format("{:>{}}", r.values[i], widths[i]);
    out += fmt::format("{:>12.2f}{:>12.2f}{:>12.2f}{:>9.1f}%{:>12.2f}\n", r.result.step_s * 1e3, r.result.compute_s * 1e3,
                       r.result.exposed_comm_s * 1e3, r.result.overlap_pct, r.result.peak_bytes / kGiB);
  }
  return out;
}

std::string WhatIfHtml(const std::vector<std::string>& params, const std::vector<WhatIfRow>& rows) {
  double top = 1e-12;
  for (const auto& r : rows) top = std::max(top, r.result.step_s);
  const double bar = 40, gap = 20, height = 260;
  std::string svg = fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{:.0f}' height='{:.0f}' font-family='sans-serif' font-size='11'>\n",
                                rows.size() * (bar + gap) + 80, height + 60);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i].result;
    const double x = 60 + i * (bar + gap);
    const double hc = r.compute_s / top * height, he = r.exposed_comm_s / top * height;
    svg += fmt::format("<rect x='{:.0f}' y='{:.1f}' width='{:.0f}' height='{:.1f}' fill='#4e79a7'/>", x, height - hc + 10, bar, hc);
    svg += fmt::format("<rect x='{:.0f}' y='{:.1f}' width='{:.0f}' height='{:.1f}' fill='#e15759'/>", x, height - hc - he + 10, bar, he);
    std::string label;
    for (const auto& v : rows[i].values) label += (label.empty() ? "" : "/") + v;
    svg += fmt::format("<text x='{:.0f}' y='{:.0f}' transform='rotate(30 {:.0f} {:.0f})'>{}</text>\n", x, height + 25, x, height + 25, Escape(label));
    svg += fmt::format("<text x='{:.0f}' y='{:.1f}'>{:.0f} ms</text>\n", x, height - hc - he + 5, r.step_s * 1e3);
  }
  svg += "</svg>\n";
  std::string names;
  for (const auto& p : params) names += (names.empty() ? "" : " x ") + p;
  return fmt::format("<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>fsdp-sim what-if</title></head>"
                     "<body style='font-family:sans-serif'><h1>What if: {}</h1><p>blue: compute, red: exposed communication</p>\n{}"
                     "<pre>{}</pre></body></html>\n",
                     Escape(names), svg, Escape(WhatIfTable(params, rows)));
}

Result<SimSummary> SimSummaryFromJson(const Json& document, const std::string& origin) {
  if (!document.is_object() || !document.contains("time") || !document.contains("memory")) {
    return Error::BadInput(fmt::format("{}: not an fsdp-sim --json result (no time and memory objects)", origin));
  }
  const JsonReader r(document, origin);
  FSDP_ASSIGN_OR_RETURN(const JsonReader time, r.Object("time"));
  FSDP_ASSIGN_OR_RETURN(const JsonReader memory, r.Object("memory"));
  SimSummary s;
  FSDP_ASSIGN(s.step_s, time.NonNegativeNumber("step_s"));
  FSDP_ASSIGN(s.compute_s, time.NonNegativeNumber("compute_s"));
  FSDP_ASSIGN(s.comm_s, time.NonNegativeNumber("comm_s"));
  FSDP_ASSIGN(s.exposed_comm_s, time.NonNegativeNumber("exposed_comm_s"));
  FSDP_ASSIGN(s.overlap_pct, time.NonNegativeNumber("overlap_pct"));
  if (s.overlap_pct > 100) return time.KeyError("overlap_pct", fmt::format("must be at most 100, got {}", s.overlap_pct));
  FSDP_ASSIGN(s.peak_bytes, memory.NonNegativeNumber("peak_bytes"));
  return s;
}

std::string CompareTable(const std::string& name_a, const SimSummary& a, const std::string& name_b, const SimSummary& b) {
  std::string out = fmt::format("{:<22}{:>16}{:>16}{:>14}\n", "", name_a, name_b, "delta");
  auto row = [&](const char* label, double x, double y, double scale, const char* unit) {
    const std::string delta = x != 0 ? fmt::format("{:+.1f}%", 100.0 * (y - x) / x) : (y == 0 ? "+0.0%" : "new");
    out += fmt::format("{:<22}{:>13.2f} {:<2}{:>13.2f} {:<2}{:>14}\n", label, x * scale, unit, y * scale, unit, delta);
  };
  row("step_s", a.step_s, b.step_s, 1e3, "ms");
  row("compute_s", a.compute_s, b.compute_s, 1e3, "ms");
  row("comm_s", a.comm_s, b.comm_s, 1e3, "ms");
  row("exposed_comm_s", a.exposed_comm_s, b.exposed_comm_s, 1e3, "ms");
  row("overlap_pct", a.overlap_pct, b.overlap_pct, 1, "%");
  row("peak memory", a.peak_bytes, b.peak_bytes, 1 / kGiB, "Gi");
  return out;
}

}  // namespace fsdp::sim
