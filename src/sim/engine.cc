#include "sim/engine.h"

#include <algorithm>
#include <cmath>

namespace fsdp::sim {

StreamId Engine::AddStream(std::string name, int rank) {
  streams_.push_back({std::move(name), rank});
  stream_state_.emplace_back();
  return static_cast<StreamId>(streams_.size() - 1);
}

int Engine::AddLink(double share_capacity) {
  links_.emplace_back();
  links_.back().capacity = share_capacity;
  return static_cast<int>(links_.size() - 1);
}

EventId Engine::AddEvent() {
  event_time_.push_back(kNever);
  event_waiters_threads_.emplace_back();
  event_waiters_streams_.emplace_back();
  return static_cast<EventId>(event_time_.size() - 1);
}

OpId Engine::AddOp(Op op) {
  ops_.push_back(std::move(op));
  arrived_.push_back(false);
  return static_cast<OpId>(ops_.size() - 1);
}

int Engine::AddCollective(const std::vector<OpId>& ops) {
  const int id = static_cast<int>(collectives_.size());
  collectives_.push_back(ops);
  collective_ready_.push_back(0);
  for (OpId o : ops) ops_[o].collective = id;
  return id;
}

int Engine::AddCpuThread(std::vector<CpuAction> program) {
  threads_.push_back(Thread{std::move(program)});
  const int id = static_cast<int>(threads_.size() - 1);
  Push(0, Kind::kCpu, id);
  return id;
}

void Engine::Push(TimeNs t, Kind kind, int a, int64_t b) { heap_.push(Item{t, seq_++, kind, a, b}); }

TimeNs Engine::Run() {
  while (!heap_.empty()) {
    const Item item = heap_.top();
    heap_.pop();
    ++events_processed_;
    last_time_ = std::max(last_time_, item.time);
    switch (item.kind) {
      case Kind::kCpu: StepThread(item.a, item.time); break;
      case Kind::kFixedDone: {
        Op& op = ops_[item.a];
        if (op.link >= 0 && op.link_solo_s > 0) EnterLink(item.a, item.time);
        else Complete(item.a, item.time);
        break;
      }
      case Kind::kLinkDone:
        if (item.b == links_[item.a].generation) {
          AdvanceLink(item.a, item.time);
          ScheduleLink(item.a, item.time);
        }
        break;
      case Kind::kOpDone: Complete(item.a, item.time); break;
    }
  }
  return last_time_;
}

// Executes the thread's actions at `now` until it must wait (for its own CPU time or an event).
void Engine::StepThread(int t, TimeNs now) {
  Thread& th = threads_[t];
  th.time = std::max(th.time, now);
  while (th.pc < th.program.size()) {
    const CpuAction& action = th.program[th.pc];
    if (const auto* launch = std::get_if<LaunchOp>(&action)) {
      // the launch costs CPU time first; the op reaches its stream when the call returns
      if (th.waiting != kLaunching) {
        th.waiting = kLaunching;
        th.launch_start = th.time;
        Push(th.time + launch_overhead_ns_, Kind::kCpu, t);
        return;
      }
      th.waiting = kNoEvent;
      Span(t, CpuSpan{th.launch_start, th.time, 'L', launch->op, {}});
      Op& op = ops_[launch->op];
      stream_state_[op.stream].queue.push_back(launch->op);
      ++th.pc;
      TryStart(op.stream, th.time);
    } else if (const auto* sync = std::get_if<SyncEvent>(&action)) {
      if (event_time_[sync->event] == kNever) {
        th.waiting = sync->event;
        th.block_start = th.time;
        event_waiters_threads_[sync->event].push_back(t);
        return;
      }
      ++th.pc;
    } else if (const auto* work = std::get_if<CpuWork>(&action)) {
      ++th.pc;
      Span(t, CpuSpan{th.time, th.time + work->ns, 'H', -1, work->name});
      Push(th.time + work->ns, Kind::kCpu, t);
      return;
    } else if (const auto* marker = std::get_if<Marker>(&action)) {
      if (marker->key >= static_cast<int>(markers_.size())) markers_.resize(marker->key + 1, kNever);
      markers_[marker->key] = th.time;
      ++th.pc;
    }
  }
  th.finish_ns = th.time;
}

bool Engine::Ready(const Op& op) const {
  for (EventId e : op.waits) if (event_time_[e] == kNever) return false;
  return true;
}

void Engine::TryStart(StreamId s, TimeNs now) {
  StreamState& st = stream_state_[s];
  if (st.busy || st.head >= st.queue.size()) return;
  const OpId id = st.queue[st.head];
  Op& op = ops_[id];
  if (!Ready(op)) {
    for (EventId e : op.waits) if (event_time_[e] == kNever) event_waiters_streams_[e].push_back(s);
    return;
  }
  if (op.collective >= 0) {
    // a collective starts when every participant has it at the head of its stream, ready
    if (!arrived_[id]) {
      arrived_[id] = true;
      if (++collective_ready_[op.collective] < static_cast<int>(collectives_[op.collective].size())) return;
      for (OpId member : collectives_[op.collective]) StartOp(member, now);
    }
    return;
  }
  StartOp(id, now);
}

void Engine::StartOp(OpId id, TimeNs now) {
  Op& op = ops_[id];
  StreamState& st = stream_state_[op.stream];
  st.busy = true;
  ++st.head;
  op.start_ns = now;
  Push(now + op.fixed_ns, Kind::kFixedDone, id);
}

void Engine::EnterLink(OpId id, TimeNs now) {
  const int l = ops_[id].link;
  AdvanceLink(l, now);
  links_[l].active.push_back(Transfer{id, ops_[id].link_solo_s});
  ScheduleLink(l, now);
}

// Progress every transfer on the link since its last update: n concurrent transfers each run at
// 1/n of their solo speed (the link's bandwidth is shared equally).
void Engine::AdvanceLink(int l, TimeNs now) {
  LinkState& link = links_[l];
  if (!link.active.empty()) {
    const double dt = static_cast<double>(now - link.last_update) * 1e-9;
    const double share = link.capacity / static_cast<double>(link.active.size());
    for (auto& tr : link.active) tr.remaining_s -= dt * share;
    std::vector<OpId> done;
    auto it = std::remove_if(link.active.begin(), link.active.end(), [&](const Transfer& tr) {
      if (tr.remaining_s > 1e-12) return false;
      done.push_back(tr.op);
      return true;
    });
    link.active.erase(it, link.active.end());
    link.last_update = now;
    for (OpId op : done) Complete(op, now);
  }
  link.last_update = now;
}

void Engine::ScheduleLink(int l, TimeNs now) {
  LinkState& link = links_[l];
  ++link.generation;
  if (link.active.empty()) return;
  double first = INFINITY;
  for (const auto& tr : link.active) first = std::min(first, tr.remaining_s);
  const double seconds = first * static_cast<double>(link.active.size()) / link.capacity;
  Push(now + static_cast<TimeNs>(std::ceil(seconds * 1e9)), Kind::kLinkDone, l, link.generation);
}

void Engine::Complete(OpId id, TimeNs now) {
  Op& op = ops_[id];
  op.end_ns = now;
  stream_state_[op.stream].busy = false;
  if (op.records != kNoEvent) Fire(op.records, now);
  TryStart(op.stream, now);
}

void Engine::Fire(EventId e, TimeNs now) {
  event_time_[e] = now;
  std::vector<int> threads;
  threads.swap(event_waiters_threads_[e]);
  for (int t : threads) {
    Thread& th = threads_[t];
    th.blocked_ns += now - th.block_start;
    Span(t, CpuSpan{th.block_start, now, 'W', -1, {}});
    th.waiting = kNoEvent;
    th.time = now;
    ++th.pc;
    Push(now, Kind::kCpu, t);
  }
  std::vector<StreamId> streams;
  streams.swap(event_waiters_streams_[e]);
  for (StreamId s : streams) TryStart(s, now);
}

}  // namespace fsdp::sim
