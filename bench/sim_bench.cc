// Simulator speed (issue targets: >= 5 million events/s on one core; one step of llama-3.1-405b on
// 1,024 GPUs in aggregate mode under 50 ms; per-rank mode with 1,024 ranks under 5 s).
//   build/bench/sim_bench [repeats]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/catalog.h"
#include "sim/engine.h"
#include "sim/simulator.h"

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A synthetic schedule: 3 streams, each op waiting on the previous op of another stream, half of
// them transfers sharing one link. Returns events per second of Engine::Run alone.
double EngineEventsPerSecond(int ops) {
  using namespace fsdp::sim;
  Engine e(1000);
  StreamId s[3] = {e.AddStream("a", 0), e.AddStream("b", 0), e.AddStream("c", 0)};
  const int link = e.AddLink();
  std::vector<CpuAction> program;
  EventId last = kNoEvent;
  for (int i = 0; i < ops; ++i) {
    Op op;
    op.stream = s[i % 3];
    op.name = "op";
    op.fixed_ns = 1000 + (i % 7) * 100;
    if (i % 2 == 0) {
      op.link = link;
      op.link_solo_s = 2e-6;
    }
    if (last != kNoEvent) op.waits.push_back(last);
    op.records = e.AddEvent();
    if (i % 4 == 0) last = op.records;
    program.push_back(LaunchOp{e.AddOp(std::move(op))});
  }
  e.AddCpuThread(std::move(program));
  const auto start = std::chrono::steady_clock::now();
  e.Run();
  const double s_elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return static_cast<double>(e.events_processed()) / s_elapsed;
}

double SimulateSeconds(int64_t ranks, int64_t* events) {
  auto model = fsdp::LoadModel("llama-3.1-405b");
  auto hw = fsdp::LoadHardware("h100-sxm");
  fsdp::FsdpConfig c;
  c.gpus = 1024;
  c.seq_len = 8192;
  c.checkpointing = fsdp::Checkpointing::kFull;
  auto w = fsdp::BuildWorkload(model.value(), hw.value(), c);
  fsdp::sim::SimOptions o;
  o.ranks = ranks;
  o.jitter = ranks > 0 ? 0.02 : 0;
  const auto start = std::chrono::steady_clock::now();
  auto r = fsdp::sim::Simulate(w.value(), o);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!r.ok()) { std::fprintf(stderr, "%s\n", r.error().message.c_str()); std::exit(1); }
  *events = r.value().events;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  std::vector<double> rates, aggregate, per_rank;
  int64_t agg_events = 0, rank_events = 0;
  for (int i = 0; i < repeats; ++i) {
    rates.push_back(EngineEventsPerSecond(1'000'000));
    aggregate.push_back(SimulateSeconds(0, &agg_events));
  }
  for (int i = 0; i < std::max(1, repeats / 2); ++i) per_rank.push_back(SimulateSeconds(1024, &rank_events));
  std::printf("engine: median %.1f million events/s (synthetic 1,000,000-op schedule, %d runs)\n", Median(rates) / 1e6, repeats);
  std::printf("llama-3.1-405b, 1024 x h100-sxm, aggregate mode: median %.1f ms per simulated step (%lld events, %d runs)\n",
              Median(aggregate) * 1e3, static_cast<long long>(agg_events), repeats);
  std::printf("llama-3.1-405b, 1024 x h100-sxm, per-rank mode (1024 ranks, 2%% jitter): median %.2f s per simulated step (%lld events, %zu runs)\n",
              Median(per_rank), static_cast<long long>(rank_events), per_rank.size());
  return 0;
}
