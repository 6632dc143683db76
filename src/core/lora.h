// peft's LoRA as a transformation of the model: which linears get adapters, what is frozen.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/model_spec.h"
#include "core/status.h"

namespace fsdp {

/// The block-relative module paths of the linears `lora` targets in `model` (in forward order), as
/// peft's check_target_module_exists matches target_modules: a module whose path equals a target
/// or ends with "." + target; "all-linear" every linear of the decoder blocks (peft leaves the
/// output layer out). BadInput for a target that names no linear of the blocks, one naming a
/// router or routed experts, all-linear on an MoE model (transformers 5 stores experts as fused 3-D
/// parameters, which peft adapts through target_parameters and fsdpkit does not model), or a rank
/// above a targeted layer's width (min(in, out)).
Result<std::vector<std::string>> LoraTargetModules(const ModelSpec& model, const LoraConfig& lora);

/// Applies `lora` (rank > 0) to `model` as get_peft_model does: every base parameter frozen
/// (Architecture::base_frozen), each targeted linear given lora_rank and its adapters, the tensor
/// inventory rebuilt. With lora.qlora, every linear of the blocks is first stored as NF4 packed in
/// `quant_storage` elements, as transformers' replace_with_bnb_linear converts them (lm_head and
/// the embedding stay as they are); BadInput on an MoE model, whose fused expert parameters
/// bitsandbytes' Linear4bit does not replace. Rank 0 leaves the model as it is. Errors as
/// LoraTargetModules.
Status ApplyLora(ModelSpec& model, const LoraConfig& lora, DType quant_storage = DType::kBf16);
/// The block-relative paths of the linears ApplyLora wrapped, in forward order, each once (over
/// every block shape), then the vision tower's (layer-relative, or full outside its layers): what
/// peft's target_modules lists. A vision tower's linears matching the targets are wrapped too, as
/// peft matches every module of the model.
std::vector<std::string> AdaptedModules(const Architecture& arch);

/// The tensors of the quantization state bitsandbytes keeps beside one NF4 weight of
/// `weight_numel` elements (QuantState of functional.py quantize_4bit), in bytes: the absmax of
/// every block of 64 in fp32 and the 16-entry fp32 code; with double quantization the code, the
/// fp32 offset, the absmax in uint8, an fp32 absmax per 256 of those and the nested state's copy of
/// the 256-entry fp32 dynamic map. Each rank holds
/// the whole state of every quantized weight: it lives on the module, outside what FSDP shards.
std::vector<int64_t> Nf4QuantStateTensorBytes(int64_t weight_numel, bool double_quant);
/// Their sum.
int64_t Nf4QuantStateBytes(int64_t weight_numel, bool double_quant);

/// A QLoRA model's NF4 weights: their packed storage (every rank's shards together) and their
/// quantization state (held whole by each rank), in bytes; zeros without QLoRA.
struct Nf4Bytes {
  int64_t packed = 0, quant_state = 0;
};
Nf4Bytes Nf4ModelBytes(const ModelSpec& model, const LoraConfig& lora, DType quant_storage);

/// What fsdp-run's CPU engine keeps of a quantized weight's state (runtime/nf4.h Nf4QuantState):
/// the fp32 absmax per 64 weights or, double-quantized, a byte per 64, an fp32 absmax per 256 of
/// those bytes and the fp32 offset. (bitsandbytes' QuantState holds the codes too:
/// Nf4QuantStateTensorBytes.)
int64_t Nf4EngineStateBytes(int64_t weight_numel, bool double_quant);

/// fsdp-run's CPU engine under QLoRA dequantizes a gathered unit into a compute buffer of the unit's
/// own tensors (`unit_tensors` less the LoRA adapters) at their LogicalNumel: its elements, or 0
/// when none of them is a quantized weight (runtime/fsdp_engine.h, ComputeOffsets).
int64_t Nf4ComputeNumel(const ModelSpec& model, const std::vector<int>& unit_tensors);

/// The names peft gives a wrapped linear's tensors (lora.Linear, adapter "default"):
/// "<module>.base_layer.weight" (and .bias), "<module>.lora_A.default.weight",
/// "<module>.lora_B.default.weight". BuildInventory names them so.
inline constexpr std::string_view kLoraBaseLayer = ".base_layer", kLoraASuffix = ".lora_A.default.weight",
                                  kLoraBSuffix = ".lora_B.default.weight";
/// Whether a tensor name is a LoRA adapter's (lora_A or lora_B).
inline bool IsLoraAdapter(std::string_view tensor_name) { return tensor_name.ends_with(kLoraASuffix) || tensor_name.ends_with(kLoraBSuffix); }

/// peft's check_target_module_exists: `path` is `name`, or ends with "." + `name`.
bool ModulePathMatches(std::string_view path, std::string_view name);

/// "q_proj,v_proj" -> {"q_proj", "v_proj"}; empty items dropped.
std::vector<std::string> SplitTargets(const std::string& targets);

}  // namespace fsdp
