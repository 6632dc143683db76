// Mistral (configuration_mistral.py): Llama's block without biases, and a sliding attention window.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadMistral(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {32000, 4096, 14336, 32, 32, 8, 4096 * 32, false, 1e-6, 10000.0}, m));
  FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "MistralDecoderLayer";
  m.arch.rope_rotate_half = true;
  AddLlamaAttention(m, false, false, m.arch.block);
  AddGatedMlp(m, false, m.arch.block);
  return {};
}

}  // namespace fsdp::families
