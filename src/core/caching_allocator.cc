#include "core/caching_allocator.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cmath>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "core/dtype.h"

namespace fsdp {
namespace {

constexpr int64_t kMiB = 1 << 20;
constexpr int kSearchKey = 0;

// ConfigTokenizer: ',' ':' '[' ']' are tokens of their own, white space (std::isspace: a tab, a
// trailing newline) is dropped.
std::vector<std::string> LexAllocatorConfig(std::string_view text) {
  std::vector<std::string> tokens;
  std::string word;
  for (char c : text) {
    if (c == ',' || c == ':' || c == '[' || c == ']') {
      if (!word.empty()) tokens.push_back(std::exchange(word, {}));
      tokens.emplace_back(1, c);
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      word += c;
    }
  }
  if (!word.empty()) tokens.push_back(word);
  return tokens;
}

bool IsPowerOfTwo(uint64_t v) { return v > 0 && (v & (v - 1)) == 0; }
int Log2Floor(uint64_t v) { return 63 - std::countl_zero(v); }

// A non-negative integer token as std::stoull reads one (up to 2^64 - 1, which PyTorch then
// clamps), but refusing a sign and text after the digits.
std::optional<uint64_t> ParseCount(const std::string& s) {
  if (s.empty() || !std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  if (s.size() - std::min(s.find_first_not_of('0'), s.size()) > 20) return std::nullopt;  // (leading zeros aside) over 2^64
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), nullptr, 10);
  if (errno == ERANGE) return std::nullopt;  // stoull's out_of_range
  return v;
}

// A count that rounding treats alike from here up (divisions or intervals of 2^62 and more), kept in
// an int64.
int64_t Capped(uint64_t v) { return static_cast<int64_t>(std::min<uint64_t>(v, uint64_t{1} << 62)); }

class ConfigParser {
 public:
  explicit ConfigParser(std::string_view text) : tokens_(LexAllocatorConfig(text)) {}

  Result<AllocatorConfig> Parse(std::string_view text) {
    AllocatorConfig c;
    c.text = std::string(text);
    // AcceleratorAllocatorConfig::parseArgs reads large_segment_size_mb first, wherever it stands:
    // it is the default of max_non_split_rounding_mb and the least max_split_size_mb and
    // max_non_split_rounding_mb may be.
    for (i_ = 0; i_ < tokens_.size(); ++i_) {
      if (tokens_[i_] != "large_segment_size_mb") continue;
      Status s = LargeSegment(c);
      if (!s.ok()) return s.error();
    }
    c.max_non_split_rounding_bytes = c.large_segment_bytes;
    for (i_ = 0; i_ < tokens_.size(); ++i_) {
      const std::string key = tokens_[i_];
      Status s = Key(key, c);
      if (!s.ok()) return s.error();
      if (i_ + 1 < tokens_.size() && !Expect(",")) return Bad(fmt::format("expected ',' after the value of {}", key));
    }
    return c;
  }

 private:
  Error Bad(const std::string& what) const { return Error::BadInput(fmt::format("--alloc-conf: {}", what)); }
  bool Expect(const char* token) { return ++i_ < tokens_.size() && tokens_[i_] == token; }
  std::optional<std::string> Value() {
    if (!Expect(":") || ++i_ >= tokens_.size()) return std::nullopt;
    return tokens_[i_];
  }

  Status Bool(const std::string& key, bool& out) {
    auto v = Value();
    if (!v || (*v != "True" && *v != "False")) return Bad(fmt::format("{} takes True or False", key));
    out = *v == "True";
    return Status::Ok();
  }

  // parseMaxSplitSize, parseMaxNonSplitRoundingSize: at least the large segment size.
  Status Megabytes(const std::string& key, const AllocatorConfig& c, int64_t& out) {
    auto v = Value();
    auto mb = v ? ParseCount(*v) : std::nullopt;
    if (!mb) return Bad(fmt::format("{} takes a whole number of MiB, got '{}'", key, v.value_or("")));
    const auto least_mb = static_cast<uint64_t>(c.large_segment_bytes / kMiB);
    if (*mb < least_mb) return Bad(fmt::format("{} too small, must be >= {} (large_segment_size_mb), got {}", key, least_mb, *mb));
    out = static_cast<int64_t>(std::min<uint64_t>(*mb, alloc::kNoMaxSplit / kMiB)) * kMiB;  // parseMaxSplitSize clamps to SIZE_MAX / 1 MiB
    return Status::Ok();
  }

  // parseLargeSegmentSize: more than kMinLargeAlloc (10 MiB).
  Status LargeSegment(AllocatorConfig& c) {
    auto v = Value();
    auto mb = v ? ParseCount(*v) : std::nullopt;
    if (!mb) return Bad(fmt::format("large_segment_size_mb takes a whole number of MiB, got '{}'", v.value_or("")));
    if (*mb <= alloc::kMinLargeAlloc / kMiB) return Bad(fmt::format("large_segment_size_mb must be > {}, got {}", alloc::kMinLargeAlloc / kMiB, *mb));
    if (*mb > alloc::kMaxLargeSegmentMiB) return Bad(fmt::format("large_segment_size_mb must be at most {} (1 PiB), got {}", alloc::kMaxLargeSegmentMiB, *mb));
    c.large_segment_bytes = static_cast<int64_t>(*mb) * kMiB;
    return Status::Ok();
  }

