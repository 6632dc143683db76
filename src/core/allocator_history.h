// Replays a recorded allocation history on CachingAllocator: PyTorch's own on a GPU
// (torch.cuda.memory._record_memory_history, written by tools/torch_reference.py
// --memory-history), or the CPU's request sequence, which the same option writes on --device cpu
// from torch.profiler's allocation events. The first checks the allocator's rules against
// PyTorch's (caching_allocator_test); the second, without a GPU, the order and sizes of the
// requests fsdp-plan's replay makes (bench/allocator_replay).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/caching_allocator.h"
#include "core/json_io.h"
#include "core/status.h"

namespace fsdp {

/// A request of the history that grew the reserve (a cudaMalloc, or more of an expandable segment mapped).
struct ReserveGrowth {
  int64_t event = 0;           ///< its index in "events"
  int64_t request_bytes = 0;
  int stream = 0;              ///< as numbered by the replay
  int64_t reserved_after_bytes = 0;
  std::string context;         ///< the event's fifth element when a string, else empty
};

struct HistoryReplay {
  AllocatorStats stats;                 ///< the allocator's, after the whole history
  int64_t reserved_at_start_bytes = 0;  ///< after the start layout
  int64_t device_allocs_at_start = 0;
  int64_t events = 0;                   ///< allocs and completed frees replayed
  int64_t segments_recorded = 0;        ///< segment_alloc events of the history (a GPU's; 0 from a CPU)
  int64_t unknown_frees = 0;            ///< frees of addresses neither the start layout nor the history allocated
  std::vector<ReserveGrowth> growth;    ///< in order, the events' (not the start layout's)
};

/// `history`: {"events": [[action, address, bytes, stream], ...]} with the layout at its start,
/// either "segments_at_start" ([address, bytes, stream, "large" | "small", [[block bytes,
/// state], ...]]: PyTorch's segments, re-made block by block, the "active_allocated" ones left
/// allocated) or "live_at_start" ([[address, bytes], ...]: storages alive when the CPU's
/// recording began, allocated in that order). Actions: "alloc" is a malloc, "free_requested" a
/// free() whose block waits for other streams (allocated no more, not yet reusable),
/// "free_completed" the block back in its pool (after a "free_requested": its events passed;
/// alone: this allocator's Free), and "segment_alloc" is counted; the rest are skipped. Stream 0 is stream 0 here and the others
/// are numbered 1, 2, ... as they first appear (each its own pools, as on the GPU). Malformed
/// input is an error naming the entry; an out-of-memory stops the replay with one.
Result<HistoryReplay> ReplayAllocatorHistory(const Json& history, const AllocatorConfig& config, DeviceMemory& device);

/// One request of a history, as ReplayAllocatorHistory reads it.
struct HistoryEvent {
  enum class Action { kAlloc, kFreeRequested, kFreeCompleted };
  Action action = Action::kAlloc;
  int64_t address = 0;  ///< any number naming the block, unique among the live ones
  int64_t bytes = 0;    ///< as requested (the allocator rounds)
  int stream = 0;       ///< 0 the default stream
  std::string context;  ///< what made it (the CPU recording's op name; fsdp-plan's phase and category)
};

/// A history of `events` (no start layout: the first event is the first request), with `source`
/// saying where it came from: the document ReplayAllocatorHistory replays, each event
/// [action, address, bytes, stream, context] with the actions "alloc", "free_requested" (the
/// tensor dropped, its block not yet back: record_stream) and "free_completed".
Json AllocatorHistoryJson(const std::vector<HistoryEvent>& events, const std::string& source);

}  // namespace fsdp
