// Reading JSON documents with errors that name the file, the position and the key.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace fsdp {

using Json = nlohmann::json;

/// Parses `text`; on a syntax error returns BadInput "<origin>:<line>:<column>: malformed JSON: ...".
Result<Json> ParseJson(const std::string& text, const std::string& origin);
/// Reads and parses the file at `path` (BadInput if it cannot be read or parsed).
Result<Json> LoadJsonFile(const std::string& path);

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
