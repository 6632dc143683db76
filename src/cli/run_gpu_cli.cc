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

// The CUDA context, cuBLAS and NCCL as the device saw them, against fsdp-plan's framework terms.
ComparisonTable FrameworkTable(const runtime::GpuMemoryReport& m, const FrameworkOverheads& o) {
  const int64_t predicted_nccl = m.nccl_communicators * o.nccl_bytes_per_communicator;
  auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / kMiB; };
  return {"framework (device)", "MiB", "fsdp-plan", 1,
          {{"CUDA context", mib(m.context_bytes), mib(o.cuda_context_bytes), ""},
           {"cuBLAS workspace", mib(m.cublas_bytes), mib(o.cublas_workspace_bytes), ""},
           {"NCCL", mib(m.nccl_bytes), mib(predicted_nccl),
            fmt::format("({} communicator{}; a virtual world has none)", m.nccl_communicators, m.nccl_communicators == 1 ? "" : "s")},
           {"device in use (max)", mib(m.device_used_bytes), std::nullopt, ""}}};
}

Json FrameworkJson(const runtime::GpuMemoryReport& m, const FrameworkOverheads& o) {
  return Json{{"context_bytes", m.context_bytes}, {"cublas_bytes", m.cublas_bytes}, {"nccl_bytes", m.nccl_bytes},
              {"device_used_bytes", m.device_used_bytes}, {"device_total_bytes", m.device_total_bytes},
              {"predicted_context_bytes", o.cuda_context_bytes}, {"predicted_cublas_bytes", o.cublas_workspace_bytes},
              {"predicted_nccl_bytes_per_communicator", o.nccl_bytes_per_communicator},
              {"nccl_communicators", m.nccl_communicators}, {"predicted_nccl_bytes", m.nccl_communicators * o.nccl_bytes_per_communicator}};
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

// Rank 0's report: the GPU engine's measurements against its replay and fsdp-plan's step model
// and fsdp-sim on this GPU's hardware file (charging the engine's fused kernels' activation
// traffic); beside them fsdp-plan's PyTorch profile and PyTorch eager step, for reference.
RunReport GpuRunReport(const RunFlags& f, const Workload& w, const runtime::GpuEngine& engine, const StepLog& log, const GpuRuntimeMemory& replay,
                       int64_t largest_peak, int ranks) {
  RunReport r = NewRunReport(f, w, log, ranks);
  r.device = "cuda";
  r.device_name = engine.device_name();
  RunMeasurement& m = r.measured;
  m.step_s = Median(SteadySteps(m.steps_s));
  m.step_basis = m.steps_s.size() > 1 ? fmt::format("median of steps 2..{}", m.steps_s.size()) : "step 1 only";
  const runtime::GpuPhaseTimes t = engine.times();
  m.forward_s = Median(SteadySteps(t.forward_s));
  m.backward_s = Median(SteadySteps(t.backward_s));
  m.optimizer_s = Median(SteadySteps(t.optimizer_s));
  const std::vector<int64_t> steady_waits = SteadySteps(t.host_waits);
  m.host_waits_per_step = steady_waits.empty() ? 0 : *std::max_element(steady_waits.begin(), steady_waits.end());
  const runtime::GpuMemoryReport mem = engine.memory();
  m.peak_bytes = largest_peak;
  m.rank0 = {mem.peak_allocated_bytes, mem.peak_phase, mem.at_peak};
  m.rank0_reserved_bytes = mem.peak_reserved_bytes;
  m.device_mallocs = mem.device_mallocs;
  SetMeasuredComm(engine.shard_stats(), engine.replica_stats(), engine.shard_world(), w.config.gpus, m);
  m.collectives_are_copies = f.virtual_world > 0;
  m.loss_scaler = engine.loss_scaler();

  RunPrediction& p = r.predicted;
  p.memory = {replay.peak_bytes, replay.peak_phase, replay.at_peak};
  p.reserved_bytes = replay.reserved_peak_bytes;
  p.reserved_lagging_bytes = replay.reserved_peak_lagging_bytes;
  p.categories_compared.assign(kRuntimeCategories.begin(), kRuntimeCategories.end());
  const TimeEstimate time = EstimateTime(w, kFusedEngineTrafficPerSavedByte);
  p.step_s = time.step.step_s;
  p.time_basis = fmt::format("fsdp-plan, fsdp-run's kernels, {}", w.hardware.id);
  sim::SimOptions sim_options;
  sim_options.compute_override = time.compute;
  if (auto simulated = sim::Simulate(w, sim_options); simulated.ok()) p.sim_step_s = simulated.value().step_s;
  SetPredictedComm(w, m, f.steps, p);

  const MemoryEstimate torch_profile = EstimateMemory(w);  // fsdp-plan's PyTorch FSDP profile
  const StepEstimate torch_step = EstimateStep(w, EstimateCompute(w), time.comm);
  r.extra_memory_rows.push_back({"peak (PyTorch profile)", static_cast<double>(mem.peak_allocated_bytes) / kMiB,
                                 static_cast<double>(torch_profile.allocated_peak_bytes) / kMiB,
                                 fmt::format("(fsdp-plan's PyTorch {} profile: max_memory_allocated)",
                                             w.config.framework == Framework::kFsdp2 ? "FSDP2" : "FSDP1")});
  r.extra_tables.push_back(FrameworkTable(mem, torch_profile.overheads));
  r.extra_time_rows.push_back({"step time", std::nullopt, torch_step.step_s, "(fsdp-plan's PyTorch eager step, for tools/torch_reference.py)"});
  r.measured_memory_extra = {{"framework", FrameworkJson(mem, torch_profile.overheads)}};
  r.predicted_extra = {{"pytorch_profile",
                        {{"allocated_peak_bytes", torch_profile.allocated_peak_bytes},
                         {"peak_bytes", torch_profile.peak_bytes},
                         {"reserved_peak_bytes", torch_profile.reserved_peak_bytes},
                         {"alloc_retries", torch_profile.alloc_retries},
                         {"step_s", torch_step.step_s},
                         {"tokens_per_s_per_gpu", torch_step.tokens_per_s_per_gpu}}}};
  return r;
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
  if (Status s = WriteTextFile(out_path, DumpJson(j, 2) + "\n"); !s.ok()) return s;
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
  if (Status s = CheckRanksAgree(f, prepared.value(), comm); !s.ok()) return s;
  const Workload& w = prepared.value().workload;
  auto engine = runtime::CreateGpuEngine(w, comm, prepared.value().options, f.virtual_world);
  if (!engine.ok()) return engine.error();
  if (f.memory_limit_mib > 0) engine.value()->set_memory_limit(static_cast<int64_t>(f.memory_limit_mib * kMiB));
  const GpuRuntimeMemory predicted = EstimateGpuRuntimeMemory(w);
  auto log = RunSteps(f, comm.rank(), [&](int64_t step) { return engine.value()->Step(step); });
  if (log.ok()) {
    if (Status s = CheckLossesFinite(log.value(), prepared.value().options); !s.ok()) return s;
  }
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
  const RunReport report = GpuRunReport(f, w, *engine.value(), log.value(), predicted, largest_peak.value(), comm.size());
  PrintRunReport(report, out);
  if (f.json_path.empty()) return {};
  return WriteTextFile(f.json_path, DumpJson(RunReportJson(report), 2) + "\n");
}

}  // namespace fsdp
