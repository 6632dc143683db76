// A --tokens file.
#include <cstdint>
#include <string_view>

#include "cli/token_file.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kVocab = 32000;
  auto tokens = fsdp::ParseTokens(std::string_view(reinterpret_cast<const char*>(data), size), kVocab, "tokens.txt");
  if (!tokens.ok()) return 0;
  for (int32_t t : tokens.value()) fsdp::fuzz::Require(t >= 0 && t < kVocab, "every id is in the vocabulary");
  return 0;
}
