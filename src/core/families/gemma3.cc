// Gemma 3's multimodal model (configuration_gemma3.py Gemma3Config, modeling_gemma3.py
// Gemma3ForConditionalGeneration, which AutoModelForCausalLM builds for model_type gemma3): the
// text model of `text_config` (gemma3_text, gemma.cc) under model.language_model, lm_head tied by
// the top-level tie_word_embeddings (default true; text_config's is not read), and beside it a
// SigLIP vision tower of `vision_config` (configuration_siglip.py SiglipVisionConfig,
// modeling_siglip.py SiglipVisionTransformer) and Gemma3MultiModalProjector:
//   model.vision_tower.embeddings: patch_embedding Conv2d(channels, hidden, patch, stride patch)
//     with a bias, position_embedding [(image_size / patch_size)^2, hidden];
//   encoder.layers.i (SiglipEncoderLayer): layer_norm1, self_attn k/v/q/out_proj (hidden x hidden,
//     biased), layer_norm2, mlp fc1 (hidden -> intermediate) and fc2, biased; LayerNorms;
//   post_layernorm; with vision_use_head (SiglipVisionConfig's default, false in every published
//     Gemma 3) the pooling head: probe [1, 1, hidden], nn.MultiheadAttention (in_proj [3 hidden,
//     hidden] and its bias, out_proj), layernorm, mlp;
//   model.multi_modal_projector: mm_input_projection_weight [vision hidden, text hidden] and
//     mm_soft_emb_norm (a Gemma RMSNorm over the vision hidden size).
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {

Status ReadGemma3Text(const JsonReader& r, ModelSpec& m);

namespace {

ParamOp Linear(std::string module, int64_t in, int64_t out, bool bias) {
  ParamOp op{ParamOp::Kind::kLinear, std::move(module), in, out};
  op.bias = bias;
  return op;
}

ParamOp Parameter(std::string name, std::vector<int64_t> shape) {
  ParamOp op{ParamOp::Kind::kParameter, std::move(name)};
  op.shape = std::move(shape);
  return op;
}

// SiglipVisionConfig's keys (its defaults: a SigLIP base at 224 px) into the tower.
Status ReadSiglipTower(const JsonReader& v, int64_t text_hidden, VisionTower& t) {
  FSDP_ASSIGN_OR_RETURN(const int64_t h, ReadDim(v, {"hidden_size"}, 768, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const int64_t inner, ReadDim(v, {"intermediate_size"}, 3072, kMaxDim));
  FSDP_ASSIGN(t.num_layers, ReadDim(v, {"num_hidden_layers"}, 12, kMaxLayers));
  FSDP_ASSIGN_OR_RETURN(const int64_t heads, ReadDim(v, {"num_attention_heads"}, 12, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const int64_t channels, ReadDim(v, {"num_channels"}, 3, 64));
  FSDP_ASSIGN_OR_RETURN(const int64_t image, ReadDim(v, {"image_size"}, 224, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const int64_t patch, ReadDim(v, {"patch_size"}, 16, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const bool head, ReadFlag(v, "vision_use_head", true));
  if (h % heads != 0) return v.KeyError("num_attention_heads", fmt::format("{} does not divide hidden_size {}", heads, h));
  if (patch > image) return v.KeyError("patch_size", fmt::format("{} exceeds image_size {}", patch, image));
  const int64_t patches_per_side = image / patch;
  if (patches_per_side > (int64_t{1} << 12)) return v.KeyError("image_size", fmt::format("{} / patch_size {} gives over 4096 patches a side", image, patch));
  const std::string tower = "model.vision_tower";
  t.layer_class = "SiglipEncoderLayer";
  t.norm = NormKind::kLayer;
  t.before = {Parameter(tower + ".embeddings.patch_embedding.weight", {h, channels, patch, patch}),
              Parameter(tower + ".embeddings.patch_embedding.bias", {h}),
              Parameter(tower + ".embeddings.position_embedding.weight", {patches_per_side * patches_per_side, h})};
  t.layers = tower + ".encoder.layers";
  t.layer = {{ParamOp::Kind::kNorm, "layer_norm1", 0, h},      Linear("self_attn.k_proj", h, h, true), Linear("self_attn.v_proj", h, h, true),
             Linear("self_attn.q_proj", h, h, true),           Linear("self_attn.out_proj", h, h, true),
             {ParamOp::Kind::kNorm, "layer_norm2", 0, h},      Linear("mlp.fc1", h, inner, true), Linear("mlp.fc2", inner, h, true)};
  t.after = {{ParamOp::Kind::kNorm, tower + ".post_layernorm", 0, h}};
  if (head) {
    t.after.push_back(Parameter(tower + ".head.probe", {1, 1, h}));
    t.after.push_back(Parameter(tower + ".head.attention.in_proj_weight", {3 * h, h}));
    t.after.push_back(Parameter(tower + ".head.attention.in_proj_bias", {3 * h}));
    t.after.push_back(Linear(tower + ".head.attention.out_proj", h, h, true));
    t.after.push_back({ParamOp::Kind::kNorm, tower + ".head.layernorm", 0, h});
    t.after.push_back(Linear(tower + ".head.mlp.fc1", h, inner, true));
    t.after.push_back(Linear(tower + ".head.mlp.fc2", inner, h, true));
  }
  t.after.push_back(Parameter("model.multi_modal_projector.mm_input_projection_weight", {h, text_hidden}));
  t.after.push_back(Parameter("model.multi_modal_projector.mm_soft_emb_norm.weight", {h}));
  return {};
}

}  // namespace

Status ReadGemma3(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN_OR_RETURN(const JsonReader text, ReadSubConfig(r, "text_config"));
  FSDP_TRY(ReadGemma3Text(text, m));
  FSDP_ASSIGN(m.tie_word_embeddings, ReadFlag(r, "tie_word_embeddings", true));
  ModuleNames& names = m.arch.names;
  names.embedding = "model.language_model.embed_tokens";
  names.blocks = "model.language_model.layers";
  names.final_norm = "model.language_model.norm";
  m.arch.lora_default_targets = {};  // peft 0.21's mapping has gemma3_text, not gemma3
  FSDP_ASSIGN_OR_RETURN(const JsonReader vision, ReadSubConfig(r, "vision_config"));
  return ReadSiglipTower(vision, m.hidden_size, m.arch.vision);
}

}  // namespace fsdp::families
