#include "core/caching_allocator.h"
#include "core/allocator_history.h"

#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include "core/catalog.h"
#include "core/json_io.h"

namespace fsdp {
namespace {

constexpr int64_t MiB = 1 << 20;
constexpr int64_t GiB = int64_t{1} << 30;

AllocatorConfig Conf(const std::string& text) {
  auto c = ParseAllocatorConfig(text);
  REQUIRE_MESSAGE(c.ok(), (c.ok() ? "" : c.error().message));
  return c.value();
}

// One segment's blocks as "size/A" (allocated), "size/F" (free) or "size/E" (awaiting events), in MiB
// or bytes below 1 MiB.
std::string Layout(const SegmentView& s) {
  std::string out;
  for (const BlockView& b : s.blocks) {
    if (!out.empty()) out += " ";
    out += b.bytes % MiB == 0 ? std::to_string(b.bytes / MiB) + "M" : std::to_string(b.bytes);
    out += b.allocated ? "/A" : b.awaiting_events ? "/E" : "/F";
  }
  return out;
}

TEST_CASE("round_size: 512-byte multiples, or power-of-two divisions when configured") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator plain(Conf(""), memory);
  CHECK(plain.RoundSize(1) == 512);
  CHECK(plain.RoundSize(512) == 512);
  CHECK(plain.RoundSize(513) == 1024);
  CHECK(plain.RoundSize(1258291) == 1258496);  // 2458 x 512
  CachingAllocator four(Conf("roundup_power2_divisions:4"), memory);
  CHECK(four.RoundSize(1258291) == 1310720);   // 1.2 MiB -> 1.25 MiB (1 MiB + 1/4 of 1 MiB)
  CHECK(four.RoundSize(2 * MiB) == 2 * MiB);    // a power of two stays
  CHECK(four.RoundSize(1500) == 1536);          // not above 512 x 4: plain rounding
}

TEST_CASE("small requests share a 2 MiB segment, split at 512-byte granularity") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  a.Malloc(1000, 0);
  a.Malloc(3000, 0);
  CHECK(a.stats().reserved_bytes == 2 * MiB);
  CHECK(a.stats().allocated_bytes == 1024 + 3072);
  auto snap = a.Snapshot();
  REQUIRE(snap.size() == 1);
  CHECK(snap[0].small_pool);
  CHECK(Layout(snap[0]) == "1024/A 3072/A 2093056/F");
}

TEST_CASE("requests between 1 and 10 MiB split a 20 MiB segment; a remainder of 1 MiB or less is not split off") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  a.Malloc(3 * MiB, 0);
  a.Malloc(16 * MiB, 0);  // best fit: the 17 MiB remainder; 1 MiB left is not > kSmallSize
  CHECK(a.stats().reserved_bytes == 20 * MiB);
  CHECK(a.stats().allocated_bytes == 20 * MiB);
  CHECK(Layout(a.Snapshot()[0]) == "3M/A 17M/A");
  a.Malloc(11 * MiB + 1, 0);  // >= 10 MiB: its own segment rounded to 2 MiB, 12 MiB, unsplit
  CHECK(a.stats().reserved_bytes == 32 * MiB);
  CHECK(a.stats().allocated_bytes == 32 * MiB);
}

TEST_CASE("a freed block merges with its free neighbours") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  auto x = a.Malloc(3 * MiB, 0);
  auto y = a.Malloc(3 * MiB, 0);
  CHECK(Layout(a.Snapshot()[0]) == "3M/A 3M/A 14M/F");
  a.Free(x);
  CHECK(Layout(a.Snapshot()[0]) == "3M/F 3M/A 14M/F");
  a.Free(y);
  CHECK(Layout(a.Snapshot()[0]) == "20M/F");
  CHECK(a.stats().allocated_bytes == 0);
  CHECK(a.stats().reserved_bytes == 20 * MiB);
  a.EmptyCache();
  CHECK(a.stats().reserved_bytes == 0);
}

