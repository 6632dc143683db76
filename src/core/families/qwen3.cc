// Qwen3 (configuration_qwen3.py, modeling_qwen3.py): Llama's block, with an RMSNorm over head_dim
// on every head of q and of k (Qwen3Attention's q_norm and k_norm, between the projections and
// RoPE), an explicit head_dim (128 by default, not hidden / heads) and optional q/k/v/o biases
// (attention_bias, default false); the sliding window only with use_sliding_window.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadQwen3(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{151936, 4096, 22016, 32, 32, 32, 32768, false, 1e-6, 10000.0};
  defaults.head_dim = 128;  // Qwen3Config(head_dim=128)
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_ASSIGN_OR_RETURN(const bool bias, ReadFlag(r, "attention_bias", false));
  m.qkv_bias = bias;
  m.o_bias = bias;
  FSDP_ASSIGN_OR_RETURN(const bool use_window, ReadFlag(r, "use_sliding_window", false));
  if (use_window) FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "Qwen3DecoderLayer";
  m.arch.rope_rotate_half = true;
  AddLlamaAttention(m, bias, bias, m.arch.block);
  AddHeadQkNorms(m, m.arch.block);
  AddGatedMlp(m, false, m.arch.block);
  return {};
}

}  // namespace fsdp::families
