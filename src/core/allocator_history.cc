#include "core/allocator_history.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace fsdp {
namespace {

bool IsCount(const Json& j) { return j.is_number_integer() || j.is_number_unsigned(); }
// a byte count: an integer, not negative (every size of a history: events, segments, blocks, live storages)
bool IsSize(const Json& j) { return IsCount(j) && j.get<int64_t>() >= 0; }

// [action, address, bytes, stream]
bool WellFormedEvent(const Json& e) {
  return e.is_array() && e.size() >= 4 && e[0].is_string() && IsCount(e[1]) && IsSize(e[2]) && IsCount(e[3]);
}

// The allocator's stream for a recorded one: 0 stays 0, the others are numbered 1, 2, ... in the
// order they first appear (CUDA's stream handles are addresses); past 63 they share the last.
class StreamNumbers {
 public:
  int Of(const Json& j) {
    const uint64_t recorded = j.get<uint64_t>();
    if (recorded == 0) return 0;
    return std::min(numbers_.try_emplace(recorded, static_cast<int>(numbers_.size()) + 1).first->second, kMaxStream);
  }
 private:
  static constexpr int kMaxStream = 63;
  std::map<uint64_t, int> numbers_;
};

}  // namespace

Result<HistoryReplay> ReplayAllocatorHistory(const Json& history, const AllocatorConfig& config, DeviceMemory& device) {
  if (!history.is_object() || !history.contains("events") || !history["events"].is_array()) {
    return Error::BadInput("allocator history: no \"events\" list");
  }
  CachingAllocator a(config, device);
  StreamNumbers streams;
  std::map<uint64_t, CachingAllocator::Handle> live;      // by the recording's address
  std::map<uint64_t, CachingAllocator::Handle> awaiting;  // "free_requested", not yet completed
  auto malloc_at = [&](uint64_t address, int64_t bytes, int stream) -> Status {
    const CachingAllocator::Handle h = a.Malloc(bytes, stream);
    if (h == CachingAllocator::kNoHandle) return Error::OutOfMemory(fmt::format("allocator history: out of memory at a {}-byte request", bytes));
    live[address] = h;
    return Status::Ok();
  };
  std::vector<CachingAllocator::Handle> inactive;
  for (const Json& seg : history.value("segments_at_start", Json::array())) {
    if (!seg.is_array() || seg.size() < 5 || !IsCount(seg[0]) || !IsSize(seg[1]) || !IsCount(seg[2]) || !seg[4].is_array()) {
      return Error::BadInput(fmt::format("allocator history: malformed segment {}", seg.dump().substr(0, 80)));
    }
    const int stream = streams.Of(seg[2]);
    if (seg[3] == "large") {  // the segment, then its blocks
      const CachingAllocator::Handle whole = a.Malloc(seg[1].get<int64_t>(), stream);
      if (whole == CachingAllocator::kNoHandle) return Error::OutOfMemory("allocator history: out of memory re-making the start layout");
      a.Free(whole);
    }
    uint64_t address = seg[0].get<uint64_t>();
    for (const Json& block : seg[4]) {
      if (!block.is_array() || block.size() < 2 || !IsSize(block[0])) return Error::BadInput("allocator history: malformed block in segments_at_start");
      const CachingAllocator::Handle b = a.Malloc(block[0].get<int64_t>(), stream);
      if (b == CachingAllocator::kNoHandle) return Error::OutOfMemory("allocator history: out of memory re-making the start layout");
      if (block[1] == "active_allocated") live[address] = b;
      else inactive.push_back(b);
      address += block[0].get<uint64_t>();
    }
  }
  for (CachingAllocator::Handle b : inactive) a.Free(b);
  for (const Json& t : history.value("live_at_start", Json::array())) {
    if (!t.is_array() || t.size() < 2 || !IsCount(t[0]) || !IsSize(t[1])) return Error::BadInput("allocator history: malformed live_at_start entry");
    FSDP_TRY(malloc_at(t[0].get<uint64_t>(), t[1].get<int64_t>(), 0));
  }
  HistoryReplay r;
  r.reserved_at_start_bytes = a.stats().reserved_bytes;
  r.device_allocs_at_start = a.stats().num_device_alloc;
  int64_t index = -1;
  for (const Json& e : history["events"]) {
    ++index;
    if (!WellFormedEvent(e)) return Error::BadInput(fmt::format("allocator history: malformed event {}", e.dump().substr(0, 80)));
    const std::string& action = e[0].get_ref<const std::string&>();
    const uint64_t address = e[1].get<uint64_t>();
    if (action == "alloc") {
      const int64_t reserved_before = a.stats().reserved_bytes;
      const int stream = streams.Of(e[3]);
      FSDP_TRY(malloc_at(address, e[2].get<int64_t>(), stream));
      if (a.stats().reserved_bytes > reserved_before) {
        const std::string context = e.size() > 4 && e[4].is_string() ? e[4].get<std::string>() : "";
        r.growth.push_back({index, e[2].get<int64_t>(), stream, a.stats().reserved_bytes, context});
      }
      ++r.events;
    } else if (action == "free_requested") {
      // free() of a block used on other streams: no longer allocated (allocated_bytes falls), back
      // in its pool at its "free_completed" (PyTorch records both for every free; fsdp-plan's
      // trace this one only where record_stream defers the return)
      const auto it = live.find(address);
      if (it == live.end()) {
        ++r.unknown_frees;
        continue;
      }
      a.RecordStream(it->second, streams.Of(e[3]) == 0 ? 1 : 0);
      a.Free(it->second);
      awaiting[address] = it->second;
      live.erase(it);
    } else if (action == "free_completed") {
      if (const auto waited = awaiting.find(address); waited != awaiting.end()) {
        a.EventsPassed(waited->second);
        awaiting.erase(waited);
        ++r.events;
        continue;
      }
      const auto it = live.find(address);
      if (it == live.end()) {
        ++r.unknown_frees;
        continue;
      }
      a.Free(it->second);
      live.erase(it);
      ++r.events;
    } else if (action == "segment_alloc") {
      ++r.segments_recorded;
    }
  }
  r.stats = a.stats();
  return r;
}

Json AllocatorHistoryJson(const std::vector<HistoryEvent>& events, const std::string& source) {
  Json list = Json::array();
  for (const HistoryEvent& e : events) {
    const char* action = e.action == HistoryEvent::Action::kAlloc           ? "alloc"
                         : e.action == HistoryEvent::Action::kFreeRequested ? "free_requested"
                                                                            : "free_completed";
    list.push_back(Json::array({action, e.address, e.bytes, e.stream, e.context}));
  }
  return Json{{"source", source}, {"events", std::move(list)}, {"live_at_start", Json::array()}};
}

}  // namespace fsdp
