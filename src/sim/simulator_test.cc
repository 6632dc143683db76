#include "core/limits.h"
#include "sim/simulator.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include "planner/memory_model.h"
#include "planner/step_model.h"

namespace fsdp::sim {
namespace {

constexpr const char* kHandLlama =
    R"({"model_type":"llama","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
    R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64})";

Workload Hand(FsdpConfig c) {
  auto m = ModelFromHfConfig(ParseJson(kHandLlama, "hand.json").value(), "hand", "hand.json");
  auto w = BuildWorkload(m.value(), LoadHardware("a100-80gb-sxm").value(), c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

Workload Real(const char* model, FsdpConfig c, const char* gpu = "h100-sxm") {
  auto w = BuildWorkload(LoadModel(model).value(), LoadHardware(gpu).value(), c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

SimOptions NoCpu() {
  SimOptions o;
  o.launch_overhead_s = 0;
  return o;
}

TEST_CASE("golden: 3 units with known durations, timeline computed by hand") {
  FsdpConfig c;
  c.gpus = 3;
  c.seq_len = 2;
  Workload w = Hand(c);
  SimOptions o = NoCpu();
  // embedding 0.25 s forward and backward, lm_head with the loss 0.75 s, blocks 2 s and 4 s
  std::vector<NodeCompute> nodes(w.nodes.size());
  for (size_t i = 0; i < w.nodes.size(); ++i) {
    const ModuleNode::Role role = w.nodes[i].role;
    if (role == ModuleNode::Role::kEmbedding) nodes[i] = {0.25, 0.25, 0};
    if (role == ModuleNode::Role::kLmHead) nodes[i] = {0.75, 0.75, 0};
    if (role == ModuleNode::Role::kBlock) nodes[i] = {2.0, 4.0, 0};
  }
  o.compute_override = ComputeFromNodes(w, std::move(nodes), 0.5);
  o.collective_override = std::vector<UnitComm>{{{0.5}, {0.5}, {}, 0, 0}, {{1.0}, {1.0}, {}, 0, 0}, {{1.0}, {1.0}, {}, 0, 0}};
  // Same schedule as step_model_test's hand timeline: forward AG root [0, .5], embedding [.5, .75],
  // AG L0 [.5, 1.5], L0 [1.5, 3.5], AG L1 [1.5, 2.5], L1 [3.5, 5.5], lm_head + loss [5.5, 6.25];
  // backward: the CPU blocks on L0's free event before re-gathering L1 [3.5, 4.5]; lm_head + loss
  // [6.25, 7]; AG L0 [4.5, 5.5]; L1 [7, 11]; RS L1 [11, 12]; L0 [11, 15]; RS L0 [15, 16]; embedding
  // [15, 15.25]; RS root [16, 16.5]; wait; optimizer [16.5, 17].
  auto r = Simulate(w, o);
  REQUIRE(r.ok());
  CHECK(r.value().step_s == doctest::Approx(17.0));
  CHECK(r.value().compute_s == doctest::Approx(14.5));
  CHECK(r.value().exposed_comm_s == doctest::Approx(2.5));
  bool saw_rs_root = false, saw_head = false;
  for (const auto& op : r.value().ops) {
    if (op.name == "RS root") {
      saw_rs_root = true;
      CHECK(op.start_s == doctest::Approx(16.0));
      CHECK(op.end_s == doctest::Approx(16.5));
    }
    if (op.name == "FWD root (norm, lm_head + loss)") {
      saw_head = true;
      CHECK(op.start_s == doctest::Approx(5.5));
    }
    if (op.name == "AG model.layers.1" && op.start_s > 3) CHECK(op.start_s == doctest::Approx(3.5));
  }
  CHECK(saw_rs_root);
  CHECK(saw_head);
  CHECK(r.value().cpu_blocked_s > 0);  // the limiter made the CPU wait
}

TEST_CASE("consistency with fsdp-plan: same peak memory, step time within 1% without CPU overheads") {
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard, Strategy::kHybridShard}) {
    FsdpConfig c;
    c.gpus = 16;
    c.seq_len = 2048;
    c.strategy = s;
    c.grad_accum = 2;
    Workload w = Real("llama-2-7b", c);
    auto r = Simulate(w, NoCpu());
    REQUIRE(r.ok());
    CAPTURE(StrategyName(s));
    CHECK(r.value().peak_bytes == EstimateMemory(w).peak_bytes);
    CHECK(r.value().step_s == doctest::Approx(EstimateTime(w).step.step_s).epsilon(0.01));
  }
}

TEST_CASE("invariants: compute <= step <= compute + communication") {
  for (bool offload : {false, true}) {
    FsdpConfig c;
    c.gpus = 8;
    c.seq_len = 1024;
    c.cpu_offload = offload;
    Workload w = Real("llama-2-7b", c, "a100-40gb-sxm");
    auto r = Simulate(w, SimOptions{});
    REQUIRE(r.ok());
    CHECK(r.value().step_s >= r.value().compute_s);
    CHECK(r.value().step_s <= r.value().compute_s + EstimateComm(w).volume.total_comm_s + 1.0);  // + CPU-side work
  }
}

TEST_CASE("infinite bandwidth and no latency give the compute time; no compute gives the communication time") {
  FsdpConfig c;
  c.gpus = 8;
  c.seq_len = 2048;
  Workload w = Real("llama-2-7b", c);
  SimOptions fast = NoCpu();
  fast.bandwidth_override = limits::kBytesPerS.max;  // 1 PB/s: an all-gather of a block takes ~0.4 us
  fast.latency_scale = 0;
  auto r = Simulate(w, fast);
  REQUIRE(r.ok());
  CHECK(r.value().step_s == doctest::Approx(r.value().compute_s).epsilon(1e-5));
  SimOptions idle = NoCpu();
  idle.compute_scale = 0;
  auto z = Simulate(w, idle);
  REQUIRE(z.ok());
  CHECK(z.value().compute_s == doctest::Approx(0.0).epsilon(1e-9));
  CHECK(z.value().step_s == doctest::Approx(z.value().comm_s).epsilon(1e-6));
  CHECK(z.value().step_s == doctest::Approx(EstimateComm(w).volume.total_comm_s).epsilon(1e-3));
}

TEST_CASE("separate process groups let an all-gather and a reduce-scatter share the link") {
  FsdpConfig c;
  c.gpus = 16;
  c.seq_len = 1024;
  Workload w = Real("llama-2-13b", c, "a100-40gb-sxm");
  SimOptions one = NoCpu(), two = NoCpu();
  two.separate_process_groups = true;
  auto a = Simulate(w, one), b = Simulate(w, two);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(b.value().stream_names.size() == a.value().stream_names.size() + 1);
  CHECK(b.value().step_s <= a.value().step_s * 1.0001);
}

TEST_CASE("per-rank mode: no jitter reproduces the aggregate; one slow rank slows everyone") {
  FsdpConfig c;
  c.gpus = 8;
  c.seq_len = 1024;
  Workload w = Real("llama-2-7b", c);
  SimOptions agg = NoCpu(), all = NoCpu();
  all.ranks = 8;
  auto a = Simulate(w, agg), p = Simulate(w, all);
  REQUIRE(a.ok());
  REQUIRE(p.ok());
  CHECK(p.value().step_s == doctest::Approx(a.value().step_s).epsilon(1e-9));
  SimOptions slow = all;
  slow.slow_ranks[3] = 1.1;
  auto s = Simulate(w, slow);
  REQUIRE(s.ok());
  // the collectives wait for rank 3, whose compute alone takes 1.1x rank 0's
  CHECK(s.value().step_s >= a.value().compute_s * 1.1);
  CHECK(s.value().step_s > a.value().step_s);
  SimOptions jitter = all;
  jitter.jitter = 0.05;
  auto j1 = Simulate(w, jitter), j2 = Simulate(w, jitter);
  CHECK(j1.value().step_s == j2.value().step_s);  // seeded
  CHECK(j1.value().step_s > a.value().step_s);
}

TEST_CASE("blocking collectives (an engine without overlap): step = compute + communication") {
  FsdpConfig c;
  c.gpus = 8;
  c.seq_len = 1024;
  Workload w = Real("llama-2-7b", c, "a100-40gb-sxm");
  SimOptions o = NoCpu();
  o.blocking_collectives = true;
  auto r = Simulate(w, o);
  REQUIRE(r.ok());
  CHECK(r.value().stream_names.size() == 1);
  CHECK(r.value().step_s == doctest::Approx(EstimateCompute(w).compute_s_per_step + EstimateComm(w).volume.total_comm_s).epsilon(1e-6));
}

TEST_CASE("bad options are rejected") {
  FsdpConfig c;
  c.gpus = 8;
  Workload w = Real("gpt2", c);
  SimOptions o;
  o.bandwidth_override = -1;
  CHECK_FALSE(Simulate(w, o).ok());
  o = SimOptions{};
  o.jitter = 2;
  CHECK_FALSE(Simulate(w, o).ok());
  o = SimOptions{};
  o.ranks = 4;  // not the GPU count
  CHECK_FALSE(Simulate(w, o).ok());
  o = SimOptions{};
  o.ranks = 8;
  o.slow_ranks[9] = 1.1;
  auto r = Simulate(w, o);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message == "slow rank 9 is not one of the 8 simulated ranks");
}

// Start of the first op named `name` in forward (before any backward op), or -1.
double ForwardStart(const SimResult& r, const std::string& name) {
  for (const OpRecord& op : r.ops) {
    if (op.name.starts_with("BWD")) break;
    if (op.name == name) return op.start_s;
  }
  return -1;
}

TEST_CASE("FSDP2's forward keeps at most two all-gathers ahead of the compute stream") {
  // llama-3.1-8b on 16 GPUs at 8192 tokens: compute-bound, so without the all_gather_state rule
  // the CPU (no rate limiter in FSDP2) would issue every all-gather back to back.
  FsdpConfig c;
  c.gpus = 16;
  c.seq_len = 8192;
  c.framework = Framework::kFsdp2;
  auto r = Simulate(Real("llama-3.1-8b", c), SimOptions{});
  REQUIRE(r.ok());
  std::vector<double> gather, forward;
  for (int k = 0; k < 32; ++k) {
    gather.push_back(ForwardStart(r.value(), fmt::format("AG model.layers.{}", k)));
    forward.push_back(ForwardStart(r.value(), fmt::format("FWD model.layers.{}", k)));
    REQUIRE(gather.back() >= 0);
    REQUIRE(forward.back() >= 0);
  }
  int most_ahead = 0;
  for (int k = 0; k < 32; ++k) {
    // the all-gather of layer k waits for the copy-out of layer k - 2, just before its forward
    if (k >= 2) CHECK(gather[k] >= forward[k - 2] - 1e-12);
    int ahead = 0;  // all-gathers started, their blocks' forwards not yet
    for (int j = 0; j < 32; ++j) ahead += gather[j] <= gather[k] && forward[j] > gather[k] ? 1 : 0;
    most_ahead = std::max(most_ahead, ahead);
  }
  CHECK(most_ahead == 2);
  // FSDP1's rate limiter gives the same bound through the CPU (its free events)
  c.framework = Framework::kFsdp1;
  auto fsdp1 = Simulate(Real("llama-3.1-8b", c), SimOptions{});
  REQUIRE(fsdp1.ok());
  CHECK(ForwardStart(fsdp1.value(), "AG model.layers.3") >= ForwardStart(fsdp1.value(), "FWD model.layers.1") - 1e-12);
}

TEST_CASE("memory on the simulated clock: the peak sits inside the ops of the phase it names") {
  struct Case {
    Framework framework;
    const char* phase;
    const char* op;
  };
  for (const Case& k : {Case{Framework::kFsdp2, "backward: lm_head + loss", "BWD root (lm_head + loss, norm)"},
                        Case{Framework::kFsdp1, "backward: lm_head + loss", "BWD root (lm_head + loss, norm)"}}) {
    FsdpConfig c;
    c.gpus = 16;
    c.seq_len = 8192;
    c.framework = k.framework;
    auto r = Simulate(Real("llama-3.1-8b", c), SimOptions{});
    REQUIRE(r.ok());
    CAPTURE(FrameworkName(k.framework));
    REQUIRE(r.value().peak_phase == k.phase);
    bool found = false;
    for (const OpRecord& op : r.value().ops) {
      if (op.name != k.op) continue;
      found = true;
      CHECK(r.value().peak_time_s >= op.start_s - 1e-12);
      CHECK(r.value().peak_time_s <= op.end_s + 1e-12);
    }
    CHECK(found);
    // and the root's head runs after the last block, in forward and in backward before the first
    CHECK(ForwardStart(r.value(), "FWD root (norm, lm_head + loss)") > ForwardStart(r.value(), "FWD model.layers.31"));
  }
}

TEST_CASE("a step past the simulator's clock or its action budget is refused, not looped on") {
  FsdpConfig c;
  c.gpus = 8;
  c.grad_accum = 1000;
  Workload w = Real("llama-3.1-405b", c);
  SimOptions slow;
  slow.bandwidth_override = limits::kBytesPerS.min;  // 1 MB/s
  auto r = Simulate(w, slow);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().message.find("of simulated time, past the simulator's 1e+08 s") != std::string::npos);
  FsdpConfig many;
  many.gpus = 8;
  many.seq_len = 16;
  many.grad_accum = 1000000;
  auto big = Simulate(Real("tiny-llama", many), SimOptions{});
  REQUIRE_FALSE(big.ok());
  CHECK(big.error().message.starts_with("simulating 1000000 micro-batch(es) x 1 rank(s) plays 7.9e+07 schedule actions"));
}

}  // namespace
}  // namespace fsdp::sim

