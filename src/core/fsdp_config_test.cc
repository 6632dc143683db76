#include "core/fsdp_config.h"

#include <doctest/doctest.h>

#include <cctype>
#include <string>

#include "core/testing/hand_llama.h"

namespace fsdp {
namespace {

using testing::HandLlama;

TEST_CASE("inconsistent configurations are rejected") {
  FsdpConfig c;
  c.gpus = 12;
  c.gpus_per_node = 8;
  auto w = BuildWorkload(HandLlama(), testing::GibGpu(), c);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().message == "--gpus 12 is not a whole number of nodes of 8 GPUs (--gpus-per-node)");

  c.gpus = 16;
  c.strategy = Strategy::kHybridShard;
  c.shard_group_size = 6;
  w = BuildWorkload(HandLlama(), testing::GibGpu(), c);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().message == "HYBRID_SHARD shard group of 6 GPUs does not divide --gpus 16");

  c.strategy = Strategy::kFullShard;
  w = BuildWorkload(HandLlama(), testing::GibGpu(), c);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().message.starts_with("--shard-group-size only applies to --strategy hybrid_shard"));

  FsdpConfig d;
  d.micro_batch = 0;
  CHECK_FALSE(BuildWorkload(HandLlama(), testing::GibGpu(), d).ok());
  d.micro_batch = 1;
  d.no_sync = true;
  CHECK_FALSE(BuildWorkload(HandLlama(), testing::GibGpu(), d).ok());
  d.no_sync = false;
  d.framework = Framework::kFsdp2;
  d.strategy = Strategy::kNoShard;
  CHECK_FALSE(BuildWorkload(HandLlama(), testing::GibGpu(), d).ok());
  FsdpConfig e;
  e.seq_len = 0;
  CHECK(BuildWorkload(HandLlama(), testing::GibGpu(), e).value().config.seq_len == 64);  // min(4096, max positions)
}

TEST_CASE("--transformers-version: releases parse to their loss path; malformed or too old ones are refused") {
  CHECK(ParseTransformersVersion("4.44.2").value() == TransformersVersion{4, 44});
  CHECK(ParseTransformersVersion("5.0.0.dev0").value() == TransformersVersion{5, 0});
  CHECK(ParseTransformersVersion("4.31").value() == TransformersVersion{4, 31});
  CHECK(ParseTransformersVersion("4.57.0rc1").value() == TransformersVersion{4, 57});
  CHECK(ParseTransformersVersion("4.44rc1").value() == TransformersVersion{4, 44});
  CHECK(ParseTransformersVersion("4.48.1.post2").value() == TransformersVersion{4, 48});
  for (const char* bad : {"", "4", "4.", "four.44", "4.x", "-4.44", "4.44.2 ", "99999.1", "4..44", "4.44...", "4.44.+", "4.44.abc",
                          "4.44rc", "4.44.2rc1x", "4.44.dev", "4.58", "6.0", "4.44.2.3"}) {
    auto v = ParseTransformersVersion(bad);
    REQUIRE_MESSAGE(!v.ok(), std::string(bad));
    CHECK(v.error().message.find("--transformers-version") != std::string::npos);
  }
  CHECK(ParseTransformersVersion("4.30.2").error().message.find("before 4.31") != std::string::npos);
  // RoPE tables per attention layer, read in the wheels: Llama to 4.40, Mistral 4.41, Qwen2 4.44, Mixtral 4.47
  CHECK(HasPerLayerRopeTables({4, 31}, "llama"));
  CHECK(HasPerLayerRopeTables({4, 40}, "llama"));
  CHECK_FALSE(HasPerLayerRopeTables({4, 41}, "llama"));
  CHECK(HasPerLayerRopeTables({4, 41}, "mistral"));
  CHECK_FALSE(HasPerLayerRopeTables({4, 42}, "mistral"));
  CHECK(HasPerLayerRopeTables({4, 44}, "qwen2"));
  CHECK_FALSE(HasPerLayerRopeTables({4, 45}, "qwen2"));
  CHECK(HasPerLayerRopeTables({4, 47}, "mixtral"));
  CHECK_FALSE(HasPerLayerRopeTables({4, 48}, "mixtral"));
  CHECK(HasCausalMaskBuffer({4, 38}, "llama"));
  CHECK_FALSE(HasCausalMaskBuffer({4, 37}, "llama"));
  CHECK_FALSE(HasCausalMaskBuffer({4, 39}, "llama"));
  CHECK_FALSE(HasCausalMaskBuffer({4, 38}, "mistral"));
  CHECK_FALSE(HasPerLayerRopeTables({4, 42}, "gemma2"));
  CHECK_FALSE(HasPerLayerRopeTables(TransformersVersion{}, "llama"));
  CHECK(HfLossOf({4, 31}, "llama") == HfLoss::kFp32Logits);
  CHECK(HfLossOf({4, 45}, "llama") == HfLoss::kFp32Logits);
  CHECK(HfLossOf({4, 46}, "llama") == HfLoss::kShiftedCopy);
  CHECK(HfLossOf({4, 48}, "llama") == HfLoss::kShiftedCopy);
  CHECK(HfLossOf({4, 49}, "llama") == HfLoss::kPaddedLabels);
  CHECK(HfLossOf(TransformersVersion{}, "llama") == HfLoss::kPaddedLabels);
  // MistralForCausalLM kept its own upcast and shift through 4.47 (modeling_mistral.py of 4.46.3, 4.47.1)
  CHECK(HfLossOf({4, 47}, "mistral") == HfLoss::kFp32Logits);
  CHECK(HfLossOf({4, 48}, "mistral") == HfLoss::kShiftedCopy);
  CHECK(HfLossOf({4, 47}, "qwen2") == HfLoss::kShiftedCopy);
  CHECK(TransformersVersionName({4, 9}) == "4.9");
}

