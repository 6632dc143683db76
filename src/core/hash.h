// FNV-1a (64-bit): the fingerprints ranks compare to agree on a run, without a hashing library.
// http://www.isthe.com/chongo/tech/comp/fnv/ ("FNV-1a", offset basis and prime for 64 bits).
#pragma once

#include <cstdint>
#include <string_view>

namespace fsdp {

inline constexpr uint64_t kFnv1aOffsetBasis = 1469598103934665603ULL;

/// The FNV-1a hash of `bytes`, continuing from `h` (the offset basis for a fresh hash).
inline uint64_t Fnv1a(std::string_view bytes, uint64_t h = kFnv1aOffsetBasis) {
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ULL;
  return h;
}

}  // namespace fsdp