namespace fsdp::sim {
namespace {

TEST_CASE("memory on the clock: reserved over allocated, the same peak as fsdp-plan; rank 0's CPU thread is recorded") {
  FsdpConfig c;
  c.gpus = 8;
  const Workload w = Real("llama-2-7b", c);
  SimOptions o;
  o.launch_overhead_s = 5e-6;
  auto r = Simulate(w, o);
  REQUIRE(r.ok());
  const MemoryEstimate plan = EstimateMemory(w);
  CHECK(r.value().peak_bytes == plan.peak_bytes);
  int64_t highest_reserved = 0;
  for (const MemorySample& m : r.value().memory) {
    CHECK(m.reserved_bytes >= m.bytes);  // segments hold every live tensor
    highest_reserved = std::max(highest_reserved, m.reserved_bytes);
  }
  CHECK(highest_reserved == plan.peak_bytes);  // reserved + the terms outside the allocator
  CHECK(r.value().allocated_peak_bytes < plan.peak_bytes);
  // the allocator's figures are fsdp-plan's
  const SimResult::Allocator& a = r.value().allocator;
  CHECK(a.allocated_peak_bytes == plan.allocated_peak_bytes);
  CHECK(a.allocated_blocks_peak_bytes == plan.allocated_blocks_peak_bytes);
  CHECK(a.allocated_blocks_peak_bytes >= a.allocated_peak_bytes);
  CHECK(a.reserved_peak_bytes == plan.reserved_peak_bytes);
  CHECK(a.reserved_peak_phase == plan.reserved_peak_phase);
  CHECK(a.fragmentation_bytes == plan.fragmentation_bytes);
  CHECK(a.reserved_over_allocated_peak_bytes == plan.reserved_peak_bytes - plan.allocated_peak_bytes);
  CHECK(a.alloc_retries == plan.alloc_retries);
  CHECK(a.reserved_peak_bytes > a.allocated_peak_bytes);
  int launches = 0, waits = 0;
  double last_end = 0;
  for (const CpuRecord& span : r.value().cpu) {
    launches += span.kind == 'L';
    waits += span.kind == 'W';
    CHECK(span.start_s >= last_end - 1e-12);  // one thread: spans do not overlap
    last_end = span.end_s;
  }
  CHECK(launches > 0);
  CHECK(waits > 0);  // FSDP1's rate limiter
}

}  // namespace
}  // namespace fsdp::sim
