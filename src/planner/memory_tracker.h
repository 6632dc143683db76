// Live-bytes bookkeeping for a played-out step: allocations by category, frees, buffers whose free
// the GPU has not reached yet, and the peaks of both views.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "core/allocator_history.h"
#include "core/caching_allocator.h"
#include "core/phase.h"
#include "planner/memory_model.h"

namespace fsdp {
struct SavedTensor;

/// Device bytes by category after one event, with the phase it happened in.
struct TrackedPoint {
  Phase phase;
  CategoryBytes device{};
  int64_t reserved_bytes = 0;  ///< the caching allocator's reserved bytes then (no allocator: the device bytes)
};

/// Handle of one live allocation; kNoBlock for zero-byte requests.
using BlockId = int;
constexpr BlockId kNoBlock = -1;

/// The CUDA streams FSDP allocates on (the caching allocator keeps one cache per stream).
enum class Stream {
  kCompute = 0,     ///< the default stream: activations, autograd's gradients, optimizer
  kUnshard = 1,     ///< FSDP1's unshard stream (all-gather outputs); FSDP2's all-gather copy-in stream
  kPreUnshard = 2,  ///< FSDP1's pre-unshard stream (the low-precision shard, the offload staging copy)
  kReduce = 3,      ///< FSDP1's post-backward stream; FSDP2's reduce-scatter stream (outputs and upcasts)
};

/// One request the tracker passed on (MemoryTracker::RecordRequests): a HistoryEvent before its
/// context is named.
struct TrackedRequest {
  HistoryEvent::Action action;
  int64_t address;  ///< a block's id; AllocatorOnly's blocks numbered from kAllocatorOnlyAddress
  int64_t bytes;    ///< as requested
  int stream;       ///< the allocator's stream (every one the compute stream under one_stream)
  MemCategory category;
  Phase phase;
};
constexpr int64_t kAllocatorOnlyAddress = int64_t{1} << 40;

class MemoryTracker {
 public:
  /// `rounding_bytes`: every allocation is rounded up to a multiple (PyTorch: 512).
  MemoryTracker(int64_t rounding_bytes, bool record_timeline);
  /// The same, each allocation also replayed on PyTorch's caching allocator with `config`, which may
  /// reserve at most `limit_bytes` (the card less what lives outside the allocator) of a device of
  /// `device_bytes`. `one_stream`: every request on the compute stream, as PyTorch makes them on a
  /// CPU device (one stream, no record_stream: a freed block is reusable at once), for comparing the
  /// replay with a CPU recording; not what a GPU does.
  MemoryTracker(int64_t rounding_bytes, bool record_timeline, const AllocatorConfig& config, int64_t limit_bytes, int64_t device_bytes,
                bool one_stream = false);
  ~MemoryTracker();

  /// From now on appends every request to `log` (null stops): each Alloc and AllocatorOnly block
  /// an "alloc", each Free a "free_completed", FreeToPending a "free_requested" and its release
  /// the "free_completed" (or at once a "free_completed" where the pool's user is the block's own
  /// stream, as under one_stream: record_stream then records nothing). Replayed by
  /// ReplayAllocatorHistory, the log gives this tracker's reserved bytes, segment for segment.
  void RecordRequests(std::vector<TrackedRequest>* log) { log_ = log; }

  /// Names what the step is doing; peaks report the phase they happened in.
  void SetPhase(Phase phase) { phase_ = phase; }
  const Phase& phase() const { return phase_; }

  BlockId Alloc(MemCategory category, int64_t bytes, Stream stream = Stream::kCompute);
  /// Blocks the caching allocator hands out together and takes back at once, outside the tensors'
  /// accounting (no category, no allocated peak): their only effect is on the allocator's
  /// segments and reserved bytes. Without an allocator, nothing.
  void AllocatorOnly(const std::vector<int64_t>& bytes, Stream stream = Stream::kCompute);
  /// Moves a live block to another category (a reduce-scatter output that becomes the sharded gradient).
  void Recategorize(BlockId block, MemCategory category);
  /// Frees a block (kNoBlock is ignored) and sets the handle to kNoBlock.
  void Free(BlockId& block);
  /// Streams whose freed blocks the caching allocator cannot reuse until the stream passes them
  /// (record_stream): the all-gather stream's unsharded buffers (used by the compute stream), the
  /// post-backward stream's gradients (used by the reduce stream), and FSDP1's all-gather inputs
  /// (made on the pre-unshard stream, used by the all-gather on the unshard stream).
  enum class Pool { kAllGather, kPostBackward, kAllGatherInput };
  static constexpr int kPoolCount = 3;

