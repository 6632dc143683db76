// Step time with overlap: the compute stream and the communication stream of one GPU played
// unit by unit in FSDP's issue order (docs/time-model.md, "Overlap").
#pragma once

#include <vector>

#include "core/workload.h"
#include "planner/comm_model.h"
#include "planner/compute_model.h"

namespace fsdp {

struct StepEstimate {
  double step_s = 0;              ///< one optimizer step (all micro-batches + optimizer)
  double compute_s = 0;           ///< compute-stream busy time
  double comm_s = 0;              ///< all collectives and copies back to back (no overlap)
  double exposed_comm_s = 0;      ///< step_s - compute_s: time the compute stream waits on communication
  double first_all_gather_s = 0;  ///< the step's first all-gather, always exposed
  double last_reduce_s = 0;       ///< communication after the last backward compute, always exposed
  double forward_s = 0, backward_s = 0, optimizer_s = 0;  ///< wall time of each phase (summed over micro-batches)
  double tokens_per_s_per_gpu = 0;
  double tflops_per_gpu = 0;      ///< model FLOPs (6N + 12Lsad per token) per second, in TFLOP/s
  /// Model FLOPs utilisation of the param_dtype peak, at most 1: PaLM's 12 L s a d attention term
  /// counts the masked half that causal (flash) attention skips, so at long sequences the
  /// convention's figure passes the peak; it is then reported as 1 with mfu_capped set.
  double mfu = 0;
  bool mfu_capped = false;
  double hfu = 0;                 ///< hardware FLOPs utilisation: what the GPU executes (recomputation, attention as run) over the peak
  std::vector<double> unit_exposed_s;  ///< per unit: compute-stream time spent waiting for its all-gather
};

/// Plays the schedule's compute and communication (core/schedule.h): all-gathers wait for the
/// stream and (FSDP1 limit_all_gathers) for the free event the CPU synchronises on; compute waits
/// for its unit's all-gather; reduce-scatters follow each unit's backward on the same stream; the
/// optimizer waits for the last reduction. CPU launch overheads are not modelled (fsdp-sim does).
/// With `fast_forward`, middle micro-batches that run the same program from the same relative
/// state are not replayed one by one but added as a shift of every clock; the result is the same.
StepEstimate EstimateStep(const Workload& workload, const ComputeModel& compute, const CommModel& comm, const Schedule& schedule,
                          bool fast_forward = true);
/// The same with BuildSchedule(workload).
StepEstimate EstimateStep(const Workload& workload, const ComputeModel& compute, const CommModel& comm, bool fast_forward = true);

/// Compute, communication and step estimates for one workload; the activation traffic is eager
/// PyTorch's by default (fsdp-run's engines pass kFusedEngineTrafficPerSavedByte).
struct TimeEstimate {
  ComputeModel compute;
  CommModel comm;
  StepEstimate step;
};
TimeEstimate EstimateTime(const Workload& workload, double traffic_per_saved_byte = kEagerTrafficPerSavedByte);

}  // namespace fsdp
