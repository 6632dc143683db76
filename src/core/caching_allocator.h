// PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator), as
// a policy over a swappable device-memory backend: the planner replays a step's allocations on a
// backend that only counts bytes against a capacity, fsdp-run's GPU engine on one that calls
// cudaMalloc. Reserved bytes (what the GPU runs out of) are the backend's; allocated bytes the
// blocks handed out. Every rule below names the PyTorch function it follows; docs/memory-model.md
// ("The caching allocator") walks through them with a worked layout.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace fsdp {

/// The allocator's constants (CUDACachingAllocator.cpp, top of file).
namespace alloc {
constexpr int64_t kMinBlockSize = 512;             ///< every request is rounded to a multiple
constexpr int64_t kSmallSize = 1 << 20;            ///< requests up to 1 MiB use the small pool
constexpr int64_t kSmallBuffer = 2 << 20;          ///< small-pool segments (and expandable pages) are 2 MiB
constexpr int64_t kMinLargeAlloc = 10 << 20;       ///< requests under 10 MiB take a large segment
constexpr int64_t kLargeBuffer = 20 << 20;         ///< large segment by default: for 1-10 MiB requests, and the expandable large-pool page
constexpr uint64_t kMaxLargeSegmentMiB = 1 << 30;  ///< large_segment_size_mb above 1 PiB is refused (no device holds one)
constexpr int64_t kRoundLarge = 2 << 20;           ///< larger requests get a segment rounded to 2 MiB
constexpr int kRoundupIntervals = 16;              ///< roundup_power2_divisions intervals: 1 MiB .. 32 GiB and above
constexpr int64_t kNoMaxSplit = std::numeric_limits<int64_t>::max();
}  // namespace alloc

/// PYTORCH_CUDA_ALLOC_CONF as c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp
/// of PyTorch 2.11 parse it. Keys that do not change device memory (release_lock_on_cudamalloc,
/// pinned_*, graph_capture_record_stream_reuse, their HIP spellings) are accepted and ignored.
struct AllocatorConfig {
  int64_t max_split_size_bytes = alloc::kNoMaxSplit;             ///< max_split_size_mb
  int64_t max_non_split_rounding_bytes = alloc::kLargeBuffer;    ///< max_non_split_rounding_mb (default: the large segment)
  /// large_segment_size_mb: the segment a 1-10 MiB request takes (get_allocation_size), the
  /// expandable large pool's page, and the least max_split_size_mb may be
  int64_t large_segment_bytes = alloc::kLargeBuffer;
  /// per_process_memory_fraction: below 1 (0 included) the allocator may reserve only this share
  /// of the device's total memory, and garbage_collection_threshold acts (setMemoryFraction)
  double per_process_memory_fraction = 1.0;
  std::array<int64_t, alloc::kRoundupIntervals> roundup_power2_divisions{};  ///< per power-of-two interval from 1 MiB; 0 off
  double garbage_collection_threshold = 0.0;                     ///< only acts with a memory fraction set
  bool expandable_segments = false;
  std::string text;                                              ///< as given (for reports)
};

/// setMemoryFraction: what the allocator may reserve on a device of `total_bytes` under the config's
/// per_process_memory_fraction (below 1, 0 included), or -1 where it sets no cap.
int64_t FractionCapBytes(const AllocatorConfig& config, int64_t total_bytes);

/// round_size(): the size a request of `bytes` is rounded to under `config` (512-byte multiples,
/// or roundup_power2_divisions steps between powers of two).
int64_t RoundAllocationSize(const AllocatorConfig& config, int64_t bytes);

/// Parses a PYTORCH_CUDA_ALLOC_CONF string ("" is the default). An unknown key, a malformed value
/// or one PyTorch rejects (max_split_size_mb below the large segment, a threshold outside (0, 1),
/// divisions not a power of two, large_segment_size_mb <= 10) is an error naming it;
/// backend:cudaMallocAsync is refused (a different allocator). Stricter than PyTorch in one way: a
/// number followed by anything ("512MB") is an error here, where std::stoull reads 512 and drops
/// the rest.
Result<AllocatorConfig> ParseAllocatorConfig(std::string_view text);

