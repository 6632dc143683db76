// Reading JSON documents with errors that name the file, the position and the key.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/limits.h"
#include "core/status.h"

namespace fsdp {

using Json = nlohmann::json;

/// Deepest nesting of arrays and objects a document may have. Every file the tools read is at most
/// four levels deep; the bound keeps recursive walks (dump, destruction, error messages) off the
/// end of the stack.
constexpr int kMaxJsonDepth = 128;
/// Largest JSON document read, in bytes: config.json and hardware files are a few KB, a 405B
/// model's safetensors index ~100 KB, an fsdp-sim --json result ~1 MB.
constexpr int64_t kMaxJsonFileBytes = 64ll << 20;

/// Parses `text`. BadInput "<origin>:<line>:<column>: malformed JSON: ..." on a syntax error,
/// "<origin>: ..." on a number no double holds (1e400) or nesting past kMaxJsonDepth. Never throws.
Result<Json> ParseJson(const std::string& text, const std::string& origin);
/// Reads and parses the file at `path` (BadInput if it cannot be read, is larger than
/// kMaxJsonFileBytes or cannot be parsed).
Result<Json> LoadJsonFile(const std::string& path);

/// Writes `text` to `path` (a report, a trace, a JSON document); BadInput naming the path when it
/// cannot be written.
Status WriteTextFile(const std::string& path, const std::string& text);

/// Serialises `json` (indent < 0: one line). Strings that are not valid UTF-8 (a path given on
/// the command line) have their bad bytes replaced by U+FFFD instead of throwing.
std::string DumpJson(const Json& json, int indent = -1);

/// A short description of a value for an error message: scalars by type and JSON text (`number
/// 1.5`, strings cut at 40 characters), arrays and objects by size (`array of 3 elements`).
std::string DescribeJsonValue(const Json& value);

/// Typed access to object members with errors of the form "<origin>: key 'k': ...".
/// The Optional variants return std::nullopt when the key is absent or null, an error when the
/// value has the wrong type or is out of range; the plain variants also fail when it is absent.
class JsonReader {
 public:
  JsonReader(const Json& object, std::string origin) : object_(object), origin_(std::move(origin)) {}

  Result<std::optional<int64_t>> OptionalInt(const std::string& key) const;
  Result<std::optional<double>> OptionalNumber(const std::string& key) const;
  Result<std::optional<bool>> OptionalBool(const std::string& key) const;
  Result<std::optional<std::string>> OptionalString(const std::string& key) const;

  Result<int64_t> Int(const std::string& key) const;
  /// An integer that must be >= min_value.
  Result<int64_t> IntAtLeast(const std::string& key, int64_t min_value) const;
  /// A finite number that must be > 0.
  Result<double> PositiveNumber(const std::string& key) const;
  /// A finite number that must be >= 0.
  Result<double> NonNegativeNumber(const std::string& key) const;
  /// A number inside `range`: "<origin>: key 'k': must be between 1.05e+06 and 1.13e+15 bytes, got 1e+19".
  Result<double> NumberIn(const std::string& key, const NumberRange& range) const;
  /// An integer in [min_value, max_value].
  Result<int64_t> IntIn(const std::string& key, int64_t min_value, int64_t max_value) const;
  Result<std::string> String(const std::string& key) const;
  /// A nested object; BadInput when absent or not an object.
  Result<JsonReader> Object(const std::string& key) const;

  const Json& json() const { return object_; }
  const std::string& origin() const { return origin_; }
  Error KeyError(const std::string& key, const std::string& what) const;

 private:
  const Json& object_;
  std::string origin_;
};

}  // namespace fsdp
