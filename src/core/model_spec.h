// Transformer architecture read from a HuggingFace config.json, with its per-tensor inventory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/architecture.h"
#include "core/json_io.h"
#include "core/status.h"

namespace fsdp {

/// One parameter tensor of the real checkpoint.
struct TensorSpec {
  std::string name;             ///< HF state-dict name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;   ///< as stored in the checkpoint (GPT-2 Conv1D weights are [in, out])
  int block = -1;               ///< decoder block index, -1 outside the blocks
  bool in_linear = false;       ///< owned by an nn.Linear (or GPT-2 Conv1D) module
  bool trainable = true;        ///< gets a gradient and optimizer states in the planned step (all of them in full training)
  double active_share = 1.0;    ///< share of the tokens whose forward uses it (a routed expert's: top_k / experts)
  /// a routed expert the forward multiplies by every token all the same (transformers' Llama 4
  /// experts: the unselected tokens with a zero weight), so that its FLOPs are a dense weight's
  bool dense_dispatch = false;
  /// > 0: a weight bitsandbytes stores packed as NF4 (QLoRA): its own element count; `shape` is the
  /// packed storage's ([(n + 1) / (2 x storage bytes), 1], as Params4bit holds it)
  int64_t nf4_numel = 0;
  /// a vision tower's (Architecture::vision): runs only on images, which the planned text-only
  /// steps have none of
  bool image_only = false;
  /// requires_grad as the model declares it; differs from `trainable` only for image_only tensors
  /// under FSDP2, which get no gradient in a text-only step (workload.h)
  bool requires_grad = true;
  /// Whether the model declares it requires grad (`requires_grad` for a tower's, else `trainable`).
  bool RequiresGrad() const { return image_only ? requires_grad : trainable; }

