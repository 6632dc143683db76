#include "planner/runtime_profile.h"

#include <doctest/doctest.h>

#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "core/lora.h"
#include "core/model_spec.h"

namespace fsdp {
namespace {

Workload Tiny(int gpus, Strategy strategy, Checkpointing ac, DType param_dtype, DType reduce_dtype) {
  FsdpConfig c;
  c.gpus = c.gpus_per_node = gpus;
  c.strategy = strategy;
  c.checkpointing = ac;
  c.param_dtype = param_dtype;
  c.reduce_dtype = reduce_dtype;
  c.micro_batch = 2;
  c.seq_len = 32;
  return BuildWorkload(LoadModel("tiny-llama").value(), LoadHardware("h200-sxm").value(), c).value();
}

int64_t Round512(int64_t bytes) { return (bytes + 511) / 512 * 512; }

// LoRA r=4 under FSDP2 on `gpus` ranks, micro-batch 2 of 32 tokens (tiny-llama's tests below)
FsdpConfig TinyLora(int64_t gpus) {
  FsdpConfig c;
  c.gpus = c.gpus_per_node = gpus;
  c.framework = Framework::kFsdp2;
  c.micro_batch = 2;
  c.seq_len = 32;
  c.lora.rank = 4;
  return c;
}

// tests/data/hf_configs/qwen3-moe-mini.json's shapes at seq 64, micro-batch 2: T = 128 tokens,
// h 64, 4 heads and 2 kv heads of 16, 8 experts of 32, top 2 (256 pairs).
TEST_CASE("CPU engine profile: what a Qwen3-MoE block saves, counted by hand") {
  auto json = ParseJson(R"({"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8,
                            "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2})",
                        "moe.json");
  REQUIRE(json.ok());
  FsdpConfig c;
  c.gpus = c.gpus_per_node = 2;
  c.micro_batch = 2;
  c.seq_len = 64;
  const Workload w = BuildWorkload(ModelFromHfConfig(json.value(), "moe", "moe.json").value(), LoadHardware("h200-sxm").value(), c).value();
  // x, n1, x2, n2 4 x 128 x 64; q and attn 2 x 128 x 64; k, v 2 x 128 x 32; two inverse RMS 2 x 128;
  // probabilities 2 x 4 x 64 x 64; q and k before their norms 128 x 6 rows of 16, and their inverse RMS
  const int64_t attention = (4 * 128 * 64 + 2 * 128 * 64 + 2 * 128 * 32 + 2 * 128 + 2 * 4 * 64 * 64 + 128 * 6 * 16 + 128 * 6) * 4;
  // per pair gate, up, mid (32 each) and the expert's output (64); the router's softmax 128 x 8 and
  // weights 128 x 2; each pair's token and slot (int32); 9 pair_begin entries (int64)
  const int64_t experts = (3 * 256 * 32 + 256 * 64 + 128 * 8 + 256) * 4 + 2 * 256 * 4 + 9 * 8;
  CHECK(RuntimeBlockSavedBytes(w) == attention + experts);
  CHECK(RuntimeBlockSavedBytes(w) == 584776);
}

// tiny-llama (h 128, intermediate 344) at seq 32, micro-batch 2: T = 64 tokens. LoRA r=4 on q, v and
// down adds x A^T (T, 4) per projection; lora_dropout 0.1 adds each one's dropout(x) (T, in) fp32
// and its keep mask (T x in bytes), in = 128, 128, 344.
TEST_CASE("CPU engine profile: what LoRA and its dropout add to a block, counted by hand") {
  auto with_lora = [](double dropout) {
    FsdpConfig c = TinyLora(2);
    c.lora.targets = "q_proj,v_proj,down_proj";
    c.lora.dropout = dropout;
    return RuntimeBlockSavedBytes(BuildWorkload(LoadModel("tiny-llama").value(), LoadHardware("h200-sxm").value(), c).value());
  };
  const int64_t full = RuntimeBlockSavedBytes(Tiny(2, Strategy::kFullShard, Checkpointing::kNone, DType::kBf16, DType::kFp32));
  CHECK(with_lora(0) == full + 3 * 64 * 4 * 4);
  CHECK(with_lora(0.1) == with_lora(0) + 64 * (128 + 128 + 344) * (4 + 1));
}

// tiny-llama on 1 rank, LoRA r=4 on q and v over a bf16 base, then QLoRA: each block's seven linears
// (q 128 x 128, k and v 64 x 128, o 128 x 128, gate, up 344 x 128, down 128 x 344: 181,248 weights)
// go from 2 bytes a weight to 4 codes a bf16 element, and every rank adds their fp32 absmax per 64
// (256 + 128 + 128 + 256 + 3 x 688 = 2,832 blocks).
TEST_CASE("CPU engine profile: QLoRA's packed codes and absmax in the sharded parameters, counted by hand") {
  auto sharded = [](bool qlora) {
    FsdpConfig c = TinyLora(1);
    c.lora.qlora = qlora;
    c.lora.base_dtype = DType::kBf16;
    ModelSpec m = LoadModel("tiny-llama").value();
    REQUIRE(ApplyLora(m, c.lora, c.param_dtype).ok());
    const Workload w = BuildWorkload(m, LoadHardware("h200-sxm").value(), c).value();
    return EstimateRuntimeMemory(w).peak[static_cast<int>(MemCategory::kShardedParams)];
  };
  CHECK(sharded(true) == sharded(false) - 5 * (181248 * 2 - 181248 / 4 * 2) + 5 * 2832 * 4);
}

TEST_CASE("GPU engine replay: fp32 shards and AdamW states, param_dtype unsharded units, 512 B blocks") {
  const Workload w = Tiny(8, Strategy::kFullShard, Checkpointing::kNone, DType::kBf16, DType::kFp32);
  const GpuRuntimeMemory m = EstimateGpuRuntimeMemory(w);
  int64_t shards = 0;
  for (const WrapUnit& u : w.units) shards += Round512(u.shard_numel * 4);
  CHECK(m.at_peak[0] == shards);      // sharded params
  CHECK(m.at_peak[3] == 2 * shards);  // exp_avg, exp_avg_sq
  int64_t sum = 0;
  for (int64_t b : m.at_peak) sum += b;
  CHECK(sum == m.peak_bytes);
  // tiny-llama's activations are small (64 tokens): the fp32 gradient shards growing through the
  // backward make the peak, at a reduce-scatter
  CHECK(m.peak_phase.starts_with("backward: reduce-scatter model.layers."));
}

TEST_CASE("GPU engine replay: 1 rank, the peak at the last reduce-scatter counted by hand") {
  // FULL_SHARD on 1 rank, bf16 parameters and reduction: the peak is the allocation of block 0's
  // fp32 gradient shard, when every block's shard exists, the root's and block 0's bf16 gradients
  // are still held, only the root is gathered (block 0 was resharded before its reduce-scatter),
  // and the reduce-scatter output (block 0's shard in bf16) is the one communication buffer.
  const Workload w = Tiny(1, Strategy::kFullShard, Checkpointing::kNone, DType::kBf16, DType::kBf16);
  REQUIRE(w.units.size() == 6);  // root + 5 blocks
  const GpuRuntimeMemory m = EstimateGpuRuntimeMemory(w);
  const int64_t root = Round512(w.units[0].padded_numel * 2), block = Round512(w.units[1].padded_numel * 2);
  const int64_t block_shard_fp32 = Round512(w.units[1].shard_numel * 4);
  CHECK(m.peak_phase == "backward: reduce-scatter model.layers.0");
  CHECK(m.at_peak[1] == root);
  CHECK(m.at_peak[2] == root + block + 5 * block_shard_fp32);
  CHECK(m.at_peak[5] == Round512(w.units[1].shard_numel * 2));
  // the temporaries that live through the step: loss, the loss scaler's flag, RMSNorm weight-gradient scratch, RoPE table,
  // token ids, targets and the embedding backward's token groups (64 tokens)
  const int64_t T = 64;
  CHECK(m.at_peak[6] == 2 * Round512(4) + Round512(w.model.hidden_size * 4) + Round512(32 * w.model.head_dim * 4) + 2 * Round512(T * 4) +
                            Round512((3 * T + 1) * 4));
}

TEST_CASE("GPU engine replay: checkpointing trades saved tensors for recomputation; SHARD_GRAD_OP keeps units gathered") {
  const GpuRuntimeMemory none = EstimateGpuRuntimeMemory(Tiny(4, Strategy::kFullShard, Checkpointing::kNone, DType::kBf16, DType::kFp32));
  const GpuRuntimeMemory full = EstimateGpuRuntimeMemory(Tiny(4, Strategy::kFullShard, Checkpointing::kFull, DType::kBf16, DType::kFp32));
  CHECK(full.peak_bytes < none.peak_bytes);
  CHECK(full.at_peak[4] < none.at_peak[4]);
  const Workload zero2 = Tiny(4, Strategy::kShardGradOp, Checkpointing::kNone, DType::kBf16, DType::kFp32);
  const GpuRuntimeMemory sgo = EstimateGpuRuntimeMemory(zero2);
  CHECK(sgo.at_peak[1] > none.at_peak[1]);
  // a reduce_dtype different from param_dtype needs a cast buffer: bf16 reduction uses less
  const GpuRuntimeMemory bf16_reduce = EstimateGpuRuntimeMemory(Tiny(4, Strategy::kFullShard, Checkpointing::kNone, DType::kBf16, DType::kBf16));
  CHECK(bf16_reduce.peak_bytes <= none.peak_bytes);
}


// fsdp-run --device cuda on one H200 (docs/data/gpu_h200_2026-12-04.json, runs.fsdp_*:
// measured.memory.rank0_peak_reserved_bytes): TinyLlama 1.1B, seq 2048, micro-batch 1, bf16/fp32,
// FSDP2 (NO_SHARD: FSDP1), world 1 or a virtual world of 8, and Llama 3.1 8B at seq 4096 with
// full AC in a virtual world of 8 (..._fresh.json, runs.fsdp_large_v8). Each measured reserve lies
// between the replay's two ends. For SHARD_GRAD_OP the two ends meet (when its blocks freed for
// another stream become reusable does not change where later blocks go) and equal the
// measurement. FULL_SHARD was measured twice (the second run with the calibrated hardware file).
TEST_CASE("GPU engine replay: the H200's measured reserves lie between its two ends") {
  struct Run {
    const char* model;
    int gpus;
    int64_t seq;
    Strategy strategy;
    Framework framework;
    Checkpointing ac;
    int64_t measured_reserved_bytes;
  };
  const Run runs[] = {
      {"tinyllama-1.1b", 1, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kNone, 31373393920},
      {"tinyllama-1.1b", 1, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kNone, 31193038848},
      {"tinyllama-1.1b", 1, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kFull, 23506976768},
      {"tinyllama-1.1b", 1, 2048, Strategy::kShardGradOp, Framework::kFsdp2, Checkpointing::kNone, 31193038848},
      {"tinyllama-1.1b", 1, 2048, Strategy::kNoShard, Framework::kFsdp1, Checkpointing::kNone, 31534874624},
      {"tinyllama-1.1b", 1, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kSelective, 25557991424},
      {"tinyllama-1.1b", 8, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kNone, 14269022208},
      {"tinyllama-1.1b", 8, 2048, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kFull, 7124025344},
      {"tinyllama-1.1b", 8, 2048, Strategy::kShardGradOp, Framework::kFsdp2, Checkpointing::kNone, 14810087424},
      {"llama-3.1-8b", 8, 4096, Strategy::kFullShard, Framework::kFsdp2, Checkpointing::kFull, 51772391424},
  };
  for (const Run& r : runs) {
    FsdpConfig c;
    c.gpus = r.gpus;
    c.seq_len = r.seq;
    c.strategy = r.strategy;
    c.framework = r.framework;
    c.checkpointing = r.ac;
    c.param_dtype = DType::kBf16;
    c.reduce_dtype = DType::kFp32;
    CAPTURE(r.model);
    CAPTURE(r.gpus);
    CAPTURE(static_cast<int>(r.strategy));
    CAPTURE(static_cast<int>(r.ac));
    const GpuRuntimeMemory m = EstimateGpuRuntimeMemory(BuildWorkload(LoadModel(r.model).value(), LoadHardware("h200-sxm").value(), c).value());
    CHECK(m.reserved_peak_bytes <= r.measured_reserved_bytes);
    CHECK(r.measured_reserved_bytes <= m.reserved_peak_lagging_bytes);
    if (r.strategy == Strategy::kShardGradOp) CHECK(m.reserved_peak_bytes == r.measured_reserved_bytes);
  }
}

}  // namespace
}  // namespace fsdp
