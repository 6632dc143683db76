#include "cli/run_cli.h"

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string_view>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "cli/run_report.h"
#include "cli/token_file.h"
#include "core/hash.h"
#include "core/json_io.h"
#include "core/lora.h"
#include "planner/plan_report.h"
#include "planner/comm_model.h"
#include "planner/plan_report.h"
#include "planner/runtime_profile.h"
#include "runtime/calibrate.h"
#include "runtime/fsdp_engine.h"
#include "runtime/loss_scaler.h"
#include "sim/sim_report.h"
#include "sim/simulator.h"

namespace fsdp {

namespace {

// Stops the process when a stage of the run (start-up, a step, the final report) outlives
// --timeout: the collectives of a rank whose peer died or hangs would otherwise wait for ever.
// Exit code 1, one line naming the stage.
class Deadline {
 public:
  Deadline(double timeout_s, int rank) : timeout_(timeout_s), rank_(rank), thread_([this] { Watch(); }) {}
  ~Deadline() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Arm(std::string stage) {
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = std::move(stage);
    deadline_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_));
    cv_.notify_all();
  }

 private:
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      if (!stage_.empty() && std::chrono::steady_clock::now() > deadline_) {
        const std::string line = fmt::format("fsdp-run (rank {}): error: {} did not finish within --timeout {} s (a peer rank died or hangs)\n",
                                             rank_, stage_, timeout_);
        std::fwrite(line.data(), 1, line.size(), stderr);
        std::fflush(stderr);
        std::_Exit(1);
      }
      cv_.wait_for(lock, std::chrono::milliseconds(100));
    }
  }
  double timeout_;
  int rank_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string stage_;
  std::chrono::steady_clock::time_point deadline_{};
  std::thread thread_;
};

std::unique_ptr<Deadline>& RunDeadline() {
  static std::unique_ptr<Deadline> deadline;
  return deadline;
}

// This process's rank as the MPI launcher numbers it (0 without one): known before MPI_Init.
int LauncherRank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(name)) return std::atoi(v);
  }
  return 0;
}

// Ranks sharing this host's memory: the launcher's local size (all ranks without one).
int RanksOnThisHost(const runtime::Comm& comm) {
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) return std::max(1, std::atoi(v));
  return comm.size();
}

// Everything of the model config that changes what a rank computes.
Json ModelFingerprintJson(const ModelSpec& m) {
  Json tensors = Json::array();
  for (const TensorSpec& t : m.tensors) tensors.push_back({t.name, t.shape, t.trainable});
  const RopeScaling& r = m.rope_scaling;
  return Json{{"model_type", m.model_type}, {"norm_eps", m.norm_eps}, {"rope_theta", m.rope_theta},
              {"rope_scaling", {r.type, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_positions}},
              {"heads", {m.num_heads, m.num_kv_heads, m.head_dim}}, {"sliding_window", m.sliding_window}, {"activation", m.activation},
              {"dropout", {m.attention_dropout, m.residual_dropout, m.embedding_dropout}}, {"experts", {m.num_experts, m.experts_per_token}},
              {"tie_word_embeddings", m.tie_word_embeddings}, {"tensors", tensors}};
}


}  // namespace

void StartRunDeadline(double timeout_s) {
  if (!(timeout_s > 0 && timeout_s <= kMaxTimeoutS)) return;  // PrepareRun reports the bad value
  RunDeadline() = std::make_unique<Deadline>(timeout_s, LauncherRank());
  RunDeadline()->Arm("start-up (MPI_Init, reading the model, checkpoint and tokens, the cross-rank check)");
}

void ArmRunDeadline(const std::string& stage) {
  if (RunDeadline()) RunDeadline()->Arm(stage);
}

uint64_t RunFingerprint(const RunFlags& f, const PreparedRun& run) {
  const runtime::TrainOptions& o = run.options;
  Json j = {{"config", ConfigToJson(run.workload.config)},
            {"model", ModelFingerprintJson(run.workload.model)},
            {"run", {f.steps, f.seed, f.lr, f.memory_limit_mib, f.device, f.virtual_world, f.hang_rank, f.fail_rank, f.fail_step}},
            {"loss_scaling", {static_cast<int>(o.loss_scaling.mode), o.loss_scaling.init_scale, o.loss_scaling.growth_interval}},
            {"checkpoint", o.checkpoint ? o.checkpoint->Fingerprint() : 0}};
  uint64_t h = Fnv1a(DumpJson(j));
  const auto* tokens = reinterpret_cast<const char*>(o.tokens.data());
  return Fnv1a(std::string_view(tokens, o.tokens.size() * sizeof(int32_t)), h);
}