TEST_CASE("--transformers-version refuses a model the release did not have, and torchtitan's profiles") {
  ModelSpec m = HandLlama();
  CHECK(TransformersRuledOut(m, {4, 31}).empty());
  m.model_type = "qwen3";
  CHECK(TransformersRuledOut(m, {4, 50}) == "--transformers-version 4.50: transformers has qwen3 models from 4.51 on");
  CHECK(TransformersRuledOut(m, {4, 51}).empty());
  m.model_type = "gpt2";
  CHECK(TransformersRuledOut(m, {4, 47}).find("GPT-2's loss before 4.48") != std::string::npos);
  CHECK(TransformersRuledOut(m, {4, 48}).empty());
  FsdpConfig c;
  c.transformers = {4, 40};
  c.seq_len = 8;
  CHECK(BuildWorkload(HandLlama(), testing::GibGpu(), c).ok());
  c.transformers = {4, 33};  // no FlashAttention-2 nor SDPA for Llama yet
  auto eager_only = BuildWorkload(HandLlama(), testing::GibGpu(), c);
  REQUIRE_FALSE(eager_only.ok());
  CHECK(eager_only.error().message == "--transformers-version 4.33 runs attention eagerly (FlashAttention-2 from 4.34, SDPA from 4.36); add --attention eager");
  c.attention = Attention::kEager;
  CHECK(BuildWorkload(HandLlama(), testing::GibGpu(), c).ok());
  c.attention = Attention::kFlash;
  c.transformers = {4, 40};
  c.impl = Impl::kTorchtitan;
  c.framework = Framework::kFsdp2;
  auto w = BuildWorkload(HandLlama(), testing::GibGpu(), c);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().message == "--impl torchtitan runs torchtitan's model and loss; --transformers-version does not apply");
}

TEST_CASE("--use-cache: the tuple cache of 4.31 to 4.35; with a loop that keeps outputs, every block checkpointed") {
  FsdpConfig c;
  c.seq_len = 8;
  c.attention = Attention::kEager;
  c.use_cache = true;
  const auto message = [&] {
    auto w = BuildWorkload(HandLlama(), testing::GibGpu(), c);
    return w.ok() ? std::string() : w.error().message;
  };
  CHECK(message() ==
        "--use-cache is modelled for transformers 4.31 to 4.35 (each layer returns its key and value states as a tuple), not 5.24: "
        "from 4.36 the layers write a DynamicCache; add --transformers-version 4.31 to 4.35");
  c.transformers = {4, 36};
  CHECK(message().find("not 4.36") != std::string::npos);
  for (TransformersVersion v : {TransformersVersion{4, 31}, TransformersVersion{4, 35}}) {
    c.transformers = v;
    CHECK(message().empty());
  }
  c.loop_holds_outputs = true;
  CHECK(message() == "--use-cache with --loop-holds-outputs is modelled with every block checkpointed (--ac full), not --ac none: "
                     "an un-checkpointed block's saved keys and values would outlive their backward");
  c.checkpointing = Checkpointing::kFull;
  CHECK(message().empty());
  c.ac_every = 2;
  CHECK(message().find("not --ac full --ac-every 2") != std::string::npos);
  FsdpConfig t;
  t.seq_len = 8;
  t.impl = Impl::kTorchtitan;
  t.framework = Framework::kFsdp2;
  t.use_cache = true;
  auto w = BuildWorkload(HandLlama(), testing::GibGpu(), t);
  REQUIRE_FALSE(w.ok());
  CHECK(w.error().message == "--impl torchtitan: torchtitan's model keeps no key/value cache; --use-cache does not apply");
}

