#include "planner/compute_model.h"

#include <doctest/doctest.h>

#include "core/testing/hand_llama.h"

namespace fsdp {
namespace {

using testing::HandWorkload;
using testing::ThreeRanks;

TEST_CASE("FLOPs of the hand llama, counted by hand") {
  // 2 tokens, flash attention. A block's linears hold 64 + 32 + 32 + 64 + 3 x 128 = 576 weights:
  // 2 x 576 x 2 = 2304 FLOPs; causal flash visits (2 + 1) / 2 keys: 4 x 1.5 x 8 (heads x head_dim)
  // x 2 = 96. The root's lm_head: 2 x 128 x 2 = 512 (the embedding is a lookup).
  const ComputeModel cm = EstimateCompute(HandWorkload(ThreeRanks()));
  CHECK(cm.units[1].forward_flops == doctest::Approx(2304 + 96));
  CHECK(cm.units[1].backward_flops == doctest::Approx(2 * 2304 + 2.5 * 96));  // FlashAttention-2 backward: 2.5x
  CHECK(cm.units[0].forward_flops == doctest::Approx(512));
  CHECK(cm.units[1].recompute_flops == 0);
  // 6 N + 12 L s a d with N = 2 x 576 + 128
  CHECK(cm.model_flops_per_token == doctest::Approx(6.0 * (2 * 576 + 128) + 12.0 * 2 * 2 * 8));
}

TEST_CASE("units are the sums of their nodes; segments of the walk sum to the same") {
  const Workload w = HandWorkload(ThreeRanks());
  const ComputeModel cm = EstimateCompute(w);
  REQUIRE(cm.nodes.size() == w.nodes.size());
  REQUIRE(cm.segments_s.size() == w.walk->segments.size());
  double forward_units = 0, backward_units = 0, forward_segments = 0, backward_segments = 0;
  for (const UnitCompute& u : cm.units) {
    forward_units += u.forward_s;
    backward_units += u.backward_s + u.recompute_s;
  }
  for (size_t s = 0; s < cm.segments_s.size(); ++s) (w.walk->segments[s].forward ? forward_segments : backward_segments) += cm.segments_s[s];
  CHECK(forward_segments == doctest::Approx(forward_units));
  CHECK(backward_segments == doctest::Approx(backward_units));
  // known node times add up the same way
  std::vector<NodeCompute> nodes(w.nodes.size(), NodeCompute{1.0, 2.0, 0.5});
  const ComputeModel known = ComputeFromNodes(w, nodes, 3.0);
  CHECK(known.compute_s_per_step == doctest::Approx(static_cast<double>(w.nodes.size()) * 3.5 + 3.0));
  CHECK(known.units[0].forward_s + known.units[1].forward_s + known.units[2].forward_s == doctest::Approx(static_cast<double>(w.nodes.size())));
}

TEST_CASE("activation traffic: the given bytes per saved byte in forward, twice that in backward") {
  Workload w = HandWorkload(ThreeRanks());
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
  const ComputeModel all = EstimateCompute(HandWorkload(c));
  c.ac_every = 2;
  const ComputeModel every2 = EstimateCompute(HandWorkload(c));
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
  CHECK(EstimateCompute(HandWorkload(c)).units[1].recompute_flops == 896);
  c.attention = Attention::kEager;
  // plus the scores and probabilities x V: 4 x 2 keys x 8 (heads x head_dim) x 2 tokens
  CHECK(EstimateCompute(HandWorkload(c)).units[1].recompute_flops == 896 + 128);
}

TEST_CASE("a frozen weight's GEMM computes no weight gradient in backward") {
  ModelSpec m = testing::HandLlama();
  for (TensorSpec& t : m.tensors) t.trainable = t.block != 0;  // layers.0 frozen
  const ComputeModel cm = EstimateCompute(BuildWorkload(m, LoadHardware("a100-80gb-sxm").value(), ThreeRanks()).value());
  CHECK(cm.units[1].backward_flops == doctest::Approx(2304 + 2.5 * 96));      // the input gradients only
  CHECK(cm.units[2].backward_flops == doctest::Approx(2 * 2304 + 2.5 * 96));  // layers.1 trains
}

TEST_CASE("pure bf16: AdamW's step moves bf16 parameters, gradients and states, half the bytes of fp32 masters") {
  FsdpConfig c = ThreeRanks();
  c.param_dtype = DType::kBf16;
  const double mixed = OptimizerSeconds(HandWorkload(c));
  c.master_dtype = DType::kBf16;
  CHECK(OptimizerSeconds(HandWorkload(c)) == doctest::Approx(mixed / 2));
}

TEST_CASE("QLoRA: the FLOPs of the unpacked weights and the adapters, and each quantized weight's dequantization traffic") {
  FsdpConfig c = ThreeRanks();
  c.framework = Framework::kFsdp2;  // decoder-layer units with adapters inside
  c.lora.rank = 2;                  // q_proj and v_proj
  const Workload lora = HandWorkload(c);
  c.lora.qlora = true;
  const Workload qlora = HandWorkload(c);
  const ComputeModel a = EstimateCompute(lora), q = EstimateCompute(qlora);
  // the block's 576 weights as before (stored packed, 72 fp32 words; FLOPs count the weights the
  // product uses) plus the adapters, q: A [2, 8] + B [8, 2], v: A [2, 8] +
  // B [4, 2] = 56 weights: 2 x 56 x 2 tokens = 224
  CHECK(q.units[1].forward_flops == doctest::Approx(2304 + 96 + 224));
  CHECK(q.units[1].forward_flops == doctest::Approx(a.units[1].forward_flops));
  // dequantizing n weights reads n / 2 code bytes and n / 64 fp32 absmax, writes n fp32 weights:
  // 4.5625 bytes a weight, 576 x 4.5625 = 2628 bytes a block, once in forward and once in backward
  const HardwareSpec& hw = qlora.hardware;
  const double mem_rate = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency;
  CHECK(Nf4DequantTrafficBytes(576, DType::kFp32) == doctest::Approx(2628));
  CHECK(q.units[1].forward_s - a.units[1].forward_s == doctest::Approx(2628 / mem_rate));
  CHECK(q.units[1].backward_s - a.units[1].backward_s == doctest::Approx(2628 / mem_rate));
  CHECK(q.units[0].forward_s == doctest::Approx(a.units[0].forward_s));  // lm_head is not quantized
}

TEST_CASE("QLoRA's compute dtype: the quantized weights' products at its rate, their dequantization written in it") {
  FsdpConfig c = ThreeRanks();  // fp32 parameters
  c.framework = Framework::kFsdp2;
  c.lora.rank = 2;
  c.lora.qlora = true;
  const ComputeModel fp32 = EstimateCompute(HandWorkload(c));
  c.lora.compute_dtype = DType::kBf16;
  const Workload w = HandWorkload(c);
  const ComputeModel bf16 = EstimateCompute(w);
  // the block's 576 quantized weights: 2 x 576 x 2 tokens = 2304 FLOPs in forward and again for the
  // input gradient (frozen: no weight gradient); the dequantized weights written in 2 bytes instead
  // of 4: 576 x 2.5625 = 1476 bytes instead of 2628, in forward and in backward
  const HardwareSpec& hw = w.hardware;
  const double mem_rate = hw.memory_bandwidth_bytes_per_s * hw.memory_efficiency;
  const double faster_s = 2304 / (hw.peak_flops_fp32 * hw.matmul_efficiency) - 2304 / (hw.peak_flops_bf16 * hw.matmul_efficiency);
  CHECK(Nf4DequantTrafficBytes(576, DType::kBf16) == doctest::Approx(1476));
  CHECK(fp32.units[1].forward_s - bf16.units[1].forward_s == doctest::Approx(faster_s + (2628 - 1476) / mem_rate));
  CHECK(fp32.units[1].backward_s - bf16.units[1].backward_s == doctest::Approx(faster_s + (2628 - 1476) / mem_rate));
  CHECK(bf16.units[1].forward_flops == doctest::Approx(fp32.units[1].forward_flops));
}

}  // namespace
}  // namespace fsdp