TEST_CASE("cached blocks serve only the stream that allocated them") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  a.Free(a.Malloc(12 * MiB, 0));
  a.Malloc(12 * MiB, 1);
  CHECK(a.stats().reserved_bytes == 24 * MiB);
  a.Malloc(12 * MiB, 0);  // stream 0's cached block
  CHECK(a.stats().reserved_bytes == 24 * MiB);
}

TEST_CASE("record_stream defers the free until the recorded stream's event has passed") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  auto x = a.Malloc(12 * MiB, 0);
  a.RecordStream(x, 1);
  a.Free(x);
  CHECK(a.stats().allocated_bytes == 0);
  CHECK(a.stats().active_bytes == 12 * MiB);  // active until its event has passed
  CHECK(Layout(a.Snapshot()[0]) == "12M/E");
  auto y = a.Malloc(12 * MiB, 0);  // x is not reusable yet: a second segment
  CHECK(a.stats().reserved_bytes == 24 * MiB);
  CHECK(a.stats().allocated_peak_bytes == 12 * MiB);
  CHECK(a.stats().active_peak_bytes == 24 * MiB);
  a.EventsPassed(x);
  CHECK(a.stats().active_bytes == 12 * MiB);
  a.Free(y);
  a.Malloc(12 * MiB, 0);
  a.Malloc(12 * MiB, 0);
  CHECK(a.stats().reserved_bytes == 24 * MiB);
  CHECK(a.stats().num_alloc_retries == 0);
}

TEST_CASE("max_split_size_mb: oversize blocks are neither split nor given to small requests") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf("max_split_size_mb:20"), memory);
  auto big = a.Malloc(30 * MiB, 0);
  a.Free(big);
  auto small = a.Malloc(12 * MiB, 0);  // 12 < 20 and the cached 30 MiB block is oversize: new segment
  CHECK(a.stats().reserved_bytes == 42 * MiB);
  a.Free(small);
  a.Malloc(25 * MiB, 0);  // 25 >= 20 and 30 < 25 + 20: the whole 30 MiB block, unsplit
  CHECK(a.stats().reserved_bytes == 42 * MiB);
  CHECK(a.stats().allocated_bytes == 30 * MiB);
}

TEST_CASE("out of memory: the cache is freed and the allocation retried once, then it fails") {
  CountingDeviceMemory memory(40 * MiB, GiB);
  CachingAllocator a(Conf(""), memory);
  a.Free(a.Malloc(12 * MiB, 0));
  auto b = a.Malloc(30 * MiB, 0);  // 12 + 30 > 40: release the cached 12 MiB segment, retry
  CHECK(b != CachingAllocator::kNoHandle);
  CHECK(a.stats().num_alloc_retries == 1);
  CHECK(a.stats().reserved_bytes == 30 * MiB);
  CHECK(a.stats().reserved_peak_bytes == 30 * MiB);
  auto c = a.Malloc(12 * MiB, 0);  // nothing cached to free: the retry fails too
  CHECK(c == CachingAllocator::kNoHandle);
  CHECK(a.stats().num_alloc_retries == 2);
  CHECK(a.stats().num_ooms == 1);
}

TEST_CASE("expandable segments grow one segment per stream by 20 MiB pages") {
  CountingDeviceMemory memory(80 * GiB, 80 * GiB);
  CachingAllocator a(Conf("expandable_segments:True"), memory);
  auto x = a.Malloc(3 * MiB, 0);
  CHECK(a.stats().reserved_bytes == 20 * MiB);
  auto y = a.Malloc(30 * MiB, 0);  // the free 17 MiB tail plus one more page: 37 MiB, 30 of it handed out
  CHECK(a.stats().reserved_bytes == 40 * MiB);
  auto snap = a.Snapshot();
  REQUIRE(snap.size() == 1);
  CHECK(snap[0].expandable);
  CHECK(Layout(snap[0]) == "3M/A 30M/A 7M/F");
  a.Free(x);
  a.Free(y);
  a.EmptyCache();
  CHECK(a.stats().reserved_bytes == 0);
  // The same requests without expandable segments: a 20 MiB and a 30 MiB segment.
  CachingAllocator b(Conf(""), memory);
  b.Malloc(3 * MiB, 0);
  b.Malloc(30 * MiB, 0);
  CHECK(b.stats().reserved_bytes == 50 * MiB);
}

