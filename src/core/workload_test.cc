#include "core/workload.h"

#include <doctest/doctest.h>

#include "core/testing/hand_llama.h"

namespace fsdp {
namespace {

// A llama small enough to count by hand: V=16, h=8, I=16, 2 layers, 2 heads, 1 kv head (head_dim 4).
// Per block: norms 8+8, q 64, k 32, v 32, o 64, gate/up/down 128 each = 592. Root: embed 128 +
// norm 8 + lm_head 128 = 264. Total 1,448.
constexpr const char* kHandLlama =
    R"({"model_type":"llama","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
    R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64})";

ModelSpec HandModel(const char* text = kHandLlama) {
  auto json = ParseJson(text, "hand.json");
  REQUIRE(json.ok());
  auto m = ModelFromHfConfig(json.value(), "hand", "hand.json");
  REQUIRE(m.ok());
  return m.value();
}

Workload Build(FsdpConfig c, const char* text = kHandLlama) {
  auto w = BuildWorkload(HandModel(text), testing::GibGpu(), c);
  REQUIRE_MESSAGE(w.ok(), (w.ok() ? "" : w.error().message));
  return w.value();
}

TEST_CASE("block wrap: root unit plus one unit per block, padded to the shard group") {
  FsdpConfig c;
  c.gpus = 3;  // 592 is not a multiple of 3: FSDP1 pads the flat parameter to 594
  Workload w = Build(c);
  REQUIRE(w.units.size() == 3);
  CHECK(w.units[0].name == "root");
  CHECK(w.units[0].numel == 264);
  CHECK(w.units[0].padded_numel == 264);
  CHECK(w.units[0].shard_numel == 88);
  CHECK(w.units[1].name == "model.layers.0");
  CHECK(w.units[1].numel == 592);
  CHECK(w.units[1].padded_numel == 594);
  CHECK(w.units[1].shard_numel == 198);
  CHECK(w.units[2].parent_unit == 0);
  CHECK(w.ShardNumelTotal() == 88 + 198 + 198);
  CHECK(w.shard_world == 3);
  CHECK(w.replicas == 1);
  // Forward ends layers.0, layers.1, then the root: in backward the root's hook prefetches layers.1.
  CHECK(w.post_forward_order == std::vector<int>{1, 2, 0});
  // fsdp-run's flat buffers: the root holds embed_tokens (128), norm (8), lm_head (128); a block
  // its two norms of 8 around q 64, k 32, v 32, o 64, then gate, up, down 128 each
  const auto tensor = [&](const std::string& name) {
    for (size_t t = 0; t < w.model.tensors.size(); ++t) if (w.model.tensors[t].name == name) return static_cast<int>(t);
    return -1;
  };
  CHECK(w.tensor_unit[tensor("model.norm.weight")] == 0);
  CHECK(w.tensor_offset[tensor("model.norm.weight")] == 128);
  CHECK(w.tensor_offset[tensor("lm_head.weight")] == 136);
  CHECK(w.tensor_unit[tensor("model.layers.1.mlp.down_proj.weight")] == 2);
  CHECK(w.tensor_offset[tensor("model.layers.1.mlp.down_proj.weight")] == 464);
  CHECK(w.tensor_offset[tensor("model.layers.1.self_attn.k_proj.weight")] == 72);
  CHECK(w.nodes[w.units[2].node].first_tensor == tensor("model.layers.1.input_layernorm.weight"));
}

