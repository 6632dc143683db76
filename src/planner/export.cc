#include "planner/export.h"

#include <fmt/format.h>

#include "core/lora.h"
#include "core/workload.h"

namespace fsdp {
namespace {

std::string_view TorchDType(DType d) {
  switch (d) {
    case DType::kFp32: return "torch.float32";
    case DType::kBf16: return "torch.bfloat16";
    case DType::kFp16: return "torch.float16";
  }
  return "?";
}

std::string_view ModelingModule(const ModelSpec& m) { return m.arch.modeling_module.empty() ? m.model_type : m.arch.modeling_module; }

std::string Python(bool b) { return b ? "True" : "False"; }

// FSDP1's backward_prefetch argument.
std::string_view PrefetchExpression(BackwardPrefetch p) {
  switch (p) {
    case BackwardPrefetch::kNone: return "None";
    case BackwardPrefetch::kPre: return "BackwardPrefetch.BACKWARD_PRE";
    case BackwardPrefetch::kPost: return "BackwardPrefetch.BACKWARD_POST";
  }
  return "None";
}

constexpr const char* kCheckpointImports =
    "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
    "    CheckpointImpl,\n    apply_activation_checkpointing,\n    checkpoint_wrapper,\n)\n";

std::string LayerImport(const ModelSpec& m) {
  return fmt::format("from transformers.models.{0}.modeling_{0} import {1}\n", ModelingModule(m), DecoderLayerClass(m));
}

std::string Header(const Workload& w) {
  const FsdpConfig& c = w.config;
  const int64_t nodes = (c.gpus + c.gpus_per_node - 1) / c.gpus_per_node;
  return fmt::format("# fsdpkit plan: {} on {} x {} ({} node(s) x {}), {}, micro-batch {} x seq {}, grad-accum {}\n"
                     "# launch: torchrun --nnodes {} --nproc-per-node {} train.py\n",
                     w.model.id, c.gpus, w.hardware.id, nodes, c.gpus_per_node, StrategyName(c.strategy), c.micro_batch, c.seq_len,
                     c.grad_accum, nodes, c.gpus_per_node);
}

std::string AutoWrapPolicy(const Workload& w) {
  switch (w.config.wrap) {
    case WrapPolicy::kBlock:
      return fmt::format("functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={{{}}})", DecoderLayerClass(w.model));
    case WrapPolicy::kSize: return fmt::format("functools.partial(size_based_auto_wrap_policy, min_num_params={})", w.config.wrap_min_params);
    case WrapPolicy::kLinear: return "ModuleWrapPolicy({torch.nn.Linear})";
    case WrapPolicy::kPeft: return "fsdp_auto_wrap_policy(model)";  // peft.utils.other: decoder layers + each trainable leaf (the adapters)
    case WrapPolicy::kNone: return "None";
  }
  return "None";
}

// --ac selective as fsdpkit models it: HF's attention function (with its mask function) under a
// non-reentrant checkpoint, registered as the model's attention implementation, so only the
// attention core is recomputed. tools/torch_reference.py runs this code (and
// tools/export_check.py runs the exported FSDP2 code).
std::string SelectiveCheckpointingCode(const Workload& w, std::string_view model_var) {
  const bool eager = w.config.attention == Attention::kEager;
  const std::string core = eager ? fmt::format("from transformers.models.{0}.modeling_{0} import eager_attention_forward as attention_core\n",
                                               ModelingModule(w.model))
                                 : "from transformers.integrations.sdpa_attention import sdpa_attention_forward as attention_core\n";
  return fmt::format(
      "# selective activation checkpointing: the attention core (scores, softmax, probabilities x V)\n"
      "# is recomputed in backward, the rest of each block is saved\n"
      "from torch.utils.checkpoint import checkpoint\n"
      "from transformers import AttentionInterface, AttentionMaskInterface\n"
      "from transformers.masking_utils import {}_mask as attention_mask_function\n{}\n\n"
      "def checkpointed_attention(module, query, key, value, attention_mask, **kwargs):\n"
      "    return checkpoint(attention_core, module, query, key, value, attention_mask, use_reentrant=False, **kwargs)\n\n\n"
      "AttentionInterface.register(\"fsdpkit_selective\", checkpointed_attention)\n"
      "AttentionMaskInterface.register(\"fsdpkit_selective\", attention_mask_function)  # else a causal batch gets no mask\n"
      "{}.set_attn_implementation(\"fsdpkit_selective\")  # before wrapping; or from_pretrained(..., attn_implementation=...)\n",
      eager ? "eager" : "sdpa", core, model_var);
}

// --ac selective-op: torchtitan's op-level selective AC (selective_ac_option = "op"), a context_fn
// for checkpoint_wrapper. tools/torch_reference.py --ac selective-op runs the same policy.
constexpr const char* kOpPolicyCode =
    "# torchtitan's op-level selective activation checkpointing: keep the outputs of aten.mm, but every\n"
    "# second one of a block, and of the SDPA kernels; recompute every other op in backward\n"
    "from collections import defaultdict\n"
    "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts\n\n"
    "op_saved = {\n    torch.ops.aten.mm.default,\n    torch.ops.aten._scaled_dot_product_efficient_attention.default,\n"
    "    torch.ops.aten._scaled_dot_product_flash_attention.default,\n}\n\n\n"
    "def op_selective_context():\n"
    "    mm_seen = defaultdict(int)  # per pass (forward, recompute) of the block\n\n"
    "    def policy(ctx, func, *args, **kwargs):\n"
    "        pass_name = \"recompute\" if ctx.is_recompute else \"forward\"\n"
    "        if func == torch.ops.aten.mm.default:\n            mm_seen[pass_name] += 1\n"
    "        keep = func in op_saved and not (func == torch.ops.aten.mm.default and mm_seen[pass_name] % 2 == 0)\n"
    "        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE\n\n"
    "    return create_selective_checkpoint_contexts(policy)\n\n\n";

std::string CheckpointingCode(const Workload& w, std::string_view model_var) {
  if (w.config.checkpointing == Checkpointing::kNone) return "";
  if (w.config.checkpointing == Checkpointing::kSelective) return SelectiveCheckpointingCode(w, model_var);
  const bool op = w.config.checkpointing == Checkpointing::kSelectiveOp;  // else full
  const std::string layer(DecoderLayerClass(w.model));
  std::string blocks, check_fn = fmt::format("isinstance(m, {})", layer);
  if (w.config.ac_every > 1) {  // layer-level selective (torchtitan's selective_ac_option = "N")
    blocks = fmt::format("# decoder blocks {2}, 2 x {2}, ... (counting from 1) are checkpointed whole, the others keep their activations\n"
                         "checkpointed_blocks = {{\n    id(m) for i, m in enumerate(x for x in {0}.modules() if isinstance(x, {1})) if (i + 1) % {2} == 0\n}}\n",
                         model_var, layer, w.config.ac_every);
    check_fn = "id(m) in checkpointed_blocks";
  }
  return fmt::format("{3}{0}.config.use_cache = False  # a KV cache would grow again each time a block is recomputed\n{1}"
                     "apply_activation_checkpointing(\n    {0},\n"
                     "    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT{4}),\n"
                     "    check_fn=lambda m: {2},\n)\n",
                     model_var, blocks, check_fn, op ? kOpPolicyCode : "", op ? ", context_fn=op_selective_context" : "");
}

// A block of Python as comment lines, for formats that cannot hold code (YAML, Trainer arguments).
std::string Commented(const std::string& code) {
  std::string out;
  size_t begin = 0;
  while (begin < code.size()) {
    const size_t end = code.find('\n', begin);
    const std::string_view line(code.data() + begin, (end == std::string::npos ? code.size() : end) - begin);
    out += line.empty() ? "#\n" : fmt::format("#   {}\n", line);
    begin = end == std::string::npos ? code.size() : end + 1;
  }
  return out;
}

// fp16 parameters need loss scaling (bf16 has fp32's exponent range and does not): PyTorch's
// ShardedGradScaler, whose inf/NaN check is all-reduced over the ranks.
std::string GradScalerCode(const FsdpConfig& c) {
  if (c.param_dtype != DType::kFp16) return "";
  return "# fp16 gradients underflow without loss scaling; a step whose gradients hold an inf or NaN on any rank is\n"
         "# skipped and halves the scale. In the loop: scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()\n"
         "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n\nscaler = ShardedGradScaler()\n";
}

// The model as planned under LoRA / QLoRA, made from the `model` the code starts from: for QLoRA
// how to load it (4-bit, its storage in the param dtype so that FSDP can shard it), then peft's
// adapters; "" in full fine-tuning.
std::string LoraCode(const Workload& w) {
  const FsdpConfig& c = w.config;
  const LoraConfig& l = c.lora;
  if (l.rank == 0) return "";
  std::string targets;
  for (const std::string& module : AdaptedModules(w.model.arch)) {  // block-relative paths: peft matches them as suffixes
    targets += fmt::format("{}\"{}\"", targets.empty() ? "" : ", ", module);
  }
  const DType base = FrozenStorageDtype(c);
  std::string out;
  if (l.qlora) {
    out += fmt::format(
        "# QLoRA: the model loaded 4-bit by bitsandbytes, the NF4 codes packed in {0} (quant_storage) so that FSDP shards\n"
        "# and all-gathers them as any {0} parameter:\n"
        "from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n\n"
        "bnb_config = BitsAndBytesConfig(\n    load_in_4bit=True,\n    bnb_4bit_quant_type=\"nf4\",\n    bnb_4bit_use_double_quant={1},\n"
        "    bnb_4bit_compute_dtype={2},\n    bnb_4bit_quant_storage={0},\n)\n"
        "# model = AutoModelForCausalLM.from_pretrained(MODEL_ID, dtype={0}, quantization_config=bnb_config)\n",
        TorchDType(c.param_dtype), Python(l.double_quant), TorchDType(QloraComputeDtype(c)));
  } else if (base != c.master_dtype) {
    out += fmt::format("# the frozen base in {}: model = AutoModelForCausalLM.from_pretrained(MODEL_ID, dtype={})\n", DTypeName(base), TorchDType(base));
  }
  // peft casts bf16 / fp16 adapters up to fp32 (autocast_adapter_dtype=True): a pure-bf16 plan keeps them in bf16
  const bool adapters_in_base_dtype = c.master_dtype != DType::kFp32;
  out += fmt::format(
      "from peft import LoraConfig, get_peft_model\n\n"
      "model = get_peft_model(\n    model,\n    LoraConfig(r={}, lora_alpha={}, lora_dropout={}, target_modules=[{}], task_type=\"CAUSAL_LM\"),\n"
      "    autocast_adapter_dtype={},\n)\n",
      l.rank, l.alpha, l.dropout, targets, Python(!adapters_in_base_dtype));
  if (c.wrap == WrapPolicy::kPeft) out += "from peft.utils.other import fsdp_auto_wrap_policy\n";
  return out + "\n";
}

std::string MeshCode(const Workload& w) {
  if (w.config.strategy == Strategy::kHybridShard) {
    return fmt::format("mesh = init_device_mesh(\"cuda\", ({}, {}), mesh_dim_names=(\"replicate\", \"shard\"))\n", w.replicas, w.shard_world);
  }
  return fmt::format("mesh = init_device_mesh(\"cuda\", ({},))\n", w.config.gpus);
}

// Selective and every-N-th-block checkpointing are not options of accelerate's or Lightning's FSDP
// configuration: those exports carry the code as a comment.
bool CheckpointingNeedsCode(const FsdpConfig& c) {
  return c.checkpointing == Checkpointing::kSelective || c.checkpointing == Checkpointing::kSelectiveOp || c.ac_every > 1;
}

// That comment: "<what> is not <an option of the format>: run this <where>", then the code with
// the imports it needs (the selective code brings its own); "" when the format expresses it.
std::string CheckpointingComment(const Workload& w, std::string_view not_an_option_where) {
  if (!CheckpointingNeedsCode(w.config)) return "";
  const Checkpointing ac = w.config.checkpointing;
  const bool selective = ac == Checkpointing::kSelective;
  const std::string code = selective ? CheckpointingCode(w, "model")
                                     : "import functools\n" + std::string(kCheckpointImports) + LayerImport(w.model) + CheckpointingCode(w, "model");
  const char* what = selective ? "selective checkpointing" : ac == Checkpointing::kSelectiveOp ? "op-level selective checkpointing" : "checkpointing every N-th block";
  return fmt::format("# {} is not {}\n", what, not_an_option_where) + Commented(code);
}

std::string Fsdp1(const Workload& w) {
  const FsdpConfig& c = w.config;
  std::string out = Header(w);
  out += "import functools\nimport torch\n"
         "from torch.distributed.device_mesh import init_device_mesh\n"
         "from torch.distributed.fsdp import (\n    BackwardPrefetch,\n    CPUOffload,\n    FullyShardedDataParallel as FSDP,\n"
         "    MixedPrecision,\n    ShardingStrategy,\n)\n"
         "from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy\n";
  out += kCheckpointImports;
  out += LayerImport(w.model) + "\n";
  out += LoraCode(w);
  out += MeshCode(w);
  out += fmt::format("mixed_precision = MixedPrecision(param_dtype={}, reduce_dtype={}, buffer_dtype={})\n", TorchDType(c.param_dtype),
                     TorchDType(c.reduce_dtype), TorchDType(c.buffer_dtype));
  const std::string_view prefetch = PrefetchExpression(c.backward_prefetch);
  if (c.checkpointing == Checkpointing::kSelective) out += CheckpointingCode(w, "model");
  out += fmt::format("model = FSDP(\n    model,\n    sharding_strategy=ShardingStrategy.{},\n    auto_wrap_policy={},\n"
                     "    mixed_precision=mixed_precision,\n    cpu_offload=CPUOffload(offload_params={}),\n    backward_prefetch={},\n"
                     "    forward_prefetch={},\n    limit_all_gathers={},\n    use_orig_params={},\n    device_mesh=mesh,\n"
                     "    device_id=torch.cuda.current_device(),\n)\n",
                     StrategyName(c.strategy), AutoWrapPolicy(w), Python(c.cpu_offload), prefetch, Python(c.forward_prefetch),
                     Python(c.limit_all_gathers), Python(c.use_orig_params));
  if (c.checkpointing == Checkpointing::kFull || c.checkpointing == Checkpointing::kSelectiveOp) out += CheckpointingCode(w, "model");
  out += GradScalerCode(c);
  return out;
}

std::string Fsdp2(const Workload& w) {
  const FsdpConfig& c = w.config;
  std::string out = Header(w);
  out += "import functools\nimport torch\n"
         "from torch.distributed.device_mesh import init_device_mesh\n"
         "from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # torch >= 2.6\n";
  out += kCheckpointImports;
  out += LayerImport(w.model) + "\n";
  out += LoraCode(w);
  out += CheckpointingCode(w, "model");
  out += MeshCode(w);
  const bool reshard = c.strategy == Strategy::kFullShard || c.strategy == Strategy::kHybridShard;
  out += fmt::format("fsdp_kwargs = dict(\n    mesh=mesh,\n    mp_policy=MixedPrecisionPolicy(param_dtype={}, reduce_dtype={}),\n"
                     "    offload_policy={},\n    reshard_after_forward={},\n)\n",
                     TorchDType(c.param_dtype), TorchDType(c.reduce_dtype), c.cpu_offload ? "CPUOffloadPolicy()" : "OffloadPolicy()", Python(reshard));
  if (c.wrap == WrapPolicy::kBlock) {
    out += fmt::format("for module in model.modules():\n    if isinstance(module, {}):\n        fully_shard(module, **fsdp_kwargs)\n",
                       DecoderLayerClass(w.model));
  } else if (c.wrap == WrapPolicy::kLinear) {
    out += "for module in model.modules():\n    if isinstance(module, torch.nn.Linear):\n        fully_shard(module, **fsdp_kwargs)\n";
  }
  out += "fully_shard(model, **fsdp_kwargs)  # the root: embeddings, final norm, lm_head\n";
  out += GradScalerCode(c);
  return out;
}

std::string Accelerate(const Workload& w) {
  const FsdpConfig& c = w.config;
  const int64_t nodes = (c.gpus + c.gpus_per_node - 1) / c.gpus_per_node;
  const bool layers = c.wrap == WrapPolicy::kBlock || c.wrap == WrapPolicy::kPeft;
  std::string wrap = layers ? "TRANSFORMER_BASED_WRAP" : c.wrap == WrapPolicy::kSize ? "SIZE_BASED_WRAP" : "NO_WRAP";
  std::string prefetch = c.backward_prefetch == BackwardPrefetch::kNone ? "NO_PREFETCH"
                         : c.backward_prefetch == BackwardPrefetch::kPre ? "BACKWARD_PRE" : "BACKWARD_POST";
  const bool fsdp2 = c.framework == Framework::kFsdp2;
  std::string out = Header(w);
  out += "# accelerate launch --config_file fsdp.yaml train.py\n";
  if (c.param_dtype == DType::kFp16) out += "# fp16: accelerator.backward(loss) scales the loss (Accelerator makes a ShardedGradScaler under FSDP)\n";
  if (c.reduce_dtype != c.param_dtype) {
    out += fmt::format("# the plan reduces gradients in {}: pass FullyShardedDataParallelPlugin(mixed_precision_policy=...) to Accelerator\n",
                       DTypeName(c.reduce_dtype));
  }
  out += CheckpointingComment(w, "an accelerate option: run this in train.py before accelerator.prepare(model)");
  if (c.lora.rank > 0) out += "# the model, in train.py before accelerator.prepare(model):\n" + Commented(LoraCode(w));
  if (c.wrap == WrapPolicy::kPeft) {
    out += "# peft's wrap: transformers' Trainer installs it for a PeftModel (update_fsdp_plugin_peft); with accelerate alone,\n"
           "# before accelerator.prepare(model): accelerator.state.fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)\n";
  }
  out += "compute_environment: LOCAL_MACHINE\ndebug: false\ndistributed_type: FSDP\ndowncast_bf16: 'no'\nfsdp_config:\n";
  out += fmt::format("  fsdp_activation_checkpointing: {}\n", c.checkpointing == Checkpointing::kFull && !CheckpointingNeedsCode(c) ? "true" : "false");
  out += fmt::format("  fsdp_auto_wrap_policy: {}\n", wrap);
  if (!fsdp2) out += fmt::format("  fsdp_backward_prefetch: {}\n", prefetch);
  out += "  fsdp_cpu_ram_efficient_loading: true\n";
  if (!fsdp2) out += fmt::format("  fsdp_forward_prefetch: {}\n", c.forward_prefetch ? "true" : "false");
  if (c.wrap == WrapPolicy::kSize) out += fmt::format("  fsdp_min_num_params: {}\n", c.wrap_min_params);
  out += fmt::format("  fsdp_offload_params: {}\n", c.cpu_offload ? "true" : "false");
  if (fsdp2) {
    const bool reshard = c.strategy == Strategy::kFullShard || c.strategy == Strategy::kHybridShard;
    out += fmt::format("  fsdp_reshard_after_forward: {}\n", reshard ? "true" : "false");
  } else {
    out += fmt::format("  fsdp_sharding_strategy: {}\n", StrategyName(c.strategy));
  }
  out += "  fsdp_state_dict_type: SHARDED_STATE_DICT\n";
  if (!fsdp2) out += "  fsdp_sync_module_states: true\n";
  if (layers) out += fmt::format("  fsdp_transformer_layer_cls_to_wrap: {}\n", DecoderLayerClass(w.model));
  if (!fsdp2) out += fmt::format("  fsdp_use_orig_params: {}\n", c.use_orig_params ? "true" : "false");
  out += fmt::format("  fsdp_version: {}\n", fsdp2 ? 2 : 1);
  out += fmt::format("machine_rank: 0\nmain_training_function: main\nmixed_precision: {}\nnum_machines: {}\nnum_processes: {}\n"
                     "rdzv_backend: static\nsame_network: true\nuse_cpu: false\n",
                     c.param_dtype == DType::kFp32 ? "'no'" : DTypeName(c.param_dtype), nodes, c.gpus);
  return out;
}

std::string Lightning(const Workload& w) {
  const FsdpConfig& c = w.config;
  const int64_t nodes = (c.gpus + c.gpus_per_node - 1) / c.gpus_per_node;
  std::string out = Header(w);
  out += "import torch\nfrom lightning.pytorch import Trainer\nfrom lightning.pytorch.strategies import FSDPStrategy\n"
         "from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision\n";
  out += LayerImport(w.model) + "\n";
  out += LoraCode(w);
  std::string wrap = c.wrap == WrapPolicy::kBlock  ? fmt::format("{{{}}}", DecoderLayerClass(w.model))
                     : c.wrap == WrapPolicy::kPeft ? AutoWrapPolicy(w)
                                                   : "None";
  std::string ac = c.checkpointing == Checkpointing::kFull && !CheckpointingNeedsCode(c) ? fmt::format("{{{}}}", DecoderLayerClass(w.model)) : "None";
  out += CheckpointingComment(w, "a FSDPStrategy option: run this on the model before the Trainer wraps it");
  const std::string_view prefetch = PrefetchExpression(c.backward_prefetch);
  out += fmt::format("strategy = FSDPStrategy(\n    sharding_strategy=\"{}\",\n    auto_wrap_policy={},\n"
                     "    activation_checkpointing_policy={},\n    cpu_offload={},\n"
                     "    mixed_precision=MixedPrecision(param_dtype={}, reduce_dtype={}, buffer_dtype={}),\n"
                     "    state_dict_type=\"sharded\",\n    # passed through to FullyShardedDataParallel:\n"
                     "    backward_prefetch={},\n    forward_prefetch={},\n    limit_all_gathers={},\n    use_orig_params={},\n)\n",
                     StrategyName(c.strategy), wrap, ac, Python(c.cpu_offload), TorchDType(c.param_dtype), TorchDType(c.reduce_dtype),
                     TorchDType(c.buffer_dtype), prefetch, Python(c.forward_prefetch), Python(c.limit_all_gathers), Python(c.use_orig_params));
  out += fmt::format("trainer = Trainer(\n    accelerator=\"gpu\",\n    devices={},\n    num_nodes={},\n    strategy=strategy,\n"
                     "    precision=\"{}\",\n    accumulate_grad_batches={},\n)\n",
                     c.gpus_per_node, nodes, c.param_dtype == DType::kFp32 ? "32-true" : c.param_dtype == DType::kBf16 ? "bf16-mixed" : "16-mixed",
                     c.grad_accum);
  if (c.param_dtype == DType::kFp16) out += "# precision=\"16-mixed\" scales the loss with a ShardedGradScaler\n";
  out += fmt::format("# DataLoader batch_size={} (micro-batch per GPU), sequences of {} tokens\n", c.micro_batch, c.seq_len);
  return out;
}

}  // namespace

std::string_view DecoderLayerClass(const ModelSpec& m) { return m.arch.decoder_layer_class; }

std::string ExportNeedsCurrentTransformers(TransformersVersion planned) {
  return fmt::format("--export writes code for transformers {}'s API; --transformers-version {} is planned, not exported",
                     TransformersVersionName(TransformersVersion{}), TransformersVersionName(planned));
}

Result<ExportFormat> ParseExportFormat(std::string_view t) {
  if (t == "pytorch" || t == "fsdp1") return ExportFormat::kFsdp1;
  if (t == "fsdp2") return ExportFormat::kFsdp2;
  if (t == "accelerate") return ExportFormat::kAccelerate;
  if (t == "lightning") return ExportFormat::kLightning;
  return Error::BadInput(fmt::format("unknown export format '{}' (expected pytorch, fsdp2, accelerate or lightning)", t));
}

std::string ExportConfig(const Workload& w, ExportFormat f) {
  switch (f) {
    case ExportFormat::kFsdp1: return Fsdp1(w);
    case ExportFormat::kFsdp2: return Fsdp2(w);
    case ExportFormat::kAccelerate: return Accelerate(w);
    case ExportFormat::kLightning: return Lightning(w);
  }
  return "";
}

}  // namespace fsdp
