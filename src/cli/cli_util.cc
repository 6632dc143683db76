#include "cli/cli_util.h"

#include <cstdio>
#include <iostream>
#include <string_view>

#include <fmt/format.h>

#include "core/dtype.h"
#include "core/json_io.h"
#include "core/vocabulary.h"

namespace fsdp {

int ReportError(const std::string& tool, const Error& error, bool json_stdout) {
  // one write per line, so that lines of several MPI ranks sharing stderr do not interleave
  const std::string line = tool + ": error: " + error.message + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
  if (json_stdout) {
    const char* kind = error.kind == Error::Kind::kBadInput ? "bad_input" : error.kind == Error::Kind::kOutOfMemory ? "out_of_memory" : "run_failed";
    std::cout << DumpJson(Json{{"error", {{"kind", kind}, {"message", error.message}}}}, 2) << "\n" << std::flush;
  }
  return error.kind == Error::Kind::kBadInput ? kExitBadInput : kExitRunFailed;
}

int ParseOrExitCode(CLI::App& app, int argc, char** argv, const std::string& tool) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return kExitOk;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return kExitOk;
  } catch (const CLI::ParseError& e) {
    std::string what = e.what();
    for (char& ch : what) if (ch == '\n') ch = ' ';
    bool json = false;
    for (int i = 1; i < argc; ++i) json = json || std::string_view(argv[i]) == "--json";
    return ReportError(tool, Error::BadInput(what + " (see --help)"), json);
  }
}

std::string Gib(int64_t bytes) { return fmt::format("{:.2f}", static_cast<double>(bytes) / kGiB); }

}  // namespace fsdp

namespace fsdp {

std::vector<std::string> Split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find(separator, start);
    if (end == std::string::npos) end = text.size();
    if (end > start) parts.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

std::string WithCommas(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

}  // namespace fsdp