TEST_CASE("--impl torchtitan: apply_fsdp's units, tok_embeddings, each block, [norm, output], an empty root") {
  FsdpConfig c;
  c.gpus = 3;
  c.framework = Framework::kFsdp2;
  c.impl = Impl::kTorchtitan;
  Workload w = Build(c);
  REQUIRE(w.units.size() == 5);
  CHECK(w.units[0].name == "root");
  CHECK(w.units[0].numel == 0);
  CHECK(w.units[1].name == "model.embed_tokens");
  CHECK(w.units[1].numel == 128);
  CHECK(w.units[2].name == "model.layers.0");
  CHECK(w.units[3].name == "model.layers.1");
  CHECK(w.units[4].name == "[norm, lm_head]");
  CHECK(w.units[4].numel == 8 + 128);
  CHECK(w.units[4].padded_numel == 9 + 18 * 8);  // FSDP2 pads each parameter's dim 0 to a multiple of 3: [8] -> [9], [16, 8] -> [18, 8]
  CHECK_FALSE(w.units[4].reshard_after_forward);
  CHECK(w.units[1].reshard_after_forward);
  CHECK(w.post_forward_order == std::vector<int>{1, 2, 3, 4, 0});
  CHECK(w.ShardNumelTotal() * 3 == w.PaddedNumelTotal());
  // the same parameters as transformers' layout, in other units
  FsdpConfig hf = c;
  hf.impl = Impl::kTransformers;
  CHECK(Build(hf).model.ParamsTotal() == w.model.ParamsTotal());
  // torchtitan trains with FSDP2, SDPA and its own wrap; it is a Llama 3
  FsdpConfig bad = c;
  bad.framework = Framework::kFsdp1;
  CHECK(BuildWorkload(HandModel(), testing::GibGpu(), bad).error().message.find("--framework fsdp2") != std::string::npos);
  bad = c;
  bad.wrap = WrapPolicy::kNone;
  CHECK(BuildWorkload(HandModel(), testing::GibGpu(), bad).error().message.find("--wrap none does not apply") != std::string::npos);
  bad = c;
  bad.attention = Attention::kEager;
  CHECK_FALSE(BuildWorkload(HandModel(), testing::GibGpu(), bad).ok());
  bad = c;
  bad.checkpointing = Checkpointing::kSelective;
  CHECK_FALSE(BuildWorkload(HandModel(), testing::GibGpu(), bad).ok());
  bad = c;
  bad.lora.rank = 2;
  CHECK(BuildWorkload(HandModel(), testing::GibGpu(), bad).error().message.find("LoRA") != std::string::npos);
  const char* tied = R"({"model_type":"llama","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
                     R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64,"tie_word_embeddings":true})";
  CHECK(BuildWorkload(HandModel(tied), testing::GibGpu(), c).error().message.find("ties lm_head") != std::string::npos);
  const char* qwen = R"({"model_type":"qwen2","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
                     R"("num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64})";
  CHECK(BuildWorkload(HandModel(qwen), testing::GibGpu(), c).error().message.find("is a qwen2 model") != std::string::npos);
  // torchtitan 0.2.2 has a dense Qwen3 (models/qwen3), the January 2025 tree none; a sliding window it has not
  const std::string qwen3 = R"({"model_type":"qwen3","vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":2,)"
                            R"("num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"max_position_embeddings":64)";
  CHECK(BuildWorkload(HandModel((qwen3 + "}").c_str()), testing::GibGpu(), c).ok());
  FsdpConfig qwen3_jan = c;
  qwen3_jan.impl = Impl::kTorchtitan202501;
  CHECK(BuildWorkload(HandModel((qwen3 + "}").c_str()), testing::GibGpu(), qwen3_jan).error().message.find("is a qwen3 model") != std::string::npos);
  const std::string windowed = qwen3 + R"(,"use_sliding_window":true,"sliding_window":16})";
  CHECK(BuildWorkload(HandModel(windowed.c_str()), testing::GibGpu(), c).error().message.find("sliding window") != std::string::npos);
  // the module tree differs: Reconfigure refuses to switch it
  CHECK_FALSE(Reconfigure(w, testing::GibGpu(), hf).ok());
  // January 2025's apply_fsdp: the blocks, the last one with reshard_after_forward=False, then the
  // model (its embedding, norm and output in the root)
  FsdpConfig jan = c;
  jan.impl = Impl::kTorchtitan202501;
  Workload w25 = Build(jan);
  REQUIRE(w25.units.size() == 3);
  CHECK(w25.units[0].numel == 264);
  CHECK(w25.units[1].reshard_after_forward);
  CHECK_FALSE(w25.units[2].reshard_after_forward);
}

TEST_CASE("strategies set the shard group") {
  FsdpConfig c;
  c.gpus = 16;
  c.gpus_per_node = 8;
  c.strategy = Strategy::kHybridShard;
  Workload hybrid = Build(c);
  CHECK(hybrid.shard_world == 8);
  CHECK(hybrid.replicas == 2);
  c.strategy = Strategy::kNoShard;
  Workload ddp = Build(c);
  CHECK(ddp.shard_world == 1);
  CHECK(ddp.units[1].padded_numel == 592);
  CHECK(ddp.units[1].shard_numel == 592);
}

