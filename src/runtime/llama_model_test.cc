#include "runtime/llama_model.h"

#include <doctest/doctest.h>

#include "core/lora.h"
#include "runtime/gradient_check.h"

#include <algorithm>
#include <random>

#include <fmt/format.h>

namespace fsdp::runtime {
namespace {

// One block of a llama, qwen2 (q/k/v biases) or qwen3 (per-head q/k norms) against finite
// differences of sum(y * r).
// `keys`: more config keys (qwen3_moe's experts).
void CheckBlockGradients(const std::string& type, const std::string& keys = "") {
  CAPTURE(type);
  CAPTURE(keys);
  const bool qkv_bias = type == "qwen2";
  // vocab 11, hidden 8, inner 12, 4 heads of 2, 2 kv heads, 1 layer
  auto config = ParseJson(fmt::format(R"({{"model_type": "{}", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "head_dim": 2,
                                           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1{}}})",
                                      type, keys),
                          "block.json");
  REQUIRE(config.ok());
  auto model = ModelFromHfConfig(config.value(), "block", "block.json");
  REQUIRE(model.ok());
  auto dims = DimsOf(model.value(), 3);
  REQUIRE(dims.ok());
  const LlamaDims& d = dims.value();
  REQUIRE(d.head_dim == 2);
  REQUIRE(d.qkv_bias == qkv_bias);
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 0.3f);
  std::vector<float> params(static_cast<size_t>(d.BlockNumel()));
  for (auto& v : params) v = n(rng);
  const auto o = d.Offsets();
  REQUIRE(d.qk_norm == (type == "qwen3" || type == "qwen3_moe"));
  for (int64_t i = 0; i < d.hidden; ++i) params[o.in_norm + i] = params[o.post_norm + i] = 1.0f + 0.1f * n(rng);
  for (int64_t i = 0; d.qk_norm && i < d.head_dim; ++i) params[o.q_norm + i] = params[o.k_norm + i] = 1.0f + 0.1f * n(rng);
  const int64_t batch = 2, seq = 3;
  Mat x(batch * seq, d.hidden), r(batch * seq, d.hidden);
  for (Eigen::Index i = 0; i < x.size(); ++i) { x.data()[i] = n(rng); r.data()[i] = n(rng); }
  auto loss = [&] { return static_cast<double>(BlockForward(d, params.data(), x, batch, seq, nullptr).cwiseProduct(r).sum()); };
  BlockCache cache;
  BlockForward(d, params.data(), x, batch, seq, &cache);
  std::vector<float> grads(params.size(), 0.0f);
  Mat dx = BlockBackward(d, params.data(), grads.data(), r, cache, batch, seq);
  CheckGradient(params.data(), static_cast<int64_t>(params.size()), grads.data(), loss, rng, 40, "params");
  CheckGradient(x.data(), x.size(), dx.data(), loss, rng, 20, "x");
  if (d.qkv_bias) {  // every bias element: they are too few for the random sample above
    const int64_t qd = d.heads * d.head_dim, kvd = d.kv_heads * d.head_dim;
    CheckGradient(params.data() + o.bq, qd, grads.data() + o.bq, loss, rng, 2 * static_cast<int>(qd), "q bias");
    CheckGradient(params.data() + o.bk, kvd, grads.data() + o.bk, loss, rng, 2 * static_cast<int>(kvd), "k bias");
    CheckGradient(params.data() + o.bv, kvd, grads.data() + o.bv, loss, rng, 2 * static_cast<int>(kvd), "v bias");
  }
  if (d.experts > 0) {  // every router weight; the experts' in the sample above
    const int64_t router = d.experts * d.hidden;
    CheckGradient(params.data() + o.router, router, grads.data() + o.router, loss, rng, 2 * static_cast<int>(router), "router");
    const int64_t pairs = batch * seq * d.experts_per_token;  // probs, weights, (gate, up, mid), expert outputs; token, slot; pair_begin
    CHECK(cache.SavedBytes() == BlockCache{cache.x, cache.n1, cache.q, cache.k, cache.v, cache.attn, cache.x2, cache.n2, {}, {}, {},
                                           cache.inv1, cache.inv2, cache.q_heads, cache.k_heads, cache.inv_q, cache.inv_k, cache.probs}.SavedBytes() +
                                    4 * (batch * seq * d.experts + batch * seq * d.experts_per_token + 3 * pairs * d.inner + pairs * d.hidden) +
                                    4 * 2 * pairs + 8 * (d.experts + 1));
  } else if (d.qk_norm) {  // every norm weight
    CheckGradient(params.data() + o.q_norm, d.head_dim, grads.data() + o.q_norm, loss, rng, 2 * static_cast<int>(d.head_dim), "q_norm");
    CheckGradient(params.data() + o.k_norm, d.head_dim, grads.data() + o.k_norm, loss, rng, 2 * static_cast<int>(d.head_dim), "k_norm");
    CHECK(cache.SavedBytes() == BlockCache{cache.x, cache.n1, cache.q, cache.k, cache.v, cache.attn, cache.x2, cache.n2, cache.gate,
                                           cache.up, cache.mid, cache.inv1, cache.inv2, {}, {}, {}, {}, cache.probs}.SavedBytes() +
                                    4 * (batch * seq * (d.heads + d.kv_heads) * (d.head_dim + 1)));
  }
}

