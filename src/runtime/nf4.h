// bitsandbytes' NF4 weight format (QLoRA: Dettmers et al. 2023, arXiv:2305.14314), as bitsandbytes
// 0.50.2 quantizes and dequantizes on the CPU: backends/default/ops.py (quantize_4bit,
// _dequantize_4bit_compute), functional.py (get_4bit_type("nf4"), quantize_4bit's QuantState).
// fsdp-run's CPU engine stores a QLoRA model's block linears so (fsdp_engine.h).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace fsdp::runtime {

/// NF4's 16 values, code i for the 4-bit index i (functional.py get_4bit_type("nf4"): the normal
/// quantiles create_normal_map(offset=0.9677083, use_extra_value=True) gives, stored as fp32).
inline constexpr std::array<float, 16> kNf4Code = {
    -1.0f,          -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, -0.18477343022823334f,
    -0.09105003625154495f, 0.0f,          0.07958029955625534f, 0.16093020141124725f,  0.24611230194568634f,  0.33791524171829224f,
    0.44070982933044434f,  0.5626170039176941f, 0.7229568362236023f, 1.0f};
/// Linear4bit's blocksize (bitsandbytes nn/modules.py Params4bit: 64): one absmax per 64 weights.
inline constexpr int64_t kNf4BlockSize = 64;

/// One weight quantized: two 4-bit indices a byte, the even element in the high nibble
/// ((n + 1) / 2 bytes), and the fp32 absmax of each block of 64 (the last block may be shorter).
struct Nf4Weight {
  std::vector<uint8_t> packed;
  std::vector<float> absmax;
};

/// quantize_4bit(A, blocksize=64, quant_type="nf4") of n finite fp32 values (A.reshape(-1).float();
/// fsdp-run's starting values are finite: Checkpoint::Read refuses others; bitsandbytes sends a
/// NaN to index 15 and makes its block's absmax NaN, which this does not reproduce),
/// as the default backend computes it: a full block's absmax = max |a|, scaled = clamp(a * (1 /
/// max(absmax, 1e-38)), -1, 1) (the reciprocal rounded to fp32, then the product); a shorter last
/// block's absmax = max(max |a|, 1e-38), scaled = clamp(a / absmax, -1, 1); index = the number of
/// bucket bounds below scaled (torch.bucketize, right=False), the bounds being the fp32 midpoints
/// (code[i] + code[i + 1]) / 2; an odd n padded with one zero index.
Nf4Weight Nf4Quantize(const float* values, int64_t n);

/// dequantize_4bit: out[i] = code[index i] * absmax[i / 64], an fp32 product, from (n + 1) / 2
/// packed bytes and (n + 63) / 64 absmax (out: n floats).
void Nf4Dequantize(const uint8_t* packed, const float* absmax, int64_t n, float* out);

/// The packed bytes viewed as `storage` elements (bnb_4bit_quant_storage: packed.view(storage),
/// little-endian), as fsdp-run holds an element: the float whose bits a bf16 element has in its
/// upper 16 bits, or an fp32 element's own. bytes.size() must be a multiple of the element size.
/// Only bf16 and fp32 storage (an fp16 element's bits do not survive fsdp-run's float buffers).
std::vector<float> Nf4StorageElements(const std::vector<uint8_t>& bytes, DType storage);
/// The bytes of `count` such elements (the inverse).
std::vector<uint8_t> Nf4PackedBytes(const float* elements, int64_t count, DType storage);

}  // namespace fsdp::runtime
