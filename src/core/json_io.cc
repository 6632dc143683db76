#include "core/json_io.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

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

// Byte offset where nesting first exceeds max_depth (brackets inside strings do not count), or -1.
int64_t TooDeepAt(const std::string& text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (ch == '\\') ++i;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > max_depth) return static_cast<int64_t>(i);
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
  return -1;
}

}  // namespace

Status WriteTextFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  if (!out) return Error::BadInput(fmt::format("cannot write '{}': {}", path, std::strerror(errno)));
  out << text;
  out.close();
  if (!out) return Error::BadInput(fmt::format("cannot write '{}'", path));
  return {};
}

std::string DumpJson(const Json& json, int indent) {
  return json.dump(indent, ' ', false, Json::error_handler_t::replace);
}

std::string DescribeJsonValue(const Json& value) {
  constexpr size_t kMaxChars = 40;
  if (value.is_array()) return fmt::format("array of {} element{}", value.size(), value.size() == 1 ? "" : "s");
  if (value.is_object()) return fmt::format("object of {} key{}", value.size(), value.size() == 1 ? "" : "s");
  if (value.is_string()) {
    const std::string& s = value.get_ref<const std::string&>();
    if (s.size() <= kMaxChars) return "string " + DumpJson(value);
    std::string head = DumpJson(Json(s.substr(0, kMaxChars)));  // "...", closing quote dropped below
    head.pop_back();
    return fmt::format("string {}...\" ({} bytes)", head, s.size());
  }
  return fmt::format("{} {}", TypeName(value), DumpJson(value));
}

Result<Json> ParseJson(const std::string& text, const std::string& origin) {
  if (const int64_t at = TooDeepAt(text, kMaxJsonDepth); at >= 0) {
    auto [line, column] = LineColumn(text, static_cast<size_t>(at));
    return Error::BadInput(fmt::format("{}:{}:{}: JSON nested deeper than {} levels", origin, line, column, kMaxJsonDepth));
  }
  try {
    return Json::parse(text);
  } catch (const Json::out_of_range& e) {
    // out_of_range.406: a number literal no double holds ("1e400")
    std::string what = e.what();
    auto bracket = what.find("] ");
    return Error::BadInput(fmt::format("{}: malformed JSON: {} (a JSON number must fit a double, |x| < 1.8e308)", origin,
                                       bracket == std::string::npos ? what : what.substr(bracket + 2)));
  } catch (const Json::parse_error& e) {
    size_t offset = e.byte > 0 ? e.byte - 1 : 0;
    auto [line, column] = LineColumn(text, offset);
    std::string what = e.what();
    // nlohmann's message starts with "[json.exception.parse_error.101] parse error at line..."; keep the tail.
    auto colon = what.find(": ", what.find("parse error"));
    std::string detail = colon == std::string::npos ? what : what.substr(colon + 2);
    return Error::BadInput(fmt::format("{}:{}:{}: malformed JSON: {}", origin, line, column, detail));
  } catch (const Json::exception& e) {
    return Error::BadInput(fmt::format("{}: malformed JSON: {}", origin, e.what()));
  }
}

Result<Json> LoadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Error::BadInput(fmt::format("{}: cannot open file", path));
  std::string text;
  char chunk[1 << 16];
  while (in.read(chunk, sizeof chunk) || in.gcount() > 0) {
    text.append(chunk, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(text.size()) > kMaxJsonFileBytes) {
      return Error::BadInput(fmt::format("{}: larger than {} MiB, not a file these tools read", path, kMaxJsonFileBytes >> 20));
    }
  }
  if (in.bad()) return Error::BadInput(fmt::format("{}: cannot read file", path));
  return ParseJson(text, path);
}

Error JsonReader::KeyError(const std::string& key, const std::string& what) const {
  return Error::BadInput(fmt::format("{}: key '{}': {}", origin_, key, what));
}

Result<std::optional<int64_t>> JsonReader::OptionalInt(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<int64_t>{};
  if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
    return KeyError(key, fmt::format("{} is out of range for a 64-bit integer", it->get<uint64_t>()));
  }
  if (it->is_number_integer()) return std::optional<int64_t>{it->get<int64_t>()};
  if (it->is_number_float()) {
    double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 9e15) return std::optional<int64_t>{static_cast<int64_t>(v)};
  }
  return KeyError(key, fmt::format("expected an integer, got {}", DescribeJsonValue(*it)));
}

Result<std::optional<double>> JsonReader::OptionalNumber(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<double>{};
  if (!it->is_number()) return KeyError(key, fmt::format("expected a number, got {}", DescribeJsonValue(*it)));
  return std::optional<double>{it->get<double>()};
}

Result<std::optional<bool>> JsonReader::OptionalBool(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<bool>{};
  if (!it->is_boolean()) return KeyError(key, fmt::format("expected true or false, got {}", DescribeJsonValue(*it)));
  return std::optional<bool>{it->get<bool>()};
}

Result<std::optional<std::string>> JsonReader::OptionalString(const std::string& key) const {
  auto it = object_.find(key);
  if (it == object_.end() || it->is_null()) return std::optional<std::string>{};
  if (!it->is_string()) return KeyError(key, fmt::format("expected a string, got {}", DescribeJsonValue(*it)));
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

Result<double> JsonReader::NumberIn(const std::string& key, const NumberRange& range) const {
  auto v = OptionalNumber(key);
  if (!v.ok()) return v.error();
  if (!v.value()) return KeyError(key, "missing");
  const double x = *v.value();
  if (!(x >= range.min && x <= range.max)) {
    return KeyError(key, fmt::format("must be between {:.3g} and {:.3g}{}{}, got {:.6g}", range.min, range.max, range.unit[0] ? " " : "", range.unit, x));
  }
  return x;
}

Result<int64_t> JsonReader::IntIn(const std::string& key, int64_t min_value, int64_t max_value) const {
  auto v = Int(key);
  if (!v.ok()) return v;
  if (v.value() < min_value || v.value() > max_value) {
    return KeyError(key, fmt::format("must be between {} and {}, got {}", min_value, max_value, v.value()));
  }
  return v;
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
