// Qwen3-MoE (configuration_qwen3_moe.py, modeling_qwen3_moe.py): Qwen3's attention (per-head
// q_norm / k_norm; head_dim from the config, else hidden / heads), then Qwen3MoeSparseMoeBlock:
// a router (Qwen3MoeTopKRouter, mlp.gate.weight [experts, hidden]) choosing num_experts_per_tok of
// num_experts SwiGLU experts, stored as transformers 5 stores them, two 3-D parameters
// (Qwen3MoeExperts: gate_up_proj [experts, 2 x moe_intermediate_size, hidden], down_proj
// [experts, hidden, moe_intermediate_size]). Layers in mlp_only_layers, or off decoder_sparse_step,
// run a dense SwiGLU MLP of intermediate_size instead (Architecture::dense_block).
#include <algorithm>

#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {
namespace {

// Which layers run Qwen3MoeMLP (a SwiGLU MLP of intermediate_size) instead of the experts, as
// Qwen3MoeDecoderLayer decides: those listed in mlp_only_layers, and those whose 1-based index
// decoder_sparse_step does not divide. Every released Qwen3-MoE routes every layer.
Status ReadDenseLayers(const JsonReader& r, ModelSpec& m) {
  FSDP_ASSIGN_OR_RETURN(const int64_t step, ReadDim(r, {"decoder_sparse_step"}, 1, kMaxLayers));
  std::vector<bool> dense(static_cast<size_t>(m.num_layers), false);
  for (int64_t layer = 0; layer < m.num_layers; ++layer) dense[static_cast<size_t>(layer)] = (layer + 1) % step != 0;
  const auto listed = r.json().find("mlp_only_layers");
  if (listed != r.json().end() && !listed->is_null()) {
    if (!listed->is_array()) return r.KeyError("mlp_only_layers", "expected a list of layer indices");
    for (const Json& index : *listed) {
      if (!index.is_number_integer() || index.get<int64_t>() < 0 || index.get<int64_t>() >= m.num_layers) {
        return r.KeyError("mlp_only_layers", fmt::format("expected layer indices from 0 to {}, got {}", m.num_layers - 1, index.dump()));
      }
      dense[static_cast<size_t>(index.get<int64_t>())] = true;
    }
  }
  if (std::find(dense.begin(), dense.end(), true) != dense.end()) m.arch.dense_layers = std::move(dense);
  return {};
}

}  // namespace

Status ReadQwen3Moe(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {151936, 2048, 6144, 24, 32, 4, 32768, false, 1e-6, 10000.0}, m));
  FSDP_ASSIGN_OR_RETURN(const bool bias, ReadFlag(r, "attention_bias", false));
  m.qkv_bias = bias;
  m.o_bias = bias;
  FSDP_ASSIGN_OR_RETURN(const bool use_window, ReadFlag(r, "use_sliding_window", false));
  if (use_window) FSDP_ASSIGN(m.sliding_window, ReadSlidingWindow(r));
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"num_experts", "num_local_experts"}, 128, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 8, kMaxExperts));
  if (m.experts_per_token > m.num_experts) {
    return r.KeyError("num_experts_per_tok", fmt::format("{} exceeds num_experts {}", m.experts_per_token, m.num_experts));
  }
  FSDP_ASSIGN(m.router_norm_topk, ReadFlag(r, "norm_topk_prob", false));
  m.router_weights_in_compute_dtype = true;
  FSDP_TRY(ReadDenseLayers(r, m));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "Qwen3MoeDecoderLayer";
  m.arch.rope_rotate_half = true;
  m.arch.lora_default_targets = {};  // peft 0.21's mapping has "qwen3", not "qwen3_moe"
  if (!m.arch.dense_layers.empty()) {  // Qwen3MoeMLP over intermediate_size
    AddLlamaAttention(m, bias, bias, m.arch.dense_block);
    AddHeadQkNorms(m, m.arch.dense_block);
    AddGatedMlp(m, false, m.arch.dense_block);
  }
  FSDP_ASSIGN(m.intermediate_size, ReadDim(r, {"moe_intermediate_size"}, 768, kMaxDim));  // each expert's from here on
  m.arch.mlp = MlpKind::kMoe;
  AddLlamaAttention(m, bias, bias, m.arch.block);
  AddHeadQkNorms(m, m.arch.block);
  AddFusedExperts(m, m.arch.block);
  return {};
}

}  // namespace fsdp::families
