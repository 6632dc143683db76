// fsdp-run --device cuda: trains on the GPU engine and prints measured against predicted.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "cli/run_cli.h"
#include "core/catalog.h"
#include "core/hardware_spec.h"
#include "core/json_io.h"
#include "planner/comm_model.h"
#include "planner/memory_model.h"
#include "planner/plan_report.h"
#include "planner/runtime_profile.h"
#include "planner/step_model.h"
#include "runtime/gpu_engine.h"
#include "runtime/memory_ledger.h"
#include "sim/sim_report.h"
#include "sim/simulator.h"

namespace fsdp {

Result<std::string> HardwareIdForDevice(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  const bool pcie = has("PCIE") || has("PCIe");
  // Grace Hopper (96/144 GB), H100 NVL (94 GB) and A100 PCIe 40GB have no catalog entry
  if (has("GH200") || has("NVL") || (has("A100") && has("40GB") && pcie)) {
    return Error::BadInput(fmt::format("GPU '{}' is not in the hardware catalog: pass --gpu with a hardware file", name));
  }
  if (has("H200")) return std::string("h200-sxm");
  if (has("H100")) return std::string(pcie ? "h100-pcie" : "h100-sxm");
  if (has("B200")) return std::string("b200");
  if (has("A100")) return std::string(has("40GB") ? "a100-40gb-sxm" : pcie ? "a100-80gb-pcie" : "a100-80gb-sxm");
  if (has("L40S")) return std::string("l40s");
  if (has("RTX A6000")) return std::string("rtx-a6000");
  if (has("4090")) return std::string("rtx-4090");
  if (has("3090")) return std::string("rtx-3090");
  return Error::BadInput(fmt::format("GPU '{}' is not in the hardware catalog: pass --gpu with a hardware file", name));
}

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

Json MemoryTable(const runtime::GpuMemoryReport& m, const GpuRuntimeMemory& p, std::ostream& out) {
  fmt::print(out, "  {:<22}{:>14}{:>14}{:>9}\n", "allocated at peak", "measured MiB", "predicted MiB", "error");
  Json measured = Json::object(), predicted = Json::object();
  for (MemCategory c : kRuntimeCategories) {
    const std::string key(MemCategoryKey(c));
    const double mm = At(m.at_peak, c) / kMiB, pp = At(p.at_peak, c) / kMiB;
    measured[key + "_bytes"] = At(m.at_peak, c);
    predicted[key + "_bytes"] = At(p.at_peak, c);
    fmt::print(out, "  {:<22}{:>14.2f}{:>14.2f}{:>8.1f}%\n", key, mm, pp, PercentError(mm, pp));
  }
  fmt::print(out, "  {:<22}{:>14.2f}{:>14.2f}{:>8.1f}%   (measured at {}, predicted at {})\n", "peak allocated", m.peak_allocated_bytes / kMiB,
             p.peak_bytes / kMiB, PercentError(static_cast<double>(m.peak_allocated_bytes), static_cast<double>(p.peak_bytes)), m.peak_phase,
             p.peak_phase);
  fmt::print(out, "  {:<22}{:>14.2f}   ({} cudaMalloc calls)\n", "peak reserved", m.peak_reserved_bytes / kMiB, m.device_mallocs);
  return Json{{"measured", measured}, {"predicted", predicted}};
}

// The CUDA context, cuBLAS and NCCL as the device saw them, against fsdp-plan's framework terms.
Json FrameworkTable(const runtime::GpuMemoryReport& m, const MemoryEstimate& torch_profile, std::ostream& out) {
  const FrameworkOverheads& o = torch_profile.overheads;
  fmt::print(out, "  {:<22}{:>14}{:>14}\n", "framework (device)", "measured MiB", "fsdp-plan MiB");
  fmt::print(out, "  {:<22}{:>14.1f}{:>14.1f}\n", "CUDA context", m.context_bytes / kMiB, o.cuda_context_bytes / kMiB);
  fmt::print(out, "  {:<22}{:>14.1f}{:>14.1f}\n", "cuBLAS workspace", m.cublas_bytes / kMiB, o.cublas_workspace_bytes / kMiB);
  const int64_t predicted_nccl = m.nccl_communicators * o.nccl_bytes_per_communicator;
  fmt::print(out, "  {:<22}{:>14.1f}{:>14.1f}   ({} communicator{}; a virtual world has none)\n", "NCCL", m.nccl_bytes / kMiB,
             predicted_nccl / kMiB, m.nccl_communicators, m.nccl_communicators == 1 ? "" : "s");
  fmt::print(out, "  {:<22}{:>14.1f}\n", "device in use (max)", m.device_used_bytes / kMiB);
  return Json{{"context_bytes", m.context_bytes}, {"cublas_bytes", m.cublas_bytes}, {"nccl_bytes", m.nccl_bytes},
              {"device_used_bytes", m.device_used_bytes}, {"device_total_bytes", m.device_total_bytes},
              {"predicted_context_bytes", o.cuda_context_bytes}, {"predicted_cublas_bytes", o.cublas_workspace_bytes},
              {"predicted_nccl_bytes_per_communicator", o.nccl_bytes_per_communicator},
              {"nccl_communicators", m.nccl_communicators}, {"predicted_nccl_bytes", predicted_nccl}};
}

// The collectives of the shard group (all-gathers, reduce-scatters) and of the replica group
// (HYBRID_SHARD's and NO_SHARD's gradient all-reduces), measured and predicted for the steps run.
Json CommReport(const runtime::GpuEngine& engine, const Workload& w, int64_t steps, bool virtual_world, std::ostream& out) {
  const runtime::CommStats& cs = engine.shard_stats();
  const runtime::CommStats& rs = engine.replica_stats();
  const int64_t replicas = w.config.gpus / std::max<int64_t>(1, engine.shard_world());
  auto per = [](int64_t bytes, int64_t count) { return bytes / 1e6 / static_cast<double>(std::max<int64_t>(1, count)); };
  fmt::print(out, "  all-gathers {} x {:.2f} MB in {:.4f} s, reduce-scatters {} x {:.2f} MB in {:.4f} s{}\n", cs.all_gather_count,
             per(cs.all_gather_bytes, cs.all_gather_count), cs.all_gather_s, cs.reduce_scatter_count,
             per(cs.reduce_scatter_bytes, cs.reduce_scatter_count), cs.reduce_scatter_s,
             virtual_world ? " (device copies standing in for collectives)" : "");
  if (rs.all_reduce_count > 0) {
    fmt::print(out, "  gradient all-reduces across {} replicas: {} x {:.2f} MB in {:.4f} s\n", replicas, rs.all_reduce_count,
               per(rs.all_reduce_bytes, rs.all_reduce_count), rs.all_reduce_s);
  }
  Json j = {{"shard", CommStatsJson(cs, engine.shard_world())}, {"replica", CommStatsJson(rs, replicas)}};
  // fsdp-plan counts no collective in a group of one rank; the engine still calls them (as copies)
  const CommVolume volume = EstimateComm(w).volume;
  const double n = static_cast<double>(steps);
  j["predicted_all_gather_bytes"] = engine.shard_world() > 1 ? Json(static_cast<double>(volume.forward_all_gather_bytes + volume.backward_all_gather_bytes) * n) : Json();
  j["predicted_reduce_scatter_bytes"] = engine.shard_world() > 1 ? Json(static_cast<double>(volume.reduce_scatter_bytes) * n) : Json();
  j["predicted_all_reduce_bytes"] = replicas > 1 ? Json(static_cast<double>(volume.all_reduce_bytes) * n) : Json();
  return j;
}

// --gpu, or the catalog entry of the GPU this rank runs on.
Result<std::string> GpuOfThisRank(const PlanFlags& plan, int rank) {
  if (plan.gpu_given) return plan.gpu;
  auto name = runtime::GpuDeviceName(rank);
  if (!name.ok()) return name.error();
  return HardwareIdForDevice(name.value());
}

// Steps after the first (which pays for cudaMalloc and cuBLAS's heuristics); the one step if only one ran.
template <typename T>
std::vector<T> SteadySteps(const std::vector<T>& per_step) {
  return per_step.size() > 1 ? std::vector<T>(per_step.begin() + 1, per_step.end()) : per_step;
}

// Rank 0's report: losses, step time, memory against the engine's replay and fsdp-plan's
// PyTorch profile, framework memory, step time against fsdp-plan and fsdp-sim, collectives.
Status ReportGpuRun(const RunFlags& f, const Workload& w, const runtime::GpuEngine& engine, const StepLog& log, const GpuRuntimeMemory& predicted,
                    int64_t largest_peak, int ranks, std::ostream& out) {
  std::vector<double> steps;
  for (const auto& t : log.times) steps.push_back(t.get<double>());
  const double step_s = Median(SteadySteps(steps));
  const int64_t world = f.virtual_world > 0 ? f.virtual_world : ranks;
  const double tokens_per_gpu = static_cast<double>(w.config.micro_batch * w.config.seq_len * w.config.grad_accum) / step_s;
  fmt::print(out, "{} on {} ({}{} ranks), {}, {}/{}: losses", w.model.id, engine.device_name(), f.virtual_world > 0 ? "rank 0 of a virtual world of " : "",
             world, StrategyName(w.config.strategy), DTypeName(w.config.param_dtype), DTypeName(w.config.reduce_dtype));
  for (const auto& l : log.losses) fmt::print(out, " {:.4f}", l.get<double>());
  fmt::print(out, "\n");
  PrintLossScaling(engine.loss_scaler(), out);
  fmt::print(out, "  step {:.4f} s ({}), {:.0f} tokens/s per GPU\n", step_s, steps.size() > 1 ? fmt::format("median of steps 2..{}", steps.size()) : "step 1 only",
             tokens_per_gpu);
  const runtime::GpuMemoryReport mem = engine.memory();
  Json memory_json = MemoryTable(mem, predicted, out);
  const MemoryEstimate torch_profile = EstimateMemory(w);  // fsdp-plan's PyTorch FSDP profile, for reference
  fmt::print(out, "  {:<22}{:>14.2f}{:>14.2f}{:>8.1f}%   (fsdp-plan's PyTorch {} profile: max_memory_allocated)\n", "peak allocated",
             mem.peak_allocated_bytes / kMiB, torch_profile.allocated_peak_bytes / kMiB,
             PercentError(static_cast<double>(mem.peak_allocated_bytes), static_cast<double>(torch_profile.allocated_peak_bytes)),
             w.config.framework == Framework::kFsdp2 ? "FSDP2" : "FSDP1");
  Json framework_json = FrameworkTable(mem, torch_profile, out);
  // fsdp-plan's step model and fsdp-sim on this GPU's hardware file, charging the engine's fused
  // kernels' activation traffic; and, for reference, the same model of PyTorch eager
  const TimeEstimate time = EstimateTime(w, kFusedEngineTrafficPerSavedByte);
  const StepEstimate torch_step = EstimateStep(w, EstimateCompute(w), time.comm);
  sim::SimOptions sim_options;
  sim_options.compute_override = time.compute;
  auto simulated = sim::Simulate(w, sim_options);
  const double sim_s = simulated.ok() ? simulated.value().step_s : 0.0;
  fmt::print(out, "  {:<22}{:>14.4f}{:>14.4f}{:>8.1f}%   (fsdp-plan, fsdp-run's kernels, {})\n", "step time s", step_s, time.step.step_s,
             PercentError(step_s, time.step.step_s), w.hardware.id);
  if (simulated.ok()) fmt::print(out, "  {:<22}{:>14.4f}{:>14.4f}{:>8.1f}%   (fsdp-sim)\n", "step time s", step_s, sim_s, PercentError(step_s, sim_s));
  fmt::print(out, "  {:<22}{:>14}{:>14.4f}           (fsdp-plan's PyTorch eager step, for tools/torch_reference.py)\n", "step time s", "-",
             torch_step.step_s);
  const runtime::GpuPhaseTimes t = engine.times();
  const double forward_s = Median(SteadySteps(t.forward_s)), backward_s = Median(SteadySteps(t.backward_s)),
               optimizer_s = Median(SteadySteps(t.optimizer_s));
  const std::vector<int64_t> steady_waits = SteadySteps(t.host_waits);
  const int64_t host_waits = steady_waits.empty() ? 0 : *std::max_element(steady_waits.begin(), steady_waits.end());
  fmt::print(out, "  GPU time per step: forward {:.4f} s, backward {:.4f} s, optimizer {:.4f} s (CUDA events, same steps); host waits per step: at most {}\n",
             forward_s, backward_s, optimizer_s, host_waits);
  Json comm_json = CommReport(engine, w, f.steps, f.virtual_world > 0, out);
  if (f.json_path.empty()) return {};
  Json doc = {{"model", w.model.id},
              {"device", "cuda"},
              {"device_name", engine.device_name()},
              {"hardware", w.hardware.id},
              {"ranks", ranks},
              {"virtual_world", f.virtual_world},
              {"config", ConfigToJson(w.config)},
              {"inputs", RunInputsJson(f)},
              {"predicted",
               {{"memory", {{"peak_bytes", predicted.peak_bytes}, {"peak_phase", predicted.peak_phase}, {"categories", memory_json["predicted"]}}},
                {"pytorch_profile",
                 {{"allocated_peak_bytes", torch_profile.allocated_peak_bytes},
                  {"peak_bytes", torch_profile.peak_bytes},
                  {"step_s", torch_step.step_s},
                  {"tokens_per_s_per_gpu", torch_step.tokens_per_s_per_gpu}}},
                {"time", {{"step_s", time.step.step_s}, {"sim_step_s", sim_s}, {"tokens_per_s_per_gpu", time.step.tokens_per_s_per_gpu}}}}},
              {"measured",
               {{"loss", log.losses},
                {"loss_scaling", LossScalingJson(engine.loss_scaler())},
                {"memory",
                 {{"peak_bytes", largest_peak},
                  {"rank0_peak_allocated_bytes", mem.peak_allocated_bytes},
                  {"rank0_peak_reserved_bytes", mem.peak_reserved_bytes},
                  {"rank0_peak_phase", mem.peak_phase},
                  {"rank0_categories", memory_json["measured"]},
                  {"framework", framework_json}}},
                {"time", {{"step_s", step_s}, {"steps_s", log.times}, {"forward_s", forward_s}, {"backward_s", backward_s}, {"optimizer_s", optimizer_s}, {"host_waits_per_step", host_waits}}},
                {"tokens_per_s_per_gpu", tokens_per_gpu},
                {"comm", comm_json}}}};
  return sim::WriteText(f.json_path, doc.dump(2) + "\n");
}

}  // namespace

