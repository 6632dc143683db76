// The FSDP training configuration: everything a user chooses besides the model and the GPU.
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/status.h"

namespace fsdp {

struct ModelSpec;
struct HardwareSpec;

enum class Strategy { kFullShard, kShardGradOp, kNoShard, kHybridShard };
/// kPeft: peft's fsdp_auto_wrap_policy (the decoder layers, and each leaf module with a trainable
/// weight, i.e. every LoRA adapter, in a unit of its own), accelerate's default for a PeftModel.
enum class WrapPolicy { kBlock, kSize, kNone, kLinear, kPeft };
/// kSelective: fsdpkit's (Korthikanti et al.'s attention core recomputed); kSelectiveOp:
/// torchtitan's op-level selective AC (every matmul output but every second one of a block, and the
/// SDPA kernel's outputs, kept; every other op recomputed); kFull: the whole block recomputed.
enum class Checkpointing { kNone, kSelective, kSelectiveOp, kFull };
enum class Attention { kEager, kFlash };
enum class Optimizer { kAdamW, kAdam, kSgd, kSgdMomentum };
enum class Framework { kFsdp1, kFsdp2 };
enum class BackwardPrefetch { kPre, kPost, kNone };
/// Whose model code and training loop run the step (`--impl`): transformers' modules under FSDP
/// (accelerate, HF Trainer, the exports), or torchtitan's own Llama 3, as released in 0.2.2
/// (`torchtitan.models.llama3`: apply_fsdp's units tok_embeddings, each block, [norm, output];
/// nn.RMSNorm) or as its main branch stood for its January 2025 Llama 3.1 8B performance tables
/// (commit d4c86e3: blocks, the last one kept unsharded after forward, and the root; a Python
/// RMSNorm that upcasts to fp32, saving what transformers' does). docs/torchtitan-0.3.0.md. Same
/// parameters and FLOPs, different saved tensors, wrap units and buffers.
enum class Impl { kTransformers, kTorchtitan, kTorchtitan202501 };
/// Either torchtitan profile: its Llama 3 model, FSDP2 and SDPA (TorchtitanRuledOut, ResolveAndValidate).
inline bool IsTorchtitan(Impl i) { return i != Impl::kTransformers; }

/// The device PyTorch's kernels run on (`--torch-device`): the GPU being planned, or a CPU, for
/// comparing with PyTorch on CPU ranks. The kernels' working buffers differ: CUDA's softmax
/// backward makes `grad * output` before its kernel (aten/src/ATen/native/cuda/SoftMax.cu,
/// softmax_backward_cuda_out), the CPU's does not (activation_model.cc, MarkSoftmaxBackward).
enum class TorchDevice { kCuda, kCpu };

/// A transformers release, major.minor (`--transformers-version`; a patch number is read and
/// dropped). The default is the release fsdpkit's checks run against.
struct TransformersVersion {
  int major = 5, minor = 24;
  bool operator==(const TransformersVersion&) const = default;
  auto operator<=>(const TransformersVersion&) const = default;
};
/// How a release's causal-LM head turns the logits into the loss. Read from the releases' sources:
/// LlamaForCausalLM.forward of 4.31.0 to 4.45.2 (models/llama/modeling_llama.py; Mistral, Mixtral,
/// Qwen2, Phi-3 and Gemma 2 copy it, Mistral until 4.47.1), ForCausalLMLoss of 4.46.3 to 4.48.3
/// and of 4.49.0 on (loss/loss_utils.py). The slice logits[..., :-1, :] of one sequence is
/// contiguous already, so the copy exists from a micro-batch of 2 on.
enum class HfLoss {
  kPaddedLabels,  ///< 4.49 on: the loss upcasts the logits and pads the labels (no copy of the logits)
  /// From the family's first ForCausalLMLoss release (families::Family::loss_function_since: 4.46,
  /// Mistral's and GPT-2's 4.48) to 4.48: the loss upcasts, then copies logits[..., :-1, :] contiguous
  kShiftedCopy,
  /// Before it: the model's forward upcasts the logits it returns (the 16-bit ones die there), and
  /// copies logits[..., :-1, :] contiguous for the loss
  kFp32Logits,
};
/// The loss path of release `v` for a model of HF `model_type`.
HfLoss HfLossOf(TransformersVersion v, std::string_view model_type);
/// Whether release `v`'s attention layers of HF `model_type` each hold RoPE tables of every position
/// as buffers (families::Family::rope_tables_until: Llama to 4.40, Mistral to 4.41, Qwen2 to 4.44,
/// Mixtral to 4.47).
bool HasPerLayerRopeTables(TransformersVersion v, std::string_view model_type);
/// Whether release `v`'s model of HF `model_type` holds a bool [P, P] causal_mask buffer
/// (families::Family::causal_mask_buffer_in: Llama 4.38).
bool HasCausalMaskBuffer(TransformersVersion v, std::string_view model_type);

/// peft's LoraConfig (peft/tuners/lora/config.py), applied to the model by BuildWorkload
/// (core/lora.h): every base parameter frozen, a pair of adapters beside each targeted linear.
struct LoraConfig {
  int64_t rank = 0;      ///< r; 0 is full fine-tuning (no adapters, every parameter trained)
  double alpha = 8;      ///< lora_alpha (peft's default 8): the output scale alpha / r, no memory or time effect
  double dropout = 0;    ///< lora_dropout: p > 0 gives each adapted linear a dropout of its own, whose output lora_A saves
  /// target_modules: comma-separated module names ("q_proj,v_proj"), "all-linear" (every linear of
  /// the decoder blocks; peft leaves the output layer out), or "" for peft's default for the model type
  std::string targets;
  /// QLoRA (Dettmers et al. 2023, as transformers' BitsAndBytesConfig loads it for FSDP): every
  /// linear of the decoder blocks stored by bitsandbytes as NF4 (load_in_4bit, bnb_4bit_quant_type
  /// "nf4"), packed into the param dtype (bnb_4bit_quant_storage = the dtype the model is loaded
  /// in, so that FSDP shards and all-gathers it as any parameter, and its cast leaves it alone),
  /// computed in the param dtype (bnb_4bit_compute_dtype); the rest of the frozen base is stored in
  /// the param dtype too, the adapters in the master dtype (peft's autocast_adapter_dtype)
  bool qlora = false;
  bool double_quant = false;  ///< bnb_4bit_use_double_quant: the absmax quantized to 8 bits in blocks of 256
  /// bnb_4bit_compute_dtype: what Linear4bit casts its input to and dequantizes its weight into
  /// for the product (the output cast back); unset, the param dtype, as QLoRA recipes set it
  /// (BitsAndBytesConfig's own default is fp32: every quantized GEMM in fp32). See QloraComputeDtype.
  std::optional<DType> compute_dtype{};
  /// The dtype the frozen base is stored in (from_pretrained's torch_dtype): unset, the master dtype
  /// (a model loaded in fp32), under QLoRA the param dtype; bf16 is the usual peft recipe (a bf16
  /// model, fp32 adapters). See StorageDtype (core/workload.h).
  std::optional<DType> base_dtype{};
  bool operator==(const LoraConfig&) const = default;
};

/// One FSDP configuration. Defaults are what people run today: FULL_SHARD, one unit per block,
/// bf16 parameters with fp32 gradient reduction (torchtitan's default), AdamW, FSDP1 defaults for
/// prefetch (BACKWARD_PRE, no forward prefetch) and limit_all_gathers=True.
struct FsdpConfig {
  int64_t gpus = 8;
  int64_t gpus_per_node = 0;       ///< 0: take the hardware file's usual GPUs per node
  int64_t shard_group_size = 0;    ///< HYBRID_SHARD shard group; 0: one node
  Strategy strategy = Strategy::kFullShard;
  WrapPolicy wrap = WrapPolicy::kBlock;
  int64_t wrap_min_params = 100'000'000;  ///< size-based policy threshold (PyTorch's default 1e8)
  int64_t seq_len = 0;             ///< 0: min(4096, the model's max_position_embeddings)
  int64_t micro_batch = 1;
  int64_t grad_accum = 1;
  bool no_sync = false;            ///< accumulate unsharded gradients under no_sync()
  Checkpointing checkpointing = Checkpointing::kNone;
  /// With full checkpointing, only every N-th decoder block is checkpointed (blocks N-1, 2N-1, ...
  /// counting from 0): torchtitan's layer-level selective AC (`selective_ac_option = "N"`);
  /// fms-fsdp's `selective_checkpointing = 1/N` picks every N-th block too. 1: every block.
  int64_t ac_every = 1;
  Attention attention = Attention::kFlash;
  DType param_dtype = DType::kBf16;
  DType reduce_dtype = DType::kFp32;
  DType buffer_dtype = DType::kBf16;
  /// dtype of the model's own (sharded) parameters, so of the gradients FSDP hands the optimizer
  /// and of the optimizer's states (torch.optim creates them zeros_like the parameter): fp32 is
  /// mixed precision's master copy, bf16 a model loaded in bf16 and trained without one
  DType master_dtype = DType::kFp32;
  Optimizer optimizer = Optimizer::kAdamW;
  bool cpu_offload = false;
  Framework framework = Framework::kFsdp1;
  bool forward_prefetch = false;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;
  bool limit_all_gathers = true;
  bool use_orig_params = false;    ///< FSDP1 flat-parameter layout: 16-byte alignment per original parameter
  /// The training loop keeps the model's output object (`outputs = model(**batch); loss =
  /// outputs.loss; loss.backward()`, as accelerate's examples do): its logits stay alive through the
  /// backward, the optimizer step and the next forward, until `outputs` is rebound. false: the loop
  /// keeps only the loss (HF Trainer, Lightning, torchtitan).
  bool loop_holds_outputs = false;
  /// The model's forward runs with use_cache=True (a HF config's default, which only HF's own
  /// gradient_checkpointing_enable() turns off in training): under transformers 4.31 to 4.35 each
  /// decoder layer returns its key and value states ([B, kv_heads, s, head_dim] each, after RoPE,
  /// before repeat_kv) as `past_key_values`, alive until the loop drops the model's output (after
  /// the loss; with loop_holds_outputs, at the next forward). A checkpoint_wrapper'd layer saves
  /// neither, so they come on top (llama-recipes of 2023: ~4 GB on Llama 2 7B, its PR #165).
  bool use_cache = false;
  /// --ac full as transformers' own gradient_checkpointing_enable() runs it under the HF Trainer
  /// (gradient_checkpointing=True with no kwargs): use_reentrant=True from 4.35 to at least 4.51,
  /// the checkpoint called by the model's layer loop around each decoder layer, and so around its
  /// FSDP1 unit. FSDP1 registers its reshard-only post-backward hook for a frozen flat parameter
  /// (LoRA and QLoRA under peft's wrap) on the unit's input tensors when the unit's forward runs
  /// with grad enabled (_runtime_utils.py, _register_post_backward_reshard_only_hook): that is the
  /// reentrant recomputation, whose input is a detached leaf, so the hook holds its AccumulateGrad
  /// node, the input and, once backward has run, its .grad until _finalize_params at the end of
  /// backward. From 4.52 the layer checkpoints itself inside the unit (GradientCheckpointingLayer)
  /// and nothing is held. Requires --ac full.
  bool ac_reentrant = false;
  /// PYTORCH_CUDA_ALLOC_CONF, verbatim (core/caching_allocator.h parses it; "" is PyTorch's default).
  std::string alloc_conf;
  LoraConfig lora;                 ///< rank 0: full fine-tuning
  Impl impl = Impl::kTransformers;
  TorchDevice torch_device = TorchDevice::kCuda;
  TransformersVersion transformers;  ///< the release under Impl::kTransformers (its loss path: HfLossOf)
};

/// FsdpConfig::ac_reentrant where it holds something: FSDP1 with transformers before 4.52 (whose
/// layer loop calls the checkpoint around the FSDP unit). Which units it holds (frozen ones) is
/// the workload's question.
bool ReentrantHoldsInputs(const FsdpConfig& c);

std::string_view StrategyName(Strategy s);        ///< "FULL_SHARD", ...
std::string_view WrapPolicyName(WrapPolicy w);    ///< "block", "size", "none", "linear", "peft"
std::string_view CheckpointingName(Checkpointing c);
std::string_view AttentionName(Attention a);
std::string_view OptimizerName(Optimizer o);
std::string_view FrameworkName(Framework f);
std::string_view BackwardPrefetchName(BackwardPrefetch p);
std::string_view ImplName(Impl i);  ///< "transformers", "torchtitan", "torchtitan-2025-01"
std::string_view TorchDeviceName(TorchDevice d);  ///< "cuda", "cpu"

Result<Strategy> ParseStrategy(std::string_view text);
/// "block", "none", "linear", "peft" or "size:N" (N parameters, e.g. size:1e8 or size:100000000).
Status ParseWrap(std::string_view text, FsdpConfig& config);
Result<Checkpointing> ParseCheckpointing(std::string_view text);
Result<Attention> ParseAttention(std::string_view text);
Result<Optimizer> ParseOptimizer(std::string_view text);
Result<Framework> ParseFramework(std::string_view text);
Result<BackwardPrefetch> ParseBackwardPrefetch(std::string_view text);
Result<Impl> ParseImpl(std::string_view text);
Result<TorchDevice> ParseTorchDevice(std::string_view text);  ///< "cuda" or "cpu"
/// "4.44", "4.44.2", "4.57.0rc1" or "5.0.0.dev0" (MAJOR.MINOR[.PATCH][aN|bN|rcN|.devN|.postN]).
/// Refused: releases before 4.31, which computed the loss in the logits' own dtype, and any but
/// 4.31 to 4.57 and 5.x.
Result<TransformersVersion> ParseTransformersVersion(std::string_view text);
std::string TransformersVersionName(TransformersVersion v);  ///< "4.44"

/// Fills the defaults that depend on model and hardware (seq_len, gpus_per_node, shard group) and
/// rejects impossible or inconsistent settings with a one-line BadInput.
Status ResolveAndValidate(FsdpConfig& config, const ModelSpec& model, const HardwareSpec& hw);

/// FSDP1 on a world of one rank runs every strategy as NO_SHARD: FullyShardedDataParallel warns
/// and switches (torch/distributed/fsdp/_init_utils.py, _init_core_state). FSDP2 keeps its
/// strategy. True when `config` is one PyTorch runs as another strategy.
bool Fsdp1SwitchesToNoShard(const FsdpConfig& config);

/// Whether fsdpkit models --ac selective-op for this model: dense, bias-free Llama-style blocks
/// (torchtitan's policy keeps every second aten.mm output; a biased Linear runs as addmm).
bool OpCheckpointingModelled(const ModelSpec& model);

/// Why torchtitan's own model code under `impl` (IsTorchtitan) cannot stand for the model, or ""
/// when it can: a Llama with untied embeddings and dense, bias-free pre-norm blocks (torchtitan
/// 0.2.2's models/llama3/model/model.py: wq/wk/wv/wo, w1/w2/w3, nn.RMSNorm, an untied `output`),
/// and under Impl::kTorchtitan also a dense Qwen3 of that shape with its per-head q/k norms and
/// full causal attention (models/qwen3/model/model.py; the January 2025 tree had no Qwen3).
std::string TorchtitanRuledOut(const ModelSpec& model, Impl impl);

/// Why transformers release `v` cannot plan the model, or "" when it can: the release has no such
/// model_type yet (families::Family::plannable_since).
std::string TransformersRuledOut(const ModelSpec& model, TransformersVersion v);

/// Why transformers cannot run the model's attention through SDPA, or "" when it can: Gemma 2's
/// soft-capped scores (Gemma2PreTrainedModel._supports_sdpa = False; sdpa_attention_forward
/// refuses a softcap), gpt-oss's attention sinks (GptOssPreTrainedModel._supports_sdpa = False).
/// Without --attention the CLIs plan such a model with eager attention.
std::string SdpaRuledOut(const ModelSpec& model);

/// Whether decoder block `block` (0-based) runs under activation checkpointing: every block for
/// selective and selective-op, every `ac_every`-th for full, none without.
bool BlockCheckpointed(const FsdpConfig& config, int block);
/// Applies that switch; returns true when it changed `config`.
bool ApplyFsdp1WorldOfOne(FsdpConfig& config);

/// Ranks that share one parameter shard group (W): gpus for FULL/SHARD_GRAD_OP, the shard group
/// for HYBRID_SHARD, 1 for NO_SHARD. Call after ResolveAndValidate.
int64_t ShardWorldSize(const FsdpConfig& config);
/// Number of replicas of each shard (gpus / ShardWorldSize).
int64_t ReplicaCount(const FsdpConfig& config);

}  // namespace fsdp
