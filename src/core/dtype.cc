#include "core/dtype.h"

#include <fmt/format.h>

namespace fsdp {

int64_t BytesPerElement(DType dtype) { return dtype == DType::kFp32 ? 4 : 2; }

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return "fp32";
    case DType::kBf16: return "bf16";
    case DType::kFp16: return "fp16";
  }
  return "?";
}

Result<DType> ParseDType(std::string_view text, std::string_view what) {
  if (text == "fp32" || text == "float32") return DType::kFp32;
  if (text == "bf16" || text == "bfloat16") return DType::kBf16;
  if (text == "fp16" || text == "float16") return DType::kFp16;
  return Error::BadInput(fmt::format("{}: unknown dtype '{}' (expected fp32, bf16 or fp16)", what, text));
}

}  // namespace fsdp