TEST_CASE("a whole decoder block: backward against finite differences") { CheckBlockGradients("llama"); }
TEST_CASE("a block with q/k/v biases (Qwen2): backward against finite differences") { CheckBlockGradients("qwen2"); }
TEST_CASE("a block with per-head q/k norms (Qwen3): backward against finite differences") { CheckBlockGradients("qwen3"); }
// 4 experts of 6, top 2, with and without dividing the chosen weights by their sum
TEST_CASE("a block with routed experts (Qwen3-MoE): backward against finite differences") {
  for (const char* norm : {"true", "false"}) {
    CheckBlockGradients("qwen3_moe", fmt::format(R"(, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6, "norm_topk_prob": {})", norm));
  }
}

// LoRA r=2 on every projection of a Qwen2 block (biases too), alpha 3: the adapters' gradients and
// the input's against finite differences, the frozen base's gradients never written, the adapters
// in a buffer of their own (as the engine's trained group holds them under FSDP2); without
// lora_dropout and with p = 0.4 (the masks fixed by their key, as a recompute draws them).
TEST_CASE("a LoRA block: the adapters' and the input's gradients against finite differences, the base untouched") {
  double dropout = 0;
  SUBCASE("lora_dropout 0") {}
  SUBCASE("lora_dropout 0.4") { dropout = 0.4; }
  const DropoutKey key{.seed = 5, .first_sequence = 7, .block = 2};
  auto config = ParseJson(R"({"model_type": "qwen2", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 12, "head_dim": 2,
                              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1})",
                          "block.json");
  REQUIRE(config.ok());
  auto model = ModelFromHfConfig(config.value(), "block", "block.json");
  REQUIRE(model.ok());
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = "all-linear";
  REQUIRE(ApplyLora(model.value(), lora).ok());
  const ModelSpec& m = model.value();
  // the engine's layout: the block's own tensors packed in one buffer, its adapters in another
  std::vector<int64_t> offset(m.tensors.size(), 0);
  int64_t base_numel = 0, adapter_numel = 0;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    if (m.tensors[t].block != 0) continue;
    int64_t& next = m.tensors[t].trainable ? adapter_numel : base_numel;
    offset[t] = next;
    next += m.tensors[t].numel();
  }
  auto dims = DimsOf(m, 3);
  REQUIRE(dims.ok());
  LlamaDims d = dims.value();
  SetBlockLayout(m, [&offset](int t) { return offset[static_cast<size_t>(t)]; }, d);
  d.lora_scale = 1.5f;
  d.lora_dropout = dropout;
  CHECK(d.lora_rank == 2);
  CHECK(d.base_frozen);
  CHECK(d.BlockNumel() == base_numel + adapter_numel);
  // in = 8 for q, k, v, gate, up; o's in is 8 (4 heads x 2), down's 12: A (2, in), B (out, 2)
  CHECK(adapter_numel == 2 * (8 + 8) + 2 * (8 + 4) * 2 + 2 * (8 + 8) + 2 * (8 + 12) * 2 + 2 * (12 + 8));
  CHECK(d.lora[LlamaDims::kQ].a == 0);
  CHECK(d.lora[LlamaDims::kQ].b == 16);
  CHECK(d.lora[LlamaDims::kK].a == 32);
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0.0f, 0.3f);
  std::vector<float> base(static_cast<size_t>(base_numel)), adapters(static_cast<size_t>(adapter_numel));
  for (auto& v : base) v = n(rng);
  for (auto& v : adapters) v = n(rng);  // lora_B non-zero, so that lora_A's gradient is too
  const auto o = d.Offsets();
  for (int64_t i = 0; i < d.hidden; ++i) base[o.in_norm + i] = base[o.post_norm + i] = 1.0f + 0.1f * n(rng);
  const int64_t batch = 2, seq = 3;
  Mat x(batch * seq, d.hidden), r(batch * seq, d.hidden);
  for (Eigen::Index i = 0; i < x.size(); ++i) { x.data()[i] = n(rng); r.data()[i] = n(rng); }
  const BlockWeights weights(base.data(), adapters.data());
  auto loss = [&] { return static_cast<double>(BlockForward(d, weights, x, batch, seq, nullptr, key).cwiseProduct(r).sum()); };
  BlockCache cache;
  BlockForward(d, weights, x, batch, seq, &cache, key);
  std::vector<float> base_grads(base.size(), 0.0f), adapter_grads(adapters.size(), 0.0f);
  Mat dx = BlockBackward(d, weights, BlockGrads(base_grads.data(), adapter_grads.data()), r, cache, batch, seq);
  CheckGradient(adapters.data(), adapter_numel, adapter_grads.data(), loss, rng, 2 * static_cast<int>(adapter_numel), "adapters");
  CheckGradient(x.data(), x.size(), dx.data(), loss, rng, 20, "x");
  CHECK(std::all_of(base_grads.begin(), base_grads.end(), [](float g) { return g == 0.0f; }));
  // x A^T of every projection saved: 7 x (T, 2); with dropout each one's dropout(x) (T, in) fp32 and
  // its mask, a byte an element: in = 8 for q, k, v, o, gate, up and 12 for down
  CHECK(cache.SavedBytes() == BlockCache{cache.x, cache.n1, cache.q, cache.k, cache.v, cache.attn, cache.x2, cache.n2, cache.gate,
                                         cache.up, cache.mid, cache.inv1, cache.inv2, {}, {}, {}, {}, cache.probs}.SavedBytes() +
                                  4 * 7 * batch * seq * 2 + (dropout > 0 ? (4 + 1) * batch * seq * (6 * 8 + 12) : 0));
}

