#include "core/schedule.h"

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "core/testing/hand_llama.h"

namespace fsdp {
namespace {

// The hand llama (core/testing/hand_llama.h) on a test GPU of 8 per node.
Workload Hand(FsdpConfig c) {
  HardwareSpec hw;
  hw.id = "test";
  hw.memory_bytes = 1LL << 30;
  hw.gpus_per_node = 8;
  auto w = BuildWorkload(testing::HandLlama(), hw, c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

// One word per action: pf/pof/pb pre-forward, post-forward and pre-backward hooks, u unshard (p: a prefetch, ! after the
// rate limiter's wait), w wait, F/B a forward/backward segment, r reshard, pp post-backward (k:
// gradient kept under no_sync), R reduction, EF/EB end of forward/backward, O optimizer.
std::string Render(std::span<const Action> actions) {
  std::string out;
  for (const Action& a : actions) {
    if (!out.empty()) out += ' ';
    const std::string u = std::to_string(a.unit);
    switch (a.kind) {
      case ActionKind::kPreForward: out += "pf" + u; break;
      case ActionKind::kUnshard: out += (a.rate_limit_wait ? "!u" : "u") + u + (a.prefetch ? "p" : ""); break;
      case ActionKind::kWaitUnshard: out += "w" + u; break;
      case ActionKind::kForward: out += "F"; break;
      case ActionKind::kPostForward: out += "pof" + u; break;
      case ActionKind::kReshard: out += "r" + u; break;
      case ActionKind::kEndForward: out += "EF"; break;
      case ActionKind::kPreBackward: out += "pb" + u; break;
      case ActionKind::kBackward: out += "B"; break;
      case ActionKind::kPostBackward: out += "pp" + u + (a.reduces ? "" : "k"); break;
      case ActionKind::kReduce: out += "R" + u; break;
      case ActionKind::kEndBackward: out += "EB"; break;
      case ActionKind::kOptimizer: out += "O"; break;
    }
  }
  return out;
}

TEST_CASE("FSDP1 FULL_SHARD: hooks in PyTorch's order, the rate limiter's waits, the root never resharded after forward") {
  FsdpConfig c;
  c.gpus = 3;
  const Schedule s = BuildSchedule(Hand(c));
  REQUIRE(s.program_count() == 1);
  // Forward: the limiter queue holds layers.0 then layers.1's free events. Backward: the root's hook
  // prefetches layers.1 (the unit before it in post-forward order) and waits on layers.0's event;
  // layers.1's hook prefetches layers.0 with one event queued (no wait).
  CHECK(Render(s.MicroBatch(0)) ==
        "pf0 u0 w0 F pf1 u1 w1 F pof1 r1 pf2 u2 w2 F pof2 r2 F pof0 EF "
        "pb0 !u2p B pb2 w2 u1p B pp2 r2 R2 pb1 w1 B pp1 r1 R1 B pp0 r0 R0 EB O");
  CHECK(s.BackwardPrefetchTarget(0) == 2);
  CHECK(s.BackwardPrefetchTarget(2) == 1);
  CHECK(s.BackwardPrefetchTarget(1) == -1);
  for (int u = 0; u < 3; ++u) CHECK(s.ForwardAllGathers(u) == 1);
  CHECK(s.BackwardAllGathers(0) == 0);
  CHECK(s.BackwardAllGathers(1) == 1);
  CHECK(s.Reductions() == 1);
}

TEST_CASE("compute segments: the root's own compute before the first block and after the last") {
  FsdpConfig c;
  c.gpus = 3;
  const Workload w = Hand(c);
  const Schedule s = BuildSchedule(w);
  std::vector<const ComputeSegment*> forward;
  for (const ComputeSegment& seg : s.segments()) if (seg.forward) forward.push_back(&seg);
  REQUIRE(forward.size() == 4);
  auto names = [&](const ComputeSegment& seg) {
    std::string out;
    for (const NodeVisit& v : s.Visits(seg)) {
      const ModuleNode& n = w.nodes[v.node];
      if (n.role == ModuleNode::Role::kOther && n.unit < 0) continue;
      out += (out.empty() ? "" : ",") + (v.node == 0 ? std::string("root") : n.path);
    }
    return out;
  };
  CHECK(forward[0]->unit == 0);
  CHECK(names(*forward[0]) == "model.embed_tokens");
  CHECK(forward[1]->unit == 1);
  CHECK(names(*forward[1]) == "model.layers.0");
  CHECK(forward[3]->unit == 0);
  CHECK(names(*forward[3]) == "model.norm,lm_head,root");
  // Backward: the loss and the final norm before the blocks, the embedding after them.
  std::vector<const ComputeSegment*> backward;
  for (const ComputeSegment& seg : s.segments()) if (!seg.forward) backward.push_back(&seg);
  REQUIRE(backward.size() == 4);
  CHECK(names(*backward[0]) == "root,lm_head,lm_head,model.norm,model.norm");
  CHECK(names(*backward[3]) == "model.embed_tokens,model.embed_tokens,root");
}

TEST_CASE("FSDP2: the all-gather streams wait on the previous copy-out in forward, on this one in backward") {
  FsdpConfig c;
  c.gpus = 3;
  c.framework = Framework::kFsdp2;
  const Schedule s = BuildSchedule(Hand(c));
  int forward_waits = 0, backward_waits = 0;
  for (const Action& a : s.MicroBatch(0)) {
    CHECK_FALSE(a.rate_limit_wait);  // no CPU-side rate limiter
    CHECK_FALSE(a.queues_free_event);
    if (a.kind == ActionKind::kWaitUnshard) {
      CHECK(a.copy_out_wait == (a.forward ? CopyOutWait::kPrevious : CopyOutWait::kThis));
      (a.forward ? forward_waits : backward_waits) += 1;
    }
    if (a.kind == ActionKind::kEndForward) CHECK(a.releases_all_gather_state);
  }
  CHECK(forward_waits == 3);
  CHECK(backward_waits == 2);  // the root stays unsharded from forward to backward
}

TEST_CASE("--impl torchtitan: tok_embeddings resharded after forward, [norm, output] kept unsharded until its backward") {
  FsdpConfig c;
  c.gpus = 3;
  c.framework = Framework::kFsdp2;
  c.impl = Impl::kTorchtitan;
  const Workload w = Hand(c);
  const Schedule s = BuildSchedule(w);
  // units: 0 the root (no parameters: nothing to gather), 1 the embedding, 2 and 3 the blocks, 4 [norm, lm_head]
  // forward: the embedding and each block gathered and freed in turn; the group gathered at the
  // norm and left unsharded (no r4), its hooks run once per module (norm, then lm_head); the loss
  // is the root's. Backward, as torch 2.11 runs fully_shard([norm, output]) (FSDPParamGroup's
  // pre_backward / post_backward / unshard traced on torchtitan 0.2.2, docs/accuracy.md): at
  // lm_head's pre-backward nothing is prefetched (the first of the group's two post-forward
  // records targets the group itself); after lm_head's backward its gradient is reduced and the
  // group resharded; the norm's pre-backward gathers the group again and prefetches the last
  // block; after the norm's backward its gradient is reduced.
  CHECK(Render(s.MicroBatch(0)) ==
        "pf0 pf1 u1 w1 F pof1 r1 pf2 u2 w2 F pof2 r2 pf3 u3 w3 F pof3 r3 F pf4 u4 w4 F pof4 pf4 F pof4 F pof0 EF "
        "pb0 B pb4 B pp4 r4 R4 pb4 u4 w4 u3p B pp4 r4 R4 B pb3 w3 u2p B pp3 r3 R3 pb2 w2 u1p B pp2 r2 R2 B pb1 w1 B pp1 r1 R1 B pp0 EB O");
  // the two reductions of the group, lm_head's (site 1: [16, 8] padded to [18, 8] for 3 ranks),
  // then the norm's (site 0: [8] to [9])
  std::vector<int64_t> reduced;
  for (const Action& a : s.MicroBatch(0)) {
    if (a.kind == ActionKind::kReduce && a.unit == 4) reduced.push_back(w.units[4].SiteGradPaddedNumel(a.site));
  }
  CHECK(reduced == std::vector<int64_t>{18 * 8, 9});
  CHECK(s.BackwardAllGathers(4) == 1);  // the norm's second gather
}

TEST_CASE("no_sync: SHARD_GRAD_OP keeps parameters and gradients unsharded; the middle micro-batches share one program") {
  FsdpConfig c;
  c.gpus = 3;
  c.strategy = Strategy::kShardGradOp;
  c.grad_accum = 5;
  c.no_sync = true;
  const Schedule s = BuildSchedule(Hand(c));
  REQUIRE(s.program_count() == 3);
  CHECK(s.ProgramOf(0) == 0);
  CHECK(s.ProgramOf(1) == 1);
  CHECK(s.ProgramOf(3) == 1);
  CHECK(s.ProgramOf(4) == 2);
  CHECK(s.ProgramRuns(1) == 3);
  CHECK(Render(s.MicroBatch(0)) == "pf0 u0 w0 F pf1 u1 w1 F pof1 pf2 u2 w2 F pof2 F pof0 EF pb0 B pb2 B pp2k pb1 B pp1k B pp0k EB");
  CHECK(Render(s.MicroBatch(2)) == "pf0 F pf1 F pof1 pf2 F pof2 F pof0 EF pb0 B pb2 B pp2k pb1 B pp1k B pp0k EB");
  CHECK(Render(s.MicroBatch(4)) == "pf0 F pf1 F pof1 pf2 F pof2 F pof0 EF pb0 B pb2 B pp2 r2 R2 pb1 B pp1 r1 R1 B pp0 r0 R0 EB O");
  CHECK(s.ForwardAllGathers(1) == 1);  // once per step, as the comm model's ForwardGathersPerStep
  CHECK(s.BackwardAllGathers(1) == 0);
  CHECK(s.Reductions() == 1);
}

TEST_CASE("FULL_SHARD with gradient accumulation: every micro-batch gathers and reduces") {
  FsdpConfig c;
  c.gpus = 3;
  c.grad_accum = 4;
  const Schedule s = BuildSchedule(Hand(c));
  for (int u = 0; u < 3; ++u) CHECK(s.ForwardAllGathers(u) == 4);
  CHECK(s.BackwardAllGathers(2) == 4);
  CHECK(s.Reductions() == 4);
  int64_t runs = 0;
  for (int p = 0; p < s.program_count(); ++p) runs += s.ProgramRuns(p);
  CHECK(runs == 4);
  // The queue the first backward leaves behind makes the second micro-batch's root all-gather wait.
  CHECK(Render(s.MicroBatch(1)).starts_with("pf0 !u0 w0 F"));
}

TEST_CASE("NO_SHARD, HYBRID_SHARD and CPU offload: which collectives and copies the actions carry") {
  FsdpConfig c;
  c.gpus = 2;
  c.strategy = Strategy::kNoShard;
  for (const Action& a : BuildSchedule(Hand(c)).MicroBatch(0)) {
    if (a.kind == ActionKind::kUnshard) CHECK_FALSE(a.all_gather);  // the low-precision copy only
    if (a.kind == ActionKind::kReduce) CHECK((a.all_reduce && !a.reduce_scatter));
  }
  c.gpus = 16;
  c.strategy = Strategy::kHybridShard;
  c.cpu_offload = true;
  for (const Action& a : BuildSchedule(Hand(c)).MicroBatch(0)) {
    if (a.kind == ActionKind::kUnshard) CHECK((a.all_gather && a.host_to_device));
    if (a.kind == ActionKind::kReduce) CHECK((a.reduce_scatter && a.all_reduce && a.to_host));
  }
}

TEST_CASE("reshard rules") {
  FsdpConfig c;
  c.gpus = 3;
  const Workload full = Hand(c);
  CHECK_FALSE(ReshardsAfterForward(full, 0));
  CHECK(ReshardsAfterForward(full, 1));
  c.strategy = Strategy::kShardGradOp;
  CHECK_FALSE(ReshardsAfterForward(Hand(c), 1));
  CHECK_FALSE(FreesInBackward(c, false));
  CHECK(FreesInBackward(c, true));
  c.framework = Framework::kFsdp2;
  CHECK(FreesInBackward(c, false));
  c.strategy = Strategy::kNoShard;
  c.framework = Framework::kFsdp1;
  c.gpus = 2;
  CHECK(ReshardsAfterForward(Hand(c), 0));  // post_reshard frees the root's low-precision copy too
}

}  // namespace
}  // namespace fsdp