Status CheckRanksAgree(const RunFlags& f, const PreparedRun& run, runtime::Comm& comm) {
  return comm.CheckSame(RunFingerprint(f, run), "flags, model configs or token files (every value that changes what a rank runs)");
}

Status CheckLossesFinite(const StepLog& log, const runtime::TrainOptions& o) {
  if (o.loss_scaling.mode != runtime::LossScaling::kNone) return {};  // the scaler skips non-finite steps
  for (size_t i = 0; i < log.losses.size(); ++i) {
    const double loss = log.losses[i].get<double>();
    if (!std::isfinite(loss)) return Error::RunFailed(fmt::format("step {}: the loss is {} (training diverged; no loss scaling to skip the step)", i + 1, loss));
  }
  return {};
}

Status CheckHostMemory(const Workload& w, int ranks_on_host) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const double per_rank = static_cast<double>(EstimateRuntimeMemory(w).peak_bytes);
  if (physical > 0 && per_rank * ranks_on_host > physical) {
    return Error::BadInput(fmt::format("the run needs about {:.2f} GiB per rank (predicted peak) x {} rank(s) on this host, more than its {:.2f} GiB: "
                                       "lower --seq-len, --micro-batch or the model size", per_rank / kGiB, ranks_on_host, physical / kGiB));
  }
  return {};
}

void AddRunFlags(CLI::App& app, RunFlags& f) {
  AddPlanFlags(app, f.plan);
  app.add_option("--steps", f.steps, "optimizer steps to run")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the initialisation and the synthetic tokens")->capture_default_str();
  app.add_option("--lr", f.lr, "AdamW learning rate")->capture_default_str();
  // fsdp-run's --json takes the output path (the plan's --json flag prints to stdout)
  if (CLI::Option* plan_json = app.get_option_no_throw("--json")) app.remove_option(plan_json);
  app.add_option("--json,--out", f.json_path, "write the results as JSON: measured vs predicted memory, time, bytes, losses");
  app.add_flag("--quiet", f.quiet, "no progress on stderr");
  app.add_option("--memory-limit", f.memory_limit_mib, "MiB each rank may use: stop with the phase and category where it would run out");
  app.add_option("--timeout", f.timeout_s, "seconds a step may take before every rank is stopped")->capture_default_str();
  app.add_option("--tokens", f.tokens_path, "file of whitespace-separated token ids to train on (default: seeded synthetic tokens)");
  app.add_option("--init-from", f.init_from,
                 "start from a HuggingFace safetensors checkpoint (a file, or a directory with model.safetensors or its sharded index) "
                 "instead of seeded weights");
  app.add_option("--hang-rank", f.hang_rank, "fault injection: this rank stops responding at --fail-step (tests)");
  app.add_option("--fail-rank", f.fail_rank, "fault injection: this rank exits abruptly at --fail-step (tests)");
  app.add_option("--fail-step", f.fail_step, "fault injection: the step at which --fail-rank dies");
  app.add_option("--device", f.device, "cpu (Eigen fp32, MPI ranks) or cuda (one GPU per rank: CUDA kernels, cuBLAS, NCCL)")->capture_default_str();
  app.add_option("--loss-scale", f.loss_scale,
                 "auto (dynamic when --param-dtype fp16), none or dynamic: ShardedGradScaler's loss scaling, inf/NaN steps skipped")
      ->capture_default_str();
  app.add_option("--loss-scale-init", f.loss_scale_init, "initial loss scale, a power of two (init_scale)")->capture_default_str();
  app.add_option("--loss-scale-interval", f.loss_scale_interval, "clean steps before the scale doubles (growth_interval)")->capture_default_str();
  app.add_option("--virtual-world", f.virtual_world,
                 "cuda: run rank 0 of an N-rank configuration on one GPU (shards and buffers sized for N, collectives as device copies)");
}