/// Where segments come from: cudaMalloc/cudaFree, or cuMemAddressReserve/cuMemMap for expandable
/// segments. Addresses are opaque integers to the policy.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  /// cudaMalloc of `bytes`; nullopt when the device is out of memory.
  virtual std::optional<uint64_t> Malloc(int64_t bytes) = 0;
  virtual void Free(uint64_t address, int64_t bytes) = 0;
  /// Virtual address range for an expandable segment (cuMemAddressReserve); nothing is backed yet.
  virtual uint64_t ReserveAddressRange(int64_t bytes) = 0;
  /// Backs [address, address + bytes) with physical pages (cuMemCreate + cuMemMap); false when out of memory.
  virtual bool Map(uint64_t address, int64_t bytes) = 0;
  virtual void Unmap(uint64_t address, int64_t bytes) = 0;
  /// Total device memory (cudaGetDeviceProperties().totalGlobalMem): sizes the expandable ranges.
  virtual int64_t TotalBytes() const = 0;
  /// Waits for the device before the out-of-memory path returns blocks still awaiting their events
  /// (synchronize_and_free_events); false when the wait failed (the malloc then fails too).
  virtual bool Synchronize() { return true; }
};

/// A backend that only counts: `limit_bytes` of memory the allocator may reserve (the card's
/// capacity less what lives outside the allocator), fake addresses. What the planner replays on.
class CountingDeviceMemory final : public DeviceMemory {
 public:
  CountingDeviceMemory(int64_t limit_bytes, int64_t total_bytes) : limit_(limit_bytes), total_(total_bytes) {}
  std::optional<uint64_t> Malloc(int64_t bytes) override;
  void Free(uint64_t address, int64_t bytes) override;
  uint64_t ReserveAddressRange(int64_t bytes) override;
  bool Map(uint64_t address, int64_t bytes) override;
  void Unmap(uint64_t address, int64_t bytes) override;
  int64_t TotalBytes() const override { return total_; }
  int64_t used_bytes() const { return used_; }

 private:
  int64_t limit_, total_, used_ = 0;
  uint64_t next_address_ = uint64_t{1} << 40;
};

/// One pool's share of the statistics (torch.cuda.memory_stats' small_pool / large_pool entries).
struct PoolStats {
  int64_t reserved_bytes = 0, reserved_peak_bytes = 0;  ///< reserved_bytes.<pool>.current / .peak
  int64_t segments = 0, segments_peak = 0;              ///< segment.<pool>.current / .peak (expandable: not counted)
};

/// The allocator's statistics (torch.cuda.memory_stats names).
struct AllocatorStats {
  int64_t allocated_bytes = 0, allocated_peak_bytes = 0;  ///< allocated_bytes.all.current / .peak
  /// active_bytes.all.current / .peak: the allocated blocks and the freed ones still awaiting
  /// their recorded streams' events (free() lowers allocated_bytes at once, free_block() lowers
  /// active_bytes when the block goes back to its pool)
  int64_t active_bytes = 0, active_peak_bytes = 0;
  int64_t reserved_bytes = 0, reserved_peak_bytes = 0;    ///< reserved_bytes.all.current / .peak
  int64_t segments = 0;                                   ///< segment.all.current (expandable: mapped ranges not counted)
  int64_t num_alloc_retries = 0;                          ///< mallocs that freed the cache and retried
  int64_t num_ooms = 0;
  int64_t num_device_alloc = 0, num_device_free = 0;      ///< cudaMalloc/map and cudaFree/unmap calls
  /// The most allocated while reserved stood at its peak (fragmentation = reserved_peak - this:
  /// the reserve the allocations never used, at the tightest moment).
  int64_t allocated_at_reserved_peak_bytes = 0;
  PoolStats small_pool, large_pool;  ///< requests up to 1 MiB, and the rest
};

/// One block of a segment as torch.cuda.memory_snapshot() shows it.
struct BlockView {
  int64_t offset = 0;  ///< from the segment's start
  int64_t bytes = 0;
  bool allocated = false;
  bool awaiting_events = false;  ///< freed, its recorded streams not yet passed
  bool operator==(const BlockView&) const = default;
};
struct SegmentView {
  int stream = 0;
  bool small_pool = false;
  bool expandable = false;
  int64_t bytes = 0;  ///< mapped bytes
  std::vector<BlockView> blocks;
  bool operator==(const SegmentView&) const = default;
};

