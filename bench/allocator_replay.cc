// Replays a recorded allocation history (tools/torch_reference.py --memory-history: PyTorch's own
// on a GPU, or the CPU's request sequence on --device cpu) on fsdp's model of PyTorch's caching
// allocator and prints what it reserved. On a CPU recording this is PyTorch's request sequence
// under the GPU's allocator rules: set beside fsdp-plan's reserved figure for the same
// configuration, it separates an error in the requests fsdp-plan makes from one in the rules.
// --growth also lists each request that grew the reserve, with what made it (the recording's op,
// fsdp-plan --alloc-trace's phase and category): where two replays' reserves part.
//   build/bench/allocator_replay [--growth] HISTORY.json ["PYTORCH_CUDA_ALLOC_CONF"]
#include <cstdio>
#include <string>

#include "core/allocator_history.h"
#include "core/json_io.h"

int main(int argc, char** argv) {
  const bool growth = argc > 1 && std::string(argv[1]) == "--growth";
  if (growth) {
    --argc;
    ++argv;
  }
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: allocator_replay [--growth] HISTORY.json [ALLOC_CONF]\n");
    return 2;
  }
  auto doc = fsdp::LoadJsonFile(argv[1]);
  if (!doc.ok()) { std::fprintf(stderr, "allocator_replay: %s\n", doc.error().message.c_str()); return 2; }
  auto config = fsdp::ParseAllocatorConfig(argc > 2 ? argv[2] : "");
  if (!config.ok()) { std::fprintf(stderr, "allocator_replay: %s\n", config.error().message.c_str()); return 2; }
  fsdp::CountingDeviceMemory device(int64_t{1} << 50, int64_t{1} << 50);
  auto r = fsdp::ReplayAllocatorHistory(doc.value(), config.value(), device);
  if (!r.ok()) { std::fprintf(stderr, "allocator_replay: %s\n", r.error().message.c_str()); return r.error().kind == fsdp::Error::Kind::kBadInput ? 2 : 1; }
  const fsdp::HistoryReplay& h = r.value();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::printf("reserved_peak_bytes %lld (%.3f GiB)\n", static_cast<long long>(h.stats.reserved_peak_bytes), h.stats.reserved_peak_bytes / gib);
  std::printf("allocated_peak_bytes %lld (%.3f GiB)\n", static_cast<long long>(h.stats.allocated_peak_bytes), h.stats.allocated_peak_bytes / gib);
  std::printf("reserved_at_start_bytes %lld\n", static_cast<long long>(h.reserved_at_start_bytes));
  std::printf("small_pool_reserved_peak_bytes %lld\n", static_cast<long long>(h.stats.small_pool.reserved_peak_bytes));
  std::printf("device_allocs %lld (at start %lld)\n", static_cast<long long>(h.stats.num_device_alloc), static_cast<long long>(h.device_allocs_at_start));
  std::printf("alloc_retries %lld\n", static_cast<long long>(h.stats.num_alloc_retries));
  if (growth) {
    for (const fsdp::ReserveGrowth& g : h.growth) {
      std::printf("grew at event %lld: %lld bytes on stream %d, reserved %lld (%.3f GiB)  %s\n", static_cast<long long>(g.event),
                  static_cast<long long>(g.request_bytes), g.stream, static_cast<long long>(g.reserved_after_bytes), g.reserved_after_bytes / gib,
                  g.context.c_str());
    }
  }
  std::printf("events %lld, frees of storages made before the recording %lld\n", static_cast<long long>(h.events), static_cast<long long>(h.unknown_frees));
  return 0;
}
