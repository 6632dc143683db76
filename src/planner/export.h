// The chosen configuration as code for the libraries people train with.
#pragma once

#include <string>
#include <string_view>

#include "core/workload.h"

namespace fsdp {

enum class ExportFormat { kFsdp1, kFsdp2, kAccelerate, kLightning };

/// "pytorch" / "fsdp1", "fsdp2", "accelerate", "lightning".
Result<ExportFormat> ParseExportFormat(std::string_view text);

/// A self-contained snippet: FSDP1 `FullyShardedDataParallel(...)`, FSDP2 `fully_shard`, an
/// accelerate config YAML, or Lightning's `FSDPStrategy` + Trainer arguments, reproducing the
/// workload's strategy, wrap policy, mixed precision, offload, prefetch, rate limiter, activation
/// checkpointing, GPU layout and batch.
std::string ExportConfig(const Workload& workload, ExportFormat format);

/// The exports are written against transformers 5.24's API (AttentionInterface, `dtype=`, ...):
/// the one-line refusal for a plan of another release (FsdpConfig::transformers).
std::string ExportNeedsCurrentTransformers(TransformersVersion planned);

/// transformers' decoder-layer class for the model family (LlamaDecoderLayer, GPT2Block, ...).
std::string_view DecoderLayerClass(const ModelSpec& model);

}  // namespace fsdp