Json RunInputsJson(const RunFlags& f) {
  auto path = [](const std::string& p) { return p.empty() ? Json(nullptr) : Json(p); };
  return Json{{"init_from", path(f.init_from)}, {"tokens", path(f.tokens_path)}, {"seed", f.seed}, {"lr", f.lr}};
}

Result<int64_t> MaxOverRanks(runtime::Comm& comm, int64_t value) {
  const float halves[2] = {static_cast<float>(value >> 24), static_cast<float>(value & 0xFFFFFF)};
  std::vector<float> all(2 * static_cast<size_t>(comm.size()));
  if (Status s = comm.AllGather(halves, all.data(), 2); !s.ok()) return s.error();
  int64_t largest = 0;
  for (size_t r = 0; r < all.size(); r += 2) largest = std::max(largest, (static_cast<int64_t>(all[r]) << 24) | static_cast<int64_t>(all[r + 1]));
  return largest;
}

RunReport NewRunReport(const RunFlags& f, const Workload& w, const StepLog& log, int ranks) {
  RunReport r;
  r.model = w.model.id;
  r.hardware = w.hardware.id;
  r.ranks = ranks;
  r.world = w.config.gpus;
  r.virtual_world = f.virtual_world;
  r.config = w.config;
  r.inputs = RunInputsJson(f);
  for (const auto& l : log.losses) r.measured.losses.push_back(l.get<double>());
  for (const auto& t : log.times) r.measured.steps_s.push_back(t.get<double>());
  return r;
}

void SetMeasuredComm(const runtime::CommStats& shard, const runtime::CommStats& replica, int64_t shard_group, int64_t world, RunMeasurement& m) {
  m.shard = shard;
  m.replica = replica;
  m.shard_group = shard_group;
  m.replica_group = world / std::max<int64_t>(1, shard_group);
}

void SetPredictedComm(const Workload& w, const RunMeasurement& m, int64_t steps, RunPrediction& p) {
  const CommVolume v = EstimateComm(w).volume;
  const double n = static_cast<double>(steps);
  if (m.shard_group > 1) {
    p.all_gather_bytes = static_cast<double>(v.forward_all_gather_bytes + v.backward_all_gather_bytes) * n;
    p.reduce_scatter_bytes = static_cast<double>(v.reduce_scatter_bytes) * n;
  }
  if (m.replica_group > 1) p.all_reduce_bytes = static_cast<double>(v.all_reduce_bytes) * n;
}

