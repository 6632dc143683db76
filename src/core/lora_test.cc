#include "core/lora.h"

#include <doctest/doctest.h>

#include "core/testing/hand_llama.h"
#include "core/workload.h"

namespace fsdp {
namespace {

LoraConfig Lora(int64_t rank, const char* targets = "") {
  LoraConfig l;
  l.rank = rank;
  l.targets = targets;
  return l;
}

int64_t Trainable(const ModelSpec& m) {
  int64_t n = 0;
  for (const TensorSpec& t : m.tensors) n += t.trainable ? t.numel() : 0;
  return n;
}

const TensorSpec* Find(const ModelSpec& m, const std::string& name) {
  for (const TensorSpec& t : m.tensors) if (t.name == name) return &t;
  return nullptr;
}

TEST_CASE("LoRA on peft's default targets: adapters beside q_proj and v_proj, everything else frozen") {
  // the hand llama (h 8, 1 kv head of 4): per block q: A [2, 8] + B [8, 2] = 32, v: A [2, 8] +
  // B [4, 2] = 24; two blocks 112 trainable of 1,448 + 112
  ModelSpec m = testing::HandLlama();
  REQUIRE(ApplyLora(m, Lora(2)).ok());
  CHECK(m.ParamsTotal() == 1448 + 112);
  CHECK(Trainable(m) == 112);
  const TensorSpec* base = Find(m, "model.layers.0.self_attn.q_proj.base_layer.weight");
  const TensorSpec* a = Find(m, "model.layers.0.self_attn.q_proj.lora_A.default.weight");
  const TensorSpec* b = Find(m, "model.layers.1.self_attn.v_proj.lora_B.default.weight");
  REQUIRE((base && a && b));
  CHECK_FALSE(base->trainable);
  CHECK(a->shape == std::vector<int64_t>{2, 8});
  CHECK(b->shape == std::vector<int64_t>{4, 2});
  CHECK(Find(m, "model.layers.0.self_attn.k_proj.weight") != nullptr);  // untargeted: no base_layer
  CHECK_FALSE(Find(m, "model.embed_tokens.weight")->trainable);
  CHECK_FALSE(Find(m, "lm_head.weight")->trainable);
  // the counting without building agrees
  const InventorySize count = CountInventory(m);
  CHECK(count.tensors == static_cast<double>(m.tensors.size()));
  CHECK(count.params == static_cast<double>(m.ParamsTotal()));
}

TEST_CASE("all-linear: every linear of the blocks; ranks up to each layer's width") {
  // per block q 32, k A [2, 8] + B [4, 2] = 24, v 24, o 32, gate and up A [2, 8] + B [16, 2] = 48
  // each, down A [2, 16] + B [8, 2] = 48: 256
  ModelSpec m = testing::HandLlama();
  REQUIRE(ApplyLora(m, Lora(2, "all-linear")).ok());
  CHECK(Trainable(m) == 2 * 256);
  // k_proj is 8 -> 4: rank 5 is above its width
  ModelSpec wide = testing::HandLlama();
  const Status s = ApplyLora(wide, Lora(5, "all-linear"));
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().message.find("self_attn.k_proj (8 x 4)") != std::string::npos);
  ModelSpec q_only = testing::HandLlama();
  CHECK(ApplyLora(q_only, Lora(5, "q_proj")).ok());  // q is 8 x 8
}

TEST_CASE("LoRA on Gemma 3's multimodal model: peft adapts the vision tower's linears the targets name") {
  auto json = ParseJson(R"({"model_type":"gemma3","text_config":{"vocab_size":16,"hidden_size":8,"intermediate_size":16,)"
                        R"("num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"head_dim":4},)"
                        R"("vision_config":{"hidden_size":4,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,)"
                        R"("num_channels":1,"image_size":4,"patch_size":2,"vision_use_head":false}})",
                        "gemma3.json");
  REQUIRE(json.ok());
  ModelSpec m = ModelFromHfConfig(json.value(), "g3", "gemma3.json").value();
  ModelSpec q = m;
  REQUIRE(ApplyLora(q, Lora(2, "q_proj")).ok());
  // text q_proj: A [2, 8] + B [8, 2] = 32; the tower's q_proj: A [2, 4] + B [4, 2] = 16
  CHECK(q.ParamsTrainable() == 48);
  const TensorSpec* a = Find(q, "model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.default.weight");
  REQUIRE(a != nullptr);
  CHECK(a->image_only);
  CHECK(Find(q, "model.vision_tower.encoder.layers.0.self_attn.k_proj.weight")->trainable == false);
  CHECK(AdaptedModules(q.arch) == std::vector<std::string>{"self_attn.q_proj"});
  FsdpConfig c;
  c.gpus = 1;
  c.framework = Framework::kFsdp2;
  c.lora = Lora(2, "q_proj");
  // FSDP2: the tower's adapters get no gradient in a text-only step
  CHECK(BuildWorkload(m, testing::GibGpu(), c).value().GradShardNumelTotal() == 32);
  ModelSpec all = m;
  REQUIRE(ApplyLora(all, Lora(2, "all-linear")).ok());
  // text: q 32, k 24, v 24, o 32, gate 48, up 48, down 48 = 256; tower: k/v/q/out 4 x 16, fc1 24, fc2 24 = 112
  CHECK(all.ParamsTrainable() == 256 + 112);
  // the tower's q/k/v_proj share the blocks' paths; its out_proj, fc1 and fc2 are its own
  CHECK(AdaptedModules(all.arch).size() == 7 + 3);
  ModelSpec wide = m;
  const Status too_wide = ApplyLora(wide, Lora(6, "q_proj"));
  CHECK(too_wide.error().message.find("--lora-rank 6 exceeds the width of g3's vision self_attn.q_proj (4 x 4)") != std::string::npos);
}