  /// Share of the tokens the forward multiplies it with: its FLOPs' (active_share, or 1 under dense_dispatch).
  double ComputedShare() const { return dense_dispatch ? 1.0 : active_share; }
  /// Elements stored: what FSDP flattens, shards and all-gathers.
  int64_t numel() const;
  /// Elements of the weight as the model computes with it (the unpacked NF4 weight's): FLOPs and
  /// parameter counts.
  int64_t LogicalNumel() const { return nf4_numel > 0 ? nf4_numel : numel(); }
  /// Owning module path: the name without its last component.
  std::string module() const;
};

/// RoPE frequency scaling: config.json's `rope_scaling` (transformers 4) or `rope_parameters`
/// (transformers 5), as transformers' modeling_rope_utils.py reads it. Shapes do not depend on it;
/// fsdp-run's rotary tables do (RopeInverseFrequencies in runtime/llama_model.h).
struct RopeScaling {
  std::string type = "default";        ///< rope_type (or the older "type"): default, linear, dynamic, llama3, yarn, ...
  double factor = 1.0;                 ///< linear, dynamic, llama3
  double low_freq_factor = 1.0;        ///< llama3
  double high_freq_factor = 4.0;       ///< llama3
  int64_t original_max_positions = 0;  ///< llama3: original_max_position_embeddings (max_position_embeddings when absent)
};

/// DeepSeek's multi-head latent attention (MLA: DeepSeek-V2, arXiv 2405.04434, section 2.1;
/// modeling_deepseek_v3.py's DeepseekV3Attention): q through a latent of q_lora_rank features
/// (0: a plain q_proj), keys and values decompressed per head from one kv_lora_rank latent, each
/// head's q and k qk_nope_head_dim features without RoPE plus qk_rope_head_dim with it (the
/// latter shared by every head's k), values v_head_dim wide.
struct LatentAttention {
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;  ///< 0: not MLA
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  bool enabled() const { return kv_lora_rank > 0; }
};

/// Architecture hyper-parameters after HF's defaults were applied: what a model's shape is,
/// without its tensors (ModelSpec adds the inventory).
struct ModelShape {
  std::string id;               ///< catalog id or the config file's stem
  std::string model_type;       ///< HF model_type
  Architecture arch;            ///< the family's layout (core/architecture.h), from core/families/
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;   ///< MLP inner size (GPT-2: n_inner or 4*n_embd)
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;         ///< q's and k's per head (MLA: qk_nope_head_dim + qk_rope_head_dim)
  LatentAttention mla;
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  double norm_eps = 1e-6;       ///< rms_norm_eps (GPT-2: layer_norm_epsilon)
  double rope_theta = 10000.0;  ///< RoPE base (0 for GPT-2's learned positions)
  RopeScaling rope_scaling;     ///< RoPE frequency scaling (type "default": none)
  /// RoPE's share of each head's features (Phi-3's partial_rotary_factor: its apply_rotary_pos_emb
  /// rotates q[..., :int(head_dim * f)] and joins the rest after by torch.cat); 1 elsewhere
  double rotary_fraction = 1.0;
  int64_t sliding_window = 0;   ///< Mistral's attention window in tokens (0: full causal attention)
  /// Which layers attend through the window (layer_types "sliding_attention": Gemma's alternate
  /// with full ones); empty: every layer does when sliding_window > 0 (Mistral's)
  std::vector<bool> layer_sliding;
  bool qkv_bias = false;        ///< bias on q/k/v projections
  bool o_bias = false;          ///< bias on the attention output projection
  bool mlp_bias = false;        ///< bias on MLP projections
  int64_t num_experts = 0;      ///< routed experts per MoE layer (0 = dense MLP)
  int64_t experts_per_token = 0;
  /// How the router picks and weighs a token's experts: a fp32 softmax over every expert, then
  /// the top-k (Mixtral's, Qwen3-MoE's); the top-k logits, then a softmax over them in the compute
  /// dtype (GptOssTopKRouter); sigmoid scores with group-limited top-k (DeepseekV3TopkRouter); the
  /// top-k logits scattered into -inf and a fp32 sigmoid over every expert (Llama4Router)
  enum class Router { kSoftmaxThenTopK, kTopKThenSoftmax, kGroupedSigmoid, kTopKThenSigmoid };
  Router router = Router::kSoftmaxThenTopK;
  /// The top-k weights divided by their sum before they weigh the experts' outputs: Qwen3-MoE's and
  /// DeepSeek-V3's norm_topk_prob (Qwen3MoeTopKRouter, DeepseekV3MoE.route_tokens_to_experts),
  /// Mixtral's always (MixtralTopKRouter)
  bool router_norm_topk = false;
  /// The top-k weights cast to the router logits' dtype (the compute dtype) before they weigh the
  /// experts' outputs: Qwen3MoeTopKRouter's `router_top_value.to(router_logits.dtype)`; Mixtral's
  /// stay fp32 (transformers 5.24, modeling_qwen3_moe.py, modeling_mixtral.py)
  bool router_weights_in_compute_dtype = false;
  /// kGroupedSigmoid: the experts in this many groups (n_group), of which expert_groups_kept
  /// (topk_group) are searched for the top-k
  int64_t expert_groups = 0, expert_groups_kept = 0;
  /// Gemma 2's tanh soft-capping of the attention scores (attn_logit_softcapping) and of the
  /// logits (final_logit_softcapping): cap * tanh(x / cap); 0 for none
  /// gpt-oss's attention sinks: a learned logit per head joins every row's softmax and is
  /// dropped after it (eager only: GptOssPreTrainedModel's _supports_sdpa is False)
  bool attention_sinks = false;
  double attn_logit_softcapping = 0;
  double final_logit_softcapping = 0;
  std::string activation;       ///< hidden_act / activation_function
  double attention_dropout = 0; ///< GPT-2 attn_pdrop, llama attention_dropout
  double residual_dropout = 0;  ///< GPT-2 resid_pdrop
  double embedding_dropout = 0; ///< GPT-2 embd_pdrop