  // parsePerProcessMemoryFraction: in [0, 1]; below 1 it caps what the allocator may reserve.
  Status Fraction(AllocatorConfig& c) {
    auto v = Value();
    char* end = nullptr;
    const double f = v ? std::strtod(v->c_str(), &end) : -1.0;
    if (!v || end == v->c_str() || *end != '\0' || !(f >= 0.0 && f <= 1.0)) {
      return Bad(fmt::format("per_process_memory_fraction must be in [0.0, 1.0], got '{}'", v.value_or("")));
    }
    c.per_process_memory_fraction = f;
    return Status::Ok();
  }

  Status Threshold(AllocatorConfig& c) {
    auto v = Value();
    char* end = nullptr;
    const double t = v ? std::strtod(v->c_str(), &end) : 0.0;
    if (!v || end == v->c_str() || *end != '\0' || !(t > 0.0 && t < 1.0)) {
      return Bad(fmt::format("garbage_collection_threshold must be in (0.0, 1.0), got '{}'", v.value_or("")));
    }
    c.garbage_collection_threshold = t;
    return Status::Ok();
  }

  // parseRoundUpPower2Divisions: one power of two for every size, or [MiB:divisions,...,>:divisions].
  Status Divisions(AllocatorConfig& c) {
    auto v = Value();
    if (!v) return Bad("roundup_power2_divisions needs a value");
    auto divisions_of = [&](const std::string& s) -> std::optional<int64_t> {
      auto d = ParseCount(s);
      if (!d || (*d != 0 && !IsPowerOfTwo(*d))) return std::nullopt;
      return Capped(*d);
    };
    if (*v != "[") {
      auto d = divisions_of(*v);
      if (!d || *d == 0) return Bad(fmt::format("roundup_power2_divisions must be a power of 2, got '{}'", *v));
      c.roundup_power2_divisions.fill(*d);
      return Status::Ok();
    }
    bool first = true;
    size_t last_index = 0;
    while (++i_ < tokens_.size() && tokens_[i_] != "]") {
      const std::string interval = tokens_[i_];
      auto d = (Expect(":") && ++i_ < tokens_.size()) ? divisions_of(tokens_[i_]) : std::nullopt;
      if (!d) return Bad(fmt::format("roundup_power2_divisions: divisions for '{}' must be 0 or a power of 2", interval));
      if (interval == ">") {
        // from the interval after the last one given (std::next(begin, last_index + 1))
        std::fill(c.roundup_power2_divisions.begin() + static_cast<long>(last_index) + 1, c.roundup_power2_divisions.end(), *d);
      } else {
        auto mb = ParseCount(interval);
        if (!mb || !IsPowerOfTwo(*mb)) return Bad(fmt::format("roundup_power2_divisions: interval '{}' must be a power of 2 (MiB)", interval));
        const size_t index = std::min<size_t>(static_cast<size_t>(Log2Floor(*mb)), alloc::kRoundupIntervals - 1);
        if (first) std::fill(c.roundup_power2_divisions.begin(), c.roundup_power2_divisions.begin() + static_cast<long>(index), *d);
        first = false;
        c.roundup_power2_divisions[index] = *d;
        last_index = index;
      }
      if (i_ + 1 < tokens_.size() && tokens_[i_ + 1] != "]" && !Expect(",")) return Bad("roundup_power2_divisions: expected ',' between intervals");
    }
    if (i_ >= tokens_.size()) return Bad("roundup_power2_divisions: missing ']'");
    return Status::Ok();
  }

  Status Key(const std::string& key, AllocatorConfig& c) {
    bool ignored = false;
    if (key == "max_split_size_mb") return Megabytes(key, c, c.max_split_size_bytes);
    if (key == "max_non_split_rounding_mb") return Megabytes(key, c, c.max_non_split_rounding_bytes);
    if (key == "large_segment_size_mb") return Value() ? Status::Ok() : Bad("large_segment_size_mb needs a value");  // read first (Parse), the last one counting: stepped over here
    if (key == "per_process_memory_fraction") return Fraction(c);
    if (key == "garbage_collection_threshold") return Threshold(c);
    if (key == "roundup_power2_divisions") return Divisions(c);
    if (key == "expandable_segments") return Bool(key, c.expandable_segments);
    // CUDAAllocatorConfig::getKeys() has the HIP spellings on CUDA builds too.
    if (key == "release_lock_on_cudamalloc" || key == "release_lock_on_hipmalloc" || key == "pinned_use_cuda_host_register" ||
        key == "pinned_use_hip_host_register" || key == "pinned_use_background_threads" || key == "graph_capture_record_stream_reuse") {
      return Bool(key, ignored);
    }
    if (key == "pinned_num_register_threads") {  // parsePinnedNumRegisterThreads: a power of 2, at most 128
      auto v = Value();
      auto n = v ? ParseCount(*v) : std::nullopt;
      if (!n || !IsPowerOfTwo(*n) || *n > 128) return Bad(fmt::format("pinned_num_register_threads must be a power of 2 up to 128, got '{}'", v.value_or("")));
      return Status::Ok();
    }
    if (key == "pinned_reserve_segment_size_mb") {  // parsePinnedReserveSegmentSize: more than 0
      auto v = Value();
      auto n = v ? ParseCount(*v) : std::nullopt;
      if (!n || *n == 0) return Bad(fmt::format("pinned_reserve_segment_size_mb must be a whole number above 0, got '{}'", v.value_or("")));
      return Status::Ok();
    }
    if (key == "backend") {
      auto v = Value();
      if (v && *v == "native") return Status::Ok();
      if (v && *v == "cudaMallocAsync") return Bad("backend:cudaMallocAsync is CUDA's stream-ordered allocator, which fsdp-plan does not model; use backend:native");
      return Bad(fmt::format("unknown allocator backend '{}' (options: native, cudaMallocAsync)", v.value_or("")));
    }
    return Bad(fmt::format("unrecognized key '{}' (known: max_split_size_mb, max_non_split_rounding_mb, large_segment_size_mb, "
                           "garbage_collection_threshold, roundup_power2_divisions, expandable_segments, per_process_memory_fraction, "
                           "backend, release_lock_on_cudamalloc, pinned_use_cuda_host_register, pinned_num_register_threads, "
                           "pinned_use_background_threads, pinned_reserve_segment_size_mb, graph_capture_record_stream_reuse)",
                           key));
  }

