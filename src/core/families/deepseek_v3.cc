// DeepSeek-V3 (configuration_deepseek_v3.py, modeling_deepseek_v3.py; Kimi K2 and Moonlight
// share the type): multi-head latent attention (ModelShape::mla) and, from layer
// first_k_dense_replace on, DeepseekV3MoE: a sigmoid router with group-limited top-k
// (mlp.gate.weight [experts, hidden], its e_score_correction_bias a buffer), n_routed_experts
// SwiGLU experts stored as two 3-D parameters (DeepseekV3Experts: gate_up_proj
// [experts, 2 x moe_intermediate_size, hidden], down_proj [experts, hidden, moe_intermediate_size])
// and a shared SwiGLU MLP of n_shared_experts x moe_intermediate_size every token runs. The first
// layers run a dense SwiGLU MLP of intermediate_size (Architecture::dense_block). The checkpoint's
// multi-token-prediction layers (num_mtp_layers) are not part of DeepseekV3ForCausalLM.
#include <algorithm>

#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {
namespace {

Status ReadLatentAttention(const JsonReader& r, ModelSpec& m) {
  LatentAttention& a = m.mla;
  const auto q_rank = r.json().find("q_lora_rank");
  if (q_rank == r.json().end() || !q_rank->is_null()) FSDP_ASSIGN(a.q_lora_rank, ReadDim(r, {"q_lora_rank"}, 1536, kMaxDim));  // null: q_proj
  FSDP_ASSIGN(a.kv_lora_rank, ReadDim(r, {"kv_lora_rank"}, 512, kMaxDim));
  FSDP_ASSIGN(a.qk_nope_head_dim, ReadDim(r, {"qk_nope_head_dim"}, 128, kMaxDim));
  FSDP_ASSIGN(a.qk_rope_head_dim, ReadDim(r, {"qk_rope_head_dim"}, 64, kMaxDim));
  FSDP_ASSIGN(a.v_head_dim, ReadDim(r, {"v_head_dim"}, 128, kMaxDim));
  m.head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;  // DeepseekV3Attention's qk_head_dim
  if (m.num_kv_heads != m.num_heads) {
    // every head decompresses its own k and v from the latent (kv_b_proj): num_key_value_heads
    // only sets repeat_kv's groups, which differ from 1 in no released checkpoint
    return r.KeyError("num_key_value_heads", fmt::format("MLA decompresses k and v for every head: expected {} (num_attention_heads), got {}",
                                                         m.num_heads, m.num_kv_heads));
  }
  return {};
}

// The attention's modules in forward order, the RMSNorms of the two latents among them.
void AddLatentAttention(const ModelSpec& m, std::vector<ParamOp>& block) {
  const LatentAttention& a = m.mla;
  const int64_t h = m.hidden_size, heads = m.num_heads;
  auto latent_norm = [](const char* module, int64_t dim) {
    ParamOp norm{ParamOp::Kind::kNorm, module, 0, dim};
    norm.qk_norm = true;  // inside the attention, not over the hidden states
    return norm;
  };
  block.push_back({ParamOp::Kind::kNorm, "input_layernorm", 0, h});
  if (a.q_lora_rank == 0) {
    block.push_back({ParamOp::Kind::kLinear, "self_attn.q_proj", h, heads * m.head_dim});
  } else {
    block.push_back({ParamOp::Kind::kLinear, "self_attn.q_a_proj", h, a.q_lora_rank, m.qkv_bias});
    block.push_back(latent_norm("self_attn.q_a_layernorm", a.q_lora_rank));
    block.push_back({ParamOp::Kind::kLinear, "self_attn.q_b_proj", a.q_lora_rank, heads * m.head_dim});
  }
  block.push_back({ParamOp::Kind::kLinear, "self_attn.kv_a_proj_with_mqa", h, a.kv_lora_rank + a.qk_rope_head_dim, m.qkv_bias});
  block.push_back(latent_norm("self_attn.kv_a_layernorm", a.kv_lora_rank));
  block.push_back({ParamOp::Kind::kLinear, "self_attn.kv_b_proj", a.kv_lora_rank, heads * (a.qk_nope_head_dim + a.v_head_dim)});
  block.push_back({ParamOp::Kind::kLinear, "self_attn.o_proj", heads * a.v_head_dim, h, m.o_bias});
  block.push_back({ParamOp::Kind::kNorm, "post_attention_layernorm", 0, h});
}

Status ReadRouting(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"n_routed_experts", "num_local_experts"}, 256, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 8, kMaxExperts));
  FSDP_ASSIGN(m.router_norm_topk, ReadFlag(r, "norm_topk_prob", true));
  FSDP_ASSIGN_OR_RETURN(const int64_t groups, ReadDim(r, {"n_group"}, 8, kMaxExperts));
  FSDP_ASSIGN_OR_RETURN(const int64_t topk_groups, ReadDim(r, {"topk_group"}, 4, kMaxExperts));
  m.router = ModelShape::Router::kGroupedSigmoid;
  m.expert_groups = groups;
  m.expert_groups_kept = topk_groups;
  // DeepseekV3TopkRouter: the experts viewed as n_group groups, each scored by its best two
  if (m.num_experts % groups != 0 || m.num_experts / groups < 2) {
    return r.KeyError("n_group", fmt::format("{} groups must divide {} experts into groups of at least two", groups, m.num_experts));
  }
  if (topk_groups > groups) return r.KeyError("topk_group", fmt::format("{} exceeds n_group {}", topk_groups, groups));
  const int64_t selectable = topk_groups * (m.num_experts / groups);
  if (m.experts_per_token > selectable) {
    return r.KeyError("num_experts_per_tok", fmt::format("{} exceeds the {} experts of the topk_group {} groups it picks from",
                                                         m.experts_per_token, selectable, topk_groups));
  }
  return {};
}

}  // namespace

