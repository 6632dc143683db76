// gpt-oss (configuration_gpt_oss.py, modeling_gpt_oss.py): Llama's attention with biases
// (attention_bias, true by default) and a learned sink logit per head (self_attn.sinks, which
// rules out SDPA: GptOssPreTrainedModel's _supports_sdpa = False); sliding-window layers (128
// tokens) alternating with full ones (layer_types); RMSNorms that multiply by their weight in fp32
// (GptOssRMSNorm's `(self.weight * hidden_states).to(input_dtype)`); every MLP routed: a router
// with a bias (GptOssTopKRouter: mlp.router.weight [experts, hidden], mlp.router.bias [experts]),
// num_local_experts experts stored transposed with biases (GptOssExperts: gate_up_proj
// [experts, hidden, 2 x intermediate], gate_up_proj_bias [experts, 2 x intermediate], down_proj
// [experts, intermediate, hidden], down_proj_bias [experts, hidden]) and a clamped SwiGLU.
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {

Status ReadGptOss(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{201088, 2880, 2880, 36, 64, 8, 131072, false, 1e-5, 150000.0};
  defaults.head_dim = 64;  // GptOssConfig(head_dim=64)
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_ASSIGN_OR_RETURN(const bool bias, ReadFlag(r, "attention_bias", true));
  m.qkv_bias = m.o_bias = bias;
  FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r, 128));
  FSDP_TRY(ReadLayerTypes(r, 2, m));  // GptOssConfig: every second layer full
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"num_local_experts", "num_experts"}, 128, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 4, kMaxExperts));
  if (m.experts_per_token > m.num_experts) {
    return r.KeyError("num_experts_per_tok", fmt::format("{} exceeds num_local_experts {}", m.experts_per_token, m.num_experts));
  }
  FSDP_TRY(ReadActivation(r, m));
  m.attention_sinks = true;
  Architecture& a = m.arch;
  a.decoder_layer_class = "GptOssDecoderLayer";
  a.norm_weight_fp32 = true;
  a.softmax_fp32 = false;  // eager_attention_forward's softmax(..., dtype=combined_logits.dtype)
  a.qkv_transposed_views = false;  // _apply_rotary_emb: torch.cat of the two halves
  a.experts_clamped_swiglu = true;
  m.router = ModelShape::Router::kTopKThenSoftmax;
  a.mlp = MlpKind::kMoe;
  a.lora_default_targets = {};  // none in peft 0.21's mapping
  AddLlamaAttention(m, bias, bias, a.block);  // ends with post_attention_layernorm
  a.block.insert(a.block.end() - 1, ParamOp{ParamOp::Kind::kParameter, "self_attn.sinks", 0, m.num_heads});
  AddFusedExperts(m, a.block, {"mlp.router", true, true});
  return {};
}

}  // namespace fsdp::families