  std::vector<std::string> tokens_;
  size_t i_ = 0;
};

}  // namespace

Result<AllocatorConfig> ParseAllocatorConfig(std::string_view text) {
  if (text.size() > 4096) return Error::BadInput(fmt::format("--alloc-conf: {} characters, more than 4096", text.size()));
  return ConfigParser(text).Parse(text);
}

// ---- counting backend --------------------------------------------------------------------------
std::optional<uint64_t> CountingDeviceMemory::Malloc(int64_t bytes) {
  if (bytes > limit_ - used_) return std::nullopt;
  used_ += bytes;
  const uint64_t a = next_address_;
  next_address_ += static_cast<uint64_t>(bytes);
  return a;
}
void CountingDeviceMemory::Free(uint64_t, int64_t bytes) { used_ -= bytes; }
uint64_t CountingDeviceMemory::ReserveAddressRange(int64_t bytes) {
  const uint64_t a = next_address_;
  next_address_ += static_cast<uint64_t>(bytes);
  return a;
}
bool CountingDeviceMemory::Map(uint64_t, int64_t bytes) {
  if (bytes > limit_ - used_) return false;
  used_ += bytes;
  return true;
}
void CountingDeviceMemory::Unmap(uint64_t, int64_t bytes) { used_ -= bytes; }

// ---- the policy --------------------------------------------------------------------------------
struct CachingAllocator::Block {
  int stream = 0;
  int64_t size = 0;
  Pool* pool = nullptr;
  uint64_t address = 0;
  bool allocated = false;
  bool mapped = true;          // expandable segments: backed by pages
  bool awaiting = false;       // freed with recorded streams, events not yet passed
  uint64_t stream_uses = 0;    // bit per stream the block was used on (recordStream)
  int prev = -1, next = -1;    // neighbours in the segment when split
  int expandable = -1;         // index into expandable_, -1 for a cudaMalloc segment
  int64_t gc_count_base = 0;
  bool alive = false;
  bool is_split() const { return prev >= 0 || next >= 0; }
};

// The cached blocks of a pool in BlockComparatorSize's order (stream, size, address), kept as one
// ordered set of those keys per stream, like PyTorch's BlockPool::blocks (a std::set ordered by
// the comparator). Keys are held inline: comparing them is several times faster than a std::set
// of block ids that looks each block up (bench/planner_bench replays millions). A set, not a
// sorted array: a pool near the card's limit holds thousands of blocks, and every insert and
// erase of a sorted array moves a quarter of it (40% of fuzz_plan_flags' time under ASan).
// Iterators stay within one stream (begin_of, end_of).
class SizeIndex {
 public:
  struct Entry {
    int64_t size;
    uint64_t address;
    int id;
    bool operator<(const Entry& o) const { return size != o.size ? size < o.size : address < o.address; }
  };
  using Set = std::set<Entry>;
  class iterator {
   public:
    using It = Set::const_iterator;
    iterator(It it, int stream) : it_(it), stream_(stream) {}
    int operator*() const { return it_->id; }
    iterator& operator++() { ++it_; return *this; }
    iterator operator++(int) { iterator t = *this; ++it_; return t; }
    iterator& operator--() { --it_; return *this; }
    bool operator==(const iterator& o) const { return it_ == o.it_; }
    It raw() const { return it_; }
    int stream() const { return stream_; }
   private:
    It it_;
    int stream_;
  };
  explicit SizeIndex(const std::vector<CachingAllocator::Block>* blocks) : blocks_(blocks) {}
  iterator begin_of(int stream) const { return iterator(Of(stream).begin(), stream); }
  iterator end_of(int stream) const { return iterator(Of(stream).end(), stream); }
  iterator lower_bound(int id) const {
    const auto& v = Of(StreamOf(id));
    return iterator(v.lower_bound(EntryOf(id)), StreamOf(id));
  }
  void insert(int id) {
    if (spare_.empty()) {
      Of(StreamOf(id)).insert(EntryOf(id));
      return;
    }
    spare_.back().value() = EntryOf(id);
    Of(StreamOf(id)).insert(std::move(spare_.back()));
    spare_.pop_back();
  }
  void erase(int id) {
    auto& v = Of(StreamOf(id));
    auto it = v.find(EntryOf(id));
    if (it != v.end() && it->id == id) spare_.push_back(v.extract(it));
  }
  void erase(iterator it) { spare_.push_back(Of(it.stream()).extract(it.raw())); }
  std::vector<int> Ids() const {
    std::vector<int> ids;
    for (const auto& v : streams_) {
      for (const Entry& e : v) ids.push_back(e.id);
    }
    return ids;
  }

