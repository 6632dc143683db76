#include "planner/comm_model.h"

#include <doctest/doctest.h>

#include "core/testing/hand_llama.h"

namespace fsdp {
namespace {

using testing::HandWorkload;
using testing::ThreeRanks;

TEST_CASE("collective inventory per step (FULL_SHARD, 3 ranks, fp32)") {
  CommModel cm = EstimateComm(HandWorkload(ThreeRanks()));
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
  CHECK(EstimateComm(HandWorkload(c)).volume.backward_all_gather_count == 0);
  c.strategy = Strategy::kNoShard;
  CommVolume ddp = EstimateComm(HandWorkload(c)).volume;
  CHECK(ddp.forward_all_gather_count == 0);
  CHECK(ddp.all_reduce_count == 3);
  CHECK(ddp.all_reduce_bytes == 1448 * 4);  // unpadded, reduce dtype
  c.strategy = Strategy::kFullShard;
  c.grad_accum = 4;
  CommVolume accum = EstimateComm(HandWorkload(c)).volume;
  CHECK(accum.forward_all_gather_count == 12);
  CHECK(accum.reduce_scatter_count == 12);
  c.no_sync = true;
  CommVolume no_sync = EstimateComm(HandWorkload(c)).volume;
  CHECK(no_sync.forward_all_gather_count == 12);
  CHECK(no_sync.reduce_scatter_count == 3);
  // SHARD_GRAD_OP under no_sync: FSDP1 keeps the parameters unsharded from one micro-batch to the
  // next (_should_free_in_backward), so each unit is gathered once per step; FSDP2 reshards after
  // every backward and gathers in every micro-batch
  c.strategy = Strategy::kShardGradOp;
  CommVolume zero2 = EstimateComm(HandWorkload(c)).volume;
  CHECK(zero2.forward_all_gather_count == 3);
  CHECK(zero2.forward_all_gather_bytes == (264 + 594 + 594) * 4);
  CHECK(zero2.backward_all_gather_count == 0);
  c.framework = Framework::kFsdp2;
  const CommModel fsdp2 = EstimateComm(HandWorkload(c));
  CHECK(fsdp2.volume.forward_all_gather_count == 12);
  // the communication time counts the same: three more all-gathers per unit for FSDP2
  double gather_s = 0;
  for (const UnitComm& u : fsdp2.units) gather_s += u.all_gather.time_s;
  CHECK(fsdp2.volume.total_comm_s - zero2.total_comm_s == doctest::Approx(3 * gather_s));
  c.framework = Framework::kFsdp1;
  c.no_sync = false;
  CHECK(EstimateComm(HandWorkload(c)).volume.forward_all_gather_count == 12);
}

TEST_CASE("HYBRID_SHARD: reduce-scatter in the node, all-reduce of the shard across nodes") {
  FsdpConfig c = ThreeRanks();
  c.gpus = 16;
  c.strategy = Strategy::kHybridShard;
  CommModel cm = EstimateComm(HandWorkload(c));
  CHECK(cm.shard_group.ranks == 8);
  CHECK(cm.replica_group.ranks == 2);
  CHECK(cm.replica_group.ranks_per_node == 1);
  CHECK(cm.volume.all_reduce_count == 3);
  CHECK(cm.volume.all_reduce_bytes == (33 + 74 + 74) * 4);  // shards of 264, 592 -> 592/8 = 74
}

TEST_CASE("per-unit times are the collective model's at the unit's padded sizes") {
  const Workload w = HandWorkload(ThreeRanks());
  const CommModel cm = EstimateComm(w);
  REQUIRE(cm.units.size() == 3);
  const CollectiveEstimate ag = EstimateCollective(Collective::kAllGather, 594 * 4, cm.shard_group, w.hardware);
  const CollectiveEstimate rs = EstimateCollective(Collective::kReduceScatter, 594 * 4, cm.shard_group, w.hardware);
  CHECK(cm.units[1].all_gather.time_s == ag.time_s);
  CHECK(cm.units[1].all_gather.latency_s == ag.latency_s);
  CHECK(cm.units[1].reduce_scatter.time_s == rs.time_s);
  CHECK(cm.units[1].all_reduce.time_s == 0);
  // forward 3 all-gathers, backward 2, 3 reduce-scatters, nothing overlapped
  CHECK(cm.volume.total_comm_s == doctest::Approx(cm.units[0].all_gather.time_s + 4 * ag.time_s + cm.units[0].reduce_scatter.time_s + 2 * rs.time_s));
}

TEST_CASE("CPU offload: a host-to-device copy per unshard, a device-to-host copy per reduction") {
  FsdpConfig c = ThreeRanks();
  c.cpu_offload = true;
  // FULL_SHARD: shards of 88 and 198 fp32 elements; forward unshards all three units, backward the blocks
  CommVolume v = EstimateComm(HandWorkload(c)).volume;
  CHECK(v.host_to_device_bytes == ((88 + 198 + 198) + (198 + 198)) * 4);
  CHECK(v.device_to_host_bytes == (88 + 198 + 198) * 4);
  // NO_SHARD's copies are whole units, after every reshard (its forward frees every unit's copy)
  c.strategy = Strategy::kNoShard;
  v = EstimateComm(HandWorkload(c)).volume;
  CHECK(v.host_to_device_bytes == 2 * 1448 * 4);
  CHECK(v.forward_all_gather_count == 0);
}

TEST_CASE("one GPU moves nothing: FSDP2 keeps FULL_SHARD but has no all-gather on a shard group of one") {
  FsdpConfig c = ThreeRanks();
  c.gpus = 1;
  c.framework = Framework::kFsdp2;
  const CommModel cm = EstimateComm(HandWorkload(c));
  CHECK(cm.volume.forward_all_gather_count == 0);
  CHECK(cm.volume.reduce_scatter_count == 0);
  CHECK(cm.volume.sent_bytes == 0);
  CHECK(cm.volume.total_comm_s == 0);
}

TEST_CASE("frozen parameters are gathered but not reduced") {
  ModelSpec m = testing::HandLlama();
  for (TensorSpec& t : m.tensors) t.trainable = t.block != 1;  // layers.1 frozen
  FsdpConfig c = ThreeRanks();
  const CommVolume v = EstimateComm(BuildWorkload(m, LoadHardware("a100-80gb-sxm").value(), c).value()).volume;
  CHECK(v.forward_all_gather_count == 3);
  CHECK(v.backward_all_gather_count == 2);
  CHECK(v.reduce_scatter_count == 2);
  CHECK(v.reduce_scatter_bytes == (264 + 594) * 4);
}

}  // namespace
}  // namespace fsdp
