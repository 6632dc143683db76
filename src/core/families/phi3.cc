// Phi-3 and Phi-4 (configuration_phi3.py, modeling_phi3.py): Llama's pre-norm block with the
// projections fused, one qkv_proj (hidden -> (heads + 2 kv_heads) x head_dim; q, k and v are views
// of its output) and one gate_up_proj (hidden -> 2 x intermediate; gate and up its halves), RoPE
// on a partial_rotary_factor share of each head's features (the rest joined after by torch.cat),
// resid_pdrop dropout on both sub-layers' outputs
// before the residual adds. No biases. embd_pdrop is read by the config but applied nowhere in
// transformers 5.24's Phi3Model.
#include "core/families/family.h"

namespace fsdp::families {

Status ReadPhi3(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {32064, 3072, 8192, 32, 32, 0, 4096, false, 1e-5, 10000.0}, m));
  FSDP_ASSIGN(m.residual_dropout, ReadProbability(r, "resid_pdrop", 0.0));
  const auto window = r.json().find("sliding_window");  // Phi3Config: None unless given
  if (window != r.json().end() && !window->is_null()) FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_TRY(ReadActivation(r, m));
  FSDP_ASSIGN(m.rotary_fraction, ReadPositive(r, "partial_rotary_factor", 1.0, 1.0));
  m.arch.decoder_layer_class = "Phi3DecoderLayer";
  m.arch.rope_rotate_half = true;
  m.arch.lora_default_targets = {};  // peft 0.21's mapping has "phi" (Phi-1/2), not "phi3"
  const int64_t h = m.hidden_size, q = m.num_heads * m.head_dim, kv = m.num_kv_heads * m.head_dim;
  auto& block = m.arch.block;
  block.push_back({ParamOp::Kind::kNorm, "input_layernorm", 0, h});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.qkv_proj", h, q + 2 * kv});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.o_proj", q, h});
  block.push_back({ParamOp::Kind::kNorm, "post_attention_layernorm", 0, h});
  block.push_back({ParamOp::Kind::kLinear, "mlp.gate_up_proj", h, 2 * m.intermediate_size});
  block.push_back({ParamOp::Kind::kLinear, "mlp.down_proj", m.intermediate_size, h});
  return {};
}

}  // namespace fsdp::families