 private:
  int StreamOf(int id) const;
  Entry EntryOf(int id) const;
  static constexpr size_t kStreams = 64;
  Set& Of(int stream) { return streams_[static_cast<size_t>(stream) % kStreams]; }
  const Set& Of(int stream) const { return streams_[static_cast<size_t>(stream) % kStreams]; }
  const std::vector<CachingAllocator::Block>* blocks_;
  std::array<Set, kStreams> streams_;
  std::vector<Set::node_type> spare_;  // erased entries' nodes, reused by the next inserts (no malloc)
};

// BlockComparatorAddress (stream, address) for the unmapped ranges of expandable segments.
struct CachingAllocator::Pool {
  struct ByAddress {
    const std::vector<Block>* b;
    bool operator()(int x, int y) const {
      const Block &l = (*b)[x], &r = (*b)[y];
      if (l.stream != r.stream) return l.stream < r.stream;
      return l.address < r.address;
    }
  };
  Pool(bool small_pool, const std::vector<Block>* b) : small(small_pool), blocks(b), unmapped(ByAddress{b}) {}
  bool small;
  SizeIndex blocks;
  std::set<int, ByAddress> unmapped;
  int64_t get_free_blocks_call_count = 0;
};

SizeIndex::Entry SizeIndex::EntryOf(int id) const {
  const CachingAllocator::Block& b = (*blocks_)[id];
  return Entry{b.size, b.address, id};
}
int SizeIndex::StreamOf(int id) const { return (*blocks_)[id].stream; }

struct CachingAllocator::Expandable {
  int stream = 0;
  bool small = false;
  uint64_t base = 0;
  int64_t page_bytes = 0;  // 2 MiB small pool, 20 MiB large pool
  int64_t range_bytes = 0;
};

int64_t FractionCapBytes(const AllocatorConfig& config, int64_t total_bytes) {
  if (config.per_process_memory_fraction >= 1.0) return -1;
  return static_cast<int64_t>(config.per_process_memory_fraction * static_cast<double>(total_bytes));
}

CachingAllocator::CachingAllocator(const AllocatorConfig& config, DeviceMemory& memory)
    : config_(config), memory_(memory) {
  small_ = std::make_unique<Pool>(true, &blocks_);
  large_ = std::make_unique<Pool>(false, &blocks_);
  blocks_.emplace_back();  // block 0: the search key of lower_bound (stream, size, address 0)
  // setMemoryFraction(per_process_memory_fraction), at DeviceCachingAllocator's construction: a
  // fraction below 1 (0 too) caps the reserve at that share of the device's total memory.
  if (config.per_process_memory_fraction < 1.0) {  // (TotalBytes asks the device: only when needed)
    set_fraction_ = true;
    allowed_memory_maximum_ = FractionCapBytes(config, memory.TotalBytes());
  }
}

CachingAllocator::~CachingAllocator() = default;

int CachingAllocator::NewBlock(int stream, int64_t size, Pool* pool, uint64_t address) {
  int id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int>(blocks_.size());
    blocks_.emplace_back();
  }
  Block& b = blocks_[id];
  b = Block{};
  b.stream = stream;
  b.size = size;
  b.pool = pool;
  b.address = address;
  b.alive = true;
  return id;
}

void CachingAllocator::DeleteBlock(int id) {
  blocks_[id].alive = false;
  free_ids_.push_back(id);
}

// Block::splice: puts `block` between `before` and `after` (either -1), which were neighbours.
void CachingAllocator::Splice(int block, int before, int after) {
  if (before >= 0) blocks_[before].next = block;
  blocks_[block].prev = before;
  if (after >= 0) blocks_[after].prev = block;
  blocks_[block].next = after;
}

void CachingAllocator::InsertFree(int id) {
  Block& b = blocks_[id];
  b.gc_count_base = b.pool->get_free_blocks_call_count;  // insert_into_blocks
  b.pool->blocks.insert(id);
}

// The stats' update_stat on the aggregate and on the pool's StatType (get_stat_types_for_pool).
void CachingAllocator::AddReserved(const Pool& pool, int64_t bytes, int segments) {
  stats_.reserved_bytes += bytes;
  stats_.segments += segments;
  if (stats_.reserved_bytes > stats_.reserved_peak_bytes) {
    stats_.reserved_peak_bytes = stats_.reserved_bytes;
    stats_.allocated_at_reserved_peak_bytes = stats_.allocated_bytes;
  }
  PoolStats& p = pool.small ? stats_.small_pool : stats_.large_pool;
  p.reserved_bytes += bytes;
  p.segments += segments;
  p.reserved_peak_bytes = std::max(p.reserved_peak_bytes, p.reserved_bytes);
  p.segments_peak = std::max(p.segments_peak, p.segments);
}

