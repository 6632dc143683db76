// For tests: a llama small enough to count by hand, and workloads of it.
//   V = 16, h = 8, I = 16, 2 layers, 2 heads, 1 kv head (head_dim 4), untied lm_head.
//   Per block: norms 8 + 8, q 64, k 32, v 32, o 64, gate / up / down 128 each = 592 parameters.
//   Root (embedding, final norm, lm_head): 128 + 8 + 128 = 264. Total 1,448.
#pragma once

#include <doctest/doctest.h>

#include "core/hardware_spec.h"
#include "core/model_spec.h"
#include "core/workload.h"

namespace fsdp::testing {

inline constexpr const char* kHandLlamaConfig =
    R"({"model_type":"llama","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
    R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64})";

inline ModelSpec HandLlama() {
  auto json = ParseJson(kHandLlamaConfig, "hand.json");
  REQUIRE(json.ok());
  auto m = ModelFromHfConfig(json.value(), "hand", "hand.json");
  REQUIRE(m.ok());
  return m.value();
}

/// A bare GPU: 1 GiB, 8 per node, no other figures (for checks that read neither time nor bandwidth).
inline HardwareSpec GibGpu() {
  HardwareSpec hw;
  hw.id = "test";
  hw.memory_bytes = 1LL << 30;
  hw.gpus_per_node = 8;
  return hw;
}

/// The hand llama under `config` on a catalog GPU (a100-80gb-sxm unless named).
inline Workload HandWorkload(const FsdpConfig& config, const char* gpu = "a100-80gb-sxm") {
  auto hw = LoadHardware(gpu);
  REQUIRE(hw.ok());
  auto w = BuildWorkload(HandLlama(), hw.value(), config);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

/// FULL_SHARD on 3 ranks (the blocks padded from 592 to 594), 2 tokens, fp32 parameters.
inline FsdpConfig ThreeRanks() {
  FsdpConfig c;
  c.gpus = 3;
  c.seq_len = 2;
  c.param_dtype = DType::kFp32;
  return c;
}

}  // namespace fsdp::testing