TEST_CASE("bad LoRA targets are refused with the reason") {
  auto message = [](const char* targets) {
    ModelSpec m = testing::HandLlama();
    const Status s = ApplyLora(m, Lora(2, targets));
    REQUIRE_FALSE(s.ok());
    return s.error().message;
  };
  CHECK(message("qproj").find("'qproj' names no module") != std::string::npos);
  CHECK(message("input_layernorm").find("is a norm") != std::string::npos);
  CHECK(message("lm_head").find("outside the decoder blocks") != std::string::npos);
  CHECK(message("q_proj,all-linear").find("all-linear stands alone") != std::string::npos);
  CHECK(message(" , ").find("names no module") != std::string::npos);
  auto mixtral = LoadModel("mixtral-8x7b");
  REQUIRE(mixtral.ok());
  const Status experts = ApplyLora(mixtral.value(), Lora(8, "w1"));
  REQUIRE_FALSE(experts.ok());
  CHECK(experts.error().message.find("routed experts") != std::string::npos);
}

TEST_CASE("matching is peft's: the whole path or a suffix after a dot") {
  ModelSpec m = testing::HandLlama();
  REQUIRE(ApplyLora(m, Lora(2, "self_attn.q_proj, mlp.down_proj")).ok());
  CHECK(Find(m, "model.layers.0.mlp.down_proj.lora_A.default.weight") != nullptr);
  CHECK(Find(m, "model.layers.0.self_attn.v_proj.weight") != nullptr);
  ModelSpec partial = testing::HandLlama();
  CHECK_FALSE(ApplyLora(partial, Lora(2, "proj")).ok());  // "q_proj" does not end in ".proj"
}

TEST_CASE("the wrap under LoRA: FSDP1 refuses mixed units without use_orig_params; peft's policy gives each adapter a unit") {
  FsdpConfig c;
  c.gpus = 2;
  c.lora = Lora(2);
  auto hw = LoadHardware("a100-80gb-sxm");
  REQUIRE(hw.ok());
  auto mixed = BuildWorkload(testing::HandLlama(), hw.value(), c);
  REQUIRE_FALSE(mixed.ok());
  CHECK(mixed.error().message.find("Must flatten tensors with uniform requires_grad") != std::string::npos);
  c.use_orig_params = true;
  auto orig = BuildWorkload(testing::HandLlama(), hw.value(), c);
  REQUIRE(orig.ok());
  // FSDP1 reduces a mixed unit's whole flat gradient: block 0's 648 elements (592 + 56, with
  // use_orig_params' 4-element alignment adding none: every size is a multiple of 4)
  CHECK(orig.value().units[1].grad_padded_numel == 648);
  c.use_orig_params = false;
  c.wrap = WrapPolicy::kPeft;
  auto peft = BuildWorkload(testing::HandLlama(), hw.value(), c);
  REQUIRE(peft.ok());
  // root + 2 blocks + 2 blocks x 2 targets x (lora_A, lora_B)
  CHECK(peft.value().units.size() == 11);
  for (const WrapUnit& u : peft.value().units) CHECK((u.trainable_numel == 0 || u.trainable_numel == u.numel));
  // a change of LoRA needs a new workload
  FsdpConfig other = c;
  other.lora.rank = 4;
  Workload w = peft.value();
  CHECK_FALSE(Reconfigure(w, hw.value(), other).ok());
}