void CachingAllocator::AddAllocated(int64_t bytes) {
  stats_.allocated_bytes += bytes;
  stats_.allocated_peak_bytes = std::max(stats_.allocated_peak_bytes, stats_.allocated_bytes);
  stats_.active_bytes += bytes;
  stats_.active_peak_bytes = std::max(stats_.active_peak_bytes, stats_.active_bytes);
  if (stats_.reserved_bytes == stats_.reserved_peak_bytes) {
    stats_.allocated_at_reserved_peak_bytes = std::max(stats_.allocated_at_reserved_peak_bytes, stats_.allocated_bytes);
  }
}

// roundup_power2_next_division and round_size.
int64_t RoundAllocationSize(const AllocatorConfig& config, int64_t size) {
  if (size < alloc::kMinBlockSize) return alloc::kMinBlockSize;
  const int log_size = Log2Floor(static_cast<uint64_t>(size));
  const int index = std::clamp(log_size - 20, 0, alloc::kRoundupIntervals - 1);  // AllocatorConfig::roundup_power2_divisions
  const int64_t divisions = config.roundup_power2_divisions[index];
  // (in size_t, as PyTorch: 512 x divisions wraps from 2^55 divisions on, and then every size is above it)
  if (divisions > 1 && static_cast<uint64_t>(size) > static_cast<uint64_t>(alloc::kMinBlockSize) * static_cast<uint64_t>(divisions)) {
    if (IsPowerOfTwo(size)) return size;
    const int64_t floor = int64_t{1} << log_size;
    const int64_t step = floor >> Log2Floor(static_cast<uint64_t>(divisions));
    if (step == 0) return floor << 1;
    const int64_t rounded_floor = size & ~(step - 1);
    return rounded_floor == size ? size : rounded_floor + step;
  }
  return RoundUp(size, alloc::kMinBlockSize);
}

int64_t CachingAllocator::RoundSize(int64_t size) const { return RoundAllocationSize(config_, size); }

CachingAllocator::Pool& CachingAllocator::PoolFor(int64_t size) { return size <= alloc::kSmallSize ? *small_ : *large_; }

// get_allocation_size: requests between 1 and 10 MiB take a large segment (large_segment_size_mb).
static int64_t AllocationSize(const AllocatorConfig& config, int64_t size) {
  if (size <= alloc::kSmallSize) return alloc::kSmallBuffer;
  if (size < alloc::kMinLargeAlloc) return config.large_segment_bytes;
  return RoundUp(size, alloc::kRoundLarge);
}

CachingAllocator::Handle CachingAllocator::Malloc(int64_t orig_size, int stream) {
  if (orig_size > kMaxRequestBytes) {  // no device holds it, and the rounding below would overflow
    ++stats_.num_ooms;
    return kNoHandle;
  }
  const int64_t size = RoundSize(orig_size);
  Pool& pool = PoolFor(size);
  const int64_t alloc_size = AllocationSize(config_, size);
  int found = -1;
  bool ok = GetFreeBlock(pool, stream, size, found);
  if (!ok) {
    if (set_fraction_ && config_.garbage_collection_threshold > 0.0) GarbageCollect();
    ok = AllocBlock(pool, stream, size, alloc_size, false, found) ||
         (ReleaseAvailableCachedBlocks(pool, stream, size) && AllocBlock(pool, stream, size, alloc_size, false, found)) ||
         (memory_.Synchronize() && (ReleaseCachedBlocks(), AllocBlock(pool, stream, size, alloc_size, true, found)));
  }
  if (!ok) {
    ++stats_.num_ooms;
    return kNoHandle;
  }
  return AllocFoundBlock(found, size, ShouldSplit(blocks_[found], size));
}

// get_free_block: best fit on the same stream, within the max_split_size rules.
bool CachingAllocator::GetFreeBlock(Pool& pool, int stream, int64_t size, int& found) {
  if (set_fraction_ && config_.garbage_collection_threshold > 0.0) ++pool.get_free_blocks_call_count;
  blocks_[kSearchKey].stream = stream;
  blocks_[kSearchKey].size = size;
  auto it = pool.blocks.lower_bound(kSearchKey);
  if (it == pool.blocks.end_of(stream) || blocks_[*it].stream != stream) return false;
  if (blocks_[*it].expandable >= 0) {
    if (config_.expandable_segments) {
      // Sized as what the block can grow into: a free block followed by unmapped space.
      auto expandable_size = [&](int b) {
        const Block& x = blocks_[b];
        return x.size + (x.next >= 0 && !blocks_[x.next].mapped ? blocks_[x.next].size : 0);
      };
      auto next = it;
      ++next;
      while (blocks_[*it].expandable >= 0 && next != pool.blocks.end_of(stream) && blocks_[*next].stream == stream &&
             expandable_size(*next) < expandable_size(*it)) {
        it = next++;
      }
    } else {
      do ++it;
      while (it != pool.blocks.end_of(stream) && blocks_[*it].expandable >= 0 && blocks_[*it].stream == stream);
      if (it == pool.blocks.end_of(stream) || blocks_[*it].stream != stream) return false;
    }
  }
  const int64_t block_size = blocks_[*it].size;
  const int64_t max_split = config_.max_split_size_bytes;
  if (size < max_split && block_size >= max_split) return false;  // no oversize block for a small request
  if (size >= max_split && block_size - size >= config_.max_non_split_rounding_bytes) return false;  // (block_size >= size: no overflow)
  found = *it;
  pool.blocks.erase(it);
  return true;
}

