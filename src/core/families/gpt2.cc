// GPT-2 (configuration_gpt2.py, modeling_gpt2.py): learned positions, LayerNorm, fused q/k/v
// (c_attn) and a plain MLP (c_fc, c_proj) as Conv1D layers (weights stored [in, out]) with biases,
// dropout after embeddings, attention and residuals.
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {

Status ReadGpt2(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN(m.vocab_size, ReadDim(r, {"vocab_size"}, 50257, kMaxVocab));
  FSDP_ASSIGN(m.hidden_size, ReadDim(r, {"n_embd", "hidden_size"}, 768, kMaxDim));
  FSDP_ASSIGN(m.num_layers, ReadDim(r, {"n_layer", "num_hidden_layers"}, 12, kMaxLayers));
  FSDP_ASSIGN(m.num_heads, ReadDim(r, {"n_head", "num_attention_heads"}, 12, kMaxDim));
  FSDP_ASSIGN(m.max_position_embeddings, ReadDim(r, {"n_positions", "max_position_embeddings"}, 1024, kMaxPositions));
  FSDP_ASSIGN(m.intermediate_size, ReadDim(r, {"n_inner"}, 4 * m.hidden_size, kMaxDim));
  m.num_kv_heads = m.num_heads;
  FSDP_ASSIGN_OR_RETURN(const int64_t head_dim, ReadDim(r, {"head_dim"}, 0, kMaxDim));
  if (head_dim == 0 && m.hidden_size % m.num_heads != 0) {
    return Error::BadInput(fmt::format("{}: hidden size {} is not divisible by {} attention heads (and no head_dim is given)", r.origin(), m.hidden_size, m.num_heads));
  }
  m.head_dim = head_dim == 0 ? m.hidden_size / m.num_heads : head_dim;
  FSDP_TRY(CheckHeads(r, m));
  FSDP_ASSIGN(m.norm_eps, ReadPositive(r, "layer_norm_epsilon", 1e-5, 0.1));
  m.rope_theta = 0;  // learned positions
  FSDP_ASSIGN(m.tie_word_embeddings, ReadFlag(r, "tie_word_embeddings", true));
  m.qkv_bias = m.o_bias = m.mlp_bias = true;
  FSDP_ASSIGN_OR_RETURN(const std::optional<std::string> act, r.OptionalString("activation_function"));
  m.activation = act.value_or("gelu_new");
  FSDP_ASSIGN(m.attention_dropout, ReadProbability(r, "attn_pdrop", 0.1));
  FSDP_ASSIGN(m.residual_dropout, ReadProbability(r, "resid_pdrop", 0.1));
  FSDP_ASSIGN(m.embedding_dropout, ReadProbability(r, "embd_pdrop", 0.1));
  Architecture& a = m.arch;
  a.decoder_layer_class = "GPT2Block";
  a.names = {"transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"};
  a.norm = NormKind::kLayer;
  a.mlp = MlpKind::kPlain;
  a.fused_qkv = true;
  a.softmax_fp32 = false;
  a.attention_output = "attn.c_proj";
  a.mlp_output = "mlp.c_proj";
  a.attention_module = "attn";
  a.lora_default_targets = {"c_attn"};
  const int64_t h = m.hidden_size, inner = m.intermediate_size;
  a.block = {{ParamOp::Kind::kNorm, "ln_1", 0, h},
             {ParamOp::Kind::kLinear, "attn.c_attn", h, 3 * h, true, true},
             {ParamOp::Kind::kLinear, "attn.c_proj", h, h, true, true},
             {ParamOp::Kind::kNorm, "ln_2", 0, h},
             {ParamOp::Kind::kLinear, "mlp.c_fc", h, inner, true, true},
             {ParamOp::Kind::kLinear, "mlp.c_proj", inner, h, true, true}};
  return {};
}

}  // namespace fsdp::families