Result<PreparedRun> PrepareRun(const RunFlags& f, PlanFlags plan) {
  if (f.steps < 1 || f.steps > 1000000) return Error::BadInput(fmt::format("--steps must be between 1 and 1000000, got {}", f.steps));
  if (!(f.lr > 0) || f.lr > 1) return Error::BadInput(fmt::format("--lr must be in (0, 1], got {}", f.lr));
  if (!(f.memory_limit_mib == 0 || (f.memory_limit_mib >= 1 && f.memory_limit_mib <= 1e9))) {
    return Error::BadInput(fmt::format("--memory-limit must be between 1 and 1e9 MiB (0: no limit), got {}", f.memory_limit_mib));
  }
  if (!(f.timeout_s > 0 && f.timeout_s <= kMaxTimeoutS)) {
    return Error::BadInput(fmt::format("--timeout must be positive seconds (at most {:.0e}), got {}", kMaxTimeoutS, f.timeout_s));
  }
  if (plan.config.gpus_per_node == 0) plan.config.gpus_per_node = plan.config.gpus;  // one "node" unless told
  plan.fsdp1_world_of_one = false;  // the engine runs the strategy it is given, on one rank too
  if (auto impl = ParseImpl(plan.impl); !impl.ok() || impl.value() != Impl::kTransformers) {
    if (!impl.ok()) return impl.error();
    return Error::BadInput(fmt::format("fsdp-run runs transformers' Llama modules and wrap; --impl {} is a planning option (fsdp-plan, fsdp-sim)", ImplName(impl.value())));
  }
  if (plan.config.use_cache) return Error::BadInput("--use-cache describes transformers' forward; fsdp-run's own model keeps no key/value cache");
  if (plan.config.ac_reentrant) return Error::BadInput("--ac-reentrant describes transformers' gradient checkpointing; fsdp-run checkpoints its own blocks non-reentrantly");
  if (auto version = ParseTransformersVersion(plan.transformers_version); !version.ok() || version.value() != TransformersVersion{}) {
    if (!version.ok()) return version.error();
    return Error::BadInput("--transformers-version plans an older transformers' loss; fsdp-run computes the loss as 5.24 does (fsdp-plan and fsdp-sim take it)");
  }
  // FSDP1 flattens a unit into one dtype; the planner's way out for a base stored apart from its
  // adapters, peft's wrap (adapters in units of their own), is not one fsdp-run implements
  if (auto config = ConfigFromFlags(plan); config.ok()) {
    const FsdpConfig& c = config.value();
    if (c.framework == Framework::kFsdp1 && c.lora.rank > 0 && FrozenStorageDtype(c) != c.master_dtype) {
      return Error::BadInput(fmt::format("fsdp-run's FSDP1 flattens each block's base and adapters into one parameter of one dtype; a {} base beside {} "
                                         "adapters trains under --framework fsdp2 (peft's FSDP1 wrap is planned only)",
                                         DTypeName(FrozenStorageDtype(c)), DTypeName(c.master_dtype)));
    }
  }
  auto w = WorkloadFromFlags(plan);
  if (!w.ok()) return w.error();
  const FsdpConfig& c = w.value().config;
  if (c.cpu_offload) return Error::BadInput("fsdp-run does not implement CPU offload (--cpu-offload): fsdp-plan and fsdp-sim model it");
  if (c.master_dtype != DType::kFp32 && f.device == "cuda") {
    return Error::BadInput("fsdp-run's GPU engine keeps fp32 master weights: --master-dtype bf16 trains on --device cpu; fsdp-plan and fsdp-sim model it");
  }
  if (c.ac_every != 1) return Error::BadInput("fsdp-run checkpoints every block under --ac full; --ac-every is a planning option");
  if (c.checkpointing == Checkpointing::kSelectiveOp) {
    return Error::BadInput("fsdp-run implements --ac none, selective and full; selective-op (torchtitan's op-level policy) is a planning option");
  }
  if (c.loop_holds_outputs) return Error::BadInput("--loop-holds-outputs describes a PyTorch training loop; fsdp-run's own loop drops the logits after the loss");
  if (c.optimizer != Optimizer::kAdamW) return Error::BadInput("fsdp-run trains with AdamW only (--optimizer adamw)");
  PreparedRun run{std::move(w).value(), {}};
  run.options.seed = f.seed;
  run.options.lr = f.lr;
  auto scaling = runtime::ParseLossScaling(f.loss_scale, c.param_dtype);
  if (!scaling.ok()) return scaling.error();
  run.options.loss_scaling.mode = scaling.value();
  run.options.loss_scaling.init_scale = f.loss_scale_init;
  run.options.loss_scaling.growth_interval = f.loss_scale_interval;  // checked where the engines are made
  if (!f.init_from.empty()) {
    auto checkpoint = runtime::Checkpoint::Open(f.init_from);
    if (!checkpoint.ok()) return checkpoint.error();
    std::string found, missing;  // LoRA adapters: all from the checkpoint, or none (peft's initial values)
    for (const TensorSpec& t : run.workload.model.tensors) {  // every tensor before any rank starts
      const std::vector<runtime::CheckpointPiece> pieces = runtime::CheckpointPieces(checkpoint.value(), t);
      if (IsLoraAdapter(t.name)) (pieces.empty() ? missing : found) = t.name;
      for (const runtime::CheckpointPiece& piece : pieces) {
        if (Status s = checkpoint.value().Check(piece.name, piece.shape); !s.ok()) return s.error();
      }
    }
    if (!found.empty() && !missing.empty()) {
      return Error::BadInput(fmt::format("checkpoint '{}' has LoRA adapters ({}) but not {}: give it every adapter or none", f.init_from, found, missing));
    }
    run.options.checkpoint = std::make_shared<const runtime::Checkpoint>(std::move(checkpoint).value());
  }
  if (!f.tokens_path.empty()) {
    auto tokens = ReadTokenFile(f.tokens_path, run.workload.model.vocab_size);
    if (!tokens.ok()) return tokens.error();
    run.options.tokens = std::move(tokens).value();
  }
  return run;
}

