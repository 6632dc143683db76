// Error values for library code: functions return Result<T> (a value or an Error) instead of
// throwing or exiting; only the mains turn an Error into a message and an exit code.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace fsdp {

/// What went wrong, in one line that names the offending file, key or value.
/// kind tells the main which exit code to use (design.md: 2 bad input, 1 run failed).
struct Error {
  enum class Kind { kBadInput, kRunFailed };
  Kind kind = Kind::kBadInput;
  std::string message;

  static Error BadInput(std::string msg) { return {Kind::kBadInput, std::move(msg)}; }
  static Error RunFailed(std::string msg) { return {Kind::kRunFailed, std::move(msg)}; }
};

/// Either a T or an Error. Check ok() before value(); value() on an error is a programming bug.
template <typename T>
class Result {
 public:
  Result(T value) : data_(std::move(value)) {}          // NOLINT(implicit)
  Result(Error error) : data_(std::move(error)) {}      // NOLINT(implicit)

  bool ok() const { return std::holds_alternative<T>(data_); }
  const T& value() const& { return std::get<T>(data_); }
  T& value() & { return std::get<T>(data_); }
  T&& value() && { return std::get<T>(std::move(data_)); }
  const Error& error() const { return std::get<Error>(data_); }

 private:
  std::variant<T, Error> data_;
};

/// Result of an operation with no value.
class Status {
 public:
  Status() = default;
  Status(Error error) : error_(std::move(error)), ok_(false) {}  // NOLINT(implicit)
  static Status Ok() { return {}; }
  bool ok() const { return ok_; }
  const Error& error() const { return error_; }

 private:
  Error error_;
  bool ok_ = true;
};

}  // namespace fsdp
