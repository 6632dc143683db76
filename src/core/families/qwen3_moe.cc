// Qwen3-MoE (configuration_qwen3_moe.py, modeling_qwen3_moe.py): Qwen3's attention (per-head
// q_norm / k_norm; head_dim from the config, else hidden / heads), then Qwen3MoeSparseMoeBlock:
// a router (Qwen3MoeTopKRouter, mlp.gate.weight [experts, hidden]) choosing num_experts_per_tok of
// num_experts SwiGLU experts, stored as transformers 5 stores them, two 3-D parameters
// (Qwen3MoeExperts: gate_up_proj [experts, 2 x moe_intermediate_size, hidden], down_proj
// [experts, hidden, moe_intermediate_size]).
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {
namespace {

// Every layer routed: decoder_sparse_step 1 and no mlp_only_layers, as every released Qwen3-MoE
// has them; the dense layers the other values make are not modelled (a block per layer).
Status CheckEveryLayerSparse(const JsonReader& r) {
  FSDP_ASSIGN_OR_RETURN(const int64_t step, ReadDim(r, {"decoder_sparse_step"}, 1, kMaxLayers));
  if (step != 1) return r.KeyError("decoder_sparse_step", fmt::format("only 1 (every layer routed) is modelled, got {}", step));
  const auto dense = r.json().find("mlp_only_layers");
  if (dense != r.json().end() && !dense->is_null() && !(dense->is_array() && dense->empty())) {
    return r.KeyError("mlp_only_layers", "dense layers among the routed ones are not modelled (only an empty list or null)");
  }
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
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"num_experts"}, 128, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 8, kMaxExperts));
  if (m.experts_per_token > m.num_experts) {
    return r.KeyError("num_experts_per_tok", fmt::format("{} exceeds num_experts {}", m.experts_per_token, m.num_experts));
  }
  FSDP_ASSIGN(m.intermediate_size, ReadDim(r, {"moe_intermediate_size"}, 768, kMaxDim));  // each expert's
  FSDP_TRY(CheckEveryLayerSparse(r));
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "Qwen3MoeDecoderLayer";
  m.arch.mlp = MlpKind::kMoe;
  AddLlamaAttention(m, bias, bias, m.arch.block);
  AddHeadQkNorms(m, m.arch.block);
  const int64_t h = m.hidden_size, inner = m.intermediate_size, e = m.num_experts, k = m.experts_per_token;
  m.arch.block.push_back({ParamOp::Kind::kRouter, "mlp.gate", h, e});
  ParamOp gate_up{ParamOp::Kind::kLinear, "mlp.experts.gate_up_proj", h, 2 * inner, false, false, e, k};
  gate_up.fused_experts = true;
  ParamOp down = gate_up;
  down.module = "mlp.experts.down_proj";
  down.in = inner;
  down.out = h;
  m.arch.block.insert(m.arch.block.end(), {gate_up, down});
  return {};
}

}  // namespace fsdp::families
