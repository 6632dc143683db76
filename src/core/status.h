// Error values for library code: functions return Result<T> (a value or an Error) instead of
// throwing or exiting; only the mains turn an Error into a message and an exit code.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace fsdp {

/// What went wrong, in one line that names the offending file, key or value.
/// kind tells the main which exit code to use (design.md: 2 bad input, 1 run failed or out of
/// memory) and callers what happened without reading the message.
struct Error {
  enum class Kind { kBadInput, kRunFailed, kOutOfMemory };
  Kind kind = Kind::kBadInput;
  std::string message;

  static Error BadInput(std::string msg) { return {Kind::kBadInput, std::move(msg)}; }
  static Error RunFailed(std::string msg) { return {Kind::kRunFailed, std::move(msg)}; }
  /// A run that needed more memory than it had (or than --memory-limit allows).
  static Error OutOfMemory(std::string msg) { return {Kind::kOutOfMemory, std::move(msg)}; }
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

/// Returns the error of a failed Status expression from the enclosing function.
#define FSDP_TRY(expr)                                  \
  do {                                                  \
    if (::fsdp::Status fsdp_s = (expr); !fsdp_s.ok()) { \
      return fsdp_s.error();                            \
    }                                                   \
  } while (0)

/// Assigns a Result expression's value to `out` (an existing lvalue), or returns its error from the
/// enclosing function: FSDP_ASSIGN(hw.id, r.String("id"));
#define FSDP_ASSIGN(out, expr)                    \
  do {                                            \
    auto fsdp_v_ = (expr);                        \
    if (!fsdp_v_.ok()) return fsdp_v_.error();    \
    out = std::move(fsdp_v_).value();             \
  } while (0)

#define FSDP_CONCAT_INNER(a, b) a##b
#define FSDP_CONCAT(a, b) FSDP_CONCAT_INNER(a, b)
/// Declares `decl` from a Result expression's value, or returns its error from the enclosing
/// function: FSDP_ASSIGN_OR_RETURN(Workload w, BuildWorkload(model, hardware, config));
#define FSDP_ASSIGN_OR_RETURN(decl, expr) FSDP_ASSIGN_OR_RETURN_IMPL(FSDP_CONCAT(fsdp_result_, __LINE__), decl, expr)
#define FSDP_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                                \
  if (!tmp.ok()) return tmp.error();                \
  decl = std::move(tmp).value()