TEST_CASE("use_orig_params aligns every parameter to 16 bytes before padding") {
  // h=6, I=10, heads 2 (head_dim 3), 1 kv head. Block tensors: norm 6 (pad to 8), q 36 (->44),
  // k 18 (62 -> 64), v 18 (->82, pad to 84), o 36 (->120), norm 6 (->126, pad to 128), gate 60 (->188),
  // up 60 (->248), down 60 (->308): 300 elements, 308 aligned, 309 padded for 3 ranks.
  const char* odd = R"({"model_type":"llama","vocab_size":10,"hidden_size":6,"intermediate_size":10,"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1})";
  FsdpConfig c;
  c.gpus = 3;
  CHECK(Build(c, odd).units[1].padded_numel == 300);
  c.use_orig_params = true;
  CHECK(Build(c, odd).units[1].padded_numel == 309);
  // FSDP2 pads each parameter's dim 0 to a multiple of 3: 6 + 36 + 18 + 18 + 36 + 6 + 12*6 + 12*6 + 6*10 = 324.
  c.use_orig_params = false;
  c.framework = Framework::kFsdp2;
  CHECK(Build(c, odd).units[1].padded_numel == 324);
  CHECK(Build(c, odd).units[1].shard_numel == 108);
}

TEST_CASE("wrap policies: none, linear and size-based") {
  FsdpConfig c;
  c.gpus = 2;
  c.wrap = WrapPolicy::kNone;
  Workload none = Build(c);
  REQUIRE(none.units.size() == 1);
  CHECK(none.units[0].numel == 1448);

  c.wrap = WrapPolicy::kLinear;
  Workload linear = Build(c);
  // 7 linears per block x 2 + lm_head + root (embed, norms).
  REQUIRE(linear.units.size() == 16);
  CHECK(linear.units[0].numel == 128 + 2 * 16 + 8);
  CHECK(linear.units[1].name == "model.layers.0.self_attn.q_proj");

  // size:150 -> q_proj (64) is too small; self_attn (192) and mlp (384) of each block are wrapped;
  // a block's 16 norm weights are not, and "model" then holds embed 128 + 2*16 + norm 8 = 168 >= 150
  // and is wrapped too; lm_head (128) stays in the root.
  c.wrap = WrapPolicy::kSize;
  c.wrap_min_params = 150;
  Workload sized = Build(c);
  REQUIRE(sized.units.size() == 6);
  CHECK(sized.units[1].name == "model");
  CHECK(sized.units[1].numel == 168);
  CHECK(sized.units[2].name == "model.layers.0.self_attn");
  CHECK(sized.units[2].numel == 192);
  CHECK(sized.units[3].name == "model.layers.0.mlp");
  CHECK(sized.units[0].numel == 128);

  // size:250 -> mlp (384) wrapped; a block's rest (208) is not; "model" then holds embed + 2*208
  // + norm = 552 >= 250 and is wrapped; lm_head (128) stays in the root. layers (a ModuleList) never is.
  c.wrap_min_params = 250;
  Workload nested = Build(c);
  REQUIRE(nested.units.size() == 4);
  CHECK(nested.units[1].name == "model");
  CHECK(nested.units[1].numel == 552);
  CHECK(nested.units[2].name == "model.layers.0.mlp");
  CHECK(nested.units[2].parent_unit == 1);
  CHECK(nested.units[0].numel == 128);
}

TEST_CASE("frozen parameters: FSDP1 still reduces the whole flat parameter, FSDP2 only the trainable ones") {
  ModelSpec m = HandModel();
  for (TensorSpec& t : m.tensors) t.trainable = t.name != "model.embed_tokens.weight";
  FsdpConfig c;
  c.gpus = 3;
  // FSDP1 refuses a flat parameter of mixed requires_grad without use_orig_params
  CHECK_FALSE(BuildWorkload(m, testing::GibGpu(), c).ok());
  c.use_orig_params = true;  // every size is a multiple of its 4-element alignment: no padding between
  Workload fsdp1 = BuildWorkload(m, testing::GibGpu(), c).value();
  CHECK(fsdp1.units[0].trainable_numel == 136);  // norm 8 + lm_head 128
  CHECK(fsdp1.units[0].grad_padded_numel == 264);
  CHECK(fsdp1.units[0].grad_shard_numel == 88);
  CHECK(fsdp1.units[1].grad_padded_numel == 594);
  c.framework = Framework::kFsdp2;
  c.use_orig_params = false;
  Workload fsdp2 = BuildWorkload(m, testing::GibGpu(), c).value();
  // norm [8] -> 9 rows on 3 ranks, lm_head [16, 8] -> 18 rows of 8: 153, 51 per rank
  CHECK(fsdp2.units[0].grad_padded_numel == 9 + 144);
  CHECK(fsdp2.units[0].grad_shard_numel == 51);
  // FSDP2 pads every parameter of a block on dim 0: 9 + 72 + 48 + 48 + 72 + 9 + 3 x 144 = 690, 230 per rank
  CHECK(fsdp2.GradShardNumelTotal() == 51 + 2 * 230);
  for (TensorSpec& t : m.tensors) t.trainable = t.block != 1;  // layers.1 frozen whole
  CHECK(BuildWorkload(m, testing::GibGpu(), c).value().units[2].grad_padded_numel == 0);
}

