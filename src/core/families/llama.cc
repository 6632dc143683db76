// Llama (transformers' configuration_llama.py, modeling_llama.py): RMSNorm, GQA attention with
// RoPE, SwiGLU; q/k/v/o biases with attention_bias, MLP biases with mlp_bias.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadLlama(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {32000, 4096, 11008, 32, 32, 0, 2048, false, 1e-6, 10000.0}, m));
  FSDP_ASSIGN(m.qkv_bias, ReadFlag(r, "attention_bias", false));
  m.o_bias = m.qkv_bias;
  FSDP_ASSIGN(m.mlp_bias, ReadFlag(r, "mlp_bias", false));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "LlamaDecoderLayer";
  m.arch.rope_rotate_half = true;
  AddLlamaAttention(m, m.qkv_bias, m.o_bias, m.arch.block);
  AddGatedMlp(m, m.mlp_bias, m.arch.block);
  return {};
}

}  // namespace fsdp::families
