// Shared pieces of the three mains: error reporting and exit codes (design.md conventions).
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace fsdp {

constexpr int kExitOk = 0;
constexpr int kExitRunFailed = 1;
constexpr int kExitBadInput = 2;

/// Prints "<tool>: error: <message>" on stderr and returns the exit code for the error's kind.
/// With `json_stdout` (the user asked for --json) it also prints {"error": {"kind", "message"}} on
/// stdout, so that a program reading the output reads JSON whatever happened.
int ReportError(const std::string& tool, const Error& error, bool json_stdout = false);

/// Parses argv with CLI11. Returns -1 when parsing succeeded; otherwise the exit code to return
/// (0 after --help, 2 after a usage error, which is reported in one line, and as JSON on stdout
/// too when argv holds --json).
int ParseOrExitCode(CLI::App& app, int argc, char** argv, const std::string& tool);

/// Formats bytes as GiB with two decimals ("12.34").
std::string Gib(int64_t bytes);

/// Non-empty pieces of `text` between `separator`s: "a,,b" -> {"a", "b"}.
std::vector<std::string> Split(const std::string& text, char separator);

/// 6738415616 -> "6,738,415,616".
std::string WithCommas(int64_t value);

}  // namespace fsdp