class SizeIndex;

/// DeviceCachingAllocator for one device. Streams are small integers, 0 to 63 (0 the default stream).
class CachingAllocator {
 public:
  using Handle = int;
  static constexpr Handle kNoHandle = -1;

  /// The memory fraction is the config's per_process_memory_fraction (torch.cuda.
  /// set_per_process_memory_fraction sets the same cap).
  CachingAllocator(const AllocatorConfig& config, DeviceMemory& memory);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  /// malloc(): a block of at least `bytes` usable on `stream`, or kNoHandle when even after freeing
  /// the cache the device is out of memory (PyTorch raises OutOfMemoryError; num_ooms counts it).
  Handle Malloc(int64_t bytes, int stream);
  /// Requests above this (1 PiB: no device holds one) fail at once as an out-of-memory.
  static constexpr int64_t kMaxRequestBytes = int64_t{1} << 50;
  /// recordStream(): the block is used on another stream too; its free waits for that stream.
  void RecordStream(Handle block, int stream);
  /// free(): a block with recorded streams waits for their events (EventsPassed), others go back
  /// to their pool at once, merged with free neighbours.
  void Free(Handle block);
  /// The GPU has passed the events recorded at a block's free (process_events for that block).
  void EventsPassed(Handle block);
  /// emptyCache(): returns every unsplit cached block (and empty expandable pages) to the device.
  void EmptyCache();
  /// resetPeakStats().
  void ResetPeaks();

  const AllocatorStats& stats() const { return stats_; }
  /// Rounded size of a live block (what allocated_bytes counts for it), and its address.
  int64_t BlockBytes(Handle block) const;
  uint64_t BlockAddress(Handle block) const;
  /// round_size(): the size a request of `bytes` is rounded to.
  int64_t RoundSize(int64_t bytes) const;
  /// Segments with their blocks, ordered by stream, pool and address.
  std::vector<SegmentView> Snapshot() const;

 private:
  friend class SizeIndex;
  struct Block;
  struct Pool;
  struct Expandable;
  Pool& PoolFor(int64_t size);
  bool GetFreeBlock(Pool& pool, int stream, int64_t size, int& found);
  bool AllocBlock(Pool& pool, int stream, int64_t size, int64_t alloc_size, bool retry, int& found);
  bool ReleaseAvailableCachedBlocks(Pool& pool, int stream, int64_t size);
  void ReleaseCachedBlocks();
  void ReleaseBlocks(Pool& pool);
  void ReleaseBlock(int block);
  void UnmapBlock(int block);
  void GarbageCollect();
  int AllocFoundBlock(int block, int64_t size, bool split);
  bool ShouldSplit(const Block& block, int64_t size) const;
  void FreeBlock(int block);
  int64_t TryMerge(int dst, int src, Pool& pool);
  int TryAllocateExpandable(Pool& pool, int stream, int64_t size);
  int FindExpandableBlock(Pool& pool, int stream, int64_t size);
  bool MapBlock(int block, int64_t size);
  int NewBlock(int stream, int64_t size, Pool* pool, uint64_t address);
  void DeleteBlock(int block);
  void Splice(int block, int before, int after);
  void InsertFree(int block);
  /// Reserved bytes (and, for a cudaMalloc'd segment, the segment count) of `pool` up or down.
  void AddReserved(const Pool& pool, int64_t bytes, int segments);
  void AddAllocated(int64_t bytes);

  AllocatorConfig config_;
  DeviceMemory& memory_;
  std::vector<Block> blocks_;
  std::vector<int> free_ids_;
  std::unique_ptr<Pool> small_, large_;
  std::vector<std::unique_ptr<Expandable>> expandable_;
  int64_t allowed_memory_maximum_ = 0;  ///< set_fraction: a cap below the device's total
  bool set_fraction_ = false;
  AllocatorStats stats_;
};

}  // namespace fsdp