// garbage_collect_cached_blocks: frees unsplit large cached blocks older than the average.
void CachingAllocator::GarbageCollect() {
  const auto threshold = static_cast<int64_t>(config_.garbage_collection_threshold * static_cast<double>(allowed_memory_maximum_));
  if (stats_.reserved_bytes <= threshold) return;  // total_allocated_memory: the reserved bytes
  const int64_t target = stats_.reserved_bytes - threshold;
  auto age = [&](int b) { return large_->get_free_blocks_call_count - blocks_[b].gc_count_base; };
  int64_t total_age = 0, freeable = 0, reclaimed = 0;
  for (int b : large_->blocks.Ids()) {
    if (!blocks_[b].is_split() && blocks_[b].expandable < 0) {
      total_age += age(b);
      ++freeable;
    }
  }
  bool freed = true;
  while (reclaimed < target && freed && freeable > 0) {
    const double age_threshold = static_cast<double>(total_age) / static_cast<double>(freeable);
    freed = false;
    for (int b : large_->blocks.Ids()) {
      if (blocks_[b].alive && b != kSearchKey && !blocks_[b].is_split() && blocks_[b].expandable < 0 && static_cast<double>(age(b)) >= age_threshold) {
        freed = true;
        reclaimed += blocks_[b].size;
        total_age -= age(b);
        --freeable;
        ReleaseBlock(b);
      }
    }
  }
}

// alloc_block: a new segment (cudaMalloc of alloc_size) or, with expandable segments, new pages.
bool CachingAllocator::AllocBlock(Pool& pool, int stream, int64_t size, int64_t alloc_size, bool retry, int& found) {
  if (retry) ++stats_.num_alloc_retries;
  if (set_fraction_ && stats_.reserved_bytes + alloc_size > allowed_memory_maximum_) return false;
  if (config_.expandable_segments) {
    found = TryAllocateExpandable(pool, stream, size);
    return found >= 0;
  }
  auto address = memory_.Malloc(alloc_size);
  if (!address) return false;
  found = NewBlock(stream, alloc_size, &pool, *address);
  ++stats_.num_device_alloc;
  AddReserved(pool, alloc_size, 1);
  return true;
}

// release_available_cached_blocks: with max_split_size set, frees oversize cached blocks of the
// stream, the smallest one large enough or else the largest ones until enough is freed.
bool CachingAllocator::ReleaseAvailableCachedBlocks(Pool& pool, int stream, int64_t size) {
  const int64_t max_split = config_.max_split_size_bytes;
  if (max_split == alloc::kNoMaxSplit) return false;
  const int64_t key_size = std::max(size, max_split);
  blocks_[kSearchKey].stream = stream;
  blocks_[kSearchKey].size = key_size;
  auto it = pool.blocks.lower_bound(kSearchKey);
  if (it != pool.blocks.end_of(stream) && blocks_[*it].stream == stream) {
    if (blocks_[*it].expandable >= 0) return false;
    ReleaseBlock(*it);
    return true;
  }
  if (it == pool.blocks.begin_of(stream)) return false;
  int64_t released = 0;
  --it;
  while (released < key_size && blocks_[*it].size >= max_split && blocks_[*it].stream == stream && blocks_[*it].expandable < 0) {
    const int cur = *it;
    released += blocks_[cur].size;
    const bool at_begin = it == pool.blocks.begin_of(stream);
    if (!at_begin) --it;
    ReleaseBlock(cur);
    if (at_begin) break;
  }
  return released >= key_size;
}

// release_cached_blocks: waits for every outstanding event, then frees all unsplit cached blocks.
void CachingAllocator::ReleaseCachedBlocks() {
  for (size_t b = 1; b < blocks_.size(); ++b) {
    if (blocks_[b].alive && blocks_[b].awaiting) EventsPassed(static_cast<Handle>(b));
  }
  ReleaseBlocks(*large_);
  ReleaseBlocks(*small_);
}

void CachingAllocator::ReleaseBlocks(Pool& pool) {
  std::vector<int> to_unmap;
  for (int b : pool.blocks.Ids()) {
    if (blocks_[b].expandable >= 0) to_unmap.push_back(b);
    else if (!blocks_[b].is_split()) ReleaseBlock(b);
  }
  for (int b : to_unmap) UnmapBlock(b);
}

void CachingAllocator::ReleaseBlock(int id) {
  Block& b = blocks_[id];
  memory_.Free(b.address, b.size);
  ++stats_.num_device_free;
  AddReserved(*b.pool, -b.size, -1);
  b.pool->blocks.erase(id);
  DeleteBlock(id);
}

