// A general discrete-event engine for one training step: CPU threads that issue work in program
// order (with a launch overhead, able to block on an event), in-order GPU streams, events and
// cross-stream waits, links whose bandwidth concurrent transfers share, collectives that start when
// every participating rank has reached them, and a memory pool that records allocations and frees.
// Simulated time is integer nanoseconds; ties are broken by (time, sequence number).
#pragma once

#include <cstdint>
#include <queue>
#include <string>
#include <variant>
#include <vector>

namespace fsdp::sim {

using TimeNs = int64_t;  ///< simulated time in nanoseconds
constexpr TimeNs kNever = INT64_MAX;

/// A GPU stream of one rank (index into Engine's stream table).
using StreamId = int;
/// An event of one rank: fired when the op that records it completes (or at start, for kInitiallyFired).
using EventId = int;
using OpId = int;
constexpr EventId kNoEvent = -1;

/// Work placed on a stream.
struct Op {
  StreamId stream = 0;
  std::string name;                  ///< e.g. "AG model.layers.3"
  TimeNs fixed_ns = 0;               ///< latency / compute time, not shared
  double link_solo_s = 0;            ///< transfer time alone on the link; stretched when others share it
  int link = -1;                     ///< link used by the transfer (-1: none)
  std::vector<EventId> waits;        ///< events that must have fired before the op starts
  EventId records = kNoEvent;        ///< event fired when the op completes
  int collective = -1;               ///< collective instance id: starts when all its ops are ready
  // filled by the engine
  TimeNs start_ns = kNever, end_ns = kNever;
};

/// What a CPU thread does next, in program order.
struct LaunchOp { OpId op; };            ///< costs the launch overhead, enqueues the op
struct SyncEvent { EventId event; };     ///< blocks the thread until the event fires
struct CpuWork { TimeNs ns; std::string name; };  ///< host-side work (e.g. CPU optimizer step)
struct Marker { int key; };              ///< records the thread's current time under `key`
using CpuAction = std::variant<LaunchOp, SyncEvent, CpuWork, Marker>;

/// What a CPU thread spent a stretch of time on (recorded for one thread: RecordCpuSpans).
struct CpuSpan {
  TimeNs start_ns = 0, end_ns = 0;
  char kind = 'L';  ///< L launching an op, W blocked on an event (rate limiter, syncs), H host work
  int op = -1;      ///< the op launched (L), -1 otherwise
  std::string name; ///< host work's name (H)
};

struct StreamInfo {
  std::string name;                  ///< "rank 0 compute", ...
  int rank = 0;
};

/// Build, then run once: add streams, links and events, then ops (each naming a stream, the
/// events it waits for and the event it records, all returned by this engine), then CPU threads
/// whose programs launch those ops; Run() plays everything. Ids are dense indices in creation
/// order. The engine never fails: an op waiting for an event no op records, or a collective some
/// rank never launches, stays unstarted (start_ns and end_ns kNever) and a thread that synchronises
/// on such an event never finishes (CpuFinish kNever); callers check. Single-threaded.
class Engine {
 public:
  /// `launch_overhead_ns` (>= 0): CPU time each LaunchOp costs its thread.
  explicit Engine(TimeNs launch_overhead_ns) : launch_overhead_ns_(launch_overhead_ns) {}

  /// A new in-order stream of `rank` (rank only labels it and groups it in reports).
  StreamId AddStream(std::string name, int rank);
  /// A link whose `share_capacity` (1.0: one transfer at full speed) concurrent transfers share
  /// equally; an op's bandwidth part runs on its link.
  int AddLink(double share_capacity = 1.0);
  /// A new event, fired when the op recording it completes.
  EventId AddEvent();
  /// Registers an op (not yet launched: a thread's LaunchOp enqueues it on its stream). `op.stream`,
  /// `op.link` (-1: none) and the events in `op.waits` and `op.records` must come from this engine.
  OpId AddOp(Op op);
  /// Declares a collective made of these ops (one per participating rank): none starts before all
  /// are at the head of their streams with their waits fired; they then start together.
  int AddCollective(const std::vector<OpId>& ops);
  /// Adds a CPU thread running `program` from time 0; returns its index.
  int AddCpuThread(std::vector<CpuAction> program);