TEST_CASE("garbage_collection_threshold frees cached blocks older than the average once over the threshold") {
  CountingDeviceMemory memory(100 * MiB, 100 * MiB);
  // a fraction of 0.5 allows 50 MiB; the threshold 0.5 of that is 25 MiB
  CachingAllocator a(Conf("garbage_collection_threshold:0.5,per_process_memory_fraction:0.5"), memory);
  a.Free(a.Malloc(12 * MiB, 0));   // large-pool search 1; cached with age base 1
  a.Free(a.Malloc(14 * MiB, 0));   // search 2; base 2
  a.Malloc(16 * MiB, 0);           // search 3: ages 2 and 1, mean 1.5: the 12 MiB block goes
  CHECK(a.stats().reserved_bytes == 30 * MiB);
  CachingAllocator b(Conf(""), memory);
  b.Free(b.Malloc(12 * MiB, 0));
  b.Free(b.Malloc(14 * MiB, 0));
  b.Malloc(16 * MiB, 0);
  CHECK(b.stats().reserved_bytes == 42 * MiB);
}

TEST_CASE("per_process_memory_fraction caps the reserve at its share of the device's total") {
  CountingDeviceMemory memory(GiB, 100 * MiB);  // the device could give 1 GiB; its total is 100 MiB
  CachingAllocator a(Conf("per_process_memory_fraction:0.5"), memory);
  auto x = a.Malloc(30 * MiB, 0);
  CHECK(x != CachingAllocator::kNoHandle);
  // 30 + 30 > 50 MiB allowed (alloc_block's set_fraction check): nothing cached to free, the
  // retry fails too
  CHECK(a.Malloc(30 * MiB, 0) == CachingAllocator::kNoHandle);
  CHECK(a.stats().reserved_bytes == 30 * MiB);
  CHECK(a.stats().num_alloc_retries == 1);
  CHECK(a.stats().num_ooms == 1);
  // 0 is a fraction too (setMemoryFraction: below 1), and allows nothing
  CachingAllocator none(Conf("per_process_memory_fraction:0"), memory);
  CHECK(none.Malloc(512, 0) == CachingAllocator::kNoHandle);
  // 1 sets no cap
  CachingAllocator all(Conf("per_process_memory_fraction:1"), memory);
  all.Malloc(60 * MiB, 0);
  all.Malloc(60 * MiB, 0);
  CHECK(all.stats().reserved_bytes == 120 * MiB);
}

TEST_CASE("large_segment_size_mb: the segment of a 1-10 MiB request, the expandable page, the oversize slack") {
  CountingDeviceMemory memory(80 * GiB, 80 * GiB);
  CachingAllocator a(Conf("large_segment_size_mb:40"), memory);
  a.Malloc(3 * MiB, 0);  // a 40 MiB segment, not 20
  CHECK(a.stats().reserved_bytes == 40 * MiB);
  a.Malloc(30 * MiB, 0);  // best fit: the segment's free 37 MiB (the default's 17 MiB would not do: a new 30 MiB segment)
  CHECK(a.stats().reserved_bytes == 40 * MiB);
  REQUIRE(a.Snapshot().size() == 1);
  CHECK(Layout(a.Snapshot()[0]) == "3M/A 30M/A 7M/F");
  // expandable: 40 MiB pages; 3 MiB and then 30 MiB fit the first page (the default's needed two 20 MiB pages)
  CachingAllocator e(Conf("large_segment_size_mb:40,expandable_segments:True"), memory);
  e.Malloc(3 * MiB, 0);
  e.Malloc(30 * MiB, 0);
  CHECK(e.stats().reserved_bytes == 40 * MiB);
  REQUIRE(e.Snapshot().size() == 1);
  CHECK(Layout(e.Snapshot()[0]) == "3M/A 30M/A 7M/F");
  // max_non_split_rounding follows the large segment: with max_split_size_mb:100 a cached 150 MiB
  // block serves a 115 MiB request when 150 < 115 + 40, where the default 20 MiB slack makes a new
  // 116 MiB segment (115 MiB rounded to 2 MiB)
  CachingAllocator o(Conf("large_segment_size_mb:40,max_split_size_mb:100"), memory);
  o.Free(o.Malloc(150 * MiB, 0));
  o.Malloc(115 * MiB, 0);
  CHECK(o.stats().reserved_bytes == 150 * MiB);
  CHECK(o.stats().allocated_bytes == 150 * MiB);
  CachingAllocator d(Conf("max_split_size_mb:100"), memory);
  d.Free(d.Malloc(150 * MiB, 0));
  d.Malloc(115 * MiB, 0);
  CHECK(d.stats().reserved_bytes == 266 * MiB);
}

