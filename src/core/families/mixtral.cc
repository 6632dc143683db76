// Mixtral (configuration_mixtral.py, modeling_mixtral.py): Llama's attention, then a router over
// num_local_experts SwiGLU experts (w1, w3: hidden -> intermediate; w2 back), each token routed to
// num_experts_per_tok of them.
#include <fmt/format.h>

#include "core/families/family.h"

namespace fsdp::families {

Status ReadMixtral(const JsonReader& r, ModelSpec& m) {
  FSDP_TRY(ReadDecoderKeys(r, {32000, 4096, 14336, 32, 32, 8, 4096 * 32, false, 1e-5, 1e6}, m));
  FSDP_ASSIGN(m.num_experts, ReadDim(r, {"num_local_experts", "num_experts"}, 8, kMaxExperts));
  FSDP_ASSIGN(m.experts_per_token, ReadDim(r, {"num_experts_per_tok"}, 2, kMaxExperts));
  m.router_norm_topk = true;  // MixtralTopKRouter divides the top-k by their sum, whatever the config
  if (m.experts_per_token > m.num_experts) {
    return Error::BadInput(fmt::format("{}: num_experts_per_tok {} exceeds num_local_experts {}", r.origin(), m.experts_per_token, m.num_experts));
  }
  FSDP_TRY(ReadActivation(r, m));
  m.arch.decoder_layer_class = "MixtralDecoderLayer";
  m.arch.rope_rotate_half = true;
  m.arch.mlp = MlpKind::kMoe;
  m.arch.mlp_module = "block_sparse_moe";
  AddLlamaAttention(m, false, false, m.arch.block);
  const int64_t h = m.hidden_size, inner = m.intermediate_size, e = m.num_experts, k = m.experts_per_token;
  m.arch.block.push_back({ParamOp::Kind::kRouter, "block_sparse_moe.gate", h, e});
  m.arch.block.push_back({ParamOp::Kind::kLinear, "block_sparse_moe.experts.{}.w1", h, inner, false, false, e, k});
  m.arch.block.push_back({ParamOp::Kind::kLinear, "block_sparse_moe.experts.{}.w3", h, inner, false, false, e, k});
  m.arch.block.push_back({ParamOp::Kind::kLinear, "block_sparse_moe.experts.{}.w2", inner, h, false, false, e, k});
  return {};
}

}  // namespace fsdp::families
