#include "planner/step_model.h"

#include <doctest/doctest.h>

namespace fsdp {
namespace {

// The hand-countable llama (units: root 264, two blocks of 592 parameters).
constexpr const char* kHandLlama =
    R"({"model_type":"llama","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
    R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64})";

Workload Build(FsdpConfig c, const char* gpu = "a100-80gb-sxm") {
  auto json = ParseJson(kHandLlama, "hand.json");
  auto m = ModelFromHfConfig(json.value(), "hand", "hand.json");
  auto hw = LoadHardware(gpu);
  REQUIRE(m.ok());
  REQUIRE(hw.ok());
  auto w = BuildWorkload(m.value(), hw.value(), c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

FsdpConfig ThreeRanks() {
  FsdpConfig c;
  c.gpus = 3;
  c.seq_len = 2;
  c.param_dtype = DType::kFp32;
  return c;
}

// Known durations by role: embedding 0.25 s forward and backward, lm_head with the loss 0.75 s,
// each block 2 s forward and 4 s backward; the optimizer 0.5 s.
ComputeModel HandDurations(const Workload& w) {
  std::vector<NodeCompute> nodes(w.nodes.size());
  for (size_t i = 0; i < w.nodes.size(); ++i) {
    switch (w.nodes[i].role) {
      case ModuleNode::Role::kEmbedding: nodes[i] = {0.25, 0.25, 0}; break;
      case ModuleNode::Role::kLmHead: nodes[i] = {0.75, 0.75, 0}; break;
      case ModuleNode::Role::kBlock: nodes[i] = {2.0, 4.0, 0}; break;
      default: break;
    }
  }
  return ComputeFromNodes(w, std::move(nodes), 0.5);
}

TEST_CASE("step timeline computed by hand: 3 units, known durations") {
  Workload w = Build(ThreeRanks());
  const ComputeModel cm = HandDurations(w);
  CHECK(cm.compute_s_per_step == doctest::Approx(14.5));
  CommModel comm;
  comm.units = {{{0.5}, {0.5}, {}, 0, 0}, {{1.0}, {1.0}, {}, 0, 0}, {{1.0}, {1.0}, {}, 0, 0}};
  // forward: AG root [0, .5], embedding [.5, .75]; AG L0 [.5, 1.5], L0 waits, [1.5, 3.5];
  //   AG L1 [1.5, 2.5], L1 [3.5, 5.5]; lm_head + loss [5.5, 6.25].
  // backward: the root's hook prefetches L1, but two free events are queued (L0, L1 at 3.5 and 5.5):
  //   AG L1 waits for L0's, [3.5, 4.5]; lm_head + loss backward [6.25, 7]; L1 prefetches L0: AG [4.5, 5.5];
  //   L1 backward [7, 11], RS L1 [11, 12]; L0 backward [11, 15], RS L0 [15, 16]; embedding backward
  //   [15, 15.25], RS root [16, 16.5]; the post-backward callback waits for it; optimizer [16.5, 17].
  StepEstimate s = EstimateStep(w, cm, comm);
  CHECK(s.step_s == doctest::Approx(17.0));
  CHECK(s.forward_s == doctest::Approx(6.25));
  CHECK(s.backward_s == doctest::Approx(10.25));
  CHECK(s.exposed_comm_s == doctest::Approx(2.5));
  CHECK(s.first_all_gather_s == doctest::Approx(0.5));
  CHECK(s.last_reduce_s == doctest::Approx(1.25));
  // the root's embedding and layers.0 waited for their all-gathers; the rest was hidden
  REQUIRE(s.unit_exposed_s.size() == 3);
  CHECK(s.unit_exposed_s[0] == doctest::Approx(0.5));
  CHECK(s.unit_exposed_s[1] == doctest::Approx(0.75));
  CHECK(s.unit_exposed_s[2] == 0.0);
}

TEST_CASE("invariants: compute <= step <= compute + all communication; infinite bandwidth gives compute") {
  for (Strategy strategy : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard}) {
    FsdpConfig c = ThreeRanks();
    c.strategy = strategy;
    c.seq_len = 64;
    TimeEstimate t = EstimateTime(Build(c));
    CHECK(t.step.step_s >= t.step.compute_s * (1 - 1e-12));
    CHECK(t.step.step_s <= (t.step.compute_s + t.step.comm_s) * (1 + 1e-12));
  }
  Workload w = Build(ThreeRanks());
  w.hardware.intra_node_bandwidth_bytes_per_s = 1e30;
  ComputeModel cm = EstimateCompute(w);
  CommModel comm = EstimateComm(w);
  for (auto& u : comm.units) u = UnitComm{};  // zero-time communication
  CHECK(EstimateStep(w, cm, comm).step_s == doctest::Approx(cm.compute_s_per_step));
}

TEST_CASE("zero compute gives the communication time") {
  Workload w = Build(ThreeRanks());
  const ComputeModel cm = ComputeFromNodes(w, std::vector<NodeCompute>(w.nodes.size()), 0.0);
  CommModel comm = EstimateComm(w);
  CHECK(EstimateStep(w, cm, comm).step_s == doctest::Approx(comm.volume.total_comm_s));
}

TEST_CASE("fast-forwarding identical micro-batches gives the replayed result") {
  for (int accum : {4, 7, 16}) {
    for (bool no_sync : {false, true}) {
      for (Strategy strategy : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard}) {
        FsdpConfig c = ThreeRanks();
        c.seq_len = 32;
        c.grad_accum = accum;
        c.no_sync = no_sync;
        c.strategy = strategy;
        Workload w = Build(c);
        ComputeModel cm = EstimateCompute(w);
        CommModel comm = EstimateComm(w);
        StepEstimate fast = EstimateStep(w, cm, comm, true), slow = EstimateStep(w, cm, comm, false);
        CAPTURE(accum);
        CAPTURE(no_sync);
        CHECK(fast.step_s == doctest::Approx(slow.step_s).epsilon(1e-12));
        CHECK(fast.forward_s == doctest::Approx(slow.forward_s).epsilon(1e-12));
        CHECK(fast.backward_s == doctest::Approx(slow.backward_s).epsilon(1e-12));
      }
    }
  }
}

TEST_CASE("a real model: FLOPs, MFU and tokens per second are consistent") {
  auto m = LoadModel("llama-2-7b");
  auto hw = LoadHardware("h100-sxm");
  FsdpConfig c;
  c.gpus = 8;
  c.seq_len = 4096;
  Workload w = BuildWorkload(m.value(), hw.value(), c).value();
  TimeEstimate t = EstimateTime(w);
  // 6N + 12 L s a d with N = 6,476,267,520 block linears + 131,072,000 lm_head (embedding excluded)
  const double n = 6'476'267'520.0 - 32 * 2 * 4096.0 + 131'072'000.0;
  CHECK(t.compute.model_flops_per_token == doctest::Approx(6 * n + 12.0 * 32 * 4096 * 4096));
  CHECK(t.step.tokens_per_s_per_gpu == doctest::Approx(4096 / t.step.step_s));
  CHECK(t.step.mfu == doctest::Approx(t.compute.model_flops_per_token * t.step.tokens_per_s_per_gpu / 989.4e12));
  CHECK(t.step.mfu < 0.75);  // never above the GEMM efficiency
  c.checkpointing = Checkpointing::kFull;
  TimeEstimate ac = EstimateTime(BuildWorkload(m.value(), hw.value(), c).value());
  CHECK(ac.compute.executed_flops_per_step > t.compute.executed_flops_per_step * 1.25);  // forward recomputed
}

}  // namespace
}  // namespace fsdp