TEST_CASE("fragmentation: reserved minus the most allocated while reserved is at its peak") {
  CountingDeviceMemory memory(GiB, GiB);
  CachingAllocator a(Conf(""), memory);
  auto x = a.Malloc(12 * MiB, 0);
  a.Free(x);
  a.Malloc(8 * MiB, 0);  // best fit: the cached 12 MiB block, split (4 MiB left); allocated 8 MiB
  CHECK(a.stats().reserved_peak_bytes == 12 * MiB);
  CHECK(a.stats().allocated_at_reserved_peak_bytes == 12 * MiB);
}

// Seeded random mallocs (small, small-large, large, a third of the device), frees, record_stream
// frees and their events, and emptying the cache, under each configuration and on devices that
// force the free-and-retry path: the accounting stays consistent (reserved within the device,
// the pools summing to it, allocated equal to the live blocks) and nothing walks off a segment.
TEST_CASE("random traffic keeps the allocator's accounting consistent under every configuration") {
  for (const char* text : {"", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4"}) {
    for (uint64_t seed = 1; seed <= 6; ++seed) {
      CAPTURE(text);
      CAPTURE(seed);
      uint64_t state = seed * 0x9E3779B97F4A7C15ULL;
      auto next = [&] {  // splitmix64
        uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
      };
      const int64_t total = GiB << (seed % 3), limit = total / static_cast<int64_t>(1 + seed % 4);
      CountingDeviceMemory device(limit, total);
      CachingAllocator a(Conf(text), device);
      std::vector<CachingAllocator::Handle> live, awaiting;
      int64_t live_bytes = 0;
      for (int i = 0; i < 4000; ++i) {
        const uint64_t op = next() % 10;
        if (op < 5 || live.empty()) {
          const int64_t caps[] = {MiB, 10 * MiB, 200 * MiB, total / 3};
          const auto h = a.Malloc(1 + static_cast<int64_t>(next() % static_cast<uint64_t>(caps[next() % 4])), static_cast<int>(next() % 3));
          if (h != CachingAllocator::kNoHandle) {
            live.push_back(h);
            live_bytes += a.BlockBytes(h);
          }
        } else if (op < 8) {
          const size_t k = next() % live.size();
          const auto h = live[k];
          live[k] = live.back();
          live.pop_back();
          live_bytes -= a.BlockBytes(h);
          if (next() % 4 == 0) {
            a.RecordStream(h, static_cast<int>(next() % 3));
            awaiting.push_back(h);
          }
          a.Free(h);
        } else if (op == 8 && !awaiting.empty()) {
          a.EventsPassed(awaiting.front());
          awaiting.erase(awaiting.begin());
        } else if (op == 9 && next() % 50 == 0) {
          a.EmptyCache();  // waits for every event
          awaiting.clear();
        }
        const AllocatorStats& s = a.stats();
        REQUIRE(s.reserved_bytes >= 0);
        REQUIRE(s.reserved_bytes <= limit);
        REQUIRE(s.reserved_bytes == device.used_bytes());
        REQUIRE(s.small_pool.reserved_bytes + s.large_pool.reserved_bytes == s.reserved_bytes);
        REQUIRE(s.allocated_bytes == live_bytes);
        REQUIRE(s.allocated_bytes <= s.reserved_bytes);
        int64_t active_bytes = 0;  // the allocated blocks and those awaiting events
        for (const SegmentView& segment : a.Snapshot()) {
          for (const BlockView& b : segment.blocks) active_bytes += (b.allocated || b.awaiting_events) ? b.bytes : 0;
        }
        REQUIRE(s.active_bytes == active_bytes);
        REQUIRE(s.active_peak_bytes >= s.active_bytes);
      }
    }
  }
}

// An expandable segment reserves 1 1/8 of the device's memory in address space: a request larger
// than that maps the whole new range and still falls short. PyTorch's try_allocate_expandable_block
// then returns nullptr at the range's end (new_candidate == nullptr), and the malloc fails after
// freeing the cache and retrying, as any other.
TEST_CASE("expandable segments: a request past a whole range fails as an out-of-memory, not past the segment's end") {
  CountingDeviceMemory device(64 * GiB, GiB);  // room to map, a 1 GiB device's ranges
  CachingAllocator a(Conf("expandable_segments:True"), device);
  CHECK(a.Malloc(2 * GiB, 0) == CachingAllocator::kNoHandle);
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.stats().num_alloc_retries == 1);
  CHECK(a.stats().allocated_bytes == 0);
  CHECK(a.stats().reserved_bytes == device.used_bytes());
  const auto h = a.Malloc(GiB, 0);  // one range holds it
  REQUIRE(h != CachingAllocator::kNoHandle);
  CHECK(a.stats().allocated_bytes == GiB);
}