  /// Runs until no event is left: every thread at the end of its program (or blocked for ever) and
  /// every stream drained (or stuck). Deterministic: ties go by (time, insertion sequence).
  /// Returns the time of the last completion. Call once.
  TimeNs Run();

  /// After Run: the ops with their start and end times (kNever: never ran).
  const std::vector<Op>& ops() const { return ops_; }
  const std::vector<StreamInfo>& streams() const { return streams_; }
  /// Heap events processed by Run (the simulator's cost measure).
  int64_t events_processed() const { return events_processed_; }
  /// Time each Marker key was reached (kNever if not).
  TimeNs MarkerTime(int key) const { return key < static_cast<int>(markers_.size()) ? markers_[key] : kNever; }
  /// When thread `thread` finished its program (kNever: blocked for ever).
  TimeNs CpuFinish(int thread) const { return threads_[thread].finish_ns; }
  /// CPU time a thread spent blocked in SyncEvent.
  TimeNs CpuBlocked(int thread) const { return threads_[thread].blocked_ns; }
  /// Records what `thread` does over time (call before Run); its spans after Run, in time order.
  void RecordCpuSpans(int thread) { recorded_thread_ = thread; }
  const std::vector<CpuSpan>& CpuSpans() const { return cpu_spans_; }

 private:
  struct Thread {
    std::vector<CpuAction> program;
    size_t pc = 0;
    TimeNs time = 0, finish_ns = kNever, blocked_ns = 0, block_start = 0, launch_start = 0;
    EventId waiting = kNoEvent;   // or kLaunching while the launch overhead elapses
  };
  static constexpr EventId kLaunching = -2;
  struct StreamState {
    std::vector<OpId> queue;
    size_t head = 0;
    bool busy = false;
  };
  struct Transfer {
    OpId op;
    double remaining_s;   // solo seconds left
  };
  struct LinkState {
    std::vector<Transfer> active;
    TimeNs last_update = 0;
    int64_t generation = 0;
    double capacity = 1.0;
  };
  enum class Kind { kCpu, kOpDone, kLinkDone, kFixedDone };
  struct Item {
    TimeNs time;
    int64_t seq;
    Kind kind;
    int a;            // thread, op or link
    int64_t b;        // link generation
    bool operator>(const Item& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };

  void Push(TimeNs t, Kind kind, int a, int64_t b = 0);
  void Span(int thread, CpuSpan span) {
    if (thread == recorded_thread_ && span.end_ns > span.start_ns) cpu_spans_.push_back(std::move(span));
  }
  int recorded_thread_ = -1;
  std::vector<CpuSpan> cpu_spans_;
  void StepThread(int t, TimeNs now);
  void TryStart(StreamId s, TimeNs now);
  bool Ready(const Op& op) const;
  void StartOp(OpId id, TimeNs now);
  void EnterLink(OpId id, TimeNs now);
  void AdvanceLink(int link, TimeNs now);
  void ScheduleLink(int link, TimeNs now);
  void Complete(OpId id, TimeNs now);
  void Fire(EventId e, TimeNs now);

  TimeNs launch_overhead_ns_;
  std::vector<Op> ops_;
  std::vector<bool> arrived_;       // per op: counted towards its collective
  std::vector<StreamInfo> streams_;
  std::vector<StreamState> stream_state_;
  std::vector<LinkState> links_;
  std::vector<TimeNs> event_time_;
  std::vector<std::vector<int>> event_waiters_threads_;
  std::vector<std::vector<StreamId>> event_waiters_streams_;
  std::vector<std::vector<OpId>> collectives_;
  std::vector<int> collective_ready_;
  std::vector<Thread> threads_;
  std::vector<TimeNs> markers_;
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap_;
  int64_t seq_ = 0;
  int64_t events_processed_ = 0;
  TimeNs last_time_ = 0;
};

}  // namespace fsdp::sim
