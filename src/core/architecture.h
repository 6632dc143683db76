// A decoder family as data: the modules a block holds, in forward order, with their shapes, and
// the few facts of layout the rest of the tree needs (module names, norm and MLP kinds). A family
// is one small file under core/families/ that reads its config.json keys and fills this in; the
// tensor inventory, the module tree, FLOPs, communication sizes and fsdp-run's buffer offsets are
// derived from it, so that nothing outside core/families/ names a family.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

/// One module of a decoder block that owns parameters.
struct ParamOp {
  /// kParameter: a bare nn.Parameter of `out` elements (or of `shape`) named `module` itself
  /// (gpt-oss's self_attn.sinks, one per head; a vision tower's patch convolution)
  enum class Kind { kNorm, kLinear, kRouter, kParameter };
  Kind kind = Kind::kLinear;
  /// Module path inside the block ("self_attn.q_proj"); with experts, "{}" stands for the expert index.
  std::string module;
  int64_t in = 0;    ///< linear / router: input features
  int64_t out = 0;   ///< linear / router: output features; norm: its dimension
  bool bias = false;          ///< fused experts: "<module>_bias" [experts, out] (gpt-oss's)
  bool conv1d = false;        ///< the weight is stored [in, out]: GPT-2's Conv1D, gpt-oss's fused experts ([experts, in, out])
  int64_t experts = 0;        ///< > 0: one copy per expert...
  int64_t experts_per_token = 0;  ///< ...of which each token runs this many
  bool trainable = true;      ///< requires_grad (TensorSpec::trainable of its tensors)
  /// norm: over q's or k's features inside the attention, between the projection and RoPE
  /// (Qwen3's and OLMo 2's q_norm, k_norm), not over the hidden states
  bool qk_norm = false;
  /// qk_norm: over head_dim on every head (Qwen3's; `out` is head_dim), not over the whole
  /// projection (OLMo 2's; `out` is heads x head_dim)
  bool head_norm = false;
  /// linear: > 0 when peft's LoRA wraps it (core/lora.h): the frozen weight moves to
  /// "<module>.base_layer", beside lora_A ([rank, in]) and lora_B ([out, rank]) adapters
  int64_t lora_rank = 0;
  double lora_dropout = 0;  ///< with lora_rank: its lora_dropout's p
  /// linear: > 0 when bitsandbytes stores its weight as NF4 (QLoRA, core/lora.h): two 4-bit codes
  /// per byte, packed into elements of this many bytes (bnb_4bit_quant_storage), with an absmax per
  /// 64 weights (bitsandbytes/functional.py quantize_4bit)
  int64_t nf4_storage_bytes = 0;
  bool nf4_double_quant = false;  ///< with nf4_storage_bytes: the absmax quantized again (bnb_4bit_use_double_quant)
  /// experts: one 3-D parameter [experts, out, in] named `module` itself (transformers 5's
  /// Qwen3MoeExperts.gate_up_proj / down_proj), rather than a linear per expert ("{}" in `module`)
  bool fused_experts = false;
  /// fused experts that multiply every token (TensorSpec::dense_dispatch: transformers' Llama 4)
  bool dense_dispatch = false;
  std::vector<int64_t> shape = {};  ///< kParameter: its shape when not one-dimensional ({out} when empty)
};

enum class NormKind { kRms, kLayer };    ///< RMSNorm (weight only) or LayerNorm (weight and bias)
enum class MlpKind { kGated, kPlain, kMoe };  ///< SwiGLU gate/up/down, fc + activation + proj, routed experts
/// Where a block's hidden-state norms sit: before each sub-layer (Llama's input_layernorm and
/// post_attention_layernorm, GPT-2's ln_1 and ln_2), on each sub-layer's output before its
/// residual add (OLMo 2's post_attention_layernorm and post_feedforward_layernorm), or both
/// (Gemma 2 and 3: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
/// post_feedforward_layernorm), in that forward order in Architecture::block.
enum class NormPlacement { kPre, kPost, kSandwich };

/// Module paths outside the blocks (HF state-dict prefixes).
struct ModuleNames {
  std::string embedding = "model.embed_tokens";
  std::string positions;                ///< learned position embeddings ("" for RoPE models)
  std::string blocks = "model.layers";  ///< block i is blocks + "." + i
  std::string final_norm = "model.norm";
  std::string lm_head = "lm_head";
};

/// A vision encoder beside the decoder, whose modules run only on images (Gemma 3's SigLIP tower
/// and multi-modal projector): its parameters in state-dict order, for the inventory. fsdpkit
/// plans text-only steps, in which these modules hold parameters but run no forward (no FLOPs, no
/// activations); which of them get gradients depends on the FSDP version (workload.h).
struct VisionTower {
  std::vector<ParamOp> before;  ///< modules before the encoder layers, full module paths
  std::string layers;           ///< the encoder layers' list ("model.vision_tower.encoder.layers")
  int64_t num_layers = 0;
  std::vector<ParamOp> layer;   ///< one encoder layer's modules, relative to layers + "." + index
  std::vector<ParamOp> after;   ///< modules after the layers (post norm, projector), full paths
  NormKind norm = NormKind::kLayer;  ///< its kNorm ops' kind
  std::string layer_class;      ///< transformers' encoder-layer class (SiglipEncoderLayer)
  bool present() const { return num_layers > 0 || !before.empty(); }
};

