// Gemma 2 and Gemma 3's text model (configuration_gemma2.py / modeling_gemma2.py,
// configuration_gemma3.py / modeling_gemma3.py): four RMSNorms per block, one before and one
// after each sub-layer (NormPlacement::kSandwich), each `(x * (1 + weight)).type_as(x)` in fp32
// (Gemma2RMSNorm, Gemma3RMSNorm); an explicit head_dim (256 by default); GeGLU
// (hidden_activation gelu_pytorch_tanh) with Llama's gate/up/down; the embedding scaled by
// sqrt(hidden) (a constant: no shape); tied embeddings by default; sliding-window layers
// alternating with global ones (layer_types; only their masks differ). Gemma 2 soft-caps the
// attention scores (attn_logit_softcapping 50, which rules out SDPA: Gemma2PreTrainedModel's
// _supports_sdpa = False) and the logits (final_logit_softcapping 30); Gemma 3 has neither by
// default, and per-head q_norm / k_norm instead.
#include "core/families/family.h"

namespace fsdp::families {
namespace {

// A softcap value: null or absent is none (0).
Result<double> ReadSoftcap(const JsonReader& r, const char* key, double fallback) {
  const auto it = r.json().find(key);
  if (it != r.json().end() && it->is_null()) return 0.0;
  return ReadPositive(r, key, fallback, 1e6);
}

Status ReadGemmaBlock(const JsonReader& r, bool head_qk_norms, ModelSpec& m) {
  FSDP_ASSIGN(m.qkv_bias, ReadFlag(r, "attention_bias", false));
  m.o_bias = m.qkv_bias;
  FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_TRY(ReadActivation(r, m));
  FSDP_ASSIGN_OR_RETURN(const std::optional<std::string> act, r.OptionalString("hidden_activation"));
  m.activation = act.value_or("gelu_pytorch_tanh");
  m.arch.norm_placement = NormPlacement::kSandwich;
  m.arch.norm_weight_fp32 = true;
  m.arch.rope_rotate_half = true;
  const int64_t h = m.hidden_size;
  AddLlamaAttention(m, m.qkv_bias, m.qkv_bias, m.arch.block);  // ends with post_attention_layernorm
  if (head_qk_norms) AddHeadQkNorms(m, m.arch.block);
  m.arch.qk_norms_after_projections = head_qk_norms;
  m.arch.block.push_back({ParamOp::Kind::kNorm, "pre_feedforward_layernorm", 0, h});
  AddGatedMlp(m, false, m.arch.block);
  m.arch.block.push_back({ParamOp::Kind::kNorm, "post_feedforward_layernorm", 0, h});
  return {};
}

}  // namespace

Status ReadGemma2(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{256000, 2304, 9216, 26, 8, 4, 8192, true, 1e-6, 10000.0};
  defaults.head_dim = 256;  // Gemma2Config(head_dim=256)
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_TRY(ReadLayerTypes(r, 2, m));  // Gemma2Config: every second layer full
  FSDP_ASSIGN(m.attn_logit_softcapping, ReadSoftcap(r, "attn_logit_softcapping", 50.0));
  FSDP_ASSIGN(m.final_logit_softcapping, ReadSoftcap(r, "final_logit_softcapping", 30.0));
  m.arch.decoder_layer_class = "Gemma2DecoderLayer";
  return ReadGemmaBlock(r, false, m);
}

Status ReadGemma3Text(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{262208, 2304, 9216, 26, 8, 4, 131072, true, 1e-6, 1e6};
  defaults.head_dim = 256;  // Gemma3TextConfig(head_dim=256)
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_ASSIGN(m.attn_logit_softcapping, ReadSoftcap(r, "attn_logit_softcapping", 0.0));
  FSDP_ASSIGN(m.final_logit_softcapping, ReadSoftcap(r, "final_logit_softcapping", 0.0));
  FSDP_ASSIGN_OR_RETURN(const int64_t pattern, ReadDim(r, {"sliding_window_pattern"}, 6, kMaxLayers));
  FSDP_TRY(ReadLayerTypes(r, pattern, m));
  m.arch.decoder_layer_class = "Gemma3DecoderLayer";
  m.arch.modeling_module = "gemma3";
  return ReadGemmaBlock(r, true, m);
}

}  // namespace fsdp::families
