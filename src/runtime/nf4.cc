#include "runtime/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace fsdp::runtime {
namespace {

// _get_4bit_quantize_bounds: the midpoints of neighbouring codes, computed in fp32 as torch does
std::array<float, 15> Bounds() {
  std::array<float, 15> bounds{};
  for (size_t i = 0; i < bounds.size(); ++i) bounds[i] = (kNf4Code[i] + kNf4Code[i + 1]) / 2.0f;
  return bounds;
}

uint8_t Index(float scaled) {
  static const std::array<float, 15> bounds = Bounds();
  return static_cast<uint8_t>(std::lower_bound(bounds.begin(), bounds.end(), scaled) - bounds.begin());  // bucketize, right=False
}

float MaxAbs(const float* values, int64_t n) {
  float most = 0.0f;
  for (int64_t i = 0; i < n; ++i) most = std::max(most, std::fabs(values[i]));
  return most;
}

}  // namespace

Nf4Weight Nf4Quantize(const float* values, int64_t n) {
  Nf4Weight w;
  w.packed.assign(static_cast<size_t>((n + 1) / 2), 0);
  w.absmax.reserve(static_cast<size_t>((n + kNf4BlockSize - 1) / kNf4BlockSize));
  for (int64_t first = 0; first < n; first += kNf4BlockSize) {
    const int64_t count = std::min(kNf4BlockSize, n - first);
    const float* block = values + first;
    const bool full = count == kNf4BlockSize;
    // full blocks: A_com * (1.0 / absmax.clamp(min=1e-38)); the remainder: A / am, am clamped and kept so
    const float absmax = full ? MaxAbs(block, count) : std::max(MaxAbs(block, count), 1e-38f);
    const float reciprocal = 1.0f / std::max(absmax, 1e-38f);
    w.absmax.push_back(absmax);
    for (int64_t i = 0; i < count; ++i) {
      const float scaled = std::clamp(full ? block[i] * reciprocal : block[i] / absmax, -1.0f, 1.0f);
      const int64_t at = first + i;
      w.packed[static_cast<size_t>(at / 2)] |= static_cast<uint8_t>(Index(scaled) << (at % 2 == 0 ? 4 : 0));
    }
  }
  if (n % 2 != 0) w.packed.back() |= Index(0.0f);  // F.pad(scaled, (0, 1)): a zero's index in the low nibble
  return w;
}

void Nf4Dequantize(const uint8_t* packed, const float* absmax, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = packed[i / 2];
    const uint8_t index = i % 2 == 0 ? byte >> 4 : byte & 0xF;
    out[i] = kNf4Code[index] * absmax[i / kNf4BlockSize];
  }
}

std::vector<float> Nf4StorageElements(const std::vector<uint8_t>& bytes, DType storage) {
  const size_t element = storage == DType::kBf16 ? 2 : 4;
  std::vector<float> out(bytes.size() / element);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, bytes.data() + i * element, element);  // little-endian: the first byte lowest
    if (element == 2) bits <<= 16;
    std::memcpy(&out[i], &bits, 4);
  }
  return out;
}

std::vector<uint8_t> Nf4PackedBytes(const float* elements, int64_t count, DType storage) {
  const size_t element = storage == DType::kBf16 ? 2 : 4;
  std::vector<uint8_t> out(static_cast<size_t>(count) * element);
  for (size_t i = 0; i < static_cast<size_t>(count); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &elements[i], 4);
    if (element == 2) bits >>= 16;
    std::memcpy(out.data() + i * element, &bits, element);
  }
  return out;
}

}  // namespace fsdp::runtime