// unmap_block: returns the whole pages inside a free expandable block to the device.
void CachingAllocator::UnmapBlock(int id) {
  const Expandable& es = *expandable_[blocks_[id].expandable];
  const uint64_t start = blocks_[id].address, end = start + static_cast<uint64_t>(blocks_[id].size);
  const uint64_t page = static_cast<uint64_t>(es.page_bytes);
  const uint64_t first = es.base + (start - es.base + page - 1) / page * page;  // segmentRight
  const uint64_t last = es.base + (end - es.base) / page * page;                // segmentLeft
  if (first >= last) return;
  Pool& pool = *blocks_[id].pool;
  pool.blocks.erase(id);
  if (first > start) {  // prev? -> before_free -> block
    const int before = NewBlock(blocks_[id].stream, static_cast<int64_t>(first - start), &pool, start);
    blocks_[before].expandable = blocks_[id].expandable;
    Splice(before, blocks_[id].prev, id);
    InsertFree(before);
  }
  if (end > last) {  // block -> after_free -> next?
    const int after = NewBlock(blocks_[id].stream, static_cast<int64_t>(end - last), &pool, last);
    blocks_[after].expandable = blocks_[id].expandable;
    Splice(after, id, blocks_[id].next);
    InsertFree(after);
  }
  const int64_t unmapped = static_cast<int64_t>(last - first);
  memory_.Unmap(first, unmapped);
  blocks_[id].address = first;
  blocks_[id].size = unmapped;
  blocks_[id].mapped = false;
  TryMerge(id, blocks_[id].prev, pool);
  TryMerge(id, blocks_[id].next, pool);
  pool.unmapped.insert(id);
  AddReserved(pool, -unmapped, 0);
  ++stats_.num_device_free;
}

bool CachingAllocator::ShouldSplit(const Block& block, int64_t size) const {
  const int64_t remaining = block.size - size;
  if (block.pool->small || config_.expandable_segments) return remaining >= alloc::kMinBlockSize;
  return size < config_.max_split_size_bytes && remaining > alloc::kSmallSize;
}

// alloc_found_block: the block's front `size` bytes are handed out, the rest stays cached.
int CachingAllocator::AllocFoundBlock(int id, int64_t size, bool split) {
  if (split) {
    const int remaining = id;
    id = NewBlock(blocks_[remaining].stream, size, blocks_[remaining].pool, blocks_[remaining].address);
    Block& b = blocks_[id];
    Block& r = blocks_[remaining];
    b.expandable = r.expandable;
    Splice(id, r.prev, remaining);
    r.address += static_cast<uint64_t>(size);
    r.size -= size;
    InsertFree(remaining);
  }
  blocks_[id].allocated = true;
  AddAllocated(blocks_[id].size);
  return id;
}

void CachingAllocator::RecordStream(Handle id, int stream) {
  if (id <= kSearchKey) return;  // kNoHandle (a failed malloc) or the search key: nothing to record
  Block& b = blocks_[id];
  if (stream == b.stream) return;  // uses on the allocation stream need no event
  b.stream_uses |= uint64_t{1} << (stream & 63);
}

void CachingAllocator::Free(Handle id) {
  if (id <= kSearchKey) return;
  Block& b = blocks_[id];
  b.allocated = false;
  stats_.allocated_bytes -= b.size;
  if (b.stream_uses != 0) {  // insert_events: back to the pool once every recorded stream passes
    b.stream_uses = 0;
    b.awaiting = true;
    return;
  }
  FreeBlock(id);
}

void CachingAllocator::EventsPassed(Handle id) {
  if (id < 0 || !blocks_[id].awaiting) return;
  blocks_[id].awaiting = false;
  FreeBlock(id);
}

// free_block: the block stops being active (its size before merging: original_block_size),
// merges with free neighbours and returns to its pool.
void CachingAllocator::FreeBlock(int id) {
  stats_.active_bytes -= blocks_[id].size;
  Pool& pool = *blocks_[id].pool;
  TryMerge(id, blocks_[id].prev, pool);
  TryMerge(id, blocks_[id].next, pool);
  InsertFree(id);
}

// try_merge_blocks: src (a free neighbour of dst) is absorbed into dst.
int64_t CachingAllocator::TryMerge(int dst, int src, Pool& pool) {
  if (src < 0) return 0;
  Block& s = blocks_[src];
  Block& d = blocks_[dst];
  if (s.allocated || s.awaiting || d.mapped != s.mapped) return 0;
  if (d.prev == src) {  // [src dst]
    d.address = s.address;
    d.prev = s.prev;
    if (d.prev >= 0) blocks_[d.prev].next = dst;
  } else {  // [dst src]
    d.next = s.next;
    if (d.next >= 0) blocks_[d.next].prev = dst;
  }
  const int64_t subsumed = s.size;
  d.size += subsumed;
  if (s.mapped) pool.blocks.erase(src); else pool.unmapped.erase(src);
  DeleteBlock(src);
  return subsumed;
}

