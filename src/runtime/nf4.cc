#include "runtime/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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

const std::array<float, 256> kDynamicCode = {
    -0.992968738f, -0.978906274f, -0.96484375f, -0.950781226f, -0.936718762f, -0.922656238f, -0.908593774f, -0.89453125f,
    -0.880468726f, -0.866406262f, -0.852343738f, -0.838281274f, -0.82421875f, -0.810156226f, -0.796093762f, -0.782031238f,
    -0.767968774f, -0.75390625f, -0.739843726f, -0.725781262f, -0.711718798f, -0.697656274f, -0.68359375f, -0.669531226f,
    -0.655468762f, -0.641406298f, -0.627343774f, -0.61328125f, -0.599218726f, -0.585156262f, -0.571093798f, -0.557031274f,
    -0.54296875f, -0.528906226f, -0.514843702f, -0.500781238f, -0.486718714f, -0.47265625f, -0.458593726f, -0.444531262f,
    -0.430468738f, -0.416406244f, -0.40234375f, -0.388281226f, -0.374218762f, -0.360156238f, -0.346093744f, -0.33203125f,
    -0.317968726f, -0.303906262f, -0.289843738f, -0.275781274f, -0.26171875f, -0.247656241f, -0.233593747f, -0.219531253f,
    -0.205468744f, -0.19140625f, -0.177343756f, -0.163281247f, -0.149218753f, -0.135156244f, -0.12109375f, -0.107031256f,
    -0.0985937491f, -0.0957812592f, -0.0929687545f, -0.0901562497f, -0.0873437524f, -0.0845312476f, -0.0817187577f, -0.078906253f,
    -0.0760937482f, -0.0732812509f, -0.0704687461f, -0.0676562563f, -0.0648437515f, -0.0620312504f, -0.0592187531f, -0.0564062484f,
    -0.053593751f, -0.05078125f, -0.047968749f, -0.0451562516f, -0.0423437469f, -0.0395312496f, -0.0367187522f, -0.0339062512f,
    -0.0310937501f, -0.028281251f, -0.0254687499f, -0.0226562507f, -0.0198437516f, -0.0170312505f, -0.0142187504f, -0.0114062503f,
    -0.00971874967f, -0.00915624946f, -0.00859375019f, -0.00803124998f, -0.00746874977f, -0.00690625003f, -0.00634374982f, -0.00578125007f,
    -0.00521875033f, -0.00465624966f, -0.00409374991f, -0.00353124971f, -0.00296874996f, -0.00240624999f, -0.00184375001f, -0.00128124992f,
    -0.000943750085f, -0.000831249985f, -0.00071875006f, -0.000606250076f, -0.000493750034f, -0.000381250022f, -0.000268750038f, -0.000156250011f,
    -8.87499991e-05f, -6.62500024e-05f, -4.37499984e-05f, -2.12499981e-05f, -7.7499999e-06f, -3.25000019e-06f, -5.50000038e-07f, 0.0f,
    5.50000038e-07f, 3.25000019e-06f, 7.7499999e-06f, 2.12499981e-05f, 4.37499984e-05f, 6.62500024e-05f, 8.87499991e-05f, 0.000156250011f,
    0.000268750038f, 0.000381250022f, 0.000493750034f, 0.000606250076f, 0.00071875006f, 0.000831249985f, 0.000943750085f, 0.00128124992f,
    0.00184375001f, 0.00240624999f, 0.00296874996f, 0.00353124971f, 0.00409374991f, 0.00465624966f, 0.00521875033f, 0.00578125007f,
    0.00634374982f, 0.00690625003f, 0.00746874977f, 0.00803124998f, 0.00859375019f, 0.00915624946f, 0.00971874967f, 0.0114062503f,
    0.0142187504f, 0.0170312505f, 0.0198437516f, 0.0226562507f, 0.0254687499f, 0.028281251f, 0.0310937501f, 0.0339062512f,
    0.0367187522f, 0.0395312496f, 0.0423437469f, 0.0451562516f, 0.047968749f, 0.05078125f, 0.053593751f, 0.0564062484f,
    0.0592187531f, 0.0620312504f, 0.0648437515f, 0.0676562563f, 0.0704687461f, 0.0732812509f, 0.0760937482f, 0.078906253f,
    0.0817187577f, 0.0845312476f, 0.0873437524f, 0.0901562497f, 0.0929687545f, 0.0957812592f, 0.0985937491f, 0.107031256f,
    0.12109375f, 0.135156244f, 0.149218753f, 0.163281247f, 0.177343756f, 0.19140625f, 0.205468744f, 0.219531253f,
    0.233593747f, 0.247656241f, 0.26171875f, 0.275781274f, 0.289843738f, 0.303906262f, 0.317968726f, 0.33203125f,
    0.346093744f, 0.360156238f, 0.374218762f, 0.388281226f, 0.40234375f, 0.416406244f, 0.430468738f, 0.444531262f,
    0.458593726f, 0.47265625f, 0.486718714f, 0.500781238f, 0.514843702f, 0.528906226f, 0.54296875f, 0.557031274f,
    0.571093798f, 0.585156262f, 0.599218726f, 0.61328125f, 0.627343774f, 0.641406298f, 0.655468762f, 0.669531226f,
    0.68359375f, 0.697656274f, 0.711718798f, 0.725781262f, 0.739843726f, 0.75390625f, 0.767968774f, 0.782031238f,
    0.796093762f, 0.810156226f, 0.82421875f, 0.838281274f, 0.852343738f, 0.866406262f, 0.880468726f, 0.89453125f,
    0.908593774f, 0.922656238f, 0.936718762f, 0.950781226f, 0.96484375f, 0.978906274f, 0.992968738f, 1.0f};