// nn.Dropout(0.4)'s masks: dropout(x) = x keep / 0.6; a sequence's mask depends on its index in the
// run, not on the rows around it (a rank holding sequence 8 alone draws what a rank holding 7 and 8
// draws for it), and differs between blocks and projections; about 60% kept.
TEST_CASE("LoRA dropout's masks follow the sequence, the block and the projection") {
  const int64_t seq = 3, features = 5;
  Mat x(2 * seq, features);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = 1.0f + static_cast<float>(i);
  std::vector<uint8_t> keep_pair, keep_second, keep_other_block, keep_other_projection;
  const Mat pair = LoraDropoutForward({.seed = 5, .first_sequence = 7, .block = 2}, LlamaDims::kV, 0.4, x, seq, keep_pair);
  const Mat second = LoraDropoutForward({.seed = 5, .first_sequence = 8, .block = 2}, LlamaDims::kV, 0.4, x.bottomRows(seq), seq, keep_second);
  LoraDropoutForward({.seed = 5, .first_sequence = 7, .block = 3}, LlamaDims::kV, 0.4, x, seq, keep_other_block);
  LoraDropoutForward({.seed = 5, .first_sequence = 7, .block = 2}, LlamaDims::kK, 0.4, x, seq, keep_other_projection);
  for (Eigen::Index i = 0; i < x.size(); ++i) CHECK(pair.data()[i] == (keep_pair[static_cast<size_t>(i)] ? x.data()[i] * static_cast<float>(1.0 / (1.0 - 0.4)) : 0.0f));
  CHECK(std::equal(keep_second.begin(), keep_second.end(), keep_pair.begin() + seq * features));
  CHECK(second == pair.bottomRows(seq));
  CHECK(keep_other_block != keep_pair);
  CHECK(keep_other_projection != keep_pair);
  Mat big = Mat::Ones(1000 * seq, 100);
  std::vector<uint8_t> keep;
  LoraDropoutForward({.seed = 1}, LlamaDims::kQ, 0.4, big, seq, keep);
  const double kept = static_cast<double>(std::count(keep.begin(), keep.end(), 1)) / static_cast<double>(keep.size());
  CHECK(kept == doctest::Approx(0.6).epsilon(0.01));  // 300,000 draws: 0.0009 is one standard deviation of the fraction
}