Status RunCalibrateGpu(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  auto devices = runtime::GpuDeviceCount();
  if (!devices.ok()) return Error::RunFailed(fmt::format("--device cuda: {}", devices.error().message));
  auto model = LoadModel(f.plan.model);
  if (!model.ok()) return model.error();
  auto gpu_id = GpuOfThisRank(f.plan, comm.rank());
  if (!gpu_id.ok()) return gpu_id.error();
  const std::string& gpu = gpu_id.value();
  auto path = ResolveCatalogPath("hardware", "GPU", gpu);
  if (!path.ok()) return path.error();
  auto catalog = LoadJsonFile(path.value());
  if (!catalog.ok()) return catalog.error();
  if (auto spec = HardwareFromJson(catalog.value(), gpu, path.value()); !spec.ok()) return spec.error();  // the keys the calibration rewrites
  auto dtype = ParseDType(f.plan.param_dtype, "--param-dtype");
  if (!dtype.ok()) return dtype.error();
  const int64_t seq = f.plan.config.seq_len > 0 ? f.plan.config.seq_len : 2048;
  auto hw = runtime::CalibrateGpu(model.value(), comm, catalog.value(), dtype.value(), f.plan.config.micro_batch * seq, seq, 5, int64_t{256} << 20);
  if (!hw.ok()) return hw.error();
  if (comm.rank() != 0) return {};
  const Json& j = hw.value();
  fmt::print(out, "{}: matmul efficiency {:.3f}, attention efficiency {:.3f}, memory bandwidth efficiency {:.3f}{}\n", j.value("name", gpu),
             j["efficiency"].value("matmul", 0.0), j["efficiency"].value("attention", 0.0), j["efficiency"].value("memory_bandwidth", 0.0),
             j.contains("measured_collectives") ? fmt::format(", NCCL over {} ranks", comm.size()) : "");
  const std::string out_path = f.json_path.empty() ? "calibrated-" + std::filesystem::path(gpu).stem().string() + ".json" : f.json_path;
  if (Status s = sim::WriteText(out_path, j.dump(2) + "\n"); !s.ok()) return s;
  fmt::print(out, "wrote {} (use it with --gpu {})\n", out_path, out_path);
  return {};
}

