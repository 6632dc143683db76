// Llama 4's text model (configuration_llama4.py Llama4TextConfig, modeling_llama4.py): Llama's
// attention (head_dim 128 by default) whose RoPE layers L2-normalise each head's q and k without
// a weight (use_qk_norm) and attend within chunks of attention_chunk_size, and whose NoPE layers
// (no_rope_layers 0: every no_rope_layer_interval-th by default) have neither and scale q by a
// per-position temperature; the MLP of the layers in moe_layers (every interleave_moe_layer_step-th
// by default) is Llama4TextMoe: a router (feed_forward.router [experts, hidden]) keeping the
// top-k logits through a sigmoid, experts stored transposed (feed_forward.experts.gate_up_proj
// [experts, hidden, 2 x intermediate_size], down_proj [experts, intermediate_size, hidden]) that
// transformers runs on every token, and a shared SwiGLU expert of intermediate_size; the other
// layers' MLP is a SwiGLU of intermediate_size_mlp (Architecture::dense_block).
//
// The multimodal config (model_type llama4, Llama4Config: text_config and vision_config) loads as
// its text model: AutoModelForCausalLM, which every export uses, builds Llama4ForCausalLM from
// text_config alone (its tie_word_embeddings too) and leaves the vision model out, so that is the
// model planned. (Llama4ForConditionalGeneration adds the vision encoder and its projector.)
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {
namespace {

// An optional list of layer indices (moe_layers) into per-layer flags; absent or null: `fallback`.
Result<std::vector<bool>> ReadLayerIndexList(const JsonReader& r, const char* key, int64_t layers, std::vector<bool> fallback) {
  const auto it = r.json().find(key);
  if (it == r.json().end() || it->is_null()) return fallback;
  if (!it->is_array()) return r.KeyError(key, "expected a list of layer indices");
  std::vector<bool> flags(static_cast<size_t>(layers), false);
  for (const Json& index : *it) {
    if (!index.is_number_integer() || index.get<int64_t>() < 0 || index.get<int64_t>() >= layers) {
      return r.KeyError(key, fmt::format("expected layer indices from 0 to {}, got {}", layers - 1, index.dump()));
    }
    flags[static_cast<size_t>(index.get<int64_t>())] = true;
  }
  return flags;
}

// no_rope_layers: one 0 / 1 per layer (1: RoPE); absent, null or empty: Llama4TextConfig's default.
Result<std::vector<bool>> ReadNopeLayers(const JsonReader& r, int64_t layers) {
  FSDP_ASSIGN_OR_RETURN(const int64_t interval, ReadDim(r, {"no_rope_layer_interval"}, 4, kMaxLayers));
  std::vector<bool> nope(static_cast<size_t>(layers), false);
  for (int64_t i = 0; i < layers; ++i) nope[static_cast<size_t>(i)] = (i + 1) % interval == 0;
  const auto it = r.json().find("no_rope_layers");
  if (it == r.json().end() || it->is_null() || (it->is_array() && it->empty())) return nope;
  if (!it->is_array() || static_cast<int64_t>(it->size()) != layers) {
    return r.KeyError("no_rope_layers", fmt::format("expected a list of {} zeros and ones (one per layer)", layers));
  }
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& v = (*it)[i];
    if (!v.is_number_integer() || (v.get<int64_t>() != 0 && v.get<int64_t>() != 1)) {
      return r.KeyError("no_rope_layers", fmt::format("expected 0 or 1 per layer, got {} at {}", v.dump(), i));
    }
    nope[i] = v.get<int64_t>() == 0;
  }
  return nope;
}

}  // namespace