Status ReadDeepseekV3(const JsonReader& r, ModelSpec& m) {
  DecoderDefaults defaults{129280, 7168, 18432, 61, 128, 0, 4096, false, 1e-6, 10000.0};
  defaults.own_head_dim = true;
  FSDP_TRY(ReadDecoderKeys(r, defaults, m));
  FSDP_ASSIGN_OR_RETURN(const bool bias, ReadFlag(r, "attention_bias", false));
  m.qkv_bias = m.o_bias = bias;
  FSDP_TRY(ReadLatentAttention(r, m));
  FSDP_TRY(ReadRouting(r, m));
  FSDP_ASSIGN_OR_RETURN(const int64_t expert_inner, ReadDim(r, {"moe_intermediate_size"}, 2048, kMaxDim));
  FSDP_ASSIGN_OR_RETURN(const int64_t shared, ReadDim(r, {"n_shared_experts"}, 1, kMaxExperts));
  int64_t dense_layers = 3;  // 0 allowed: every layer routed
  if (r.json().contains("first_k_dense_replace")) FSDP_ASSIGN(dense_layers, r.IntIn("first_k_dense_replace", 0, kMaxLayers));
  FSDP_TRY(ReadActivation(r, m));
  Architecture& a = m.arch;
  a.decoder_layer_class = "DeepseekV3DecoderLayer";
  a.lora_default_targets = {};  // none in peft 0.21's mapping
  if (dense_layers > 0) {
    AddLatentAttention(m, a.dense_block);
    AddGatedMlp(m, false, a.dense_block);
    a.dense_layers.assign(static_cast<size_t>(m.num_layers), false);
    for (int64_t layer = 0; layer < std::min(dense_layers, m.num_layers); ++layer) a.dense_layers[static_cast<size_t>(layer)] = true;
  }
  // the routed layers; intermediate_size is from here on each expert's
  m.intermediate_size = expert_inner;
  a.mlp = MlpKind::kMoe;
  AddLatentAttention(m, a.block);
  AddFusedExperts(m, a.block);
  const int64_t h = m.hidden_size;
  const int64_t shared_inner = shared * expert_inner;
  a.block.push_back({ParamOp::Kind::kLinear, "mlp.shared_experts.gate_proj", h, shared_inner});
  a.block.push_back({ParamOp::Kind::kLinear, "mlp.shared_experts.up_proj", h, shared_inner});
  a.block.push_back({ParamOp::Kind::kLinear, "mlp.shared_experts.down_proj", shared_inner, h});
  return {};
}

}  // namespace fsdp::families
