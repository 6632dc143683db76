// The plan as a JSON document (schema in docs/cli.md), shared by fsdp-plan and later tools.
#pragma once

#include "core/json_io.h"
#include "core/workload.h"
#include "planner/memory_model.h"
#include "planner/step_model.h"

namespace fsdp {

/// {"model": {...}, "hardware": {...}, "config": {...}, "units": {...}, "memory": {...}}.
Json PlanToJson(const Workload& workload, const MemoryEstimate& memory);

/// Adds "comm" (per-step collective bytes and counts) and "time" (step time, tokens/s, MFU, and the
/// DDP comparison when `ddp_step_s` > 0) to a plan document.
void AddTimeToJson(const TimeEstimate& time, double ddp_step_s, Json& plan);

/// Adds "experts" for a routed model (RoutedExpertBytesPerGpu and CommVolume's routed-expert
/// bytes): what its experts cost each GPU in memory and per step in collectives; nothing for a
/// dense one.
void AddExpertsToJson(const Workload& workload, const CommVolume& volume, Json& plan);

/// The configuration alone (strategy, dtypes, ...), as written in plan files.
Json ConfigToJson(const FsdpConfig& config);

}  // namespace fsdp
