// The plan as a JSON document (schema in docs/cli.md), shared by fsdp-plan and later tools.
#pragma once

#include "core/json_io.h"
#include "core/workload.h"
#include "planner/memory_model.h"

namespace fsdp {

/// {"model": {...}, "hardware": {...}, "config": {...}, "units": {...}, "memory": {...}}.
Json PlanToJson(const Workload& workload, const MemoryEstimate& memory);

/// The configuration alone (strategy, dtypes, ...), as written in plan files.
Json ConfigToJson(const FsdpConfig& config);

}  // namespace fsdp
