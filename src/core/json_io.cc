#include "core/json_io.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace fsdp {
namespace {

// Line and column (1-based) of a byte offset in text.
std::pair<int, int> LineColumn(const std::string& text, size_t offset) {
  int line = 1, column = 1;
  for (size_t i = 0; i < offset && i < text.size(); ++i) {
    if (text[i] == '\n') { ++line; column = 1; } else { ++column; }
  }
  return {line, column};
}

std::string TypeName(const Json& value) { return value.type_name(); }

}  // namespace

Result<Json> ParseJson(const std::string& text, const std::string& origin) {
  try {
    return Json::parse(text);
  } catch (const Json::parse_error& e) {
    size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    auto [line, column] = LineColumn(text, offset);
    std::string what = e.what();
    // nlohmann's message starts with "[json.exception.parse_error.101] parse error at line..."; keep the tail.
    auto colon = what.find(": ", what.find("parse error"));
    std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    return Error::BadInput(fmt::format("{}:{}:{}: malformed JSON: {}", origin, line, column, detail));
  }
}

Result<Json> LoadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error::BadInput(fmt::format("{}: cannot open file", path));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseJson(buffer.str(), path);
}

Error JsonReader::KeyError(const std::string& key, const std::string& what) const {
  return Error::BadInput(fmt::format("{}: key '{}': {}", origin_, key, what));
}

Result<std::optional<int64_t>> JsonReader::OptionalInt(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<int64_t>{};
  if (it->is_number_integer()) return std::optional<int64_t>{it->get<int64_t>()};
  if (it->is_number_float()) {
    double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) return std::optional<int64_t>{static_cast<int64_t>(v)};
  }
  return KeyError(key, fmt::format("expected an integer, got {} {}", TypeName(*it), it->dump()));
}

Result<std::optional<double>> JsonReader::OptionalNumber(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<double>{};
  if (!it->is_number()) return KeyError(key, fmt::format("expected a number, got {} {}", TypeName(*it), it->dump()));
  return std::optional<double>{it->get<double>()};
}

Result<std::optional<bool>> JsonReader::OptionalBool(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<bool>{};
  if (!it->is_boolean()) return KeyError(key, fmt::format("expected true or false, got {} {}", TypeName(*it), it->dump()));
  return std::optional<bool>{it->get<bool>()};
}

Result<std::optional<std::string>> JsonReader::OptionalString(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<std::string>{};
  if (!it->is_string()) return KeyError(key, fmt::format("expected a string, got {} {}", TypeName(*it), it->dump()));
  return std::optional<std::string>{it->get<std::string>()};
}

Result<int64_t> JsonReader::Int(const std::string& key) const {
  auto v = OptionalInt(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return KeyError(key, "missing");
  return *v.value();
}

Result<int64_t> JsonReader::IntAtLeast(const std::string& key, int64_t min_value) const {
  auto v = Int(key);
  if (!v.ok()) return v;
  if (v.value() < min_value) return KeyError(key, fmt::format("must be >= {}, got {}", min_value, v.value()));
  return v;
}

Result<double> JsonReader::PositiveNumber(const std::string& key) const {
  auto v = OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return KeyError(key, "missing");
  double x = *v.value();
  if (!std::isfinite(x) || x <= 0) return KeyError(key, fmt::format("must be a positive number, got {}", x));
  return x;
}

Result<double> JsonReader::NonNegativeNumber(const std::string& key) const {
  auto v = OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return KeyError(key, "missing");
  double x = *v.value();
  if (!std::isfinite(x) || x < 0) return KeyError(key, fmt::format("must be a number >= 0, got {}", x));
  return x;
}

Result<std::string> JsonReader::String(const std::string& key) const {
  auto v = OptionalString(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return KeyError(key, "missing");
  return *v.value();
}

Result<JsonReader> JsonReader::Object(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return KeyError(key, "missing");
  if (!it->is_object()) return KeyError(key, fmt::format("expected an object, got {}", TypeName(*it)));
  return JsonReader(*it, fmt::format("{}: {}", origin_, key));
}

}  // namespace fsdp