TEST_CASE("the flat block layout matches the checkpoint inventory") {
  auto m = LoadModel("tiny-llama");
  REQUIRE(m.ok());
  auto d = DimsOf(m.value(), 64);
  REQUIRE(d.ok());
  CHECK(d.value().BlockNumel() == m.value().BlockParams(0));
  auto qwen = LoadModel("qwen2.5-7b");  // q/k/v biases, each right after its weight
  REQUIRE(qwen.ok());
  const LlamaDims q = DimsOf(qwen.value(), 64).value();
  CHECK(q.BlockNumel() == qwen.value().BlockParams(0));
  const auto o = q.Offsets();
  CHECK(o.bq == q.hidden + 3584 * 3584);  // after input_layernorm and q_proj.weight
  CHECK(o.wk == o.bq + 3584);
  CHECK(o.bv == o.wv + 512 * 3584);       // 4 kv heads x 128
  CHECK(o.wo == o.bv + 512);
  auto moe = LoadModel("qwen3-30b-a3b");  // 128 experts of 768, top 8; q/k norms of 128 before the MLP
  REQUIRE(moe.ok());
  const LlamaDims e = DimsOf(moe.value(), 64).value();
  CHECK(e.BlockNumel() == moe.value().BlockParams(0));
  CHECK(e.experts == 128);
  CHECK(e.experts_per_token == 8);
  CHECK(e.norm_topk);
  CHECK(e.inner == 768);
  const auto eo = e.Offsets();
  CHECK(eo.router == eo.post_norm + 2048);
  CHECK(eo.experts_gate_up == eo.router + 128 * 2048);
  CHECK(eo.experts_down == eo.experts_gate_up + 128 * 2 * 768 * 2048);
  CHECK(eo.experts_down + 128 * 2048 * 768 == e.BlockNumel());
  auto gpt2 = LoadModel("gpt2");
  CHECK_FALSE(DimsOf(gpt2.value(), 64).ok());
  for (const char* routed : {"mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"}) {  // another router, dense layers, biased experts
    auto other = LoadModel(routed);
    REQUIRE(other.ok());
    CHECK_FALSE(DimsOf(other.value(), 64).ok());
  }
}

// Expected values: transformers 5.24's ROPE_INIT_FUNCTIONS (float32) on the same configurations.
TEST_CASE("RoPE frequencies follow transformers' rope_scaling types") {
  auto llama31 = LoadModel("llama-3.1-8b");  // llama3: factor 8, bands 8192 and 2048, theta 500000
  REQUIRE(llama31.ok());
  auto inv = RopeInverseFrequencies(llama31.value(), 4096);
  REQUIRE(inv.ok());
  REQUIRE(inv.value().size() == 64);
  const std::vector<std::pair<int, double>> expected = {
      {0, 1.0}, {1, 0.8146172165870667}, {28, 0.0032114461064338684},  // short wavelengths: unchanged
      {29, 0.0021665706299245358}, {30, 0.0013718936825171113}, {34, 0.0001785077911335975},  // smoothed
      {35, 9.556212171446532e-05}, {63, 3.068925877869333e-07}};  // long wavelengths: divided by 8
  for (const auto& [i, value] : expected) CHECK(inv.value()[static_cast<size_t>(i)] == doctest::Approx(value).epsilon(1e-6));

  auto spec = [](const char* scaling) {
    return ModelFromHfConfig(Json::parse(fmt::format(R"({{"model_type":"llama","hidden_size":64,"num_attention_heads":4,
        "intermediate_size":128,"num_hidden_layers":1,"vocab_size":100,"max_position_embeddings":128,"rope_theta":10000.0,
        "rope_scaling":{}}})", scaling)), "t", "t.json").value();
  };
  auto linear = RopeInverseFrequencies(spec(R"({"rope_type":"linear","factor":4.0})"), 64).value();  // head_dim 16
  CHECK(linear[0] == 0.25);
  CHECK(linear[1] == doctest::Approx(0.07905694097280502).epsilon(1e-6));
  const ModelSpec dynamic = spec(R"({"type":"dynamic","factor":2.0})");
  auto within = RopeInverseFrequencies(dynamic, 64).value();  // up to max_position_embeddings: plain RoPE
  CHECK(within[1] == doctest::Approx(0.3162277638912201).epsilon(1e-6));
  auto beyond = RopeInverseFrequencies(dynamic, 512).value();  // NTK base for 4x the positions
  CHECK(beyond[1] == doctest::Approx(0.2394813746213913).epsilon(1e-6));
  CHECK(beyond[2] == doctest::Approx(0.05735132098197937).epsilon(1e-6));

  auto yarn = RopeInverseFrequencies(spec(R"({"rope_type":"yarn","factor":4.0})"), 64);
  REQUIRE_FALSE(yarn.ok());
  CHECK(yarn.error().message == "fsdp-run does not implement rope_scaling type 'yarn' (t)");
}

TEST_CASE("fsdp-run refuses a sequence longer than Mistral's sliding window") {
  auto mistral = LoadModel("mistral-7b");  // sliding_window 4096
  REQUIRE(mistral.ok());
  CHECK(DimsOf(mistral.value(), 4096).ok());
  auto longer = DimsOf(mistral.value(), 4097);
  REQUIRE_FALSE(longer.ok());
  CHECK(longer.error().message == "--seq-len 4097 exceeds mistral-7b's sliding_window 4096: fsdp-run's attention is fully causal");
}

}  // namespace
}  // namespace fsdp::runtime
