#include "runtime/fsdp_engine.h"

#include <cmath>
#include <limits>

#include <doctest/doctest.h>

namespace fsdp::runtime {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST_CASE("RoundTo fp16: 11 significant bits, ties to even, 65504 the largest, subnormals in steps of 2^-24") {
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -11), DType::kFp16) == 1.0f);                           // tie: to even
  CHECK(RoundTo(1.0f + 3 * std::ldexp(1.0f, -11), DType::kFp16) == 1.0f + std::ldexp(1.0f, -9));  // tie: to even, up
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -10), DType::kFp16) == 1.0f + std::ldexp(1.0f, -10));     // representable
  CHECK(RoundTo(65504.0f, DType::kFp16) == 65504.0f);
  CHECK(RoundTo(65519.0f, DType::kFp16) == 65504.0f);
  CHECK(RoundTo(65520.0f, DType::kFp16) == kInf);  // halfway to 65536: rounds to even, which is beyond the range
  CHECK(RoundTo(-1e6f, DType::kFp16) == -kInf);
  CHECK(RoundTo(std::ldexp(1.0f, -24), DType::kFp16) == std::ldexp(1.0f, -24));   // the smallest subnormal
  CHECK(RoundTo(std::ldexp(1.0f, -26), DType::kFp16) == 0.0f);                    // underflows
  CHECK(RoundTo(3 * std::ldexp(1.0f, -25), DType::kFp16) == std::ldexp(1.0f, -23));  // 1.5 quanta: tie to even (2)
  CHECK(RoundTo(1.3f * std::ldexp(1.0f, -20), DType::kFp16) == 21 * std::ldexp(1.0f, -24));  // 20.8 quanta of 2^-24
  CHECK(std::isnan(RoundTo(std::nanf(""), DType::kFp16)));
  CHECK(RoundTo(kInf, DType::kFp16) == kInf);
}

TEST_CASE("RoundTo bf16: 8 significant bits, ties to even, overflow to inf, NaN stays NaN") {
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -8), DType::kBf16) == 1.0f);
  CHECK(RoundTo(1.0f + 3 * std::ldexp(1.0f, -8), DType::kBf16) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(RoundTo(std::numeric_limits<float>::max(), DType::kBf16) == kInf);
  CHECK(std::isnan(RoundTo(std::nanf(""), DType::kBf16)));
  CHECK(RoundTo(0.1f, DType::kFp32) == 0.1f);
}

}  // namespace
}  // namespace fsdp::runtime