Result<StepLog> RunSteps(const RunFlags& f, int rank, const std::function<Result<float>(int64_t)>& step_fn) {
  StepLog log;
  for (int64_t step = 0; step < f.steps; ++step) {
    ArmRunDeadline(fmt::format("step {}", step + 1));
    if (rank == f.hang_rank && step == f.fail_step) {
      std::cerr << fmt::format("fsdp-run (rank {}): injected hang at step {}\n", rank, step + 1);
      std::this_thread::sleep_for(std::chrono::hours(1));
    }
    if (rank == f.fail_rank && step == f.fail_step) {
      std::cerr << fmt::format("fsdp-run (rank {}): injected failure at step {}\n", rank, step + 1);
      std::_Exit(3);  // dies like a crashed rank: no cleanup, no MPI_Finalize
    }
    const auto start = std::chrono::steady_clock::now();
    auto loss = step_fn(step);
    if (!loss.ok()) return loss.error();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    log.total_s += s;
    log.losses.push_back(loss.value());
    log.times.push_back(s);
    if (rank == 0 && !f.quiet) std::cerr << fmt::format("fsdp-run: step {}/{} loss {:.6f} {:.3f} s\n", step + 1, f.steps, loss.value(), s);
  }
  ArmRunDeadline("the final report (every rank's peak, the predictions)");
  return log;
}

Status RunTraining(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.device == "cuda") return RunTrainingGpu(f, comm, out);
  if (f.device != "cpu") return Error::BadInput(fmt::format("--device must be cpu or cuda, got '{}'", f.device));
  if (f.virtual_world != 0) return Error::BadInput("--virtual-world needs --device cuda");
  auto prepared = PrepareRun(f, f.plan);
  if (!prepared.ok()) return prepared.error();
  if (Status s = CheckRanksAgree(f, prepared.value(), comm); !s.ok()) return s;
  const Workload& workload = prepared.value().workload;
  if (Status s = CheckHostMemory(workload, RanksOnThisHost(comm)); !s.ok()) return s;
  auto engine = runtime::FsdpEngine::Create(workload, comm, prepared.value().options);
  if (!engine.ok()) return engine.error();
  if (f.memory_limit_mib > 0) engine.value()->set_memory_limit(static_cast<int64_t>(f.memory_limit_mib * kMiB));
  auto log = RunSteps(f, comm.rank(), [&](int64_t step) { return engine.value()->Step(step); });
  if (log.ok()) {
    if (Status s = CheckLossesFinite(log.value(), prepared.value().options); !s.ok()) return s;
  }
  if (!log.ok()) {
    if (f.memory_limit_mib > 0 && log.error().kind == Error::Kind::kOutOfMemory) {
      const MemoryEstimate predicted = EstimateRuntimeMemory(workload);
      return Error::RunFailed(fmt::format("{}; predicted peak {:.2f} MiB", log.error().message, predicted.peak_bytes / kMiB));
    }
    return log.error();
  }
  // every rank's peak (the largest is reported), gathered on rank 0
  const runtime::MemoryLedger& mem = engine.value()->memory();
  auto largest_peak = MaxOverRanks(comm, mem.peak_bytes());
  if (!largest_peak.ok()) return largest_peak.error();
  if (comm.rank() != 0) return {};
  const runtime::FsdpEngine& e = *engine.value();
  RunReport r = NewRunReport(f, workload, log.value(), comm.size());
  RunMeasurement& m = r.measured;
  const double steps = static_cast<double>(f.steps);
  m.step_s = log.value().total_s / steps;
  m.step_basis = fmt::format("mean of {} step{}", f.steps, f.steps == 1 ? "" : "s");
  m.forward_s = e.times().forward_s / steps;
  m.backward_s = e.times().backward_s / steps;
  m.optimizer_s = e.times().optimizer_s / steps;
  m.peak_bytes = largest_peak.value();
  m.rank0 = {mem.peak_bytes(), PhaseName(workload, mem.peak_phase()), mem.at_peak()};
  SetMeasuredComm(e.shard_stats(), e.replica_stats(), e.shard_world(), workload.config.gpus, m);
  m.loss_scaler = e.loss_scaler();
  // predicted: the planner's profile of this engine; its time model with a calibrated CPU file
  RunPrediction& p = r.predicted;
  const MemoryEstimate predicted = EstimateRuntimeMemory(workload);
  p.memory = {predicted.peak_bytes, predicted.peak_phase, predicted.peak};
  for (MemCategory c : kRuntimeCategories) {
    if (c != MemCategory::kTemporaries) p.categories_compared.push_back(c);  // the engine's scratch is not modelled
  }
  if (workload.hardware.architecture == "cpu") {
    p.step_s = EstimateRuntimeStepSeconds(workload);
    p.time_basis = fmt::format("calibrated {}", workload.hardware.id);
    // fsdp-sim on the same engine profile: collectives blocking on the compute stream, no CPU launch cost
    Workload engine_view = workload;
    engine_view.config.attention = Attention::kEager;
    engine_view.config.param_dtype = engine_view.config.reduce_dtype = DType::kFp32;
    sim::SimOptions sim_options;
    sim_options.blocking_collectives = true;
    sim_options.launch_overhead_s = 0;
    sim_options.compute_override = EstimateCompute(engine_view, kFusedEngineTrafficPerSavedByte);
    auto simulated = sim::Simulate(engine_view, sim_options);
    if (simulated.ok()) p.sim_step_s = simulated.value().step_s;
  } else {
    p.no_time_note = "pass --gpu with a hardware file from fsdp-run calibrate";
  }
  Workload fp32 = workload;
  fp32.config.param_dtype = fp32.config.reduce_dtype = DType::kFp32;  // the engine moves fp32 words
  SetPredictedComm(fp32, m, f.steps, p);
  PrintRunReport(r, out);
  if (f.json_path.empty()) return {};
  return WriteTextFile(f.json_path, DumpJson(RunReportJson(r), 2) + "\n");
}