namespace {
// quantize_block's index for x in [-1, 1]: the code at or below x (bin_searcher->scalar, over a
// copy of the map whose code[0] quantize_cpu set to -1), or the next when strictly nearer
uint8_t DynamicIndex(float x) {
  static const std::array<float, 256> search = [] {
    std::array<float, 256> code = kDynamicCode;
    code[0] = -1.0f;
    return code;
  }();
  int64_t i = std::upper_bound(search.begin(), search.end(), x) - search.begin() - 1;
  i = std::clamp<int64_t>(i, 0, 255);
  if (i < 255 && std::fabs(x - search[static_cast<size_t>(i + 1)]) < std::fabs(x - search[static_cast<size_t>(i)])) ++i;
  return static_cast<uint8_t>(i);
}
}  // namespace

Nf4QuantState Nf4StateOf(std::vector<float> absmax, bool double_quant) {
  Nf4QuantState s;
  if (!double_quant) {
    s.absmax = std::move(absmax);
    return s;
  }
  double sum = 0;
  for (float a : absmax) sum += a;
  s.offset = static_cast<float>(sum / static_cast<double>(absmax.size()));
  constexpr size_t kBlock = 256;
  for (float& a : absmax) a -= s.offset;  // _absmax - offset, fp32
  s.absmax_q.resize(absmax.size());
  for (size_t first = 0; first < absmax.size(); first += kBlock) {
    const size_t end = std::min(absmax.size(), first + kBlock);
    float most = -std::numeric_limits<float>::max();
    for (size_t i = first; i < end; ++i) most = std::fmax(most, std::fabs(absmax[i]));
    s.absmax2.push_back(most);
    for (size_t i = first; i < end; ++i) s.absmax_q[i] = DynamicIndex(absmax[i] / most);
  }
  return s;
}

std::vector<float> Nf4QuantState::Absmax() const {
  if (absmax_q.empty()) return absmax;
  std::vector<float> out(absmax_q.size());
  for (size_t j = 0; j < out.size(); ++j) out[j] = kDynamicCode[absmax_q[j]] * absmax2[j / 256] + offset;
  return out;
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
