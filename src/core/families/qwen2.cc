// Qwen2 (configuration_qwen2.py, modeling_qwen2.py): Llama's block with biases on q/k/v (not on
// o_proj); the sliding window only with use_sliding_window.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadQwen2(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {151936, 4096, 22016, 32, 32, 32, 32768, false, 1e-6, 10000.0}, m));
  m.qkv_bias = true;  // Qwen2Attention: q/k/v Linear(bias=True), o_proj bias=False
  FSDP_ASSIGN_OR_RETURN(const bool use_window, ReadFlag(r, "use_sliding_window", false));  // then from max_window_layers on
  if (use_window) FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "Qwen2DecoderLayer";
  m.arch.rope_rotate_half = true;
  AddLlamaAttention(m, true, false, m.arch.block);
  AddGatedMlp(m, false, m.arch.block);
  return {};
}

}  // namespace fsdp::families
