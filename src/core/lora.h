// peft's LoRA as a transformation of the model: which linears get adapters, what is frozen.
#pragma once

#include <string>
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
/// inventory rebuilt. Rank 0 leaves the model as it is. Errors as LoraTargetModules.
Status ApplyLora(ModelSpec& model, const LoraConfig& lora);

/// "q_proj,v_proj" -> {"q_proj", "v_proj"}; empty items dropped.
std::vector<std::string> SplitTargets(const std::string& targets);

}  // namespace fsdp