// PyTorch's own requests, on an H200 (tools/torch_reference.py --memory-history: torch 2.11's
// _record_memory_history of two steps of Llama 3.2 1B, FSDP2, full AC, micro-batch 8 x 4096;
// docs/data/gpu_h200_2026-12-04_history/), replayed on this allocator from the layout the
// recording started with: the segments the two steps added are PyTorch's, to the byte and in
// number. The start layout is re-made block by block, so blocks under 1 MiB of a large segment
// land in the small pool (4 MiB more at the start); what the steps add is what is compared.
// free_requested is PyTorch's free() (allocated no more), free_completed the block back in its
// pool after its recorded streams' events.
TEST_CASE("PyTorch's allocator history replayed: the segments it added, to the byte") {
  auto doc = LoadJsonFile(DataDir() + "/docs/data/gpu_h200_2026-12-04_history/hist_llama32_ac_mb8_s4k.json");
  REQUIRE(doc.ok());
  const Json& h = doc.value();
  int64_t start_bytes = 0, end_bytes = 0;
  for (const Json& seg : h["segments_at_start"]) start_bytes += seg[1].get<int64_t>();
  for (const Json& seg : h["segments_at_end"]) end_bytes += seg[1].get<int64_t>();
  CountingDeviceMemory device(int64_t{1} << 40, 150 * GiB);
  auto replayed = ReplayAllocatorHistory(h, AllocatorConfig{}, device);
  REQUIRE(replayed.ok());
  const HistoryReplay& r = replayed.value();
  CHECK(r.reserved_at_start_bytes - start_bytes == 4 * MiB);
  CHECK(r.stats.reserved_bytes - r.reserved_at_start_bytes == end_bytes - start_bytes);  // 67,578,626,048 bytes
  CHECK(r.stats.num_device_alloc - r.device_allocs_at_start == r.segments_recorded);     // 30 segments
  CHECK(r.segments_recorded == 30);
  // and its blocks at their peak are the run's torch.cuda.max_memory_allocated
  // (run_llama32_ac_mb8_s4k.json: 68,540,626,944; the tensors' requested_bytes peak is 1,784 less)
  CHECK(r.stats.allocated_peak_bytes == 68'540'626'944);
  CHECK(r.stats.num_alloc_retries == 0);
  CHECK(r.unknown_frees == 0);
}

// The CPU's form of a history (tools/torch_reference.py --memory-history on --device cpu): the
// storages alive when it began, then the profiler's allocs and frees. By hand: a 6 MiB storage
// alive at the start takes a 20 MiB large segment (requests under 10 MiB); a 16 MiB alloc does
// not fit the 14 MiB left there and gets a 16 MiB segment of its own; once it is freed, 8 MiB
// goes to the best fit, the first segment's 14 MiB.
TEST_CASE("a CPU-recorded request sequence replays from the storages alive at its start") {
  const Json h = Json::parse(R"({"live_at_start": [[4096, 6291456]],
    "events": [["alloc", 8192, 16777216, 0], ["free_completed", 8192, 16777216, 0], ["alloc", 8192, 8388608, 0],
               ["free_completed", 77, 512, 0]]})");
  CountingDeviceMemory device(int64_t{1} << 40, 150 * GiB);
  auto replayed = ReplayAllocatorHistory(h, AllocatorConfig{}, device);
  REQUIRE(replayed.ok());
  const HistoryReplay& r = replayed.value();
  CHECK(r.reserved_at_start_bytes == 20 * MiB);
  CHECK(r.stats.reserved_peak_bytes == 36 * MiB);
  CHECK(r.stats.num_device_alloc == 2);
  CHECK(r.stats.allocated_bytes == 14 * MiB);
  CHECK(r.events == 3);
  CHECK(r.unknown_frees == 1);
  // a request no device holds is an out-of-memory, not a wrapped-around size
  const Json huge = Json::parse(R"({"events": [["alloc", 1, 9223372036854775807, 0]]})");
  auto failed = ReplayAllocatorHistory(huge, AllocatorConfig{}, device);
  REQUIRE(!failed.ok());
  CHECK(failed.error().kind == Error::Kind::kOutOfMemory);
  // so is a start segment no device holds, as its blocks are
  const Json huge_segment = Json::parse(R"({"events": [], "segments_at_start": [[0, 9223372036854775807, 0, "large", []]]})");
  auto unmade = ReplayAllocatorHistory(huge_segment, AllocatorConfig{}, device);
  REQUIRE(!unmade.ok());
  CHECK(unmade.error().kind == Error::Kind::kOutOfMemory);
  // malformed input names what is wrong
  for (const char* bad : {R"({})", R"({"events": [["alloc", 1, -5, 0]]})", R"({"events": [["alloc", "x", 5, 0]]})",
                          R"({"events": [], "live_at_start": [[1]]})", R"({"events": [], "segments_at_start": [[1, 2]]})",
                          R"({"events": [], "live_at_start": [[1, -5]]})",
                          R"({"events": [], "segments_at_start": [[0, 4194304, 0, "large", [[-512, "active_allocated"]]]]})"}) {
    auto p = ReplayAllocatorHistory(Json::parse(bad), AllocatorConfig{}, device);
    CHECK_MESSAGE(!p.ok(), bad);
    if (!p.ok()) CHECK(p.error().message.rfind("allocator history: ", 0) == 0);
  }
}

