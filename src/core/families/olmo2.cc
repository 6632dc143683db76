// OLMo 2 (configuration_olmo2.py, modeling_olmo2.py): Llama's projections and SwiGLU, with the
// norms moved onto the sub-layers' outputs (Olmo2DecoderLayer: x + post_attention_layernorm(attn(x)),
// then h + post_feedforward_layernorm(mlp(h)); no input norm), an RMSNorm over the whole q and k
// projections (q_norm: heads x head_dim, k_norm: kv_heads x head_dim, before RoPE), and
// Olmo2RMSNorm's `(weight * x).to(dtype)`, which multiplies by the weight in fp32.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadOlmo2(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {50304, 4096, 11008, 32, 32, 0, 2048, false, 1e-5, 10000.0}, m));
  FSDP_ASSIGN(m.qkv_bias, ReadFlag(r, "attention_bias", false));
  m.o_bias = m.qkv_bias;
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "Olmo2DecoderLayer";
  m.arch.rope_rotate_half = true;
  m.arch.norm_placement = NormPlacement::kPost;
  m.arch.norm_weight_fp32 = true;
  m.arch.lora_default_targets = {};  // peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no olmo2
  // Olmo2DecoderLayer registers self_attn (q, k, v, o, q_norm, k_norm), mlp, then the two norms.
  const int64_t h = m.hidden_size, q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
  auto& block = m.arch.block;
  block.push_back({ParamOp::Kind::kLinear, "self_attn.q_proj", h, q, m.qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.k_proj", h, kv, m.qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.v_proj", h, kv, m.qkv_bias});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.o_proj", q, h, m.o_bias});
  const std::vector<ParamOp> qk_norms = QkNorms(m, false);
  block.insert(block.end(), qk_norms.begin(), qk_norms.end());
  AddGatedMlp(m, false, block);
  block.push_back({ParamOp::Kind::kNorm, "post_attention_layernorm", 0, h});
  block.push_back({ParamOp::Kind::kNorm, "post_feedforward_layernorm", 0, h});
  return {};
}

}  // namespace fsdp::families
