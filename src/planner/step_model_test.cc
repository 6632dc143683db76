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

TEST_CASE("collective inventory per step (FULL_SHARD, 3 ranks, fp32)") {
  CommModel cm = EstimateComm(Build(ThreeRanks()));
  const CommVolume& v = cm.volume;
  // forward: root 264 + two blocks padded to 594, 4 bytes each; backward re-gathers the blocks only.
  CHECK(v.forward_all_gather_count == 3);
  CHECK(v.forward_all_gather_bytes == (264 + 594 + 594) * 4);
  CHECK(v.backward_all_gather_count == 2);
  CHECK(v.backward_all_gather_bytes == 2 * 594 * 4);
  CHECK(v.reduce_scatter_count == 3);
  CHECK(v.reduce_scatter_bytes == (264 + 594 + 594) * 4);
  CHECK(v.all_reduce_count == 0);
  CHECK(v.sent_bytes == doctest::Approx((5808.0 + 4752 + 5808) * 2 / 3));
}

TEST_CASE("collective inventory follows strategy, accumulation and no_sync") {
  FsdpConfig c = ThreeRanks();
  c.strategy = Strategy::kShardGradOp;
  CHECK(EstimateComm(Build(c)).volume.backward_all_gather_count == 0);
  c.strategy = Strategy::kNoShard;
  CommVolume ddp = EstimateComm(Build(c)).volume;
  CHECK(ddp.forward_all_gather_count == 0);
  CHECK(ddp.all_reduce_count == 3);
  CHECK(ddp.all_reduce_bytes == 1448 * 4);  // unpadded, reduce dtype
  c.strategy = Strategy::kFullShard;
  c.grad_accum = 4;
  CommVolume accum = EstimateComm(Build(c)).volume;
  CHECK(accum.forward_all_gather_count == 12);
  CHECK(accum.reduce_scatter_count == 12);
  c.no_sync = true;
  CommVolume no_sync = EstimateComm(Build(c)).volume;
  CHECK(no_sync.forward_all_gather_count == 12);
  CHECK(no_sync.reduce_scatter_count == 3);
  // SHARD_GRAD_OP under no_sync: FSDP1 keeps the parameters unsharded from one micro-batch to the
  // next (_should_free_in_backward), so each unit is gathered once per step; FSDP2 reshards after
  // every backward and gathers in every micro-batch
  c.strategy = Strategy::kShardGradOp;
  CommVolume zero2 = EstimateComm(Build(c)).volume;
  CHECK(zero2.forward_all_gather_count == 3);
  CHECK(zero2.forward_all_gather_bytes == (264 + 594 + 594) * 4);
  CHECK(zero2.backward_all_gather_count == 0);
  c.framework = Framework::kFsdp2;
  const CommModel fsdp2 = EstimateComm(Build(c));
  CHECK(fsdp2.volume.forward_all_gather_count == 12);
  // the communication time counts the same: three more all-gathers per unit for FSDP2
  double gather_s = 0;
  for (const UnitComm& u : fsdp2.units) gather_s += u.all_gather.time_s;
  CHECK(fsdp2.volume.total_comm_s - zero2.total_comm_s == doctest::Approx(3 * gather_s));
  c.framework = Framework::kFsdp1;
  c.no_sync = false;
  CHECK(EstimateComm(Build(c)).volume.forward_all_gather_count == 12);
}

TEST_CASE("HYBRID_SHARD: reduce-scatter in the node, all-reduce of the shard across nodes") {
  FsdpConfig c = ThreeRanks();
  c.gpus = 16;
  c.strategy = Strategy::kHybridShard;
  CommModel cm = EstimateComm(Build(c));
  CHECK(cm.shard_group.ranks == 8);
  CHECK(cm.replica_group.ranks == 2);
  CHECK(cm.replica_group.ranks_per_node == 1);
  CHECK(cm.volume.all_reduce_count == 3);
  CHECK(cm.volume.all_reduce_bytes == (33 + 74 + 74) * 4);  // shards of 264, 592 -> 592/8 = 74
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

TEST_CASE("activation traffic: the given bytes per saved byte in forward, twice that in backward") {
  Workload w = Build(ThreeRanks());
  const double mem_rate = w.hardware.memory_bandwidth_bytes_per_s * w.hardware.memory_efficiency;
  const ComputeModel none = EstimateCompute(w, 0.0), eager = EstimateCompute(w), fused = EstimateCompute(w, 5.0);
  // Unit 1 is model.layers.0: its block saves 1120 bytes for 2 fp32 tokens (memory_model_test.cc).
  CHECK(eager.units[1].forward_s - none.units[1].forward_s == doctest::Approx(kEagerTrafficPerSavedByte * 1120 / mem_rate));
  CHECK(eager.units[1].backward_s - none.units[1].backward_s == doctest::Approx(2 * kEagerTrafficPerSavedByte * 1120 / mem_rate));
  CHECK(fused.units[1].forward_s - none.units[1].forward_s == doctest::Approx(5.0 * 1120 / mem_rate));
  CHECK(kEagerTrafficPerSavedByte == 10.0);
}

TEST_CASE("--ac-every 2 recomputes every second block only") {
  FsdpConfig c = ThreeRanks();
  c.checkpointing = Checkpointing::kFull;
  const ComputeModel all = EstimateCompute(Build(c));
  c.ac_every = 2;
  const ComputeModel every2 = EstimateCompute(Build(c));
  // units: 0 root, 1 model.layers.0, 2 model.layers.1; blocks 2, 4, ... counting from 1 rerun
  CHECK(all.units[1].recompute_flops > 0);
  CHECK(every2.units[1].recompute_flops == 0);
  CHECK(every2.units[2].recompute_flops == all.units[2].recompute_flops);
  CHECK(every2.units[2].recompute_flops == all.units[2].forward_flops);
}

TEST_CASE("--ac selective-op reruns every second matmul of a block (k, o, up) and, with eager attention, the attention core") {
  FsdpConfig c = ThreeRanks();
  c.checkpointing = Checkpointing::kSelectiveOp;
  c.attention = Attention::kFlash;
  // per block: the k (4 x 8), o (8 x 8) and up (16 x 8) weights, 2 tokens: 2 x 224 x 2 FLOPs; SDPA's output is kept
  CHECK(EstimateCompute(Build(c)).units[1].recompute_flops == 896);
  c.attention = Attention::kEager;
  // plus the scores and probabilities x V: 4 x 2 keys x 8 (heads x head_dim) x 2 tokens
  CHECK(EstimateCompute(Build(c)).units[1].recompute_flops == 896 + 128);
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
