// The model families fsdpkit loads, one file each (llama.cc, mistral.cc, ...), registered in
// families.cc: each reads its config.json keys with transformers' defaults
// (configuration_<type>.py) into a ModelSpec's hyper-parameters and Architecture. The readers and
// block pieces they share are here.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/json_io.h"
#include "core/model_spec.h"
#include "core/status.h"

namespace fsdp::families {

struct Family {
  std::string_view model_type;  ///< HF model_type
  /// Fills `model`'s hyper-parameters and architecture from the config (model_type, id already set);
  /// BadInput naming the key for values out of range.
  Status (*read)(const JsonReader& config, ModelSpec& model);
  /// The first transformers release that plans it (`--transformers-version`): the first whose
  /// models/ holds the type (read in the wheels of 4.30.2 to 4.55.4), and no earlier than 4.31
  /// (ParseTransformersVersion); GPT-2's loss before 4.48 ran in the logits' own dtype, unmodelled.
  TransformersVersion plannable_since;
  /// The first release whose ForCausalLM computes its loss with ForCausalLMLoss (loss_function):
  /// 4.46, Mistral's and GPT-2's 4.48 (core/fsdp_config.h HfLoss).
  TransformersVersion loss_function_since{4, 46};
  /// The last release whose attention layers each register RoPE tables of max_position_embeddings
  /// rows (the rotary embedding's cos_cached and sin_cached, [P, head_dim] each, beside inv_freq):
  /// read in the wheels of 4.31.0 to 4.48.1 (`register_buffer("cos_cached"` or "_cos_cached").
  /// {0, 0}: none in any release that plans the family.
  TransformersVersion rope_tables_until{0, 0};
  /// The one release whose model registers a bool causal_mask buffer of [P, P] positions
  /// (LlamaModel.__init__ of 4.38.2: torch.triu of a full matrix; gone in 4.39). {0, 0}: none.
  TransformersVersion causal_mask_buffer_in{0, 0};
};

/// Every family, in the order error messages list them.
const std::vector<Family>& Families();
/// The family of HF `model_type`; null when fsdpkit has none.
const Family* FindFamily(std::string_view model_type);

// ---- config readers (families/config_keys.cc) -----------------------------------------------

/// Upper bounds that no real checkpoint comes near; beyond them a value is a typo.
constexpr int64_t kMaxDim = 1 << 20;
constexpr int64_t kMaxLayers = 10000;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxVocab = 16 << 20;
constexpr int64_t kMaxPositions = int64_t{1} << 24;

/// An integer key (or the first present of several aliases) with a default and a range 1..max_value.
Result<int64_t> ReadDim(const JsonReader& r, std::initializer_list<const char*> keys, int64_t fallback, int64_t max_value);
/// A dropout probability in [0, 1).
Result<double> ReadProbability(const JsonReader& r, const char* key, double fallback);
/// A real in (0, max_value].
Result<double> ReadPositive(const JsonReader& r, const char* key, double fallback, double max_value);
Result<bool> ReadFlag(const JsonReader& r, const char* key, bool fallback);

/// Defaults of the keys every decoder has, where transformers' configuration files differ.
struct DecoderDefaults {
  int64_t vocab_size, hidden_size, intermediate_size, num_layers, num_heads;
  int64_t num_kv_heads;  ///< 0: the same as the heads
  int64_t max_position_embeddings;
  bool tie_word_embeddings;
  double rms_norm_eps;
  double rope_theta;
  /// the family sets head_dim itself (DeepSeek's MLA): hidden need not divide into the heads
  bool own_head_dim = false;
  /// head_dim when the config has none (the configuration class's default: Qwen3Config 128,
  /// Gemma's 256, GptOssConfig 64); 0: hidden / heads
  int64_t head_dim = 0;
};
/// vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
/// num_key_value_heads, head_dim (hidden / heads when absent), max_position_embeddings,
/// tie_word_embeddings, rms_norm_eps, rope_theta and the RoPE scaling (rope_scaling or
/// rope_parameters), hidden_act, attention_dropout: the keys of a Llama-style config.
Status ReadDecoderKeys(const JsonReader& r, const DecoderDefaults& d, ModelSpec& m);
/// hidden_act (default silu) and attention_dropout (default 0), after the family's own keys.
Status ReadActivation(const JsonReader& r, ModelSpec& m);
/// `sliding_window`: 4096 when absent (MistralConfig's and Qwen2Config's default), 0 (none) when null.
Result<int64_t> ReadSlidingWindow(const JsonReader& r);
/// `layer_types` (transformers 5: "sliding_attention" or "full_attention" per layer) into
/// m.layer_sliding, else every `pattern`-th layer (1-based) full and the others sliding, as
/// Gemma2Config (2) and Gemma3TextConfig (sliding_window_pattern, 6) default them.
Status ReadLayerTypes(const JsonReader& r, int64_t pattern, ModelSpec& m);
/// A nested config (a multimodal model's text_config, vision_config); absent or null: an empty
/// object, every key at its default.
Result<JsonReader> ReadSubConfig(const JsonReader& r, const char* key);
/// BadInput unless the heads divide into the key/value heads (and, with no head_dim, hidden into heads).
Status CheckHeads(const JsonReader& r, const ModelSpec& m);

// ---- block pieces (families/config_keys.cc) --------------------------------------------------

/// A Llama-style attention: the input RMSNorm, q/k/v/o projections (heads x head_dim, kv_heads x
/// head_dim) with optional biases, the post-attention RMSNorm.
void AddLlamaAttention(const ModelSpec& m, bool qkv_bias, bool o_bias, std::vector<ParamOp>& block);
/// q_norm and k_norm, RMSNorms inside the attention: over head_dim on every head (Qwen3's,
/// `per_head`) or over the whole q and k projections (OLMo 2's).
std::vector<ParamOp> QkNorms(const ModelSpec& m, bool per_head);
/// Qwen3's per-head q_norm and k_norm, inserted after o_proj as Qwen3Attention registers them
/// (before the block's post-attention norm, the last op).
void AddHeadQkNorms(const ModelSpec& m, std::vector<ParamOp>& block);
/// SwiGLU: gate_proj and up_proj (hidden -> intermediate), down_proj back.
void AddGatedMlp(const ModelSpec& m, bool bias, std::vector<ParamOp>& block);
/// How a family lays out its router and fused experts.
struct FusedExpertsLayout {
  const char* router = "mlp.gate";
  bool biases = false;      ///< gpt-oss's: the router's and each expert projection's ("<name>_bias" [experts, out])
  bool transposed = false;  ///< gpt-oss's and Llama 4's experts are stored [experts, in, out]
  const char* experts = "mlp.experts";
  bool dense_dispatch = false;  ///< Llama 4's: every token through every expert (ParamOp::dense_dispatch)
};
/// A router [experts, hidden] and routed SwiGLU experts as transformers 5 stores them: two 3-D
/// parameters, mlp.experts.gate_up_proj [experts, 2 x intermediate, hidden] and
/// mlp.experts.down_proj [experts, hidden, intermediate] (Qwen3MoeExperts, DeepseekV3Experts;
/// GptOssExperts transposed), each token through experts_per_token of them; intermediate is
/// m.intermediate_size.
void AddFusedExperts(const ModelSpec& m, std::vector<ParamOp>& block, const FusedExpertsLayout& layout = {});
/// `sliding_window` with the family's default when absent, 0 (none) when null.
Result<int64_t> ReadSlidingWindow(const JsonReader& r, int64_t fallback);

}  // namespace fsdp::families