struct Architecture {
  std::string decoder_layer_class;  ///< transformers' decoder layer class: the wrap policy's and the exports' unit
  /// transformers.models.<this> defines it; empty: the model type's own (gemma3_text's is gemma3)
  std::string modeling_module;
  ModuleNames names;
  NormKind norm = NormKind::kRms;
  NormPlacement norm_placement = NormPlacement::kPre;
  /// RMSNorm multiplies by its weight in fp32 and casts after (OLMo 2's `(weight * x).to(dtype)`),
  /// rather than casting first (Llama's `weight * x.to(dtype)`): the normalised input it saves for
  /// the weight's gradient is fp32
  bool norm_weight_fp32 = false;
  MlpKind mlp = MlpKind::kGated;
  bool fused_qkv = false;           ///< one projection for q, k and v (GPT-2's c_attn)
  /// the routed experts' activation is gpt-oss's clamped SwiGLU (GptOssExperts._apply_gate:
  /// (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate))), not SiLU(gate) * up
  bool experts_clamped_swiglu = false;
  /// the routed experts run every token, weighted by the router's scores (0 for the unselected):
  /// transformers' Llama4TextMoe repeats the tokens for each expert and multiplies them by bmm
  bool experts_dense_dispatch = false;
  /// eager attention's softmax runs in fp32 and is cast back (HF Llama-style eager_attention_forward),
  /// rather than in the compute dtype (GPT-2's)
  bool softmax_fp32 = true;
  /// The attention's output projection (module path inside the block): its backward runs just
  /// before the attention core's, the moment a block's backward holds the scores' gradients
  std::string attention_output = "self_attn.o_proj";
  /// The MLP's output (down) projection, module path inside the block: its backward runs first in
  /// the MLP's, and the MLP's intermediates' gradients peak right after it (BlockActivations::
  /// mlp_working_bytes). Routed experts' fused projections are no such module: their blocks hold
  /// that share through the MLP's backward.
  std::string mlp_output = "mlp.down_proj";
  /// The block's attention and MLP modules (paths inside the block): the end of each one's
  /// backward releases the tensors its ops saved (SavedTensor::freed_after)
  std::string attention_module = "self_attn";
  std::string mlp_module = "mlp";
  /// q, k and v reach eager attention as transposed views of their projections ([B, s, heads, d]
  /// underneath; RoPE's elementwise ops keep that layout), which torch.matmul copies into
  /// [B * heads, s, d] for a micro-batch of more than one sequence (tools/peak_trace.py: OLMo 2);
  /// false where RoPE ends in torch.cat (gpt-oss), which leaves q and k contiguous
  bool qkv_transposed_views = true;
  /// RoPE as transformers' Llama applies it (apply_rotary_pos_emb: `q * cos + rotate_half(q) *
  /// sin`, rotate_half a torch.cat of `-x2` and `x1`; each op a new tensor of the compute dtype),
  /// copied by Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, OLMo 2, Phi-3 and Gemma 2/3; false for
  /// GPT-2 (no RoPE), gpt-oss (torch.chunk halves), Llama 4 (complex products) and DeepSeek's MLA
  bool rope_rotate_half = false;
  /// q_norm and k_norm run once q's, k's and v's projections all exist (Gemma3Attention.forward);
  /// false: each right after its own projection, v's projection after both (Qwen3Attention,
  /// Olmo2Attention)
  bool qk_norms_after_projections = false;
  std::vector<ParamOp> block;       ///< a decoder block's parameter-owning modules in forward order
  /// A model whose `block` routes its MLP through experts may run a dense one in some layers
  /// (DeepSeek-V3's first first_k_dense_replace, Qwen3-MoE's mlp_only_layers): those layers'
  /// modules (a SwiGLU MLP, MlpKind::kGated), and which layers they are; empty: every layer runs `block`
  std::vector<ParamOp> dense_block;
  std::vector<bool> dense_layers;
  bool DenseLayer(int layer) const { return !dense_layers.empty() && dense_layers.at(static_cast<size_t>(layer)); }
  /// Layer `layer`'s modules in forward order.
  const std::vector<ParamOp>& BlockOf(int layer) const { return DenseLayer(layer) ? dense_block : block; }
  MlpKind MlpOf(int layer) const { return DenseLayer(layer) ? MlpKind::kGated : mlp; }
  /// The modules peft's LoRA targets when none are named: its
  /// TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING entry for the model type (peft/utils/constants.py); empty where it has none
  std::vector<std::string> lora_default_targets = {"q_proj", "v_proj"};
  /// A vision tower the model holds beside its decoder (absent: a text-only model)
  VisionTower vision;
  /// Every parameter outside the LoRA adapters is frozen (requires_grad=False), as peft's
  /// get_peft_model leaves them: the embedding, final norm and lm_head too.
  bool base_frozen = false;
};

}  // namespace fsdp
