// --alloc-conf (PYTORCH_CUDA_ALLOC_CONF): parsed as PyTorch parses it, then a few allocations and
// frees replayed on the caching allocator it configures, which must keep its books balanced.
#include <cstdint>
#include <string>

#include "core/caching_allocator.h"
#include "fuzz/fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fsdp;
  auto conf = ParseAllocatorConfig(std::string(reinterpret_cast<const char*>(data), size));
  if (!conf.ok()) {
    fuzz::Require(conf.error().message.rfind("--alloc-conf: ", 0) == 0, "errors name the flag");
    return 0;
  }
  CountingDeviceMemory memory(int64_t{1} << 30, int64_t{1} << 30);
  CachingAllocator a(conf.value(), memory);
  const int64_t sizes[] = {100, 1 << 20, (1 << 20) + 1, 3 << 20, 11 << 20, 30 << 20, 300 << 20};
  CachingAllocator::Handle live[7];
  for (int i = 0; i < 7; ++i) live[i] = a.Malloc(sizes[i], i % 2);
  for (int i = 0; i < 7; i += 2) a.Free(live[i]);
  // (a per_process_memory_fraction or a large segment can refuse any request: PyTorch's OOM)
  const CachingAllocator::Handle last = a.Malloc(5 << 20, 0);
  for (int i = 1; i < 7; i += 2) a.Free(live[i]);
  fuzz::Require(a.stats().reserved_bytes == memory.used_bytes(), "reserved equals what the device handed out");
  fuzz::Require(last == CachingAllocator::kNoHandle || a.stats().allocated_bytes >= (5 << 20), "the live block is allocated");
  fuzz::Require(a.stats().allocated_bytes <= a.stats().reserved_bytes, "allocated within reserved");
  a.EmptyCache();
  return 0;
}
