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

}  // namespace
}  // namespace fsdp