  /// Decoder block `block`'s attention window in tokens, 0 for full causal attention.
  int64_t WindowOf(int block) const;
  /// Llama 4's layers without RoPE (no_rope_layers 0: no q/k norm, temperature-tuned q instead);
  /// empty: every layer has RoPE (GPT-2: its learned positions)
  std::vector<bool> layer_nope;
  /// This shape's layers run without RoPE (a LayerShape of one of layer_nope's)
  bool nope = false;
  /// Llama 4's use_qk_norm: a weightless L2 norm over each head's q and k after RoPE (Llama4TextL2Norm)
  bool qk_l2_norm = false;
  /// Llama 4's attn_temperature_tuning: q scaled by a fp32 factor per position in the NoPE layers
  bool nope_temperature_tuning = false;
  bool LayerWithoutRope(int block) const { return !layer_nope.empty() && layer_nope.at(static_cast<size_t>(block)); }
  /// Features per head of the values (MLA's v_head_dim; else head_dim, as q's and k's).
  int64_t ValueHeadDim() const { return mla.enabled() ? mla.v_head_dim : head_dim; }
  /// The shape of decoder block `block` as that of a model whose every block is like it: a dense
  /// layer of a routed model (Architecture::dense_block) as a dense model with its MLP's width, a
  /// layer without RoPE as a model without it (`nope`).
  ModelShape LayerShape(int block) const;
};

/// A model's shape plus its tensor inventory.
struct ModelSpec : ModelShape {
  std::vector<TensorSpec> tensors;  ///< in forward execution order; a tied lm_head is not repeated

  int64_t ParamsTotal() const;
  /// Parameters that require grad (all of them in full training; the adapters under LoRA), as
  /// peft's print_trainable_parameters counts them: a vision tower's too, idle or not.
  int64_t ParamsTrainable() const;
  /// Parameters of decoder block `block`.
  int64_t BlockParams(int block) const;
  /// Parameters of the vision tower (TensorSpec::image_only); 0 for a text-only model.
  int64_t VisionParams() const;
  /// Parameters active per text token (MoE: only experts_per_token experts count; a vision tower's none).
  int64_t ActiveParamsPerToken() const;
  /// Module path prefix of decoder blocks ("model.layers" or "transformer.h").
  const std::string& BlockPrefix() const { return arch.names.blocks; }
};

/// Builds a ModelSpec from a parsed HF config.json through its family (core/families/: llama,
/// mistral, mixtral, qwen2, qwen3, qwen3_moe, olmo2, phi3, gemma2, gemma3_text, gemma3, deepseek_v3, gpt_oss, llama4_text, llama4, gpt2). Missing keys take the defaults of transformers'
/// configuration_<type>.py; absurd or inconsistent values (hidden not divisible by heads, heads not
/// divisible by kv heads, non-positive sizes) give BadInput naming `origin` and the key.
Result<ModelSpec> ModelFromHfConfig(const Json& config, const std::string& id, const std::string& origin);

/// The tensor inventory of a model whose hyper-parameters and architecture are set: the vision
/// tower's (image_only, as transformers registers it before the language model), embedding,
/// learned positions, every block's modules in forward order (experts expanded in expert order),
/// final norm, lm_head unless tied; HF names and checkpoint shapes.
std::vector<TensorSpec> BuildInventory(const ModelSpec& model);

/// How many parameter tensors and parameters BuildInventory would build, counted in doubles from
/// the architecture without building them (ModelFromHfConfig refuses models past limits::kMaxTensors
/// or limits::kMaxParams).
struct InventorySize {
  double tensors = 0, params = 0;
};
InventorySize CountInventory(const ModelSpec& model);

/// Loads a catalog id (models/<id>.json), a path to a config.json, or a directory holding one (a
/// downloaded model; its id is the directory's name).
Result<ModelSpec> LoadModel(const std::string& id_or_path);

}  // namespace fsdp
