// The first bytes of a .safetensors file: the 8-byte length and the JSON header, checked against
// a file of the input's size.
#include <cstdint>
#include <string_view>

#include "runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view head(reinterpret_cast<const char*>(data), size);
  auto checkpoint = fsdp::runtime::Checkpoint::FromHead("fuzz.safetensors", head, size);
  if (checkpoint.ok()) (void)checkpoint.value().Fingerprint();
  return 0;
}