TEST_CASE("LoRA and precision flags are validated") {
  auto hw = LoadHardware("a100-80gb-sxm");
  REQUIRE(hw.ok());
  auto refused = [&](FsdpConfig c) { return !BuildWorkload(testing::HandLlama(), hw.value(), c).ok(); };
  FsdpConfig c;
  c.lora.targets = "q_proj";
  CHECK(refused(c));  // targets without a rank
  c = {};
  c.lora.dropout = 0.1;
  CHECK(refused(c));
  c = {};
  c.lora = Lora(2);
  c.lora.dropout = 1.0;
  CHECK(refused(c));
  c = {};
  c.wrap = WrapPolicy::kPeft;
  CHECK(refused(c));  // peft's policy without adapters
  c = {};
  c.master_dtype = DType::kBf16;
  c.param_dtype = DType::kFp32;
  CHECK(refused(c));
  c.param_dtype = DType::kBf16;
  CHECK_FALSE(refused(c));
  c.master_dtype = DType::kFp16;
  CHECK(refused(c));
}

TEST_CASE("QLoRA: every linear of the blocks packed as NF4 in the storage dtype, its FLOPs and parameter count unchanged") {
  ModelSpec m = testing::HandLlama();
  LoraConfig l = Lora(2);
  l.qlora = true;
  REQUIRE(ApplyLora(m, l, DType::kBf16).ok());
  // (n + 1) / 4 bf16 elements for n 4-bit codes: gate [16, 8] -> 32, k [4, 8] -> 8
  const TensorSpec* gate = Find(m, "model.layers.1.mlp.gate_proj.weight");
  const TensorSpec* k = Find(m, "model.layers.0.self_attn.k_proj.weight");
  const TensorSpec* q = Find(m, "model.layers.0.self_attn.q_proj.base_layer.weight");
  REQUIRE((gate && k && q));
  CHECK(gate->shape == std::vector<int64_t>{32, 1});
  CHECK(gate->LogicalNumel() == 128);
  CHECK(k->numel() == 8);
  CHECK(q->nf4_numel == 64);
  CHECK(Find(m, "model.embed_tokens.weight")->nf4_numel == 0);  // the embedding, norms and lm_head stay as they are
  CHECK(Find(m, "lm_head.weight")->nf4_numel == 0);
  CHECK(m.ParamsTotal() == 1448 + 112);
  // stored: 1,448 less the blocks' 2 x 576 linear weights, plus 2 x 144 packed, plus the adapters
  int64_t stored = 0;
  for (const TensorSpec& t : m.tensors) stored += t.numel();
  CHECK(stored == 1448 - 2 * 576 + 2 * 144 + 112);
  // fp32 storage packs 8 codes an element
  ModelSpec fp32 = testing::HandLlama();
  REQUIRE(ApplyLora(fp32, l, DType::kFp32).ok());
  CHECK(Find(fp32, "model.layers.1.mlp.gate_proj.weight")->numel() == 16);
}

TEST_CASE("NF4 quantization state: fp32 absmax per 64, or uint8 with an fp32 absmax per 256 blocks, an offset and a dynamic map") {
  // Llama-2-7B's q_proj: 4096 x 4096 = 16,777,216 weights in 262,144 blocks
  CHECK(Nf4QuantStateBytes(16'777'216, false) == 262'144 * 4 + 64);
  CHECK(Nf4QuantStateBytes(16'777'216, true) == 64 + 4 + 262'144 + 1024 * 4 + 1024);
  CHECK(Nf4QuantStateTensorBytes(65, false) == std::vector<int64_t>{8, 64});  // 2 blocks
  CHECK(Nf4QuantStateTensorBytes(64 * 257, true) == std::vector<int64_t>{64, 4, 257, 8, 1024});
}

TEST_CASE("QLoRA on an MoE model is refused") {
  auto mixtral = LoadModel("mixtral-8x7b");
  REQUIRE(mixtral.ok());
  LoraConfig l = Lora(2);
  l.qlora = true;
  const Status s = ApplyLora(mixtral.value(), l);
  REQUIRE_FALSE(s.ok());
  CHECK(s.error().message.find("Linear4bit") != std::string::npos);
}

}  // namespace
}  // namespace fsdp