// Each recorded side stream keeps its own pools, as on the GPU (FSDP2's all-gather and
// reduce-scatter streams are distinct handles). By hand: 12 MiB on stream A gets a 12 MiB
// segment; freed, it is not reused by stream B's 12 MiB (a second segment), but is by A's again.
TEST_CASE("a GPU history's side streams are replayed as streams of their own") {
  const Json h = Json::parse(R"({"events": [["alloc", 1, 12582912, 93000], ["free_completed", 1, 12582912, 93000],
    ["alloc", 2, 12582912, 94000], ["alloc", 3, 12582912, 93000]]})");
  CountingDeviceMemory device(int64_t{1} << 40, 150 * GiB);
  auto replayed = ReplayAllocatorHistory(h, AllocatorConfig{}, device);
  REQUIRE(replayed.ok());
  CHECK(replayed.value().stats.num_device_alloc == 2);
  CHECK(replayed.value().stats.reserved_peak_bytes == 24 * MiB);
}

// AllocatorHistoryJson writes what ReplayAllocatorHistory reads (fsdp-plan --alloc-trace), and the
// replay lists the requests that grew the reserve. By hand: 1 MiB takes a 2 MiB small-pool
// segment, 512 bytes fit beside it; 12 MiB takes a 12 MiB segment; while it awaits its events
// ("free_requested") another 12 MiB needs a third segment; once it is back ("free_completed"), a
// 12 MiB request reuses it.
TEST_CASE("a written history replays, with the requests that grew the reserve") {
  using A = HistoryEvent::Action;
  const std::vector<HistoryEvent> events = {
      {A::kAlloc, 1, MiB, 0, "a"},           {A::kAlloc, 2, 512, 0, "b"},           {A::kAlloc, 3, 12 * MiB, 0, "c"},
      {A::kFreeRequested, 3, 12 * MiB, 0, "c"}, {A::kAlloc, 4, 12 * MiB, 0, "d"}, {A::kFreeCompleted, 3, 12 * MiB, 0, "c"},
      {A::kAlloc, 5, 12 * MiB, 0, "e"},
  };
  const Json h = AllocatorHistoryJson(events, "by hand");
  CHECK(h["source"] == "by hand");
  CHECK(h["events"][3] == Json::array({"free_requested", 3, 12 * MiB, 0, "c"}));
  CountingDeviceMemory device(int64_t{1} << 40, 150 * GiB);
  auto replayed = ReplayAllocatorHistory(h, AllocatorConfig{}, device);
  REQUIRE(replayed.ok());
  const HistoryReplay& r = replayed.value();
  CHECK(r.events == 6);  // free_requested is not a free
  CHECK(r.stats.reserved_peak_bytes == 26 * MiB);
  REQUIRE(r.growth.size() == 3);
  const int64_t event[] = {0, 2, 4}, request[] = {MiB, 12 * MiB, 12 * MiB}, reserved[] = {2 * MiB, 14 * MiB, 26 * MiB};
  const char* context[] = {"a", "c", "d"};
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(r.growth[i].event == event[i]);
    CHECK(r.growth[i].request_bytes == request[i]);
    CHECK(r.growth[i].stream == 0);
    CHECK(r.growth[i].reserved_after_bytes == reserved[i]);
    CHECK(r.growth[i].context == context[i]);
  }
}