TEST_CASE("wrap flag parsing") {
  FsdpConfig c;
  CHECK(ParseWrap("size:1e8", c).ok());
  CHECK(c.wrap == WrapPolicy::kSize);
  CHECK(c.wrap_min_params == 100'000'000);
  CHECK_FALSE(ParseWrap("size:-3", c).ok());
  CHECK_FALSE(ParseWrap("size:", c).ok());
  CHECK_FALSE(ParseWrap("layer", c).ok());
}

TEST_CASE("FSDP1 on one GPU runs every strategy as NO_SHARD; FSDP2 and larger worlds keep theirs") {
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kHybridShard}) {
    FsdpConfig c;
    c.gpus = 1;
    c.strategy = s;
    if (s == Strategy::kHybridShard) c.shard_group_size = 1;
    CHECK(ApplyFsdp1WorldOfOne(c));
    CHECK(c.strategy == Strategy::kNoShard);
    CHECK(c.shard_group_size == 0);
  }
  FsdpConfig no_shard;
  no_shard.gpus = 1;
  no_shard.strategy = Strategy::kNoShard;
  CHECK_FALSE(ApplyFsdp1WorldOfOne(no_shard));
  FsdpConfig two;
  two.gpus = 2;
  CHECK_FALSE(ApplyFsdp1WorldOfOne(two));
  CHECK(two.strategy == Strategy::kFullShard);
  FsdpConfig fsdp2;
  fsdp2.gpus = 1;
  fsdp2.framework = Framework::kFsdp2;
  CHECK_FALSE(ApplyFsdp1WorldOfOne(fsdp2));
  CHECK(fsdp2.strategy == Strategy::kFullShard);
}

TEST_CASE("names parse back to what they name; unknown names are refused with the choices") {
  for (Strategy s : {Strategy::kFullShard, Strategy::kShardGradOp, Strategy::kNoShard, Strategy::kHybridShard}) {
    std::string lower(StrategyName(s));
    for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    REQUIRE(ParseStrategy(lower).ok());
    CHECK(ParseStrategy(lower).value() == s);
  }
  for (Checkpointing a : {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kSelectiveOp, Checkpointing::kFull}) {
    CHECK(ParseCheckpointing(CheckpointingName(a)).value() == a);
  }
  for (Framework f : {Framework::kFsdp1, Framework::kFsdp2}) CHECK(ParseFramework(FrameworkName(f)).value() == f);
  for (BackwardPrefetch p : {BackwardPrefetch::kPre, BackwardPrefetch::kPost, BackwardPrefetch::kNone}) {
    CHECK(ParseBackwardPrefetch(BackwardPrefetchName(p)).value() == p);
  }
  for (Attention a : {Attention::kEager, Attention::kFlash}) CHECK(ParseAttention(AttentionName(a)).value() == a);
  CHECK_FALSE(ParseStrategy("zero3").ok());
  CHECK(ParseStrategy("zero3").error().message.find("zero3") != std::string::npos);
  CHECK_FALSE(ParseOptimizer("lion").ok());
  CHECK_FALSE(ParseFramework("fsdp3").ok());
}

TEST_CASE("shard group and replicas per strategy") {
  FsdpConfig c;
  c.gpus = 16;
  c.gpus_per_node = 8;
  REQUIRE(ResolveAndValidate(c, HandLlama(), testing::GibGpu()).ok());
  CHECK(ShardWorldSize(c) == 16);
  CHECK(ReplicaCount(c) == 1);
  c.strategy = Strategy::kNoShard;
  CHECK(ShardWorldSize(c) == 1);
  CHECK(ReplicaCount(c) == 16);
  c.strategy = Strategy::kHybridShard;
  REQUIRE(ResolveAndValidate(c, HandLlama(), testing::GibGpu()).ok());
  CHECK(c.shard_group_size == 8);  // one node by default
  CHECK(ShardWorldSize(c) == 8);
  CHECK(ReplicaCount(c) == 2);
}

TEST_CASE("which blocks run under activation checkpointing") {
  FsdpConfig c;
  CHECK_FALSE(BlockCheckpointed(c, 0));
  c.checkpointing = Checkpointing::kSelective;
  CHECK(BlockCheckpointed(c, 0));
  c.checkpointing = Checkpointing::kFull;
  c.ac_every = 3;  // blocks 2, 5, 8, ... counting from 0
  CHECK_FALSE(BlockCheckpointed(c, 0));
  CHECK_FALSE(BlockCheckpointed(c, 1));
  CHECK(BlockCheckpointed(c, 2));
  CHECK(BlockCheckpointed(c, 5));
  CHECK(OpCheckpointingModelled(HandLlama()));
}

}  // namespace
}  // namespace fsdp