TEST_CASE("a vision tower idle in text-only steps: FSDP2 gives it no gradient, FSDP1's flat gradient covers it") {
  // model_spec_test's hand Gemma 3: a 252-element tower in the root beside the embedding 128 and
  // the final norm 8 (lm_head tied); one block of 616
  constexpr const char* kGemma3 =
      R"({"model_type":"gemma3","text_config":{"vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,)"
      R"("num_attention_heads":2,"num_key_value_heads":1,"head_dim":4},)"
      R"("vision_config":{"hidden_size":4,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"num_channels":1,)"
      R"("image_size":4,"patch_size":2,"vision_use_head":false}})";
  FsdpConfig c;
  c.gpus = 1;
  c.framework = Framework::kFsdp2;
  Workload fsdp2 = Build(c, kGemma3);
  REQUIRE(fsdp2.units.size() == 2);
  CHECK(fsdp2.units[0].numel == 252 + 128 + 8);
  CHECK(fsdp2.units[0].trainable_numel == 136);
  CHECK(fsdp2.GradShardNumelTotal() == 136 + 616);
  CHECK(fsdp2.model.ParamsTrainable() == 1004);  // requires_grad all the same
  c.framework = Framework::kFsdp1;
  REQUIRE(Reconfigure(fsdp2, testing::GibGpu(), c).ok());  // the same workload, re-targeted
  CHECK(fsdp2.units[0].trainable_numel == 388);
  CHECK(fsdp2.GradShardNumelTotal() == 388 + 616);
  c.framework = Framework::kFsdp2;
  REQUIRE(Reconfigure(fsdp2, testing::GibGpu(), c).ok());
  CHECK(fsdp2.GradShardNumelTotal() == 136 + 616);
}

// Block 0 under LoRA r=2 on q_proj and v_proj, packed in inventory order: input_layernorm 8, q base
// 64, q.lora_A 16, q.lora_B 16, k 32, v 32, v.lora_A 16, v.lora_B 8, o 64, post norm 8, gate, up,
// down 128 each = 648; 2 ranks of 324.
TEST_CASE("SteppedShardRuns: FSDP1 with use_orig_params steps the adapters' parts of each rank's shard, else the whole shard") {
  FsdpConfig c;
  c.gpus = 2;
  c.lora.rank = 2;
  c.use_orig_params = true;
  c.wrap = WrapPolicy::kBlock;
  const Workload fsdp1 = Build(c);
  REQUIRE(fsdp1.units[1].grad_shard_numel == 324);  // the whole flat gradient
  CHECK(SteppedShardRuns(fsdp1, 1, 0) == std::vector<ElementRun>{{72, 32}, {168, 24}});  // q's two adapters are adjacent
  CHECK(SteppedShardRuns(fsdp1, 1, 1).empty());
  CHECK(SteppedShardRuns(fsdp1, 0, 0).empty());  // the root: frozen, no gradient
  c.framework = Framework::kFsdp2;  // the adapters' own gradients: all of the shard
  const Workload fsdp2 = Build(c);
  CHECK(SteppedShardRuns(fsdp2, 1, 1) == std::vector<ElementRun>{{0, fsdp2.units[1].grad_shard_numel}});
  c.lora.rank = 0;
  const Workload full = Build(c);
  CHECK(SteppedShardRuns(full, 0, 1) == std::vector<ElementRun>{{0, full.units[0].shard_numel}});
}

}  // namespace
}  // namespace fsdp
