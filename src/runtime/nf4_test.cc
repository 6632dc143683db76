#include "runtime/nf4.h"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/catalog.h"
#include "core/lora.h"

namespace fsdp::runtime {
namespace {

std::vector<float> Floats(const nlohmann::json& j) {
  std::vector<float> out;
  for (double v : j) out.push_back(static_cast<float>(v));  // fp32 values written as exact doubles
  return out;
}

uint32_t Bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// Bitwise equality, so that a -0 for a 0 or a last-ulp difference fails
void CheckSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": " << got[i] << " vs " << want[i]);
    CHECK(Bits(got[i]) == Bits(want[i]));
  }
}

}  // namespace

TEST_CASE("Nf4Quantize on a hand-computed block: absmax 2, indices 15, 0, 12, 7 packed high nibble first") {
  std::vector<float> block(64, 0.0f);
  block[0] = 2.0f;   // scaled 1: code 15 (1.0)
  block[1] = -2.0f;  // -1: code 0
  block[2] = 1.0f;   // 0.5, under the bound 0.50166 between codes 12 (0.4407) and 13: code 12
  block[3] = 0.0f;   // code 7 (0.0); so are the other 60
  const Nf4Weight w = Nf4Quantize(block.data(), 64);
  REQUIRE(w.absmax == std::vector<float>{2.0f});
  REQUIRE(w.packed.size() == 32);
  CHECK(w.packed[0] == 0xF0);
  CHECK(w.packed[1] == 0xC7);
  for (size_t i = 2; i < 32; ++i) CHECK(w.packed[i] == 0x77);
  std::vector<float> out(64);
  Nf4Dequantize(w.packed.data(), w.absmax.data(), 64, out.data());
  CHECK(out[0] == 2.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == 0.44070982933044434f * 2.0f);
  CHECK(out[3] == 0.0f);
}

TEST_CASE("Nf4Quantize and Nf4Dequantize equal bitsandbytes 0.50.2's, byte for byte (tests/data/nf4_bitsandbytes.json)") {
  std::ifstream in(DataDir() + "/tests/data/nf4_bitsandbytes.json");
  REQUIRE(in.good());
  const nlohmann::json fixture = nlohmann::json::parse(in);
  for (const char* prefix : {"", "weight_"}) {
    const std::vector<float> values = Floats(fixture[prefix[0] ? "weight" : "values"]);
    INFO(prefix << "values: " << values.size());
    const auto n = static_cast<int64_t>(values.size());
    const Nf4Weight w = Nf4Quantize(values.data(), n);
    CHECK(w.packed == fixture[std::string(prefix) + "packed"].get<std::vector<uint8_t>>());
    CheckSameBits(w.absmax, Floats(fixture[std::string(prefix) + "absmax"]));
    std::vector<float> out(values.size());
    Nf4Dequantize(w.packed.data(), w.absmax.data(), n, out.data());
    CheckSameBits(out, Floats(fixture[std::string(prefix) + "dequantized"]));
  }
}

// Double quantization against bitsandbytes. Nf4StateOf takes each value's nearest code; bitsandbytes'
// CPU kernel searches with BinSearch's Direct2, which near a midpoint between codes sometimes lands
// one code off (2 to 4 of 1,500 values of N(0, s) weights' absmax, s 0.02 to 1, measured): each
// byte must be bitsandbytes' or its neighbour, nearly all bitsandbytes'. The fp32 values may differ
// in their last places: the offset is torch's fp32 mean, whose vectorised cascade sum (its order
// depends on the CPU's vector width) Nf4StateOf does not reproduce: it sums in double.
TEST_CASE("Double quantization against bitsandbytes 0.50.2's on the CPU: nearest codes, the offset and absmax to a few fp32 places") {
  std::ifstream in(DataDir() + "/tests/data/nf4_bitsandbytes.json");
  REQUIRE(in.good());
  const nlohmann::json fixture = nlohmann::json::parse(in);
  CheckSameBits(std::vector<float>(kDynamicCode.begin(), kDynamicCode.end()), Floats(fixture["dq_code"]));
  const std::vector<float> absmax = Floats(fixture["dq_absmax"]);
  const Nf4QuantState s = Nf4StateOf(absmax, true);
  const auto bnb = fixture["dq_absmax_q"].get<std::vector<int>>();
  REQUIRE(s.absmax_q.size() == bnb.size());
  size_t differ = 0;
  for (size_t i = 0; i < bnb.size(); ++i) {
    CHECK(std::abs(static_cast<int>(s.absmax_q[i]) - bnb[i]) <= 1);
    differ += s.absmax_q[i] != bnb[i];
    // the nearest code to (a - offset) / absmax2 (the one below on a tie)
    const float x = (absmax[i] - s.offset) / s.absmax2[i / 256];
    for (size_t c = 0; c < kDynamicCode.size(); ++c) CHECK(std::fabs(x - kDynamicCode[s.absmax_q[i]]) <= std::fabs(x - kDynamicCode[c]));
  }
  CHECK(differ * 100 <= bnb.size());  // at most 1%
  auto close = [](const std::vector<float>& got, const std::vector<float>& want) {
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-6));
  };
  close({s.offset}, {static_cast<float>(fixture["dq_offset"].get<double>())});
  close(s.absmax2, Floats(fixture["dq_absmax2"]));
  CHECK(s.Bytes() == 300 + 2 * 4 + 4);  // a byte per absmax, two blocks of 256, the offset
  CHECK(s.Bytes() == Nf4EngineStateBytes(300 * 64, true));
  if (differ == 0) close(s.Absmax(), Floats(fixture["dq_dequantized"]));
  const Nf4QuantState plain = Nf4StateOf(absmax, false);
  CHECK(plain.Absmax() == absmax);
  CHECK(plain.Bytes() == 300 * 4);
  CHECK(plain.Bytes() == Nf4EngineStateBytes(300 * 64, false));
}

TEST_CASE("NF4 storage elements keep every byte: all 65536 bf16 patterns, and fp32 NaN payloads") {
  std::vector<uint8_t> bytes;
  for (int hi = 0; hi < 256; ++hi) {
    for (int lo = 0; lo < 256; ++lo) bytes.insert(bytes.end(), {static_cast<uint8_t>(lo), static_cast<uint8_t>(hi)});
  }
  const std::vector<float> bf16 = Nf4StorageElements(bytes, DType::kBf16);
  REQUIRE(bf16.size() == 65536);
  CHECK(Bits(bf16[0x1234]) == 0x12340000u);  // little-endian: the first byte is the low one
  CHECK(Nf4PackedBytes(bf16.data(), 65536, DType::kBf16) == bytes);
  const std::vector<float> fp32 = Nf4StorageElements(bytes, DType::kFp32);
  REQUIRE(fp32.size() == 32768);
  CHECK(Nf4PackedBytes(fp32.data(), 32768, DType::kFp32) == bytes);
  const std::vector<uint8_t> nan = {0x01, 0x00, 0x80, 0x7F, 0xFF, 0xFF, 0xFF, 0xFF};  // a signalling NaN, a negative quiet one
  CHECK(Nf4PackedBytes(Nf4StorageElements(nan, DType::kFp32).data(), 2, DType::kFp32) == nan);
}

}  // namespace fsdp::runtime
