#include "planner/activation_model.h"

#include "core/catalog.h"
#include "core/lora.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <limits>

namespace fsdp {
namespace {

ModelSpec Loaded(const char* id) {
  auto m = LoadModel(id);
  REQUIRE(m.ok());
  return m.value();
}

BlockActivations Profile(const char* id, int64_t seq, Attention attention, Checkpointing ac = Checkpointing::kNone) {
  FsdpConfig c;
  c.seq_len = seq;
  c.attention = attention;
  c.checkpointing = ac;
  return BlockActivationProfile(Loaded(id), c);
}

// A config of tests/data/hf_configs/.
ModelSpec TestConfig(const char* file) { return LoadModel(DataDir() + "/tests/data/hf_configs/" + file).value(); }

// bf16, eager attention at 2 x 256 tokens: how the saved_tensors_hooks measurements below ran.
FsdpConfig HookedConfig() {
  FsdpConfig c;
  c.seq_len = 256;
  c.micro_batch = 2;
  c.attention = Attention::kEager;
  return c;
}

TEST_CASE("GPT-2 block, eager, bf16: Korthikanti et al.'s sbh(34 + 5as/h) plus what HF really saves") {
  // Per token (h=768, a=12, s=1024, inner 3072, dropout 0.1): LayerNorms 2*(2h + 8), c_attn input 2h,
  // qkv 6h, probs 2as, dropout mask as + output 2as, c_proj input 2h, residual-dropout masks 2*h,
  // c_fc input 2h, NewGELU's four saved tensors 4*2*inner, c_proj input 2*inner = 106,000 bytes.
  BlockActivations a = Profile("gpt2", 1024, Attention::kEager);
  CHECK(a.FullBytes() == 106'000LL * 1024);
  // Korthikanti's count assumes a fused GELU that saves its input only; HF's Python NewGELU saves
  // four tensors of the MLP width (3 x 2 x inner bytes more per token), and LayerNorm's fp32
  // mean/rstd add 2 x 8 bytes per token.
  const int64_t korthikanti = 1024LL * 768 * (34 + 5 * 12 * 1024 / 768);
  CHECK(a.FullBytes() - korthikanti == 1024LL * (3 * 2 * 3072 + 16));
}

TEST_CASE("Llama-2-7B block at 4096 tokens: flash vs eager vs checkpointing") {
  // flash: norms 2*(4h + 4 + 2h + 2h), q/k/v 2h each, lse 4a, o_proj input (= SDPA output) 2h,
  // SwiGLU 4*2I = 24h + 8I + 136 = 186,504 bytes per token.
  CHECK(Profile("llama-2-7b", 4096, Attention::kFlash).FullBytes() == 186'504LL * 4096);
  // eager: k and v repeated (2h each), fp32 softmax 4as and bf16 probs 2as instead of SDPA's output.
  const int64_t eager_per_token = 24 * 4096 + 8 + 8 * 11008 + 6 * 32 * 4096;
  BlockActivations eager = Profile("llama-2-7b", 4096, Attention::kEager);
  CHECK(eager.FullBytes() == eager_per_token * 4096);
  // selective recomputation drops exactly the 6as scores; full keeps the block input (2h).
  CHECK(Profile("llama-2-7b", 4096, Attention::kEager, Checkpointing::kSelective).KeptBytes() == (eager_per_token - 6 * 32 * 4096) * 4096);
  CHECK(Profile("llama-2-7b", 4096, Attention::kFlash, Checkpointing::kFull).KeptBytes() == 2LL * 4096 * 4096);
}

TEST_CASE("--impl torchtitan: nn.RMSNorm's fused CUDA kernel saves its input and rstd, no fp32 copies") {
  // Llama-2-7B at 4096 tokens, flash (h 4096, a 32, I 11008): each norm saves its bf16 input 2h and
  // an fp32 rstd 4 where transformers' saves the fp32 input 4h, rsqrt 4 and the normalised input 2h;
  // the linears' inputs (the norms' outputs, 2h each) are the same: 186,504 - 2 * 4h bytes a token.
  FsdpConfig c;
  c.seq_len = 4096;
  c.impl = Impl::kTorchtitan;
  const ModelSpec m = Loaded("llama-2-7b");
  const BlockActivations titan = BlockActivationProfile(m, c);
  CHECK(titan.FullBytes() == (186'504LL - 8 * 4096) * 4096);
  CHECK(titan.full.front().name == "input_layernorm.in");
  CHECK(titan.full.front().is_block_input);
  // the first norm's input is the block's input, which a checkpointed block keeps: not recomputed
  c.checkpointing = Checkpointing::kFull;
  const BlockActivations full = BlockActivationProfile(m, c);
  CHECK(full.KeptBytes() == 2LL * 4096 * 4096);
  CHECK(SumBytes(full.recomputed) == titan.FullBytes() - 2LL * 4096 * 4096);
  c.checkpointing = Checkpointing::kSelectiveOp;
  const BlockActivations op = BlockActivationProfile(m, c);
  for (const SavedTensor& t : op.recomputed) CHECK(t.name != "input_layernorm.in");
  // the backward's norm term (transformers' fp32 [T, h] temporaries, 12h) is gone: held through the
  // block are the two hidden-state gradients 2 x 2h and SDPA's backward (dq, dk, dv 3 x 2h and the
  // fp32 dq accumulator 4h)
  CHECK(titan.BackwardWorkingBytes() == (2 * 2 * 4096 + 3 * 2 * 4096 + 4 * 4096) * 4096LL);
  // as six tensors, the allocator's blocks: the two hidden-state gradients, dq, dk, dv, the accumulator
  std::vector<int64_t> held;
  for (const SavedTensor& t : titan.backward_working) held.push_back(t.bytes / 4096);
  CHECK(held == std::vector<int64_t>{2 * 4096, 2 * 4096, 2 * 4096, 2 * 4096, 2 * 4096, 4 * 4096});
  // the MLP's moment: the incoming 2h and its three 2I gradients, beyond what is held
  CHECK(titan.mlp_working_bytes == (2 * 4096 + 3 * 2 * 11008 - (2 * 2 * 4096 + 3 * 2 * 4096 + 4 * 4096)) * 4096LL);
  // torchtitan's RoPE table: complex64 [seq, head_dim / 2], 8 x 4096 x 64 bytes; transformers' none
  CHECK(ModelBuffers(m, c) == std::vector<int64_t>{8LL * 4096 * 64});
  CHECK(ModelBuffers(m, FsdpConfig{}).empty());
}

TEST_CASE("--impl torchtitan on Qwen3: fused q/k norms, each layer's cast cos and sin, the fp32 rope_cache") {
  // qwen3-32b at 4096 tokens (h 5120; 64 heads and 8 kv heads of 128). transformers' q_norm saves
  // the fp32 q 4 x 8192, 64 rsqrt 4 and the normalised q 2 x 8192 a token, its k_norm the same of
  // k's 1024 features and 8 heads: 55,584 bytes; the fused kernel saves q itself 2 x 8192 and 64
  // rstd 4, k 2 x 1024 and 8 rstd 4: 18,720. The hidden-state norms save 8h less (as Llama's
  // above). FSDP2 casts the rope_cache argument of each block to bf16: [4096, 256] x 2 bytes,
  // whatever the micro-batch, kept under every checkpointing.
  FsdpConfig c;
  c.seq_len = 4096;
  const ModelSpec m = Loaded("qwen3-32b");
  const int64_t transformers = BlockActivationProfile(m, c).FullBytes();
  c.impl = Impl::kTorchtitan;
  const BlockActivations titan = BlockActivationProfile(m, c);
  CHECK(transformers - titan.FullBytes() == 4096LL * (8 * 5120 + 55'584 - 18'720) - 2LL * 4096 * 256);
  CHECK(ModelBuffers(m, c) == std::vector<int64_t>{4LL * 4096 * 2 * 128});  // rope_cache, fp32 [4096, 256]
  c.checkpointing = Checkpointing::kFull;
  CHECK(BlockActivationProfile(m, c).KeptBytes() == 2LL * 5120 * 4096 + 2LL * 4096 * 256);
  // op-level SAC keeps q's output, which the fused q_norm saves: held to q_norm's backward, not
  // freed after the recomputation as Llama's (which RoPE reads without saving)
  c.checkpointing = Checkpointing::kSelectiveOp;
  const BlockActivations op = BlockActivationProfile(m, c);
  for (const SavedTensor& t : op.recomputed) CHECK(t.name != "self_attn.q_norm.in");
  int kept_q = 0;
  for (const SavedTensor& t : op.kept) kept_q += t.name == "op_sac.q_proj_out" && !t.freed_after_recompute;
  CHECK(kept_q == 1);
  // in fp32 the cast returns the cache itself: nothing new saved
  c.checkpointing = Checkpointing::kNone;
  c.param_dtype = DType::kFp32;
  for (const SavedTensor& t : BlockActivationProfile(m, c).full) CHECK(t.name != "block.rope_cache_cast");
}

TEST_CASE("--impl torchtitan-2025-01: repeat_kv gives SDPA k and v of every head") {
  // llama-3.1-8b at 4096 tokens (32 heads, 8 kv heads of 128): its Python RMSNorm saves what
  // transformers' does, so the only difference is k and v at 4096 features instead of 1024:
  // 2 x 2 x 3072 bytes a token; under op-level SAC v's projection output is then read by the
  // copy only, freed once the recomputation has run, as eager attention's.
  FsdpConfig c;
  c.seq_len = 4096;
  const ModelSpec m = Loaded("llama-3.1-8b");
  const int64_t transformers = BlockActivationProfile(m, c).FullBytes();
  c.impl = Impl::kTorchtitan202501;
  CHECK(BlockActivationProfile(m, c).FullBytes() - transformers == 2LL * 2 * 3072 * 4096);
  c.checkpointing = Checkpointing::kSelectiveOp;
  int v_freed = 0;
  for (const SavedTensor& t : BlockActivationProfile(m, c).kept) v_freed += t.name == "op_sac.v_proj_out" && t.freed_after_recompute;
  CHECK(v_freed == 1);
}

TEST_CASE("GQA: flash keeps k/v at kv-head width, eager repeats them") {
  // llama-3.1-8b: h=4096, 8 kv heads of 128 -> k, v 1024 wide.
  BlockActivations flash = Profile("llama-3.1-8b", 1, Attention::kFlash);
  BlockActivations eager = Profile("llama-3.1-8b", 1, Attention::kEager);
  int64_t k_flash = 0, k_eager = 0;
  for (const auto& t : flash.full) if (t.name == "self_attn.k_rope") k_flash = t.bytes;
  for (const auto& t : eager.full) if (t.name == "self_attn.k_repeated") k_eager = t.bytes;
  CHECK(k_flash == 2 * 1024);
  CHECK(k_eager == 2 * 4096);
}

TEST_CASE("selective checkpointing with GQA keeps k and v at kv-head width") {
  // llama-3.1-8b, eager, per token: q 4096 wide, k/v 1024 wide (8 kv heads of 128), bf16.
  // The core recomputes repeat_kv's two 4096-wide expansions and the 32-head scores (6 * 32 * s);
  // the checkpointed function keeps its k and v inputs (2 * 1024 each).
  const int64_t seq = 4096;
  BlockActivations none = Profile("llama-3.1-8b", seq, Attention::kEager);
  BlockActivations selective = Profile("llama-3.1-8b", seq, Attention::kEager, Checkpointing::kSelective);
  CHECK(none.FullBytes() - selective.KeptBytes() == (2 * 2 * 4096 + 6 * 32 * seq - 2 * 2 * 1024) * seq);
  CHECK(SumBytes(selective.recomputed) == (2 * 2 * 4096 + 6 * 32 * seq) * seq);
  // without GQA nothing changes: k and v are saved as they are in both cases
  CHECK(Profile("llama-2-7b", seq, Attention::kEager).FullBytes() -
            Profile("llama-2-7b", seq, Attention::kEager, Checkpointing::kSelective).KeptBytes() == 6LL * 32 * seq * seq);
}

TEST_CASE("each saved tensor says which sub-layer makes it: the attention's die before the MLP's are made") {
  // Llama: the first norm and self_attn make the attention's; the norm before the MLP on, the MLP's
  for (const SavedTensor& t : Profile("llama-2-7b", 16, Attention::kEager).full) {
    CAPTURE(t.name);
    const bool mlp = t.name.starts_with("post_attention_layernorm.") || t.name.starts_with("mlp.");
    CHECK(mlp == t.mlp_sublayer);
    CHECK((mlp || t.name.starts_with("input_layernorm.") || t.name.starts_with("self_attn.") || t.name.starts_with("attn_core.")));
  }
  // Gemma 2 normalises the attention's output before the residual add (post_attention_layernorm,
  // the attention sub-layer's) and the MLP's input and output (pre_ and post_feedforward_layernorm)
  int attention = 0, mlp = 0;
  for (const SavedTensor& t : Profile("gemma-2-9b", 16, Attention::kEager).full) {
    CAPTURE(t.name);
    const bool in_mlp = t.name.starts_with("pre_feedforward_layernorm.") || t.name.starts_with("post_feedforward_layernorm.") ||
                        t.name.starts_with("mlp.");
    CHECK(in_mlp == t.mlp_sublayer);
    (t.mlp_sublayer ? mlp : attention) += 1;
    if (t.name.starts_with("post_attention_layernorm.")) CHECK_FALSE(t.mlp_sublayer);
  }
  CHECK(attention > 0);
  CHECK(mlp > 0);
}

TEST_CASE("Llama eager backward: the MLP's working gradients, then the softmax's moment with the rest freed") {
  // llama-2-7b at seq 4096, bf16 (h 4096, 32 heads of 128, I 11008), per token. The MLP's term:
  // incoming and outgoing hidden-state gradients 2 x 2h and the norms' fp32 backward (12h; the
  // attention's is the softmax's moment) held through the block; the MLP's moment (the incoming
  // 2h and SwiGLU's 3 x 2I) beyond them.
  const BlockActivations a = Profile("llama-2-7b", 4096, Attention::kEager);
  CHECK(a.BackwardWorkingBytes() == (2 * 2 * 4096 + 12 * 4096) * 4096);
  CHECK(a.mlp_working_bytes == (2 * 4096 + 3 * 2 * 11008 - (2 * 2 * 4096 + 12 * 4096)) * 4096);
  // The softmax's moment: the residual gradient 2h, v's gradient 2h (32 x 128 = h), two fp32
  // gradients of the fp32 softmax's output, 2 x 4as, and on CUDA the kernel's grad * output, 4as.
  CHECK(a.SoftmaxBackwardBytes() == (2 * 4096 + 2 * 4096 + 3 * 4LL * 32 * 4096) * 4096);
  // one tensor each, in the order autograd makes them (the caching allocator sees five blocks)
  REQUIRE(a.softmax_backward.size() == 5);
  CHECK(a.softmax_backward[0].bytes == 2LL * 4096 * 4096);
  CHECK(a.softmax_backward[1].bytes == 2LL * 4096 * 4096);
  CHECK(a.softmax_backward[2].bytes == 4LL * 32 * 4096 * 4096);
  CHECK(a.softmax_backward[3].bytes == 4LL * 32 * 4096 * 4096);
  CHECK(a.softmax_backward[4].name == "grad.softmax_product");
  CHECK(a.softmax_backward[4].bytes == 4LL * 32 * 4096 * 4096);
  // a CPU's softmax backward makes no product: the four others
  FsdpConfig cpu;
  cpu.seq_len = 4096;
  cpu.attention = Attention::kEager;
  cpu.torch_device = TorchDevice::kCpu;
  CHECK(BlockActivationProfile(Loaded("llama-2-7b"), cpu).SoftmaxBackwardBytes() == (2 * 4096 + 2 * 4096 + 2 * 4LL * 32 * 4096) * 4096);
  // fp16: CUDA fuses the forward's upcast (_softmax(half_to_float)), so the input's gradient is
  // fp16, 2as, and the forward makes no fp32 copy; a CPU converts first, as in bf16
  FsdpConfig fp16 = cpu;
  fp16.param_dtype = DType::kFp16;
  fp16.torch_device = TorchDevice::kCuda;
  const BlockActivations cuda16 = BlockActivationProfile(Loaded("llama-2-7b"), fp16);
  CHECK(cuda16.SoftmaxBackwardBytes() == (2 * 4096 + 2 * 4096 + (4 + 2 + 4) * 32LL * 4096) * 4096);
  fp16.torch_device = TorchDevice::kCpu;
  const BlockActivations cpu16 = BlockActivationProfile(Loaded("llama-2-7b"), fp16);
  CHECK(cpu16.SoftmaxBackwardBytes() == (2 * 4096 + 2 * 4096 + 2 * 4LL * 32 * 4096) * 4096);
  // the CPU's highest forward moment is the masked scores and their fp32 copy (2 + 4 bytes a
  // score), CUDA's the product and its scaled copy (2 + 2)
  CHECK(cpu16.ForwardMomentBytes() - cuda16.ForwardMomentBytes() == 2LL * 32 * 4096 * 4096);
  // Freed by then: v's saved copy, the bf16 probabilities (after the softmax in the core), and
  // everything after the core; the softmax's output, q, k and the first norm's still saved.
  int64_t freed = 0, kept = 0;
  for (const SavedTensor& t : a.full) (t.freed_by_softmax_backward ? freed : kept) += t.bytes;
  const int64_t after_core = 2 * 4096 + (4 * 4096 + 4 + 2 * 4096 + 2 * 4096) + 4 * 2 * 11008;
  CHECK(freed == (2 * 4096 + 2LL * 32 * 4096 + after_core) * 4096);
  CHECK(kept == ((4 * 4096 + 4 + 2 * 4096 + 2 * 4096) + 2 * 4096 + 2 * 4096 + 4LL * 32 * 4096) * 4096);
  // flash: no such moment (SDPA's backward is a term of backward_working)
  CHECK(Profile("llama-2-7b", 4096, Attention::kFlash).SoftmaxBackwardBytes() == 0);
}

TEST_CASE("each saved tensor names the module whose backward's end releases it") {
  auto released_by = [](const BlockActivations& a) {
    std::vector<std::pair<std::string, std::string>> out;
    for (const SavedTensor& t : a.full) out.emplace_back(std::string(t.name), t.freed_after);
    return out;
  };
  using P = std::pair<std::string, std::string>;
  // Llama, SDPA: a norm's own tensors by the norm, its output by the sub-layer whose linears read
  // it, down's input by down
  const std::vector<P> llama = {
      {"input_layernorm.x_fp32", "input_layernorm"}, {"input_layernorm.rsqrt", "input_layernorm"},
      {"input_layernorm.x_normalized", "input_layernorm"}, {"input_layernorm.out", "self_attn"},
      {"self_attn.v", "self_attn"}, {"self_attn.q_rope", "self_attn"}, {"self_attn.k_rope", "self_attn"},
      {"self_attn.lse", "self_attn"}, {"self_attn.o_proj_in", "self_attn"},
      {"post_attention_layernorm.x_fp32", "post_attention_layernorm"}, {"post_attention_layernorm.rsqrt", "post_attention_layernorm"},
      {"post_attention_layernorm.x_normalized", "post_attention_layernorm"}, {"post_attention_layernorm.out", "mlp"},
      {"mlp.gate_out", "mlp"}, {"mlp.act_out", "mlp"}, {"mlp.up_out", "mlp"}, {"mlp.down_in", "mlp.down_proj"}};
  CHECK(released_by(Profile("llama-2-7b", 4096, Attention::kFlash)) == llama);
  // GPT-2: its attention is `attn`, c_proj saves the MLP's activation
  for (const auto& [name, module] : released_by(Profile("gpt2", 1024, Attention::kEager))) {
    CAPTURE(name);
    if (name.starts_with("ln_")) CHECK(module == (name.ends_with(".out") ? (name.starts_with("ln_1") ? "attn" : "mlp") : name.substr(0, 4)));
    else if (name == "mlp.c_proj_in") CHECK(module == "mlp.c_proj");
    else CHECK(module == (name.starts_with("mlp.") ? "mlp" : "attn"));
  }
  // Mixtral's routed MLP is block_sparse_moe
  for (const SavedTensor& t : Profile("mixtral-8x7b", 4096, Attention::kFlash).full) {
    if (t.name.starts_with("moe.")) CHECK(t.freed_after == "block_sparse_moe");
  }
}

TEST_CASE("GPT-2 eager backward: the MLP's moment, then the softmax's with the rest freed, as Llama's") {
  // gpt2 at 1024 tokens (micro-batch 1), dropout 0.1, bf16. Held through the block: the two
  // hidden-state gradients 2 x 2h and the norms' 12h a token; the MLP's moment (the incoming 2h and
  // its 4 x 2I) beyond them; the softmax's moment (the held set gone): the residual's gradient 2h,
  // v's 2h (GPT-2's v is c_attn's output, h wide) and two of the probabilities' shape, 2 x 2as,
  // and CUDA's grad * output, one more.
  const int64_t h = 768, inner = 3072, as1k = 12 * 1024;
  const BlockActivations a = Profile("gpt2", 1024, Attention::kEager);
  const int64_t held = (2 * 2 * h + 12 * h) * 1024;
  CHECK(a.BackwardWorkingBytes() == held);
  CHECK(a.mlp_working_bytes == 2 * h * 1024 + 4 * 2 * inner * 1024 - held);
  CHECK(a.SoftmaxBackwardBytes() == (2 * h + 2 * h + 3 * 2 * as1k) * 1024);
  // what has gone by then: dropout's mask as and output 2as, c_proj's input 2h and its dropout
  // mask h, ln_2 2h + 8, c_fc's input 2h, NewGELU 4 x 2 x inner, c_proj's input 2 x inner, the
  // MLP's dropout mask h
  int64_t freed = 0;
  for (const SavedTensor& t : a.full) freed += t.freed_by_softmax_backward ? t.bytes : 0;
  CHECK(freed == (3 * as1k + 8 * h + 8 + 10 * inner) * 1024);
  // 4096 positions, no dropout: the same terms, the MLP's moment still above the held set
  auto m = LoadModel("gpt2");
  REQUIRE(m.ok());
  m.value().max_position_embeddings = 4096;
  m.value().attention_dropout = m.value().residual_dropout = m.value().embedding_dropout = 0;
  FsdpConfig c;
  c.seq_len = 4096;
  c.attention = Attention::kEager;
  const int64_t as4k = 12 * 4096;
  const BlockActivations b = BlockActivationProfile(m.value(), c);
  CHECK(b.BackwardWorkingBytes() == (2 * 2 * h + 12 * h) * 4096);
  CHECK(b.mlp_working_bytes == (2 * h + 4 * 2 * inner - (2 * 2 * h + 12 * h)) * 4096);
  CHECK(b.SoftmaxBackwardBytes() == (2 * h + 2 * h + 3 * 2 * as4k) * 4096);
}

TEST_CASE("Qwen3-8B block, flash: Llama's tensors plus the per-head q/k norms") {
  // h=4096, 32 heads and 8 kv heads of 128 (q 4096, kv 1024 wide), I=12288. Llama's flash block:
  // norms 2*(4h + 4 + 2h) + their outputs 2*2h, q 2q, k and v 2kv each, lse 4a, o_proj input 2q,
  // SwiGLU 4*2I; q_norm: fp32 input 4q, rsqrt 4 per head (32), normalised 2q; k_norm the same at kv width, 8 heads.
  const int64_t h = 4096, q = 4096, kv = 1024, inner = 12288;
  const int64_t llama = 2 * (4 * h + 4 + 2 * h) + 2 * 2 * h + 2 * q + 2 * 2 * kv + 4 * 32 + 2 * q + 4 * 2 * inner;
  const int64_t qk_norms = (4 * q + 4 * 32 + 2 * q) + (4 * kv + 4 * 8 + 2 * kv);
  CHECK(Profile("qwen3-8b", 1, Attention::kFlash).FullBytes() == llama + qk_norms);
}

TEST_CASE("OLMo 2 block, flash: norms on the sub-layers' outputs, whole-projection q/k norms, fp32 weight products") {
  // olmo-2-7b: h = q = kv = 4096, I=11008. The projections save the block input (2h), the MLP the
  // residual sum (2h); each hidden norm saves its fp32 input 4h, rsqrt 4 and its fp32 normalised
  // input 4h (Olmo2RMSNorm multiplies by the weight in fp32); q_norm and k_norm the same over the
  // whole projection, one rsqrt per token. Attention as Llama's: q, k, v 2h each, lse 4a, o_proj input 2h.
  const int64_t h = 4096, inner = 11008;
  const int64_t inputs = 2 * 2 * h, norm = 4 * h + 4 + 4 * h;
  const int64_t attention = 3 * 2 * h + 4 * 32 + 2 * h;
  CHECK(Profile("olmo-2-7b", 1, Attention::kFlash).FullBytes() == inputs + 4 * norm + attention + 4 * 2 * inner);
}

TEST_CASE("Phi-4 block, flash: fused qkv_proj and gate_up_proj outputs stay whole behind their views") {
  // h=5120, 40 heads and 10 kv heads of 128 (q 5120, kv 1280), I=17920. Llama's flash block but:
  // SDPA's v is a view of qkv_proj's output (2(q + 2kv) instead of 2kv), and its output, laid out
  // like the contiguous q after RoPE, is copied for o_proj (2q saved beside o_proj's input 2q);
  // gate_up's output 2*2I, the activation 2I and the product 2I (4 x 2I, as Llama's four tensors).
  const int64_t h = 5120, q = 5120, kv = 1280, inner = 17920;
  const int64_t norms = 2 * (4 * h + 4 + 2 * h) + 2 * 2 * h;
  const int64_t attention = 2 * q + 2 * kv + 2 * (q + 2 * kv) + 4 * 40 + 2 * q + 2 * q;
  const BlockActivations a = Profile("phi-4", 1, Attention::kFlash);
  CHECK(a.FullBytes() == norms + attention + 4 * 2 * inner);
  // gate_up's output is one allocation (the caching allocator sees one 2 x 2I request), not two
  std::vector<std::pair<std::string_view, int64_t>> mlp;
  for (const auto& t : a.full) if (t.name.starts_with("mlp.")) mlp.emplace_back(t.name, t.bytes);
  CHECK(mlp == std::vector<std::pair<std::string_view, int64_t>>{{"mlp.gate_up_out", 2 * 2 * inner}, {"mlp.act_out", 2 * inner}, {"mlp.down_in", 2 * inner}});
}

TEST_CASE("Gemma 2 block, eager: four fp32-weight norms and the soft-capped scores' tanh") {
  // gemma-2-9b at one token: h=3584, 16 heads and 8 kv heads of 256 (a*d = 4096), I=14336, s=1.
  // Four norms (4h + 4 + 4h: Gemma2RMSNorm multiplies by 1 + weight in fp32), the attention's and
  // the MLP's inputs 2h each; eager: q after RoPE and k, v repeated to all heads 2ad each, tanh's
  // output 2as (cap * tanh(x / cap)), fp32 softmax 4as, probabilities 2as, o_proj input 2ad; GeGLU 4 x 2I.
  const int64_t h = 3584, ad = 4096, inner = 14336, as = 16;
  const int64_t expected = 4 * (8 * h + 4) + 2 * 2 * h + 3 * 2 * ad + (2 + 4 + 2) * as + 2 * ad + 4 * 2 * inner;
  CHECK(Profile("gemma-2-9b", 1, Attention::kEager).FullBytes() == expected);
}

TEST_CASE("A sliding window shorter than the sequence gives SDPA a mask: k and v repeated, the mask saved") {
  // gemma-3-1b: 4 heads, 1 kv head of 256, window 512, layers 1-5 of every 6 sliding. At 1024
  // tokens a sliding block's SDPA saves k and v at all heads' width (2 x 2ad instead of 2 x 2d)
  // and the converted mask 2s per token; at 512 tokens the window covers the sequence: no mask.
  auto m = LoadModel("gemma-3-1b");
  REQUIRE(m.ok());
  CHECK(m.value().WindowOf(0) == 512);
  CHECK(m.value().WindowOf(5) == 0);
  FsdpConfig c;
  c.attention = Attention::kFlash;
  c.seq_len = 1024;
  const int64_t full = BlockActivationProfile(m.value(), c).FullBytes();
  const int64_t sliding = BlockActivationProfile(m.value(), c, true, 512).FullBytes();
  CHECK(sliding - full == 1024 * (2 * 2 * (1024 - 256) + 2 * 1024));
  c.seq_len = 512;
  CHECK(BlockActivationProfile(m.value(), c, true, 512).FullBytes() == BlockActivationProfile(m.value(), c).FullBytes());
}

TEST_CASE("Routed experts save each token once per selected expert, as transformers 5.24's grouped_mm path does") {
  // mixtral-8x7b, one token: top-2 of 8 experts, h=4096, I=14336. Router: fp32 softmax 4E, int64
  // top-k indices 8k, the in-place division by the top-k's sum: its fp32 denominator 4 and its copy
  // of the fp32 weights 4k; per pair: gathered input 2h, gate_up output 2*2I, activation 2I,
  // product 2I, down output 2h, fp32 routing weight 4, three int64 index vectors 24.
  BlockActivations a = Profile("mixtral-8x7b", 1, Attention::kFlash);
  int64_t moe = 0;
  for (const auto& t : a.full) if (t.name.starts_with("moe.")) moe += t.bytes;
  const int64_t h = 4096, inner = 14336, e = 8, k = 2;
  CHECK(moe == 4 * e + 8 * k + 4 + 4 * k + k * (2 * h + 4 * inner + 2 * inner + 2 * inner + 2 * h + 4 + 24));
  // the index vectors one tensor each, as the caching allocator gets them, in forward order
  std::vector<std::string_view> order;
  for (const auto& t : a.full) if (t.name.starts_with("moe.")) order.push_back(t.name);
  CHECK(order == std::vector<std::string_view>{"moe.routing_fp32", "moe.topk_indices", "moe.topk_denominator", "moe.topk_weights", "moe.perm",
                                               "moe.perm_token", "moe.expert_in", "moe.pair_weights", "moe.gate_up_out", "moe.act_out",
                                               "moe.down_in", "moe.down_out", "moe.inv_perm"});
  // held through the block: 2 x 2h and the larger of SDPA's (dq, dk, dv: 2 x (32 + 2 x 8) x 128,
  // the fp32 dq accumulator 4 x 32 x 128) and the norms' 12h; the MLP's moment beyond it: the
  // incoming 2h and three 2I gradients per routed pair
  const int64_t held = 2 * 2 * h + std::max<int64_t>(2 * 48 * 128 + 4 * 32 * 128, 12 * h);
  CHECK(a.BackwardWorkingBytes() == held);
  CHECK(a.mlp_working_bytes == 2 * h + 3 * 2 * inner * k - held);
  // qwen3-30b-a3b: top-8 of 128 experts of 768, h=2048, and Qwen3's per-head q/k norms;
  // norm_topk_prob (the denominator 4, the copy 4k), and the weights cast to bf16 before they
  // weigh the outputs: 2 per pair
  a = Profile("qwen3-30b-a3b", 1, Attention::kFlash);
  moe = 0;
  for (const auto& t : a.full) if (t.name.starts_with("moe.")) moe += t.bytes;
  CHECK(moe == 4 * 128 + 8 * 8 + 4 + 4 * 8 + 8 * (2 * 2048 + 8 * 768 + 2 * 2048 + 2 + 24));
}

TEST_CASE("RMSNorm's forward transients: pow(2) after the fp32 input, the fp32 product while the cast and output are made") {
  // llama-2-7b, bf16, one token (F = h = 4096 features): LlamaRMSNorm makes pow(2) (4F, freed
  // once mean has run: before the rsqrt) and `hidden_states * rsqrt` (4F, bound until it returns:
  // through x.to(bf16) and weight * it, the next two saved tensors)
  FsdpConfig c;
  c.seq_len = 1;
  c.attention = Attention::kFlash;
  const BlockActivations a = BlockActivationProfile(Loaded("llama-2-7b"), c);
  auto find = [](const std::vector<SavedTensor>& list, std::string_view name) -> const SavedTensor& {
    for (const auto& t : list) if (t.name == name) return t;
    FAIL("no " << name);
    return list.front();
  };
  CHECK(find(a.full, "input_layernorm.x_fp32").then_transient_bytes == 4 * 4096);
  CHECK(find(a.full, "input_layernorm.x_fp32").then_transient_spans == 0);
  CHECK(find(a.full, "input_layernorm.rsqrt").then_transient_bytes == 4 * 4096);
  CHECK(find(a.full, "input_layernorm.rsqrt").then_transient_spans == 2);
  CHECK(find(a.full, "input_layernorm.x_normalized").then_transient_bytes == 0);
  CHECK(find(a.full, "post_attention_layernorm.rsqrt").then_transient_spans == 2);
  // not saved: the byte totals do not count them
  int64_t saved = 0;
  for (const auto& t : a.full) saved += t.bytes;
  CHECK(a.FullBytes() == saved);
  // the final norm's too
  const HeadActivations head = HeadActivationProfile(Loaded("llama-2-7b"), c);
  CHECK(find(head.final_norm, "norm.rsqrt").then_transient_spans == 2);
  // fp32: the casts are the tensors themselves, only pow(2) is made apart
  c.param_dtype = DType::kFp32;
  const BlockActivations f = BlockActivationProfile(Loaded("llama-2-7b"), c);
  CHECK(find(f.full, "input_layernorm.x_fp32").then_transient_bytes == 4 * 4096);
  CHECK(find(f.full, "input_layernorm.rsqrt").then_transient_bytes == 0);
  // OLMo 2 weighs in fp32: it saves the fp32 product x * rsqrt and holds weight * it (4F) while
  // it is cast; the post-norms' outputs are saved by nothing, so it is freed before the next
  c.param_dtype = DType::kBf16;
  const BlockActivations o = BlockActivationProfile(Loaded("olmo-2-7b"), c);
  CHECK(find(o.full, "post_attention_layernorm.rsqrt").then_transient_bytes == 0);
  CHECK(find(o.full, "post_attention_layernorm.x_normalized").then_transient_bytes == 4 * 4096);
  CHECK(find(o.full, "post_attention_layernorm.x_normalized").then_transient_spans == 0);
}

// made_before as {bytes, outlives} pairs
std::vector<std::pair<int64_t, int>> MadeBefore(const std::vector<SavedTensor>& list, std::string_view name) {
  std::vector<std::pair<int64_t, int>> out;
  for (const auto& t : list) {
    if (t.name != name) continue;
    for (const auto& m : t.made_before) out.emplace_back(m.bytes, m.outlives);
    return out;
  }
  FAIL("no " << name);
  return out;
}

TEST_CASE("RoPE's forward transients: the projections' outputs and rotate_half's products, in PyTorch's order") {
  // Qwen3-8B, bf16, flash, one token: q 2 x 32 x 128 = 8192 bytes, k 2048. Counting allocations
  // from q's projection output (#0): q_norm's three saved tensors (#1-3), its output (#4: the
  // projection's freed, alive through 4); k's projection (#5) and norm (#6-9, its output #9, the
  // projection alive through 4); v (#10); q's x * cos (#11, alive through 4), -x2 (#12, through
  // the cat), the cat (#13, through the sin product), the sin product (#14, through q_embed),
  // q_embed (#15); k's likewise (#16-20); the norms' outputs freed after k_embed (through 16 and 11)
  FsdpConfig c;
  c.seq_len = 1;
  c.attention = Attention::kFlash;
  const BlockActivations q3 = BlockActivationProfile(Loaded("qwen3-8b"), c);
  using V = std::vector<std::pair<int64_t, int>>;
  CHECK(MadeBefore(q3.full, "self_attn.q_norm.x_fp32") == V{{8192, 4}});
  CHECK(MadeBefore(q3.full, "self_attn.k_norm.x_fp32") == V{{8192, 16}, {2048, 4}});
  CHECK(MadeBefore(q3.full, "self_attn.v") == V{{2048, 11}});
  CHECK(MadeBefore(q3.full, "self_attn.q_rope") == V{{8192, 4}, {4096, 1}, {8192, 1}, {8192, 1}});
  CHECK(MadeBefore(q3.full, "self_attn.k_rope") == V{{2048, 4}, {1024, 1}, {2048, 1}, {2048, 1}});
  CHECK(MadeBefore(q3.full, "self_attn.lse").empty());
  // not saved: the byte totals do not count them
  int64_t saved = 0;
  for (const auto& t : q3.full) saved += t.bytes;
  CHECK(q3.FullBytes() == saved);
  // Phi-3 (phi3-100m.json: 12 heads of 64, 4 kv heads, partial_rotary_factor 0.75): q and k are
  // views of the fused projection (saved as v, made first); 48 of each head's 64 features rotate,
  // q's 1152 bytes of its 1536, and their sum (alive through the cat) joins the rest in a new cat
  const BlockActivations phi = BlockActivationProfile(TestConfig("phi3-100m.json"), c);
  CHECK(MadeBefore(phi.full, "self_attn.v").empty());
  CHECK(MadeBefore(phi.full, "self_attn.q_rope") == V{{1152, 4}, {576, 1}, {1152, 1}, {1152, 1}, {1152, 1}});
  CHECK(MadeBefore(phi.full, "self_attn.k_rope") == V{{384, 4}, {192, 1}, {384, 1}, {384, 1}, {384, 1}});
  // eager attention's list and torchtitan's RoPE are not modelled so: none
  c.attention = Attention::kEager;
  for (const auto& t : BlockActivationProfile(Loaded("qwen3-8b"), c).full) CHECK(t.made_before.empty());
  c.attention = Attention::kFlash;
  c.impl = Impl::kTorchtitan;
  for (const auto& t : BlockActivationProfile(Loaded("qwen3-8b"), c).full) CHECK(t.made_before.empty());
}

TEST_CASE("Routed experts' forward: the router's and the sparse block's tensors one each, and what the forward holds at its end") {
  // qwen3-moe-mini.json (h 64, 8 experts of 32, top 2, norm_topk_prob) in bf16 at 16 x 4096 =
  // 65,536 tokens, 131,072 pairs: the sizes torch.profiler's allocation events gave for the H200
  // row's configuration run on the CPU (tools/torch_reference.py --device cpu --memory-history;
  // docs/accuracy.md), each tensor one allocation.
  FsdpConfig c;
  c.micro_batch = 16;
  c.seq_len = 4096;
  c.attention = Attention::kFlash;
  c.param_dtype = DType::kBf16;
  const BlockActivations a = BlockActivationProfile(TestConfig("qwen3-moe-mini.json"), c);
  std::vector<std::pair<std::string_view, int64_t>> saved, moment;
  for (const auto& t : a.full) if (t.name.starts_with("moe.")) saved.emplace_back(t.name, t.bytes);
  for (const auto& t : a.experts_forward_moment) moment.emplace_back(t.name, t.bytes);
  using Named = std::vector<std::pair<std::string_view, int64_t>>;
  CHECK(saved == Named{{"moe.routing_fp32", 2097152}, {"moe.topk_indices", 1048576}, {"moe.topk_denominator", 262144},
                       {"moe.topk_weights", 524288}, {"moe.perm", 1048576}, {"moe.perm_token", 1048576},
                       {"moe.expert_in", 16777216}, {"moe.pair_weights", 262144}, {"moe.gate_up_out", 16777216},
                       {"moe.act_out", 8388608}, {"moe.down_in", 8388608}, {"moe.down_out", 16777216}, {"moe.inv_perm", 1048576}});
  // the bf16 logits and routing weights, sort's ids and histc's copy, the weighted outputs, their
  // gather, the sum over each token's two; the residual after attention (8,388,608) is the block's
  // transient here (ResidualStreamApart), made before the MLP's first tensor
  CHECK(moment == Named{{"moe.router_logits", 1048576}, {"moe.routing_weights", 262144},
                        {"moe.sorted_expert_ids", 1048576}, {"moe.histc_input", 524288}, {"moe.weighted_out", 16777216},
                        {"moe.weighted_out_token_order", 16777216}, {"moe.token_sum", 8388608}});
  CHECK(a.experts_forward_moment[4].freed_by_next_in_moment);
  CHECK(a.experts_forward_moment[5].freed_by_next_in_moment);
  CHECK_FALSE(a.experts_forward_moment[6].freed_by_next_in_moment);
  CHECK(MadeBefore(a.kept, "post_attention_layernorm.x_fp32") == std::vector<std::pair<int64_t, int>>{{8388608, 1}, {8388608, std::numeric_limits<int>::max()}});
  CHECK(a.experts_recompute_moment.empty());
  // --ac full: the recomputation stops once inv_perm is saved (the CPU's events of the same run
  // under --ac full: the weighted outputs made, then inv_perm, then all freed as it unwinds); the
  // residual is the moment's: the checkpointed forward's stream is not modelled apart
  c.checkpointing = Checkpointing::kFull;
  const BlockActivations r = BlockActivationProfile(TestConfig("qwen3-moe-mini.json"), c);
  moment.clear();
  for (const auto& t : r.experts_recompute_moment) moment.emplace_back(t.name, t.bytes);
  CHECK(moment == Named{{"moe.residual", 8388608}, {"moe.router_logits", 1048576}, {"moe.routing_weights", 262144},
                        {"moe.sorted_expert_ids", 1048576}, {"moe.histc_input", 524288}, {"moe.weighted_out", 16777216}});
  c.ac_reentrant = true;  // reentrant checkpointing reruns the whole forward
  CHECK(BlockActivationProfile(TestConfig("qwen3-moe-mini.json"), c).experts_recompute_moment.size() == 8);
  c.ac_reentrant = false;
  c.checkpointing = Checkpointing::kNone;
  // without norm_topk_prob the weights are topk's values cast: nothing of the division is saved
  ModelSpec unnormalised = TestConfig("qwen3-moe-mini.json");
  unnormalised.router_norm_topk = false;
  const BlockActivations b = BlockActivationProfile(unnormalised, c);
  CHECK(a.FullBytes() - b.FullBytes() == 262144 + 524288);
  // Mixtral's fp32 weights promote the weighted outputs and their sum to fp32; the sum is cast
  // back. mixtral-8x7b at one token of 4096 wide, top 2 of 8.
  const BlockActivations x = Profile("mixtral-8x7b", 1, Attention::kFlash);
  moment.clear();
  for (const auto& t : x.experts_forward_moment) moment.emplace_back(t.name, t.bytes);
  CHECK(moment == Named{{"moe.router_logits", 2 * 8}, {"moe.routing_weights", 4 * 2}, {"moe.sorted_expert_ids", 8 * 2},
                        {"moe.histc_input", 4 * 2}, {"moe.weighted_out", 4 * 4096 * 2}, {"moe.weighted_out_token_order", 4 * 4096 * 2},
                        {"moe.token_sum", 4 * 4096}, {"moe.token_sum_cast", 2 * 4096}});
  // dense blocks have none
  CHECK(Profile("llama-2-7b", 1, Attention::kFlash).experts_forward_moment.empty());
}

TEST_CASE("DeepSeek-V3 blocks, eager: latent attention's norms and copies, the grouped sigmoid router, the shared expert") {
  // deepseek-v3-tiny.json in bf16 at 2 x 256 tokens: every tensor a DeepseekV3DecoderLayer's
  // forward saves (saved_tensors_hooks on transformers 5.24, the parameters and the model-wide
  // RoPE cos / sin left out): 18,620,416 bytes for the dense layer 0, 22,489,152 for a routed
  // one, less the 64 bytes of grouped_mm's int32 expert offsets, which fsdp-plan leaves out.
  const ModelSpec m = TestConfig("deepseek-v3-tiny.json");
  const FsdpConfig c = HookedConfig();
  CHECK(BlockActivationProfile(m.LayerShape(0), c).FullBytes() == 18'620'416);
  CHECK(BlockActivationProfile(m.LayerShape(1), c).FullBytes() == 22'489'152 - 64);
  // by hand, per token of the routed layer: the router's fp32 input 4h and sigmoid 4E, the
  // groups' top-2 and kept indices 8 x (2 x 4 + 2), the mask E, top-k indices 8k, denominator 4,
  // weights 4k; the fp32 weight copy 4 E h once
  int64_t router = 0;
  for (const SavedTensor& t : BlockActivationProfile(m.LayerShape(1), c).full) {
    for (const char* name : {"moe.router_in_fp32", "moe.router_weight_fp32", "moe.sigmoid_out", "moe.group_top2_indices", "moe.kept_group_indices",
                             "moe.group_mask", "moe.topk_indices", "moe.topk_denominator", "moe.topk_weights"}) {
      if (t.name == name) router += t.bytes;
    }
  }
  const int64_t tokens = 512, h = 512, e = 16, k = 4;
  CHECK(router == tokens * (4 * h + 4 * e + 8 * (2 * 4 + 2) + e + 8 * k + 4 + 4 * k) + 4 * e * h);
}

TEST_CASE("gpt-oss block, eager: the sink-joined softmax in c, a top-k-then-softmax router, biased experts' clamped SwiGLU") {
  // gpt-oss-tiny.json in bf16 at 2 x 256 tokens (h 512, 8 heads / 2 kv of 64, 8 experts of 256,
  // top-2): saved_tensors_hooks on a GptOssDecoderLayer (transformers 5.24) list 15,294,496
  // bytes beside the shared RoPE cos / sin, of which fsdp-plan leaves out grouped_mm's 32-byte
  // int32 expert offsets. Per token, by hand: the two norms' fp32 input, rsqrt and fp32
  // normalised input and outputs 2 x (4h + 4 + 4h + 2h); q after RoPE, k and v repeated to the
  // heads 3 x 2 x 8 x 64; max's indices 8 x 8; the probabilities over s + 1 keys 2 x 8 x 257;
  // o_proj's input 2 x 8 x 64; the router's top-k indices 8 x 2 and softmax 2 x 2; per pair
  // (two per token) the gathered input 2h, gate_up's output 2 x 2 x 256, five c x 256 tensors of
  // the clamped SwiGLU and down's input, the weight 2, down's output 2h, four int64 indices.
  const ModelSpec m = TestConfig("gpt-oss-tiny.json");
  const FsdpConfig c = HookedConfig();
  const int64_t h = 512, per_pair = 2 * h + 4 * 256 + 5 * 2 * 256 + 2 + 2 * h + 32;
  const int64_t per_token = 2 * (4 * h + 4 + 4 * h + 2 * h) + 3 * 2 * 8 * 64 + 8 * 8 + 2 * 8 * 257 + 2 * 8 * 64 + 8 * 2 + 2 * 2 + 2 * per_pair;
  CHECK(per_token * 512 == 15'294'496 - 32);
  CHECK(BlockActivationProfile(m, c).FullBytes() == 15'294'496 - 32);
  // SDPA cannot run it: without --attention the CLIs plan eager
  CHECK(SdpaRuledOut(m).find("sink logit per head") != std::string::npos);
}

TEST_CASE("gpt-oss block, eager, un-checkpointed: its forward's highest moment at the row maximum's subtraction, as PyTorch held it") {
  // tools/peak_trace.py on gpt-oss-tiny.json, FSDP2 on 1 CPU rank, bf16, 2 x 2048 (torch 2.11,
  // transformers 5.24): the step's peak is aten.sub.Tensor in the last block's forward, with
  // 442,974,208 bytes of that block alive: the previous block's output (the residual) 4,194,304,
  // the input norm's four tensors 20,987,904, q after RoPE 4,194,304, k after RoPE and v at the
  // two kv heads' width 1,048,576 each, repeat_kv's two copies 4,194,304 each, max's int64
  // indices 262,144, the masked scores 134,217,728, their join with the sinks and the join less
  // its row maximum 134,283,264 each, the maximum's values 65,536.
  FsdpConfig c = HookedConfig();
  c.seq_len = 2048;
  c.param_dtype = DType::kBf16;
  const BlockActivations a = BlockActivationProfile(TestConfig("gpt-oss-tiny.json"), c);
  int64_t before = 0;
  for (const SavedTensor& t : a.kept) before += t.after_forward_moment ? 0 : t.bytes;
  CHECK(before == 20'987'904 + 4'194'304 + 2 * 4'194'304 + 262'144);
  // the residual is the memory model's (ResidualStreamApart), the rest the moment's
  CHECK(ResidualStreamApart(TestConfig("gpt-oss-tiny.json"), c));
  CHECK(a.ForwardMomentBytes() == 2 * 1'048'576 + 134'217'728 + 2 * 134'283'264 + 65'536);
  CHECK(before + 4'194'304 + a.ForwardMomentBytes() == 442'974'208);
  // its backward's highest moment is the row maximum's (MaxBackward0): the probabilities and their
  // gradient gone, the softmax input's gradient, scatter_'s zeros of the joined shape and its
  // fp32 buffer of that shape, beside the residual's and v's (repeated) gradients
  CHECK(a.SoftmaxBackwardBytes() == 4'194'304 + 4'194'304 + 2 * 134'283'264 + 2 * 134'283'264);
  for (const SavedTensor& t : a.kept) {
    if (t.name == "attn_core.probs") CHECK(t.freed_by_softmax_backward);
  }
  // in fp32 scatter_ needs no buffer and the softmax's own moment (probabilities and both
  // gradients; on CUDA also the kernel's grad * output) is the higher: three of the joined shape
  // on a CPU, four on CUDA
  c.param_dtype = DType::kFp32;
  const BlockActivations fp32 = BlockActivationProfile(TestConfig("gpt-oss-tiny.json"), c);
  CHECK(fp32.SoftmaxBackwardBytes() == 2 * 8'388'608 + 3 * 268'566'528);
  c.torch_device = TorchDevice::kCpu;
  CHECK(BlockActivationProfile(TestConfig("gpt-oss-tiny.json"), c).SoftmaxBackwardBytes() == 2 * 8'388'608 + 2 * 268'566'528);
}

TEST_CASE("Gemma 2's soft-capped eager core: its forward moment, divided, tanh'd and capped copies in turn") {
  // gemma2-100m.json in bf16 at 2 x 256 (8 heads, 4 kv heads of 128): eager_attention_forward
  // makes the product, its scaled copy, `/ softcap`, tanh (saved for its backward), `* softcap`,
  // the masked scores, then the fp32 copy the softmax reads: each [2, 8, 256, 256] copy 2 MiB in
  // bf16, one alive at a time until the masked scores, which stay beside the 4 MiB fp32 copy.
  const ModelSpec m = TestConfig("gemma2-100m.json");
  FsdpConfig c = HookedConfig();
  const BlockActivations a = BlockActivationProfile(m, c);
  std::vector<std::string_view> names;
  for (const SavedTensor& t : a.forward_moment) names.push_back(t.name);
  CHECK(names == std::vector<std::string_view>{"moment.k_rope", "moment.v", "moment.scores_product", "moment.scores_scaled", "moment.scores_divided",
                                               "moment.scores_capped", "moment.scores", "moment.scores_fp32"});
  const int64_t scores = 2 * 8 * 256 * 256, kv = 4 * 128 * 512;
  CHECK(a.ForwardMomentBytes() == 2 * 2 * kv + 2 * scores + 4 * scores);
  // tanh's output is kept (made before the moment), as the softmax's fp32 output is
  for (const SavedTensor& t : a.kept) {
    if (t.name == "self_attn.softcap_tanh" || t.name == "attn_core.softmax_fp32") CHECK_FALSE(t.after_forward_moment);
  }
  // a checkpointed forward keeps nothing: tanh's output comes and goes in the moment
  c.checkpointing = Checkpointing::kFull;
  bool tanh = false;
  for (const SavedTensor& t : BlockActivationProfile(m, c).forward_moment) tanh = tanh || (t.name == "moment.scores_tanh" && t.freed_by_next_in_moment);
  CHECK(tanh);
}

TEST_CASE("Llama-style eager core in fp32: the softmax made after the forward moment, the product and its scaled copy the moment") {
  // PyTorch's CPU requests (tools/torch_reference.py --device cpu --memory-history), FSDP2 on one
  // rank, qwen3-moe-mini.json in fp32 at 2 x 1024: each block's forward makes aten::bmm's product,
  // aten::mul's scaled copy (the product freed), aten::add's masked scores (the copy freed), then
  // aten::_softmax's output (the masked scores freed): never more than two [2, 4, 1024, 1024] fp32
  // tensors, 33,554,432 bytes each. softmax(dtype=float32) of fp32 scores makes no copy, so the
  // kept softmax comes after the moment; in bf16 it is made at the moment (beside the masked
  // scores and their fp32 copy) and the probabilities cast back come after.
  FsdpConfig c = HookedConfig();
  c.seq_len = 1024;
  c.param_dtype = DType::kFp32;
  const ModelSpec m = TestConfig("qwen3-moe-mini.json");
  const int64_t scores = 2 * 4 * 1024 * 1024 * 4, kv = 2 * 16 * 2048 * 4;  // k after RoPE and v, 2 kv heads of 16
  auto after_moment = [](const BlockActivations& a, std::string_view name) {
    for (const SavedTensor& t : a.kept) {
      if (t.name == name) return t.after_forward_moment;
    }
    FAIL("no kept tensor " << name);
    return false;
  };
  const BlockActivations fp32 = BlockActivationProfile(m, c);
  CHECK(after_moment(fp32, "attn_core.softmax_fp32"));
  CHECK(fp32.ForwardMomentBytes() == 2 * kv + 2 * scores);
  c.param_dtype = DType::kBf16;
  const BlockActivations bf16 = BlockActivationProfile(m, c);
  CHECK_FALSE(after_moment(bf16, "attn_core.softmax_fp32"));
  CHECK(after_moment(bf16, "attn_core.probs"));
  // k and v in bf16, the masked scores and their fp32 copy (the softmax is kept; the residual is
  // the memory model's, ResidualStreamApart)
  CHECK(ResidualStreamApart(m, c));
  CHECK(bf16.ForwardMomentBytes() == 2 * kv / 2 + scores / 2 + scores);
}

TEST_CASE("Llama 4 blocks, eager: L2-normed q/k on RoPE layers, a temperature on NoPE ones, every token through every expert") {
  // llama4-text-tiny.json in bf16 at 2 x 256 tokens (h 512, 8 heads / 2 kv of 64, 4 experts of
  // 256 and a shared one, dense layers of 1024 on even indices, NoPE on the fourth):
  // saved_tensors_hooks on Llama4TextDecoderLayer (transformers 5.24) list, beside the model-wide
  // complex RoPE table, 13,918,208 bytes for layer 0 (RoPE, dense), 19,177,472 for layer 1
  // (RoPE, routed) and 17,847,296 for layer 3 (NoPE, routed)
  const ModelSpec m = TestConfig("llama4-text-tiny.json");
  const FsdpConfig c = HookedConfig();
  CHECK(BlockActivationProfile(m.LayerShape(0), c).FullBytes() == 13'918'208);
  CHECK(BlockActivationProfile(m.LayerShape(1), c).FullBytes() == 19'177'472);
  CHECK(BlockActivationProfile(m.LayerShape(3), c).FullBytes() == 17'847'296);
  // the routed layer's MLP per token, by hand: top-1 index 8, fp32 sigmoid 4 x 4, then 4 rows of
  // the score 2, the repeated token 2h, bmm's input 2h, gate_up 2 x 2 x 256, activation and
  // product 2 x 256 each; the shared expert 4 x 2 x 256
  int64_t moe = 0;
  for (const SavedTensor& t : BlockActivationProfile(m.LayerShape(1), c).full) moe += t.name.starts_with("moe.") ? t.bytes : 0;
  CHECK(moe == 512 * (8 + 16 + 4 * (2 + 2 * 512 + 2 * 512 + 4 * 256 + 2 * 2 * 256) + 4 * 2 * 256));
}

TEST_CASE("logits and loss buffers scale with the vocabulary") {
  auto m = LoadModel("llama-3.1-8b");
  REQUIRE(m.ok());
  FsdpConfig c;
  c.seq_len = 8192;
  HeadActivations h = HeadActivationProfile(m.value(), c);
  CHECK(h.logits_bytes == 2LL * 128256 * 8192);             // bf16 logits
  CHECK(h.loss_forward_transient_bytes == 4LL * 128256 * 8192);  // logits.float()
  CHECK(h.loss_saved_bytes == 4LL * 128256 * 8192);         // log_softmax output
}

TEST_CASE("the loss path of each transformers release (HfLoss): what the head allocates") {
  auto m = LoadModel("llama-3.1-8b");
  REQUIRE(m.ok());
  FsdpConfig c;
  c.seq_len = 8192;
  c.micro_batch = 2;
  const int64_t vT = 128256LL * 8192 * 2, shifted = 128256LL * 8191 * 2;  // logits[..., :-1, :]: a row fewer per sequence
  c.transformers = {4, 48};  // ForCausalLMLoss: logits.float(), then a contiguous copy of the shifted rows
  HeadActivations b = HeadActivationProfile(m.value(), c);
  CHECK(b.logits_bytes == 2 * vT);
  CHECK(b.loss_forward_transient_bytes == 4 * vT);
  CHECK(!b.upcast_in_model);
  CHECK(b.shift_copy_bytes == 4 * shifted);
  CHECK(b.loss_saved_bytes == 4 * shifted);
  CHECK(b.loss_grad_bytes == 4 * shifted);
  CHECK(b.slice_grad_bytes == 4 * vT);
  c.transformers = {4, 31};  // LlamaForCausalLM.forward: logits = logits.float(), returned
  HeadActivations a = HeadActivationProfile(m.value(), c);
  CHECK(a.upcast_in_model);
  CHECK(a.logits_bytes == 4 * vT);
  CHECK(a.loss_forward_transient_bytes == 2 * vT);  // lm_head's bf16 output, until upcast
  CHECK(a.LmHeadOutputBytes() == 2 * vT);
  CHECK(a.shift_copy_bytes == 4 * shifted);
  c.param_dtype = DType::kFp32;  // fp32 logits: .float() is the tensor itself
  HeadActivations a32 = HeadActivationProfile(m.value(), c);
  CHECK(!a32.upcast_in_model);
  CHECK(a32.logits_bytes == 4 * vT);
  CHECK(a32.loss_forward_transient_bytes == 0);
  c.micro_batch = 1;  // one sequence's logits[..., :-1, :] is contiguous: no copy
  CHECK(HeadActivationProfile(m.value(), c).shift_copy_bytes == 0);
  CHECK(HeadActivationProfile(m.value(), c).slice_grad_bytes == 4 * 128256LL * 8192);
  c.micro_batch = 2;
  c.transformers = {4, 49};  // labels padded: every position, no copy
  HeadActivations p = HeadActivationProfile(m.value(), c);
  CHECK(p.shift_copy_bytes == 0);
  CHECK(p.slice_grad_bytes == 0);
  CHECK(p.loss_saved_bytes == 4 * vT);
}

TEST_CASE("torchtitan's op-level selective AC keeps the block input and the outputs of q, v, gate and down (+ SDPA's)") {
  // llama-3.1-8b per token, bf16: input 2h, q 2h, v 2 x 1024 (8 kv heads of 128), gate 2I, down 2h
  // (h = 4096, I = 14336); with SDPA its output 2h and the fp32 log-sum-exp 4a (a = 32).
  const int64_t seq = 4096, kept = 2 * 4096 + 2 * 4096 + 2 * 1024 + 2 * 14336 + 2 * 4096;
  BlockActivations eager = Profile("llama-3.1-8b", seq, Attention::kEager, Checkpointing::kSelectiveOp);
  BlockActivations flash = Profile("llama-3.1-8b", seq, Attention::kFlash, Checkpointing::kSelectiveOp);
  CHECK(eager.KeptBytes() == kept * seq);
  CHECK(flash.KeptBytes() == (kept + 2 * 4096 + 4 * 32) * seq);
  // the backward re-creates everything the block saves but the kept outputs' aliases: gate's output
  // (SiLU's input), and under flash v, the SDPA output o_proj saves and the log-sum-exp
  CHECK(eager.FullBytes() - SumBytes(eager.recomputed) == 2LL * 14336 * seq);
  CHECK(flash.FullBytes() - SumBytes(flash.recomputed) == (2LL * 14336 + 2 * 1024 + 2 * 4096 + 4 * 32) * seq);
  // without GQA, eager's v is not repeated: its saved v is v_proj's output, kept
  BlockActivations mha = Profile("llama-2-7b", seq, Attention::kEager, Checkpointing::kSelectiveOp);
  CHECK(mha.FullBytes() - SumBytes(mha.recomputed) == (2LL * 11008 + 2 * 4096) * seq);
}

TEST_CASE("Only selective and full checkpointing re-create saved tensors; none keeps them all") {
  const BlockActivations none = Profile("llama-2-7b", 1024, Attention::kEager);
  CHECK(none.recomputed.empty());
  CHECK(none.KeptBytes() == none.FullBytes());
  const BlockActivations full = Profile("llama-2-7b", 1024, Attention::kEager, Checkpointing::kFull);
  CHECK(SumBytes(full.recomputed) == full.FullBytes());
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

ModelSpec WithLora(const char* id, int64_t rank, const char* targets, double dropout = 0) {
  ModelSpec m = Loaded(id);
  const LoraConfig lora{.rank = rank, .dropout = dropout, .targets = targets};
  REQUIRE(ApplyLora(m, lora).ok());
  return m;
}

TEST_CASE("LoRA on q_proj and v_proj: frozen linears and norms save less, the first block less again") {
  // llama-2-7b (h 4096, I 11008, 32 heads), flash, seq 4096, bf16, r 8. Full training saves
  // 24h + 8I + 136 bytes per token (above). Frozen: neither norm saves its normalised input
  // (2 x 2h), no frozen gate/up reads the second norm's output (2h), frozen down saves no input
  // (2I); lora_B saves each of the two lora_A outputs (2 x 2r).
  const ModelSpec m = WithLora("llama-2-7b", 8, "");
  FsdpConfig c;
  c.seq_len = 4096;
  const int64_t h = 4096, inner = 11008, r = 8;
  const int64_t later = 24 * h + 8 * inner + 136 - 6 * h - 2 * inner + 4 * r;
  CHECK(BlockActivationProfile(m, c, true).FullBytes() == later * 4096);
  // the first block's input (a frozen embedding's output) requires no grad: its norm saves
  // neither its fp32 input nor rsqrt (4h + 4)
  CHECK(BlockActivationProfile(m, c, false).FullBytes() == (later - 4 * h - 4) * 4096);
  CHECK_FALSE(BlockInputRequiresGrad(m, 0));
  CHECK(BlockInputRequiresGrad(m, 1));
  // the head: the final norm keeps its fp32 input and rsqrt only, lm_head (frozen) saves nothing
  CHECK(SumBytes(HeadActivationProfile(m, c).final_norm) == (4 * h + 4) * 4096);
}

TEST_CASE("LoRA on k_proj only, eager, first block: q k^T saves q for k's gradient, the softmax its output, probs @ v the expanded v") {
  // llama-2-7b eager at seq 128: only k requires grad in block 0. Saved per token: the first
  // norm's output (lora_A's input) 2h, lora_A's output 2r, q after RoPE 2h (for k's gradient;
  // k itself not: q needs none), the fp32 softmax 4as, v (repeat_kv returns it) 2h for the
  // scores' gradient, not the probabilities (v needs none); o_proj (frozen, eager) saves nothing.
  // Then the second norm 4h + 4 and SwiGLU's gate, act and up outputs 3 x 2I.
  const ModelSpec m = WithLora("llama-2-7b", 8, "k_proj");
  FsdpConfig c;
  c.seq_len = 128;
  c.attention = Attention::kEager;
  const int64_t h = 4096, inner = 11008, as = 32 * 128;
  CHECK(BlockActivationProfile(m, c, false).FullBytes() == (2 * h + 2 * 8 + 2 * h + 4 * as + 2 * h + 4 * h + 4 + 6 * inner) * 128);
}

TEST_CASE("LoRA dropout: each adapted linear saves its dropout's output and mask") {
  FsdpConfig c;
  c.seq_len = 4096;
  const ModelSpec plain = WithLora("llama-2-7b", 8, "q_proj,v_proj");
  const ModelSpec dropped = WithLora("llama-2-7b", 8, "q_proj,v_proj", 0.05);
  // per adapted linear 2h (its dropout's bf16 output) + h (the bool mask); the first norm's output
  // is no longer saved (lora_A reads the dropout's copy, and k is frozen): -2h
  CHECK(BlockActivationProfile(dropped, c).FullBytes() - BlockActivationProfile(plain, c).FullBytes() == (2 * 3 * 4096 - 2 * 4096) * 4096LL);
}

}  // namespace
}  // namespace fsdp
