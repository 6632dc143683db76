#include "core/model_spec.h"

#include <algorithm>

#include <doctest/doctest.h>

#include <filesystem>
#include <string>

#include "core/catalog.h"

namespace fsdp {
namespace {

int64_t CountOf(const std::string& id_or_path) {
  auto m = LoadModel(id_or_path);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? "" : m.error().message));
  return m.value().ParamsTotal();
}

Result<ModelSpec> FromText(const std::string& text) {
  auto json = ParseJson(text, "inline.json");
  REQUIRE(json.ok());
  return ModelFromHfConfig(json.value(), "inline", "inline.json");
}

TEST_CASE("catalog models have the exact parameter counts of their real checkpoints") {
  // Counts of nn.Parameter elements (tied weights once, buffers excluded); sources in models/README.md.
  CHECK(CountOf("gpt2") == 124'439'808);
  CHECK(CountOf("gpt2-medium") == 354'823'168);
  CHECK(CountOf("gpt2-large") == 774'030'080);
  CHECK(CountOf("gpt2-xl") == 1'557'611'200);
  CHECK(CountOf("llama-2-7b") == 6'738'415'616);
  CHECK(CountOf("llama-2-13b") == 13'015'864'320);
  CHECK(CountOf("llama-2-70b") == 68'976'648'192);
  CHECK(CountOf("codellama-34b") == 33'743'970'304);
  CHECK(CountOf("llama-3.1-8b") == 8'030'261'248);
  CHECK(CountOf("llama-3.1-70b") == 70'553'706'496);
  CHECK(CountOf("llama-3.1-405b") == 405'853'388'800);
  CHECK(CountOf("mistral-7b") == 7'241'732'096);
  CHECK(CountOf("mixtral-8x7b") == 46'702'792'704);
  CHECK(CountOf("qwen2.5-7b") == 7'615'616'512);
  CHECK(CountOf("qwen2.5-72b") == 72'706'203'648);
  CHECK(CountOf("tiny-llama") == 1'038'720);
  CHECK(CountOf("llama-100m") == 105'788'160);
}

TEST_CASE("Hub configs outside the catalog load with exact counts (tests/data/hf_configs/EXPECTED.md)") {
  const std::string dir = DataDir() + "/tests/data/hf_configs/";
  CHECK(CountOf(dir + "qwen2.5-0.5b.json") == 494'032'768);      // tied embeddings
  CHECK(CountOf(dir + "qwen2-1.5b.json") == 1'543'714'304);
  CHECK(CountOf(dir + "llama-3.2-1b.json") == 1'235'814'400);    // tied, rope_scaling llama3
  CHECK(CountOf(dir + "tinyllama-1.1b-3t.json") == 1'100'048'384);
  CHECK(CountOf(dir + "mistral-nemo-base-2407.json") == 12'247'782'400);  // head_dim 128 != 5120/32
  CHECK(CountOf(dir + "mixtral-8x22b.json") == 140'620'634'112);
  CHECK(CountOf(dir + "distilgpt2.json") == 81'912'576);
}

TEST_CASE("missing keys take transformers' defaults for each model type") {
  const std::string dir = DataDir() + "/tests/data/hf_configs/";
  CHECK(CountOf(dir + "minimal-llama.json") == 2'094'336);    // kv heads = heads
  CHECK(CountOf(dir + "minimal-qwen2.json") == 1'964'288);    // kv heads 32, q/k/v bias
  CHECK(CountOf(dir + "minimal-mistral.json") == 1'963'264);  // kv heads 8
  CHECK(CountOf(dir + "minimal-mixtral.json") == 9'364'736);  // 8 experts, router without bias
  CHECK(CountOf(dir + "minimal-gpt2.json") == 2'098'176);     // n_inner = 4*n_embd, n_positions 1024
  CHECK(CountOf(dir + "llama-100m-gqa.json") == 99'496'704);  // llama-100m with 4 kv heads
  CHECK(CountOf(dir + "gpt2-no-dropout.json") == 124'439'808);  // gpt2 with every dropout 0
  CHECK(CountOf(dir + "gpt2-2k-context-2k-vocab.json") == 88'201'728);  // 2048 positions and tokens
  CHECK(CountOf(dir + "llama-100m-2k-vocab.json") == 59'781'888);  // llama-100m with 2048 tokens

  auto m = FromText(R"({"model_type":"llama","hidden_size":256,"intermediate_size":688,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":1000})");
  REQUIRE(m.ok());
  CHECK(m.value().num_kv_heads == 4);
  CHECK(m.value().head_dim == 64);
  CHECK_FALSE(m.value().tie_word_embeddings);
  CHECK(m.value().max_position_embeddings == 2048);
  CHECK(m.value().norm_eps == 1e-6);  // LlamaConfig's rms_norm_eps default
  CHECK(m.value().rope_theta == 10000.0);
  auto mixtral = FromText(R"({"model_type":"mixtral"})");
  REQUIRE(mixtral.ok());
  CHECK(mixtral.value().norm_eps == 1e-5);
  CHECK(mixtral.value().rope_theta == 1e6);
}

TEST_CASE("the norm epsilon and the RoPE base come from the config") {
  auto llama3 = LoadModel("llama-3.1-8b");
  REQUIRE(llama3.ok());
  CHECK(llama3.value().rope_theta == 500000.0);
  CHECK(llama3.value().norm_eps == 1e-5);
  auto qwen = LoadModel("qwen2.5-7b");
  REQUIRE(qwen.ok());
  CHECK(qwen.value().norm_eps == 1e-6);
  CHECK(qwen.value().rope_theta == 1e6);
  auto tinyllama = LoadModel("tinyllama-1.1b");  // no rope_theta key: LlamaConfig's 10000
  REQUIRE(tinyllama.ok());
  CHECK(tinyllama.value().rope_theta == 10000.0);
  auto gpt2 = LoadModel("gpt2");  // learned positions; layer_norm_epsilon
  REQUIRE(gpt2.ok());
  CHECK(gpt2.value().rope_theta == 0.0);
  CHECK(gpt2.value().norm_eps == 1e-5);
  // Phi-3's partial_rotary_factor (rotate_half on that share of each head); 1 where absent
  auto phi3 = LoadModel(DataDir() + "/tests/data/hf_configs/phi3-100m.json");
  REQUIRE(phi3.ok());
  CHECK(phi3.value().rotary_fraction == 0.75);
  CHECK(phi3.value().arch.rope_rotate_half);
  CHECK(LoadModel("phi-4").value().rotary_fraction == 1.0);
  CHECK_FALSE(gpt2.value().arch.rope_rotate_half);
}

TEST_CASE("RoPE scaling and Mistral's sliding window come from the config") {
  auto llama31 = LoadModel("llama-3.1-8b");  // transformers 4's rope_scaling
  REQUIRE(llama31.ok());
  const RopeScaling& s = llama31.value().rope_scaling;
  CHECK(s.type == "llama3");
  CHECK(s.factor == 8.0);
  CHECK(s.low_freq_factor == 1.0);
  CHECK(s.high_freq_factor == 4.0);
  CHECK(s.original_max_positions == 8192);
  CHECK(LoadModel("llama-2-7b").value().rope_scaling.type == "default");  // "rope_scaling": null

  // transformers 5's rope_parameters carries rope_theta; llama3 without original_max_position_embeddings
  // takes max_position_embeddings (standardize_rope_params)
  auto v5 = FromText(R"({"model_type":"llama","max_position_embeddings":4096,
      "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0}})");
  REQUIRE(v5.ok());
  CHECK(v5.value().rope_theta == 500000.0);
  CHECK(v5.value().rope_scaling.factor == 32.0);
  CHECK(v5.value().rope_scaling.original_max_positions == 4096);
  auto old_key = FromText(R"({"model_type":"llama","rope_scaling":{"type":"linear","factor":2}})");  // "type" before "rope_type"
  REQUIRE(old_key.ok());
  CHECK(old_key.value().rope_scaling.type == "linear");
  CHECK(FromText(R"({"model_type":"llama","rope_scaling":{"rope_type":"yarn","factor":4.0}})").value().rope_scaling.type == "yarn");
  // both keys: rope_scaling wins, a rope_theta inside the object wins over the top level's
  // (convert_rope_params_to_dict); an empty rope_scaling leaves rope_parameters in charge
  auto both = FromText(R"({"model_type":"llama","rope_theta":10000.0,"rope_scaling":{"rope_type":"linear","factor":2.0,"rope_theta":20000.0},
      "rope_parameters":{"rope_type":"linear","factor":4.0}})");
  REQUIRE(both.ok());
  CHECK(both.value().rope_scaling.factor == 2.0);
  CHECK(both.value().rope_theta == 20000.0);
  auto empty = FromText(R"({"model_type":"llama","rope_scaling":{},"rope_parameters":{"rope_type":"linear","factor":4.0}})");
  REQUIRE(empty.ok());
  CHECK(empty.value().rope_scaling.factor == 4.0);

  auto small = FromText(R"({"model_type":"llama","rope_scaling":{"rope_type":"linear","factor":0.5}})");
  REQUIRE_FALSE(small.ok());
  CHECK(small.error().message == "inline.json: key 'rope_scaling': key 'factor': must be between 1 and 1000000, got 0.5");
  auto bands = FromText(R"({"model_type":"llama","rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":4,"high_freq_factor":1}})");
  REQUIRE_FALSE(bands.ok());
  CHECK(bands.error().message == "inline.json: key 'rope_scaling': key 'high_freq_factor': must be at least low_freq_factor 4, got 1");
  auto missing = FromText(R"({"model_type":"llama","rope_scaling":{"rope_type":"llama3","factor":8}})");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().message == "inline.json: key 'rope_scaling': key 'low_freq_factor': missing");
  auto text = FromText(R"({"model_type":"llama","rope_scaling":"llama3"})");
  REQUIRE_FALSE(text.ok());
  CHECK(text.error().message == "inline.json: key 'rope_scaling': expected an object");

  CHECK(LoadModel("mistral-7b").value().sliding_window == 4096);
  CHECK(FromText(R"({"model_type":"mistral","sliding_window":null})").value().sliding_window == 0);
  CHECK(FromText(R"({"model_type":"mistral"})").value().sliding_window == 4096);  // MistralConfig's default
  CHECK(LoadModel("llama-3.1-8b").value().sliding_window == 0);
  CHECK(LoadModel("qwen2.5-7b").value().sliding_window == 0);  // sliding_window 131072 but use_sliding_window false
  CHECK(FromText(R"({"model_type":"qwen2","use_sliding_window":true,"sliding_window":1024})").value().sliding_window == 1024);
  CHECK(FromText(R"({"model_type":"qwen2","use_sliding_window":true,"sliding_window":null})").value().sliding_window == 0);
}

TEST_CASE("tensor inventory uses HF names and shapes") {
  auto m = LoadModel("qwen2.5-7b");
  REQUIRE(m.ok());
  const auto& t = m.value().tensors;
  CHECK(t.front().name == "model.embed_tokens.weight");
  CHECK(t.front().shape == std::vector<int64_t>{152064, 3584});
  bool found_k_bias = false;
  for (const auto& x : t) {
    if (x.name == "model.layers.0.self_attn.k_proj.bias") {
      found_k_bias = true;
      CHECK(x.shape == std::vector<int64_t>{512});
    }
    CHECK(x.name != "model.layers.0.self_attn.o_proj.bias");
  }
  CHECK(found_k_bias);
  CHECK(t.back().name == "lm_head.weight");

  auto g = LoadModel("gpt2");
  REQUIRE(g.ok());
  CHECK(g.value().tensors[2].name == "transformer.h.0.ln_1.weight");
  CHECK(g.value().tensors.back().name == "transformer.ln_f.bias");  // lm_head tied to wte
  CHECK(g.value().intermediate_size == 3072);

  auto mix = LoadModel("mixtral-8x7b");
  REQUIRE(mix.ok());
  CHECK(mix.value().ActiveParamsPerToken() == 12'879'925'248);  // 46.7B total, 2 of 8 experts active
}

TEST_CASE("the inventory is derived from the Architecture alone") {
  // A made-up architecture exercising every ParamOp feature: LayerNorm (weight and bias), learned
  // positions, a Conv1D linear with a bias, a router and a run of two expert linears over 3
  // experts of which 1 runs per token, and an untied head.
  ModelSpec m;
  m.vocab_size = 10;
  m.hidden_size = 4;
  m.num_layers = 2;
  m.max_position_embeddings = 6;
  m.arch.names = {"emb", "pos", "blocks", "final", "head"};
  m.arch.norm = NormKind::kLayer;
  m.arch.block = {{ParamOp::Kind::kNorm, "ln", 0, 4},
                  {ParamOp::Kind::kLinear, "proj", 4, 5, true, true},
                  {ParamOp::Kind::kRouter, "router", 4, 3},
                  {ParamOp::Kind::kLinear, "experts.{}.up", 4, 7, false, false, 3, 1},
                  {ParamOp::Kind::kLinear, "experts.{}.down", 7, 4, false, false, 3, 1, false}};
  const std::vector<TensorSpec> t = BuildInventory(m);
  std::vector<std::string> names;
  for (const TensorSpec& x : t) names.push_back(x.name);
  const std::vector<std::string> block0 = {"blocks.0.ln.weight", "blocks.0.ln.bias", "blocks.0.proj.weight", "blocks.0.proj.bias",
                                           "blocks.0.router.weight", "blocks.0.experts.0.up.weight", "blocks.0.experts.0.down.weight",
                                           "blocks.0.experts.1.up.weight", "blocks.0.experts.1.down.weight",
                                           "blocks.0.experts.2.up.weight", "blocks.0.experts.2.down.weight"};
  REQUIRE(names.size() == 2 + 2 * block0.size() + 3);
  CHECK(names[0] == "emb.weight");
  CHECK(names[1] == "pos.weight");
  CHECK(std::vector<std::string>(names.begin() + 2, names.begin() + 2 + block0.size()) == block0);
  CHECK(names[2 + block0.size()] == "blocks.1.ln.weight");
  CHECK(std::vector<std::string>(names.end() - 3, names.end()) == std::vector<std::string>{"final.weight", "final.bias", "head.weight"});
  CHECK(t[1].shape == std::vector<int64_t>{6, 4});
  CHECK(t[4].shape == std::vector<int64_t>{4, 5});  // Conv1D stores [in, out]
  CHECK(t[6].shape == std::vector<int64_t>{3, 4});  // router: [experts, hidden]
  CHECK(t[7].shape == std::vector<int64_t>{7, 4});  // nn.Linear stores [out, in]
  CHECK(t[7].active_share == doctest::Approx(1.0 / 3));
  CHECK(t[6].active_share == 1.0);
  CHECK((t[7].trainable && !t[8].trainable && t[4].trainable));  // the frozen op's tensors only
  CHECK((t[4].in_linear && !t[2].in_linear && t[6].in_linear && t[7].block == 0 && t[0].block == -1));
  // numel: 10*4 + 6*4 + 2*(8 + 20 + 5 + 12 + 3*(28 + 28)) + 8 + 40
  m.tensors = t;
  CHECK(m.ParamsTotal() == 40 + 24 + 2 * (8 + 25 + 12 + 3 * 56) + 8 + 40);
  CHECK(m.ActiveParamsPerToken() == 40 + 24 + 2 * (8 + 25 + 12 + 56) + 8 + 40);
}

TEST_CASE("fused routed experts are one 3-D parameter per projection, after the block's other tensors") {
  // transformers 5's Qwen3MoeExperts: gate_up_proj [experts, 2I, h], down_proj [experts, h, I]
  auto m = LoadModel("qwen3-30b-a3b");
  REQUIRE(m.ok());
  std::vector<const TensorSpec*> block0;
  for (const TensorSpec& t : m.value().tensors) if (t.block == 0) block0.push_back(&t);
  REQUIRE(block0.size() == 11);  // 2 norms, q/k/v/o, q_norm, k_norm, router, 2 experts
  CHECK(block0[8]->name == "model.layers.0.mlp.gate.weight");
  CHECK(block0[8]->shape == std::vector<int64_t>{128, 2048});
  CHECK(block0[9]->name == "model.layers.0.mlp.experts.gate_up_proj");
  CHECK(block0[9]->shape == std::vector<int64_t>{128, 1536, 2048});
  CHECK(block0[10]->name == "model.layers.0.mlp.experts.down_proj");
  CHECK(block0[10]->shape == std::vector<int64_t>{128, 2048, 768});
  CHECK(block0[10]->active_share == doctest::Approx(8.0 / 128));
  const InventorySize counted = CountInventory(m.value());
  CHECK(counted.tensors == static_cast<double>(m.value().tensors.size()));
  CHECK(counted.params == static_cast<double>(m.value().ParamsTotal()));
}

TEST_CASE("DeepSeek-V3: latent attention, dense first layers, then routed and shared experts") {
  // deepseek-v3-tiny.json by hand (h 512, 8 heads, q_lora 192, kv_lora 128, qk 64 + 32, v 64):
  // attention q_a 512x192 + 192 + q_b 192x(8x96) + kv_a 512x(128+32) + 128 + kv_b 128x(8x128)
  // + o (8x64)x512 + two norms of 512 = 722,240; the dense layer's SwiGLU 3 x 512 x 1024; a routed
  // layer's router 16x512, experts 16 x 3 x 512 x 128, shared expert 3 x 512 x 128
  const ModelSpec m = LoadModel(DataDir() + "/tests/data/hf_configs/deepseek-v3-tiny.json").value();
  CHECK(m.head_dim == 96);
  CHECK(m.ValueHeadDim() == 64);
  CHECK(m.BlockParams(0) == 722'240 + 1'572'864);
  for (int b = 1; b < 4; ++b) CHECK(m.BlockParams(b) == 722'240 + 8'192 + 3'145'728 + 196'608);
  CHECK(m.ParamsTotal() == 2 * 4096 * 512 + 512 + (722'240 + 1'572'864) + 3 * (722'240 + 3'350'528));
  // block 0 is dense, block 1 routed: their tensors by name
  std::vector<std::string> names0, names1;
  for (const TensorSpec& t : m.tensors) (t.block == 0 ? names0 : names1).push_back(t.name);
  CHECK(names0.back() == "model.layers.0.mlp.down_proj.weight");
  CHECK(std::find(names1.begin(), names1.end(), "model.layers.1.mlp.experts.gate_up_proj") != names1.end());
  CHECK(std::find(names1.begin(), names1.end(), "model.layers.1.mlp.shared_experts.down_proj.weight") != names1.end());
  CHECK(std::find(names1.begin(), names1.end(), "model.layers.1.self_attn.kv_b_proj.weight") != names1.end());
  // the routed experts run 4 of 16, everything else on every token
  CHECK(m.ActiveParamsPerToken() == m.ParamsTotal() - 3 * 3'145'728 + 3 * 3'145'728 / 4);
  const InventorySize counted = CountInventory(m);
  CHECK(counted.tensors == static_cast<double>(m.tensors.size()));
  CHECK(counted.params == static_cast<double>(m.ParamsTotal()));
  // the published model (models/README.md): 671,026,404,352, multi-token prediction layer excluded
  CHECK(CountOf("deepseek-v3") == 671'026'404'352);
  // a dense layer's shape: a dense model's
  const ModelShape dense = m.LayerShape(0);
  CHECK((dense.arch.mlp == MlpKind::kGated && dense.intermediate_size == 1024 && dense.num_experts == 0));
  CHECK(m.LayerShape(1).intermediate_size == 128);
}

TEST_CASE("DeepSeek-V3's inconsistent keys are refused naming the key") {
  const std::string base = R"({"model_type":"deepseek_v3","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,)";
  auto groups = FromText(base + R"("n_routed_experts":8,"n_group":3})");
  REQUIRE_FALSE(groups.ok());
  CHECK(groups.error().message == "inline.json: key 'n_group': 3 groups must divide 8 experts into groups of at least two");
  auto kept = FromText(base + R"("n_routed_experts":8,"n_group":2,"topk_group":3})");
  CHECK(kept.error().message == "inline.json: key 'topk_group': 3 exceeds n_group 2");
  auto topk = FromText(base + R"("n_routed_experts":8,"n_group":4,"topk_group":1,"num_experts_per_tok":3})");
  CHECK(topk.error().message == "inline.json: key 'num_experts_per_tok': 3 exceeds the 2 experts of the topk_group 1 groups it picks from");
  auto kv = FromText(R"({"model_type":"deepseek_v3","num_attention_heads":4,"num_key_value_heads":2})");
  CHECK(kv.error().message == "inline.json: key 'num_key_value_heads': MLA decompresses k and v for every head: expected 4 (num_attention_heads), got 2");
  auto dense = FromText(base + R"("first_k_dense_replace":-1})");
  REQUIRE_FALSE(dense.ok());
  CHECK(dense.error().message.find("first_k_dense_replace") != std::string::npos);
  // q_lora_rank null: a plain q_proj
  auto plain_q = FromText(base + R"("q_lora_rank":null,"n_routed_experts":8,"n_group":2,"topk_group":1,"num_experts_per_tok":2})");
  REQUIRE(plain_q.ok());
  CHECK(plain_q.value().tensors[2].name == "model.layers.0.self_attn.q_proj.weight");
}

// Gemma 3's multimodal config, small enough to count by hand. Text (gemma3_text, head_dim 4):
// embed 16 x 8 = 128; a block of q 64, k 32, v 32, o 64, q_norm 4, k_norm 4, four norms 32 and
// gate/up/down 3 x 128 = 616; norm 8; tied: 752. Vision (SigLIP, 1 channel, 4 px in 2 px
// patches): patch conv [4, 1, 2, 2] 16 + bias 4, positions [4, 4] 16; a layer of two LayerNorms
// 16, k/v/q/out 4 x (16 + 4) = 80, fc1 32 + 8, fc2 32 + 4 = 172; post_layernorm 8; projector
// [4, 8] 32 + its norm 4: 252. Total 1,004.
constexpr const char* kHandGemma3 =
    R"({"model_type":"gemma3","text_config":{"vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,)"
    R"("num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"tie_word_embeddings":false},)"
    R"("vision_config":{"hidden_size":4,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"num_channels":1,)"
    R"("image_size":4,"patch_size":2,"vision_use_head":false}})";

TEST_CASE("Gemma 3's multimodal config: the text model under model.language_model beside the SigLIP tower") {
  auto m = FromText(kHandGemma3);
  REQUIRE_MESSAGE(m.ok(), (m.ok() ? "" : m.error().message));
  const ModelSpec& g = m.value();
  CHECK(g.ParamsTotal() == 1004);
  CHECK(g.VisionParams() == 252);
  CHECK(g.tensors.size() == 23 + 1 + 13 + 1);  // tower, embedding, block, norm; lm_head tied by the top-level key
  CHECK(g.tensors.front().name == "model.vision_tower.embeddings.patch_embedding.weight");
  CHECK(g.tensors.front().shape == std::vector<int64_t>{4, 1, 2, 2});
  CHECK(g.tensors[22].name == "model.multi_modal_projector.mm_soft_emb_norm.weight");
  CHECK(g.tensors[21].shape == std::vector<int64_t>{4, 8});  // mm_input_projection_weight [vision hidden, text hidden]
  for (size_t i = 0; i < g.tensors.size(); ++i) CHECK(g.tensors[i].image_only == (i < 23));
  CHECK(g.tensors[23].name == "model.language_model.embed_tokens.weight");
  CHECK(g.tensors.back().name == "model.language_model.norm.weight");
  CHECK(g.arch.vision.layer_class == "SiglipEncoderLayer");
  // text-only steps: the tower adds no parameter a token multiplies by
  CHECK(g.ActiveParamsPerToken() == 752);
  std::string untied = kHandGemma3;
  untied.replace(untied.rfind('}'), 1, R"(,"tie_word_embeddings":false})");
  CHECK(FromText(untied).value().tensors.back().name == "lm_head.weight");
  std::string pooled = kHandGemma3;
  pooled.replace(pooled.find(R"("vision_use_head":false)"), 23, R"("vision_use_head":true)");
  // probe 4, in_proj [12, 4] 48 + 12, out_proj 16 + 4, layernorm 8, mlp 40 + 36
  CHECK(FromText(pooled).value().VisionParams() == 252 + 4 + 60 + 20 + 8 + 76);
}

TEST_CASE("Llama 4's multimodal config loads its text model, as AutoModelForCausalLM builds it") {
  const std::string text = R"({"vocab_size":64,"hidden_size":16,"intermediate_size":8,"intermediate_size_mlp":24,"num_hidden_layers":2,)"
                           R"("num_attention_heads":2,"num_key_value_heads":1,"head_dim":8,"num_local_experts":2})";
  auto outer = FromText(R"({"model_type":"llama4","text_config":)" + text + R"(,"vision_config":{"hidden_size":32},"tie_word_embeddings":true})");
  auto inner = FromText(R"({"model_type":"llama4_text",)" + text.substr(1));
  REQUIRE(outer.ok());
  REQUIRE(inner.ok());
  CHECK(outer.value().ParamsTotal() == inner.value().ParamsTotal());
  CHECK(outer.value().VisionParams() == 0);
  CHECK(outer.value().tensors.back().name == "lm_head.weight");  // text_config's tie_word_embeddings (false), not the outer one
}

TEST_CASE("bad model configs give one-line errors naming the problem") {
  auto no_type = FromText(R"({"hidden_size": 64})");
  REQUIRE_FALSE(no_type.ok());
  CHECK(no_type.error().message == "inline.json: key 'model_type': missing");

  auto bad_type = FromText(R"({"model_type": "bert"})");
  REQUIRE_FALSE(bad_type.ok());
  CHECK(bad_type.error().message.find("unsupported model type 'bert'") != std::string::npos);

  auto negative = FromText(R"({"model_type":"llama","hidden_size":-8})");
  REQUIRE_FALSE(negative.ok());
  CHECK(negative.error().message == "inline.json: key 'hidden_size': must be between 1 and 1048576, got -8");

  auto mistyped = FromText(R"({"model_type":"llama","num_hidden_layers":"32"})");
  REQUIRE_FALSE(mistyped.ok());
  CHECK(mistyped.error().message == "inline.json: key 'num_hidden_layers': expected an integer, got string \"32\"");

  auto indivisible = FromText(R"({"model_type":"llama","hidden_size":100,"num_attention_heads":3})");
  REQUIRE_FALSE(indivisible.ok());
  CHECK(indivisible.error().message.find("not divisible by 3 attention heads") != std::string::npos);

  auto kv = FromText(R"({"model_type":"llama","hidden_size":96,"num_attention_heads":6,"num_key_value_heads":4})");
  REQUIRE_FALSE(kv.ok());
  CHECK(kv.error().message.find("6 attention heads are not divisible by 4 key/value heads") != std::string::npos);

  auto experts = FromText(R"({"model_type":"mixtral","num_local_experts":2,"num_experts_per_tok":3})");
  REQUIRE_FALSE(experts.ok());

  auto absurd = FromText(R"({"model_type":"gpt2","n_layer":1000000})");
  REQUIRE_FALSE(absurd.ok());
  CHECK(absurd.error().message.find("'n_layer'") != std::string::npos);

  auto theta = FromText(R"({"model_type":"llama","rope_theta":-1})");
  REQUIRE_FALSE(theta.ok());
  CHECK(theta.error().message == "inline.json: key 'rope_theta': must be positive and at most 1000000000000, got -1");
  auto eps = FromText(R"({"model_type":"mistral","rms_norm_eps":0.5})");
  REQUIRE_FALSE(eps.ok());
  CHECK(eps.error().message == "inline.json: key 'rms_norm_eps': must be positive and at most 0.1, got 0.5");
  auto rotary = FromText(R"({"model_type":"phi3","partial_rotary_factor":1.5})");
  REQUIRE_FALSE(rotary.ok());
  CHECK(rotary.error().message == "inline.json: key 'partial_rotary_factor': must be positive and at most 1, got 1.5");

  auto not_object = FromText("[1, 2]");
  REQUIRE_FALSE(not_object.ok());
}

TEST_CASE("unknown catalog ids suggest the closest ones") {
  auto m = LoadModel("llama-2-7");
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().kind == Error::Kind::kBadInput);
  CHECK(m.error().message.starts_with("unknown model 'llama-2-7' (did you mean llama-2-7b"));

  // a downloaded model's directory stands for its config.json and is named after the directory
  const auto dir = std::filesystem::temp_directory_path() / "fsdpkit-model-dir" / "Llama-Test";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(DataDir() + "/models/tiny-llama.json", dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  auto from_dir = LoadModel(dir.string());
  REQUIRE(from_dir.ok());
  CHECK(from_dir.value().id == "Llama-Test");
  CHECK(from_dir.value().ParamsTotal() == LoadModel("tiny-llama").value().ParamsTotal());
  CHECK(LoadModel(dir.string() + "/").value().id == "Llama-Test");  // a trailing slash, as shells complete it
  std::filesystem::remove(dir / "config.json");
  CHECK(LoadModel(dir.string()).error().message == "model directory '" + dir.string() + "' has no config.json");
  std::filesystem::remove_all(dir.parent_path());

  auto missing = LoadModel("no/such/config.json");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().message == "model file 'no/such/config.json' does not exist");
}

TEST_CASE("CountInventory counts what BuildInventory builds, for every catalog model") {
  for (const char* id : {"tiny-llama", "gpt2", "mixtral-8x7b", "qwen2.5-7b", "llama-3.1-8b", "mistral-7b"}) {
    CAPTURE(id);
    const ModelSpec m = LoadModel(id).value();
    const InventorySize size = CountInventory(m);
    CHECK(size.tensors == static_cast<double>(m.tensors.size()));
    CHECK(size.params == static_cast<double>(m.ParamsTotal()));
  }
}

TEST_CASE("a config that would build more than 1e6 tensors is refused before building them") {
  auto json = ParseJson(R"({"model_type": "mixtral", "num_local_experts": 4096, "num_hidden_layers": 10000})", "m.json").value();
  auto m = ModelFromHfConfig(json, "m", "m.json");
  REQUIRE_FALSE(m.ok());
  CHECK(m.error().message == "m.json: 10000 layers of mixtral would have 1.23e+08 parameter tensors and 7.22e+15 parameters; "
                             "the most a model may have is 1e+06 tensors and 1e+15 parameters");
}

}  // namespace
}  // namespace fsdp