Status ReadLlama4Text(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{202048, 5120, 8192, 48, 40, 8, 4096 * 32, false, 1e-5, 500000.0};
  defaults.head_dim = 128;  // Llama4TextConfig(head_dim=128)
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_ASSIGN_OR_RETURN(const bool bias, ReadFlag(r, "attention_bias", false));
  m.qkv_bias = m.o_bias = bias;
  FSDP_ASSIGN_OR_RETURN(const int64_t dense_inner, ReadDim(r, {"intermediate_size_mlp"}, 16384, kMaxDim));
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"num_local_experts"}, 16, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 1, kMaxExperts));
  if (m.experts_per_token > m.num_experts) {
    return r.KeyError("num_experts_per_tok", fmt::format("{} exceeds num_local_experts {}", m.experts_per_token, m.num_experts));
  }
  FSDP_ASSIGN_OR_RETURN(const int64_t step, ReadDim(r, {"interleave_moe_layer_step"}, 1, kMaxLayers));
  std::vector<bool> routed(static_cast<size_t>(m.num_layers), false);
  for (int64_t i = step - 1; i < m.num_layers; i += step) routed[static_cast<size_t>(i)] = true;
  FSDP_ASSIGN(routed, ReadLayerIndexList(r, "moe_layers", m.num_layers, routed));
  FSDP_ASSIGN(m.layer_nope, ReadNopeLayers(r, m.num_layers));
  FSDP_ASSIGN(m.qk_l2_norm, ReadFlag(r, "use_qk_norm", true));
  FSDP_ASSIGN(m.nope_temperature_tuning, ReadFlag(r, "attn_temperature_tuning", true));
  // chunked attention on the RoPE layers: for what autograd saves, a window (a mask once shorter
  // than the sequence); null: none
  const auto chunk = r.json().find("attention_chunk_size");
  if (chunk == r.json().end() || !chunk->is_null()) {
    FSDP_ASSIGN(m.sliding_window, ReadDim(r, {"attention_chunk_size"}, 8192, kMaxPositions));
    m.layer_sliding.assign(m.layer_nope.size(), false);
    for (size_t i = 0; i < m.layer_nope.size(); ++i) m.layer_sliding[i] = !m.layer_nope[i];
  }
  FSDP_TRY(ReadActivation(r, m));
  Architecture& a = m.arch;
  a.decoder_layer_class = "Llama4TextDecoderLayer";
  a.modeling_module = "llama4";
  a.softmax_fp32 = false;  // eager_attention_forward's softmax(attn_weights, dim=-1) in the compute dtype
  a.experts_dense_dispatch = true;
  a.mlp_output = "feed_forward.down_proj";  // the dense layers' MLP (the routed ones have no such module)
  a.mlp_module = "feed_forward";
  a.lora_default_targets = {};  // peft 0.21's mapping has "llama4" (the multimodal type), not "llama4_text"
  m.router = ModelShape::Router::kTopKThenSigmoid;
  const int64_t h = m.hidden_size, inner = m.intermediate_size;
  if (std::find(routed.begin(), routed.end(), false) != routed.end()) {
    a.dense_layers.resize(routed.size());
    for (size_t i = 0; i < routed.size(); ++i) a.dense_layers[i] = !routed[i];
    AddLlamaAttention(m, bias, bias, a.dense_block);
    a.dense_block.push_back({ParamOp::Kind::kLinear, "feed_forward.gate_proj", h, dense_inner});
    a.dense_block.push_back({ParamOp::Kind::kLinear, "feed_forward.up_proj", h, dense_inner});
    a.dense_block.push_back({ParamOp::Kind::kLinear, "feed_forward.down_proj", dense_inner, h});
  }
  a.mlp = MlpKind::kMoe;
  AddLlamaAttention(m, bias, bias, a.block);
  AddFusedExperts(m, a.block, {"feed_forward.router", false, true, "feed_forward.experts", true});
  a.block.push_back({ParamOp::Kind::kLinear, "feed_forward.shared_expert.gate_proj", h, inner});
  a.block.push_back({ParamOp::Kind::kLinear, "feed_forward.shared_expert.up_proj", h, inner});
  a.block.push_back({ParamOp::Kind::kLinear, "feed_forward.shared_expert.down_proj", inner, h});
  return {};
}

Status ReadLlama4(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN_OR_RETURN(const JsonReader text, ReadSubConfig(r, "text_config"));
  return ReadLlama4Text(text, m);
}

}  // namespace fsdp::families