  /// Frees a block for the allocator's bookkeeping (allocated bytes drop) while the GPU may still
  /// use it: its bytes stay on the device, in their category, until the pool releases them, or
  /// until a malloc frees the cache and retries, which first synchronizes the device
  /// (release_cached_blocks -> synchronize_and_free_events) and so releases every pool.
  void FreeToPending(BlockId& block, Pool pool);
  /// Number of buffers waiting in a pool.
  size_t PendingCount(Pool pool) const { return pending_[static_cast<int>(pool)].size(); }
  /// Drops the oldest pending buffer of a pool (e.g. the rate limiter synchronising on its event).
  void ReleaseOldestPending(Pool pool);
  /// Drops every pending buffer of a pool but the newest: the GPU one unit behind the host, the
  /// replay's rule where a buffer's event is a question of GPU time.
  void ReleaseAllButNewest(Pool pool);
  void ReleaseAllPending(Pool pool);
  void ReleaseAllPending();

  /// Device bytes now (allocated + pending) by category, and the pending buffers per pool: what a
  /// replay compares to see that the state repeats.
  CategoryBytes DeviceNow() const;
  std::vector<size_t> PendingCounts() const;

  int64_t allocated_peak() const { return allocated_peak_; }
  const Phase& allocated_peak_phase() const { return allocated_peak_phase_; }
  /// Device view (allocated + pending) at its peak, by category.
  const CategoryBytes& device_peak() const { return device_peak_; }
  const Phase& device_peak_phase() const { return device_peak_phase_; }
  int64_t pending_at_peak() const { return pending_at_peak_; }
  std::vector<TrackedPoint> TakeTimeline() { return std::move(timeline_); }
  /// Starts the peaks (and the timeline) over, as torch.cuda.reset_peak_memory_stats() between steps.
  void ResetPeaks();

  /// The caching allocator's view (null without one): its statistics, the phase in which reserved
  /// memory reached its peak, and whether a malloc failed.
  const CachingAllocator* allocator() const { return allocator_.get(); }
  const Phase& reserved_peak_phase() const { return reserved_peak_phase_; }
  /// Reserved memory has not grown since ResetPeaks: its peak was reached before (phase from then).
  bool reserved_peak_in_first_step() const { return reserved_peak_before_reset_; }
  bool out_of_memory() const { return oom_; }
  const Phase& out_of_memory_phase() const { return oom_phase_; }

 private:
  struct Block {
    MemCategory category;
    int64_t bytes;
    CachingAllocator::Handle handle = CachingAllocator::kNoHandle;
    BlockId id = kNoBlock;
    Stream stream = Stream::kCompute;
  };
  void Log(HistoryEvent::Action action, int64_t address, int64_t bytes, Stream stream, MemCategory category) {
    if (log_) log_->push_back(TrackedRequest{action, address, bytes, AllocatorStream(stream), category, phase_});
  }
  void FreeBlock(Block& b);
  /// The pool's user stream is not the block's: record_stream defers its return to the pool.
  bool Deferred(Pool pool, const Block& block) const;
  void Release(Pool pool, const Block& block);
  void Changed();
  int AllocatorStream(Stream stream) const { return one_stream_ ? static_cast<int>(Stream::kCompute) : static_cast<int>(stream); }
  int64_t ReservedNow(const CategoryBytes& device) const;

  int64_t rounding_;
  bool record_;
  bool one_stream_ = false;
  Phase phase_;
  std::vector<Block> blocks_;
  CategoryBytes live_{};
  std::deque<Block> pending_[kPoolCount];
  CategoryBytes pending_bytes_{};
  int64_t allocated_total_ = 0;   // sum of live_
  int64_t pending_total_ = 0;     // sum of pending_bytes_
  int64_t allocated_peak_ = 0;
  Phase allocated_peak_phase_;
  CategoryBytes device_peak_{};
  int64_t device_peak_total_ = -1;
  Phase device_peak_phase_;
  int64_t pending_at_peak_ = 0;
  std::vector<TrackedPoint> timeline_;
  std::unique_ptr<CountingDeviceMemory> device_memory_;
  std::unique_ptr<CachingAllocator> allocator_;
  Phase reserved_peak_phase_;
  bool reserved_peak_before_reset_ = false;
  bool oom_ = false;
  Phase oom_phase_;
  std::vector<TrackedRequest>* log_ = nullptr;
  int64_t allocator_only_blocks_ = 0;
};

/// A forward's saved tensors, in order, with the transients made between them (activations):
/// a tensor's SavedTensor::made_before ones are allocated before it, each freed just before the
/// allocation that follows the `outlives` next ones; its then_transient_bytes one right after it,
/// counted alike by `then_transient_spans` (then_transient allocations are not counted). Those
/// still held are freed when this object ends. The saved tensors' blocks are the caller's.
class TransientsBetween {
 public:
  explicit TransientsBetween(MemoryTracker& mem) : mem_(mem) {}
  ~TransientsBetween();
  TransientsBetween(const TransientsBetween&) = delete;
  TransientsBetween& operator=(const TransientsBetween&) = delete;
  BlockId Alloc(const SavedTensor& tensor);
  /// A transient of `bytes` made now (after the frees due), held until this object ends.
  void AllocTransient(int64_t bytes);

 private:
  struct Pending {
    BlockId block;
    int left;  ///< allocations still to be made before it is freed
  };
  BlockId AllocAfterFrees(int64_t bytes);
  MemoryTracker& mem_;
  std::vector<Pending> pending_;
};

}  // namespace fsdp