Status RunCalibrate(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.device == "cuda") return RunCalibrateGpu(f, comm, out);
  if (f.device != "cpu") return Error::BadInput(fmt::format("--device must be cpu or cuda, got '{}'", f.device));
  auto model = LoadModel(f.plan.model);
  if (!model.ok()) return model.error();
  runtime::CalibrationOptions o;
  if (f.plan.config.seq_len < 0 || f.plan.config.seq_len > 65536) {
    return Error::BadInput(fmt::format("calibrate --seq-len must be between 1 and 65536, got {}", f.plan.config.seq_len));
  }
  if (f.plan.config.micro_batch < 1 || f.plan.config.micro_batch > 1024) {
    return Error::BadInput(fmt::format("calibrate --micro-batch must be between 1 and 1024, got {}", f.plan.config.micro_batch));
  }
  o.seq_len = f.plan.config.seq_len > 0 ? f.plan.config.seq_len : 256;
  o.tokens = f.plan.config.micro_batch * o.seq_len;
  auto hw = runtime::Calibrate(model.value(), comm, o);
  if (!hw.ok()) return hw.error();
  if (comm.rank() != 0) return {};
  const Json& j = hw.value();
  // what it measured must be a hardware file the tools accept (a timer that read 0 is not)
  if (auto check = HardwareFromJson(j, "calibrated", "calibrate's measurement"); !check.ok()) {
    return Error::RunFailed(fmt::format("the calibration measured nonsense: {}", check.error().message));
  }
  fmt::print(out, "GEMM {:.1f} GFLOP/s, copy {:.2f} GB/s, all-gather bus bandwidth {:.2f} GB/s over {} rank(s)\n",
             j["peak_flops"]["fp32"].get<double>() / 1e9, j["memory_bandwidth_bytes_per_s"].get<double>() / kGB,
             j["intra_node_link"]["bandwidth_bytes_per_s"].get<double>() * 0.8 / kGB, comm.size());
  const std::string path = f.json_path.empty() ? "calibrated-cpu.json" : f.json_path;
  if (Status s = WriteTextFile(path, DumpJson(j, 2) + "\n"); !s.ok()) return s;
  fmt::print(out, "wrote {} (use it with --gpu {})\n", path, path);
  return {};
}

}  // namespace fsdp