// ---- expandable segments (Note [Expandable Segments]) ----------------------------------------
// find_expandable_block: the lowest address in a segment of this stream and pool where free and
// unmapped blocks together hold `size`, else a new segment spanning 1 1/8 of the device.
int CachingAllocator::FindExpandableBlock(Pool& pool, int stream, int64_t size) {
  auto allocatable = [&](int b) { return b >= 0 && !blocks_[b].allocated && !blocks_[b].awaiting; };
  auto has_room = [&](int b) {
    int64_t bytes = 0;
    while (bytes < size && allocatable(b)) {
      bytes += blocks_[b].size;
      b = blocks_[b].next;
    }
    return bytes >= size;
  };
  for (int c : pool.unmapped) {
    if (blocks_[c].stream != stream) continue;
    if (allocatable(blocks_[c].prev)) c = blocks_[c].prev;
    if (has_room(c)) return c;
  }
  auto es = std::make_unique<Expandable>();
  es->stream = stream;
  es->small = pool.small;
  es->page_bytes = pool.small ? alloc::kSmallBuffer : config_.large_segment_bytes;
  const int64_t total = memory_.TotalBytes();
  es->range_bytes = CeilDiv(total + total / 8, es->page_bytes) * es->page_bytes;
  es->base = memory_.ReserveAddressRange(es->range_bytes);
  const int candidate = NewBlock(stream, es->range_bytes, &pool, es->base);
  blocks_[candidate].mapped = false;
  blocks_[candidate].expandable = static_cast<int>(expandable_.size());
  expandable_.push_back(std::move(es));
  pool.unmapped.insert(candidate);
  return candidate;
}

// map_block: backs the front of an unmapped block with whole pages and merges it with the free
// block before it.
bool CachingAllocator::MapBlock(int id, int64_t size) {
  const Expandable& es = *expandable_[blocks_[id].expandable];
  const uint64_t start = blocks_[id].address;
  const int64_t mapped = CeilDiv(size, es.page_bytes) * es.page_bytes;  // segmentRight of the end
  if (!memory_.Map(start, mapped)) return false;
  Pool& pool = *blocks_[id].pool;
  pool.unmapped.erase(id);
  blocks_[id].mapped = true;
  if (mapped < blocks_[id].size) {  // to_map -> remaining -> next?
    const int rest = NewBlock(blocks_[id].stream, blocks_[id].size - mapped, &pool, start + static_cast<uint64_t>(mapped));
    blocks_[rest].mapped = false;
    blocks_[rest].expandable = blocks_[id].expandable;
    Splice(rest, id, blocks_[id].next);
    blocks_[id].size = mapped;
    pool.unmapped.insert(rest);
  }
  TryMerge(id, blocks_[id].prev, pool);
  TryMerge(id, blocks_[id].next, pool);
  InsertFree(id);
  ++stats_.num_device_alloc;
  AddReserved(pool, mapped, 0);
  return true;
}

// try_allocate_expandable_block: maps pages in front of (or after) the candidate until it holds
// `size`; each mapped block absorbs the free block before it (map_block's try_merge_blocks).
int CachingAllocator::TryAllocateExpandable(Pool& pool, int stream, int64_t size) {
  int candidate = FindExpandableBlock(pool, stream, size);
  if (!blocks_[candidate].mapped && !MapBlock(candidate, std::min(blocks_[candidate].size, size))) return -1;
  while (blocks_[candidate].size < size) {
    const int next = blocks_[candidate].next;
    if (next < 0) return -1;  // the segment's address range ends here (PyTorch: new_candidate == nullptr)
    if (!MapBlock(next, std::min(size - blocks_[candidate].size, blocks_[next].size))) return -1;
    candidate = next;
  }
  pool.blocks.erase(candidate);
  return candidate;
}

void CachingAllocator::EmptyCache() {
  memory_.Synchronize();
  ReleaseCachedBlocks();
}

void CachingAllocator::ResetPeaks() {
  stats_.allocated_peak_bytes = stats_.allocated_bytes;
  stats_.active_peak_bytes = stats_.active_bytes;
  stats_.reserved_peak_bytes = stats_.reserved_bytes;
  stats_.allocated_at_reserved_peak_bytes = stats_.allocated_bytes;
  for (PoolStats* p : {&stats_.small_pool, &stats_.large_pool}) {
    p->reserved_peak_bytes = p->reserved_bytes;
    p->segments_peak = p->segments;
  }
}

int64_t CachingAllocator::BlockBytes(Handle id) const { return blocks_[id].size; }
uint64_t CachingAllocator::BlockAddress(Handle id) const { return blocks_[id].address; }

std::vector<SegmentView> CachingAllocator::Snapshot() const {
  std::vector<SegmentView> out;
  std::vector<int> heads;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block& b = blocks_[i];
    if (!b.alive || !b.mapped || b.pool == nullptr) continue;
    if (b.prev >= 0 && blocks_[b.prev].mapped) continue;  // one view per contiguous mapped range
    heads.push_back(static_cast<int>(i));
  }
  std::sort(heads.begin(), heads.end(), [&](int x, int y) {
    const Block &l = blocks_[x], &r = blocks_[y];
    if (l.stream != r.stream) return l.stream < r.stream;
    if (l.pool->small != r.pool->small) return l.pool->small;
    return l.address < r.address;
  });
  for (int h : heads) {
    SegmentView s;
    s.stream = blocks_[h].stream;
    s.small_pool = blocks_[h].pool->small;
    s.expandable = blocks_[h].expandable >= 0;
    const uint64_t base = blocks_[h].address;
    for (int b = h; b >= 0 && blocks_[b].mapped; b = blocks_[b].next) {
      const Block& x = blocks_[b];
      s.blocks.push_back(BlockView{static_cast<int64_t>(x.address - base), x.size, x.allocated, x.awaiting});
      s.bytes += x.size;
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace fsdp
