// Floating-point storage types used by FSDP mixed precision, and byte/size helpers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace fsdp {

enum class DType { kFp32, kBf16, kFp16 };

/// Bytes per element: fp32 4, bf16/fp16 2.
int64_t BytesPerElement(DType dtype);
/// "fp32", "bf16", "fp16".
std::string_view DTypeName(DType dtype);
/// Parses "fp32"/"float32", "bf16"/"bfloat16", "fp16"/"float16"; BadInput error naming `what` otherwise.
Result<DType> ParseDType(std::string_view text, std::string_view what);


/// ceil(a / b) for positive b.
constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
/// a rounded up to a multiple of b (b > 0).
constexpr int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

}  // namespace fsdp