Status RunTrainingGpu(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.virtual_world < 0 || f.virtual_world > 1 << 16) {
    return Error::BadInput(fmt::format("--virtual-world must be between 1 and 65536 ranks (0: off), got {}", f.virtual_world));
  }
  auto devices = runtime::GpuDeviceCount();
  if (!devices.ok()) return Error::RunFailed(fmt::format("--device cuda: {}", devices.error().message));
  PlanFlags plan = f.plan;
  if (plan.attention_given && plan.attention != "eager") {
    return Error::BadInput(fmt::format("--device cuda computes attention with materialised scores: use --attention eager, not '{}'", plan.attention));
  }
  plan.attention = "eager";  // the engine's attention, so the PyTorch profile and the time model match it
  if (f.virtual_world > 0 && !plan.gpus_given) plan.config.gpus = f.virtual_world;
  auto gpu = GpuOfThisRank(plan, comm.rank());
  if (!gpu.ok()) return gpu.error();
  plan.gpu = gpu.value();
  if (plan.config.gpus_per_node == 0) {  // a node as the hardware file says (HYBRID_SHARD's shard group), capped at --gpus
    auto hardware = LoadHardware(plan.gpu);
    if (!hardware.ok()) return hardware.error();
    plan.config.gpus_per_node = std::min(hardware.value().gpus_per_node, plan.config.gpus);
  }
  auto prepared = PrepareRun(f, plan);
  if (!prepared.ok()) return prepared.error();
  const Workload& w = prepared.value().workload;
  auto engine = runtime::CreateGpuEngine(w, comm, prepared.value().options, f.virtual_world);
  if (!engine.ok()) return engine.error();
  if (f.memory_limit_mib > 0) engine.value()->set_memory_limit(static_cast<int64_t>(f.memory_limit_mib * kMiB));
  const GpuRuntimeMemory predicted = EstimateGpuRuntimeMemory(w);
  auto log = RunSteps(f, comm.rank(), [&](int64_t step) { return engine.value()->Step(step); });
  if (!log.ok()) {
    if (log.error().kind == Error::Kind::kOutOfMemory) {
      return Error::RunFailed(fmt::format("{}; predicted peak {:.2f} MiB at {}", log.error().message, predicted.peak_bytes / kMiB,
                                          predicted.peak_phase));
    }
    return log.error();
  }
  const runtime::GpuMemoryReport mem = engine.value()->memory();
  auto largest_peak = MaxOverRanks(comm, mem.peak_allocated_bytes);
  if (!largest_peak.ok()) return largest_peak.error();
  if (comm.rank() != 0) return {};
  return ReportGpuRun(f, w, *engine.value(), log.value(), predicted, largest_peak.value(), comm.size(), out);
}

}  // namespace fsdp