TEST_CASE("PYTORCH_CUDA_ALLOC_CONF parsing follows AllocatorConfig.cpp") {
  AllocatorConfig c = Conf("expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6");
  CHECK(c.expandable_segments);
  CHECK(c.max_split_size_bytes == 128 * MiB);
  CHECK(c.garbage_collection_threshold == doctest::Approx(0.6));
  // '>' fills from the interval after the last one given (parseRoundUpPower2Divisions; PyTorch
  // 2.11's libc10.so parses this string to [1 x 9, 2, 4 x 6])
  AllocatorConfig r = Conf("roundup_power2_divisions:[256:1,512:2,>:4]");
  CHECK(r.roundup_power2_divisions[0] == 1);
  CHECK(r.roundup_power2_divisions[8] == 1);
  CHECK(r.roundup_power2_divisions[9] == 2);
  CHECK(r.roundup_power2_divisions[10] == 4);
  CHECK(r.roundup_power2_divisions[15] == 4);
  // so 600 MiB, in [512 MiB, 1 GiB), rounds by halves to 768 MiB (by quarters it would be 640)
  CHECK(RoundAllocationSize(r, 600 * MiB) == 768 * MiB);
  // '>' alone leaves the first interval (below 2 MiB) at plain 512-byte rounding
  AllocatorConfig only_rest = Conf("roundup_power2_divisions:[>:4]");
  CHECK(only_rest.roundup_power2_divisions[0] == 0);
  CHECK(only_rest.roundup_power2_divisions[1] == 4);
  CHECK(RoundAllocationSize(only_rest, 1258291) == 1258496);  // 2458 x 512, not 1.25 MiB
  CHECK(RoundAllocationSize(only_rest, 3 * MiB + 1) == 3 * MiB + MiB / 2);  // [2, 4) MiB by quarters
  // large_segment_size_mb, wherever it stands, sets the least max_split_size_mb and the default of
  // max_non_split_rounding_mb
  AllocatorConfig l = Conf("max_split_size_mb:64,large_segment_size_mb:25");
  CHECK(l.large_segment_bytes == 25 * MiB);
  CHECK(l.max_non_split_rounding_bytes == 25 * MiB);
  CHECK(Conf("large_segment_size_mb:25,max_non_split_rounding_mb:30").max_non_split_rounding_bytes == 30 * MiB);
  // the last large_segment_size_mb counts, for every check (parseArgs' first pass reads them all)
  AllocatorConfig twice = Conf("large_segment_size_mb:40,max_split_size_mb:30,large_segment_size_mb:25");
  CHECK(twice.large_segment_bytes == 25 * MiB);
  CHECK(twice.max_split_size_bytes == 30 * MiB);
  CHECK(Conf("max_split_size_mb:0000000000000000000000512").max_split_size_bytes == 512 * MiB);  // stoull's leading zeros
  // 512 x divisions in size_t, as PyTorch: 2^54 divisions make 2^63, above every size (plain 512-byte
  // rounding); 2^55 wrap to 0, below every size (the next power of two: step 0)
  CHECK(RoundAllocationSize(Conf("roundup_power2_divisions:18014398509481984"), 600 * MiB + 1) == 600 * MiB + 512);
  CHECK(RoundAllocationSize(Conf("roundup_power2_divisions:36028797018963968"), 600 * MiB + 1) == GiB);
  CHECK(Conf("per_process_memory_fraction:0.9").per_process_memory_fraction == doctest::Approx(0.9));
  // white space of any kind is dropped (ConfigTokenizer), as a trailing newline from $(cat file)
  CHECK(Conf("expandable_segments:True\n").expandable_segments);
  CHECK(Conf("\tmax_split_size_mb:\t64").max_split_size_bytes == 64 * MiB);
  CHECK(Conf("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:False,pinned_num_register_threads:128").text.size() > 0);
  CHECK(Conf("backend:native,release_lock_on_cudamalloc:True").max_split_size_bytes == alloc::kNoMaxSplit);
  // a huge value is clamped as PyTorch clamps it, not wrapped
  CHECK(Conf("max_split_size_mb:999999999999999").max_split_size_bytes == alloc::kNoMaxSplit / MiB * MiB);
  for (const char* bad : {"foo:1", "max_split_size_mb:10", "max_split_size_mb:x", "expandable_segments:yes",
                          "garbage_collection_threshold:1.5", "roundup_power2_divisions:3", "roundup_power2_divisions:[256:3]",
                          "roundup_power2_divisions:[256:1", "backend:cudaMallocAsync", "expandable_segments:True max_split_size_mb:64",
                          "max_split_size_mb", "max_split_size_mb:20,large_segment_size_mb:25", "large_segment_size_mb:10",
                          "large_segment_size_mb:25,max_non_split_rounding_mb:24", "per_process_memory_fraction:1.5",
                          "per_process_memory_fraction:-0.1", "per_process_memory_fraction:x", "pinned_num_register_threads:3",
                          "pinned_num_register_threads:256", "pinned_reserve_segment_size_mb:0", "max_split_size_mb:512MB",
                          "large_segment_size_mb:25,max_split_size_mb:30,large_segment_size_mb:40"}) {
    auto p = ParseAllocatorConfig(bad);
    CHECK_MESSAGE(!p.ok(), bad);
    if (!p.ok()) CHECK(p.error().message.rfind("--alloc-conf: ", 0) == 0);
  }
}

}  // namespace
}  // namespace fsdp
