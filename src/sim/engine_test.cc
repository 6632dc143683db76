#include "sim/engine.h"

#include <doctest/doctest.h>

namespace fsdp::sim {
namespace {

Op MakeOp(StreamId s, TimeNs fixed, std::vector<EventId> waits, EventId records, double link_s = 0, int link = -1) {
  Op op;
  op.stream = s;
  op.name = "op";
  op.fixed_ns = fixed;
  op.waits = std::move(waits);
  op.records = records;
  op.link_solo_s = link_s;
  op.link = link;
  return op;
}

TEST_CASE("a cross-stream wait: the second stream starts when the event fires") {
  Engine e(0);
  StreamId compute = e.AddStream("compute", 0), comm = e.AddStream("comm", 0);
  EventId done = e.AddEvent();
  OpId a = e.AddOp(MakeOp(compute, 2000, {}, done));
  OpId b = e.AddOp(MakeOp(comm, 1000, {done}, e.AddEvent()));
  e.AddCpuThread({LaunchOp{a}, LaunchOp{b}});
  CHECK(e.Run() == 3000);
  CHECK(e.ops()[b].start_ns == 2000);
  CHECK(e.ops()[b].end_ns == 3000);
}

TEST_CASE("in-order streams and the CPU's launch overhead") {
  Engine e(10);
  StreamId s = e.AddStream("compute", 0);
  OpId a = e.AddOp(MakeOp(s, 5, {}, e.AddEvent()));
  OpId b = e.AddOp(MakeOp(s, 5, {}, e.AddEvent()));
  OpId c = e.AddOp(MakeOp(s, 100, {}, e.AddEvent()));
  e.AddCpuThread({LaunchOp{a}, LaunchOp{b}, LaunchOp{c}});
  e.Run();
  // launched at 10, 20, 30: a [10, 15], b [20, 25], c [30, 130]
  CHECK(e.ops()[a].start_ns == 10);
  CHECK(e.ops()[b].start_ns == 20);
  CHECK(e.ops()[c].start_ns == 30);
  CHECK(e.ops()[c].end_ns == 130);
}

TEST_CASE("concurrent transfers share a link's bandwidth") {
  Engine e(0);
  StreamId s1 = e.AddStream("all-gather", 0), s2 = e.AddStream("reduce-scatter", 0);
  int link = e.AddLink();
  EventId late = e.AddEvent();
  // t1 alone for 0.5 s, then both at half speed: t1 ends at 1.5 s; t2 then runs alone: ends at 2.0 s.
  OpId t1 = e.AddOp(MakeOp(s1, 0, {}, e.AddEvent(), 1.0, link));
  OpId delay = e.AddOp(MakeOp(s2, 500'000'000, {}, late));
  OpId t2 = e.AddOp(MakeOp(s2, 0, {late}, e.AddEvent(), 1.0, link));
  e.AddCpuThread({LaunchOp{t1}, LaunchOp{delay}, LaunchOp{t2}});
  e.Run();
  CHECK(e.ops()[t1].end_ns == 1'500'000'000);
  CHECK(e.ops()[t2].end_ns == 2'000'000'000);
}

TEST_CASE("a CPU thread blocks on an event (the rate limiter's synchronize)") {
  Engine e(0);
  StreamId s = e.AddStream("compute", 0), t = e.AddStream("comm", 0);
  EventId done = e.AddEvent();
  OpId a = e.AddOp(MakeOp(s, 1000, {}, done));
  OpId b = e.AddOp(MakeOp(t, 10, {}, e.AddEvent()));
  int thread = e.AddCpuThread({LaunchOp{a}, SyncEvent{done}, Marker{0}, LaunchOp{b}});
  e.Run();
  CHECK(e.MarkerTime(0) == 1000);
  CHECK(e.ops()[b].start_ns == 1000);
  CHECK(e.CpuBlocked(thread) == 1000);
}

TEST_CASE("a collective starts when its slowest participant arrives") {
  Engine e(0);
  StreamId c0 = e.AddStream("rank 0 compute", 0), n0 = e.AddStream("rank 0 nccl", 0);
  StreamId c1 = e.AddStream("rank 1 compute", 1), n1 = e.AddStream("rank 1 nccl", 1);
  EventId d0 = e.AddEvent(), d1 = e.AddEvent();
  OpId w0 = e.AddOp(MakeOp(c0, 100, {}, d0)), w1 = e.AddOp(MakeOp(c1, 300, {}, d1));
  OpId r0 = e.AddOp(MakeOp(n0, 50, {d0}, e.AddEvent())), r1 = e.AddOp(MakeOp(n1, 50, {d1}, e.AddEvent()));
  e.AddCollective({r0, r1});
  e.AddCpuThread({LaunchOp{w0}, LaunchOp{r0}});
  e.AddCpuThread({LaunchOp{w1}, LaunchOp{r1}});
  e.Run();
  CHECK(e.ops()[r0].start_ns == 300);
  CHECK(e.ops()[r1].start_ns == 300);
  CHECK(e.ops()[r0].end_ns == 350);
}

TEST_CASE("same inputs, same schedule: ties are broken by (time, sequence)") {
  auto run = [] {
    Engine e(0);
    std::vector<OpId> ops;
    std::vector<CpuAction> program;
    for (int s = 0; s < 3; ++s) {
      StreamId id = e.AddStream("s", 0);
      for (int i = 0; i < 4; ++i) {
        ops.push_back(e.AddOp(MakeOp(id, 7, {}, e.AddEvent())));
        program.push_back(LaunchOp{ops.back()});
      }
    }
    e.AddCpuThread(program);
    e.Run();
    std::vector<TimeNs> starts;
    for (OpId o : ops) starts.push_back(e.ops()[o].start_ns);
    return starts;
  };
  CHECK(run() == run());
}

}  // namespace
}  // namespace fsdp::sim
