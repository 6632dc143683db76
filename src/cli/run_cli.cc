#include "cli/run_cli.h"

#include <algorithm>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <thread>
#include <chrono>
#include <cstdlib>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "core/json_io.h"
#include "planner/comm_model.h"
#include "planner/plan_report.h"
#include "planner/runtime_profile.h"
#include "runtime/calibrate.h"
#include "runtime/fsdp_engine.h"
#include "sim/sim_report.h"
#include "sim/simulator.h"

namespace fsdp {

namespace {

// Stops the process when a step outlives its deadline: the collectives of a rank whose peer died
// or hangs would otherwise wait for ever. Exit code 1, one line naming the step.
class StepWatchdog {
 public:
  StepWatchdog(double timeout_s, int rank) : timeout_(timeout_s), rank_(rank), thread_([this] { Watch(); }) {}
  ~StepWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Arm(int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    step_ = step;
    deadline_ = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_));
    cv_.notify_all();
  }

 private:
  void Watch() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!done_) {
      if (step_ > 0 && std::chrono::steady_clock::now() > deadline_) {
        const std::string line = fmt::format("fsdp-run (rank {}): error: step {} did not finish within --timeout {} s (a peer rank died or hangs)\n",
                                             rank_, step_, timeout_);
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
  int64_t step_ = 0;
  std::chrono::steady_clock::time_point deadline_{};
  std::thread thread_;
};

Result<std::vector<int32_t>> ReadTokens(const std::string& path, int64_t vocab) {
  std::ifstream in(path);
  if (!in) return Error::BadInput(fmt::format("{}: cannot open token file", path));
  std::vector<int32_t> tokens;
  for (std::string word; in >> word;) {
    char* end = nullptr;
    const long v = std::strtol(word.c_str(), &end, 10);
    if (*end != '\0' || v < 0 || v >= vocab) {
      return Error::BadInput(fmt::format("{}: token {} '{}' is not an id between 0 and {}", path, tokens.size() + 1, word, vocab - 1));
    }
    tokens.push_back(static_cast<int32_t>(v));
  }
  if (tokens.size() < 2) return Error::BadInput(fmt::format("{}: needs at least 2 tokens", path));
  return tokens;
}

}  // namespace

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
  const double lr = std::stod(fmt::format("{}", f.lr));  // the float's shortest decimal, 0.001 rather than 0.0010000000474974513
  return Json{{"init_from", path(f.init_from)}, {"tokens", path(f.tokens_path)}, {"seed", f.seed}, {"lr", lr}};
}

void PrintLossScaling(const runtime::LossScaler& scaler, std::ostream& out) {
  if (!scaler.enabled()) return;
  std::string skipped;
  for (int64_t s : scaler.skipped_steps()) skipped += fmt::format("{}{}", skipped.empty() ? "" : ", ", s + 1);
  fmt::print(out, "  loss scaling: dynamic, scale {:g} after {} steps, {}\n", scaler.scale(), scaler.steps(),
             skipped.empty() ? "no step skipped" : fmt::format("skipped steps {} (inf/NaN gradients)", skipped));
}

Json LossScalingJson(const runtime::LossScaler& scaler) {
  Json skipped = Json::array();
  for (int64_t s : scaler.skipped_steps()) skipped.push_back(s + 1);
  return Json{{"mode", std::string(runtime::LossScalingName(scaler.mode()))},
              {"final_scale", scaler.scale()},
              {"skipped_steps", skipped}};
}

double PercentError(double measured, double predicted) { return measured > 0 ? 100.0 * (predicted - measured) / measured : 0.0; }

Json CommStatsJson(const runtime::CommStats& cs, int64_t group) {
  auto busbw = [&](Collective c, int64_t bytes, double s) { return s > 0 ? bytes / s * BusFactor(c, group) : 0.0; };
  return Json{{"group_size", group},
              {"all_gather_bytes", cs.all_gather_bytes}, {"all_gather_count", cs.all_gather_count}, {"all_gather_s", cs.all_gather_s},
              {"all_gather_busbw_bytes_per_s", busbw(Collective::kAllGather, cs.all_gather_bytes, cs.all_gather_s)},
              {"reduce_scatter_bytes", cs.reduce_scatter_bytes}, {"reduce_scatter_count", cs.reduce_scatter_count},
              {"reduce_scatter_s", cs.reduce_scatter_s}, {"reduce_scatter_busbw_bytes_per_s", busbw(Collective::kReduceScatter, cs.reduce_scatter_bytes, cs.reduce_scatter_s)},
              {"all_reduce_bytes", cs.all_reduce_bytes}, {"all_reduce_count", cs.all_reduce_count}, {"all_reduce_s", cs.all_reduce_s},
              {"all_reduce_busbw_bytes_per_s", busbw(Collective::kAllReduce, cs.all_reduce_bytes, cs.all_reduce_s)}};
}

Result<int64_t> MaxOverRanks(runtime::Comm& comm, int64_t value) {
  const float halves[2] = {static_cast<float>(value >> 24), static_cast<float>(value & 0xFFFFFF)};
  std::vector<float> all(2 * static_cast<size_t>(comm.size()));
  if (Status s = comm.AllGather(halves, all.data(), 2); !s.ok()) return s.error();
  int64_t largest = 0;
  for (size_t r = 0; r < all.size(); r += 2) largest = std::max(largest, (static_cast<int64_t>(all[r]) << 24) | static_cast<int64_t>(all[r + 1]));
  return largest;
}

Result<PreparedRun> PrepareRun(const RunFlags& f, PlanFlags plan) {
  if (f.steps < 1 || f.steps > 1000000) return Error::BadInput(fmt::format("--steps must be between 1 and 1000000, got {}", f.steps));
  if (!(f.lr > 0) || f.lr > 1) return Error::BadInput(fmt::format("--lr must be in (0, 1], got {}", f.lr));
  if (!(f.memory_limit_mib >= 0 && f.memory_limit_mib <= 1e9)) {
    return Error::BadInput(fmt::format("--memory-limit must be positive MiB (at most 1e9), got {}", f.memory_limit_mib));
  }
  if (!(f.timeout_s > 0 && f.timeout_s <= 1e7)) return Error::BadInput(fmt::format("--timeout must be positive seconds (at most 1e7), got {}", f.timeout_s));
  if (plan.config.gpus_per_node == 0) plan.config.gpus_per_node = plan.config.gpus;  // one "node" unless told
  plan.fsdp1_world_of_one = false;  // the engine runs the strategy it is given, on one rank too
  auto w = WorkloadFromFlags(plan);
  if (!w.ok()) return w.error();
  const FsdpConfig& c = w.value().config;
  if (c.cpu_offload) return Error::BadInput("fsdp-run does not implement CPU offload (--cpu-offload): fsdp-plan and fsdp-sim model it");
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
    for (const TensorSpec& t : run.workload.model.tensors) {  // every tensor before any rank starts
      if (Status s = checkpoint.value().Check(t.name, t.shape); !s.ok()) return s.error();
    }
    run.options.checkpoint = std::make_shared<const runtime::Checkpoint>(std::move(checkpoint).value());
  }
  if (!f.tokens_path.empty()) {
    auto tokens = ReadTokens(f.tokens_path, run.workload.model.vocab_size);
    if (!tokens.ok()) return tokens.error();
    run.options.tokens = std::move(tokens).value();
  }
  return run;
}

Result<StepLog> RunSteps(const RunFlags& f, int rank, const std::function<Result<float>(int64_t)>& step_fn) {
  StepLog log;
  StepWatchdog watchdog(f.timeout_s, rank);
  for (int64_t step = 0; step < f.steps; ++step) {
    watchdog.Arm(step + 1);
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
  return log;
}

Status RunTraining(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.device == "cuda") return RunTrainingGpu(f, comm, out);
  if (f.device != "cpu") return Error::BadInput(fmt::format("--device must be cpu or cuda, got '{}'", f.device));
  if (f.virtual_world != 0) return Error::BadInput("--virtual-world needs --device cuda");
  auto prepared = PrepareRun(f, f.plan);
  if (!prepared.ok()) return prepared.error();
  const Workload& workload = prepared.value().workload;
  auto engine = runtime::FsdpEngine::Create(workload, comm, prepared.value().options);
  if (!engine.ok()) return engine.error();
  if (f.memory_limit_mib > 0) engine.value()->set_memory_limit(static_cast<int64_t>(f.memory_limit_mib * kMiB));
  auto log = RunSteps(f, comm.rank(), [&](int64_t step) { return engine.value()->Step(step); });
  if (!log.ok()) {
    if (f.memory_limit_mib > 0 && log.error().kind == Error::Kind::kOutOfMemory) {
      const MemoryEstimate predicted = EstimateRuntimeMemory(workload);
      return Error::RunFailed(fmt::format("{}; predicted peak {:.2f} MiB", log.error().message, predicted.peak_bytes / kMiB));
    }
    return log.error();
  }
  const Json& losses = log.value().losses;
  const Json& times = log.value().times;
  const double total_s = log.value().total_s;
  // every rank's peak (the largest is reported), gathered on rank 0
  const runtime::MemoryLedger& mem = engine.value()->memory();
  auto largest_peak = MaxOverRanks(comm, mem.peak_bytes());
  if (!largest_peak.ok()) return largest_peak.error();
  if (comm.rank() != 0) return {};
  const double step_s = total_s / static_cast<double>(f.steps);
  fmt::print(out, "{} on {} rank(s), {}: losses", workload.model.id, comm.size(), StrategyName(workload.config.strategy));
  for (const auto& l : losses) fmt::print(out, " {:.6f}", l.get<double>());
  fmt::print(out, "; mean step {:.3f} s\n", step_s);
  PrintLossScaling(engine.value()->loss_scaler(), out);
  fmt::print(out, "  rank 0 peak heap {:.2f} MiB at {}:", mem.peak_bytes() / kMiB, PhaseName(workload, mem.peak_phase()));
  Json categories = Json::object();
  for (MemCategory c : kRuntimeCategories) {
    fmt::print(out, " {} {:.2f}", MemCategoryKey(c), At(mem.at_peak(), c) / kMiB);
    categories[std::string(MemCategoryKey(c)) + "_bytes"] = At(mem.at_peak(), c);
  }
  fmt::print(out, " MiB\n");
  // predicted (planner's profile of this engine) vs measured
  const MemoryEstimate predicted = EstimateRuntimeMemory(workload);
  fmt::print(out, "  {:<18}{:>14}{:>14}{:>9}\n", "rank 0 at peak", "measured MiB", "predicted MiB", "error");
  Json predicted_categories = Json::object();
  for (MemCategory c : kRuntimeCategories) {
    if (c == MemCategory::kTemporaries) continue;
    const double m = At(mem.at_peak(), c) / kMiB, p = At(predicted.peak, c) / kMiB;
    predicted_categories[std::string(MemCategoryKey(c)) + "_bytes"] = At(predicted.peak, c);
    fmt::print(out, "  {:<18}{:>14.3f}{:>14.3f}{:>8.1f}%\n", MemCategoryKey(c), m, p, PercentError(m, p));
  }
  fmt::print(out, "  {:<18}{:>14.3f}{:>14}\n", "temporaries", At(mem.at_peak(), MemCategory::kTemporaries) / kMiB, "-");
  fmt::print(out, "  {:<18}{:>14.3f}{:>14.3f}{:>8.1f}%\n", "peak", mem.peak_bytes() / kMiB, predicted.peak_bytes / kMiB,
             PercentError(static_cast<double>(mem.peak_bytes()), static_cast<double>(predicted.peak_bytes)));
  Json predicted_time = {{"step_s", nullptr}, {"note", "pass --gpu with a hardware file from fsdp-run calibrate"}};
  if (workload.hardware.architecture == "cpu") {
    const double predicted_step = EstimateRuntimeStepSeconds(workload);
    const double measured_step = total_s / static_cast<double>(f.steps);
    predicted_time = {{"step_s", predicted_step}};
    fmt::print(out, "  {:<18}{:>14.3f}{:>14.3f}{:>8.1f}%   (seconds, calibrated {})\n", "step time", measured_step, predicted_step,
               PercentError(measured_step, predicted_step), workload.hardware.id);
    // fsdp-sim on the same engine profile: collectives blocking on the compute stream, no CPU launch cost
    Workload engine_view = workload;
    engine_view.config.attention = Attention::kEager;
    engine_view.config.param_dtype = engine_view.config.reduce_dtype = DType::kFp32;
    sim::SimOptions sim_options;
    sim_options.blocking_collectives = true;
    sim_options.launch_overhead_s = 0;
    sim_options.compute_override = EstimateCompute(engine_view, kFusedEngineTrafficPerSavedByte);
    auto simulated = sim::Simulate(engine_view, sim_options);
    if (simulated.ok()) {
      predicted_time["sim_step_s"] = simulated.value().step_s;
      fmt::print(out, "  {:<18}{:>14.3f}{:>14.3f}{:>8.1f}%   (fsdp-sim)\n", "step time", measured_step, simulated.value().step_s,
                 PercentError(measured_step, simulated.value().step_s));
    }
  }
  const runtime::CommStats& cs = engine.value()->shard_stats();
  Workload fp32 = workload;
  fp32.config.param_dtype = fp32.config.reduce_dtype = DType::kFp32;  // the engine moves fp32 words
  const CommVolume volume = EstimateComm(fp32).volume;
  const double steps = static_cast<double>(f.steps);
  const runtime::FsdpEngine::PhaseTimes& t = engine.value()->times();
  const int64_t n = engine.value()->shard_world();
  auto busbw = [&](int64_t bytes, double seconds, double factor) { return seconds > 0 ? bytes / seconds * factor / kGB : 0.0; };
  const double ag_factor = BusFactor(Collective::kAllGather, n);
  fmt::print(out, "  all-gathers {} x {:.3f} MB ({:.3f} s, busbw {:.2f} GB/s), reduce-scatters {} x {:.3f} MB ({:.3f} s, busbw {:.2f} GB/s)\n",
             cs.all_gather_count, cs.all_gather_bytes / kMB, cs.all_gather_s, busbw(cs.all_gather_bytes, cs.all_gather_s, ag_factor),
             cs.reduce_scatter_count, cs.reduce_scatter_bytes / kMB, cs.reduce_scatter_s, busbw(cs.reduce_scatter_bytes, cs.reduce_scatter_s, ag_factor));
  if (n > 1) {
    fmt::print(out, "  predicted collective bytes: all-gathers {:.3f} MB, reduce-scatters {:.3f} MB\n",
               static_cast<double>(volume.forward_all_gather_bytes + volume.backward_all_gather_bytes) * steps / kMB,
               static_cast<double>(volume.reduce_scatter_bytes) * steps / kMB);
  }
  if (!f.json_path.empty()) {
    Json comm_json = CommStatsJson(cs, n);
    comm_json["predicted_all_gather_bytes"] = static_cast<double>(volume.forward_all_gather_bytes + volume.backward_all_gather_bytes) * steps;
    comm_json["predicted_reduce_scatter_bytes"] = static_cast<double>(volume.reduce_scatter_bytes) * steps;
    Json doc = {{"model", workload.model.id},
                {"predicted", {{"memory", {{"peak_bytes", predicted.peak_bytes}, {"categories", predicted_categories}}},
                               {"time", predicted_time}}},
                {"ranks", comm.size()},
                {"config", ConfigToJson(workload.config)},
                {"inputs", RunInputsJson(f)},
                {"measured",
                 {{"loss", losses},
                  {"loss_scaling", LossScalingJson(engine.value()->loss_scaler())},
                  {"memory", {{"peak_bytes", largest_peak.value()}, {"rank0_peak_bytes", mem.peak_bytes()},
                              {"rank0_peak_phase", PhaseName(workload, mem.peak_phase())}, {"rank0_categories", categories}}},
                  {"time", {{"step_s", step_s}, {"steps_s", times}, {"forward_s", t.forward_s / f.steps}, {"backward_s", t.backward_s / f.steps},
                            {"optimizer_s", t.optimizer_s / f.steps}}},
                  {"comm", comm_json}}}};
    return sim::WriteText(f.json_path, doc.dump(2) + "\n");
  }
  return {};
}

Status RunCalibrate(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.device == "cuda") return RunCalibrateGpu(f, comm, out);
  if (f.device != "cpu") return Error::BadInput(fmt::format("--device must be cpu or cuda, got '{}'", f.device));
  auto model = LoadModel(f.plan.model);
  if (!model.ok()) return model.error();
  runtime::CalibrationOptions o;
  o.seq_len = f.plan.config.seq_len > 0 ? f.plan.config.seq_len : 256;
  o.tokens = f.plan.config.micro_batch * o.seq_len;
  auto hw = runtime::Calibrate(model.value(), comm, o);
  if (!hw.ok()) return hw.error();
  if (comm.rank() != 0) return {};
  const Json& j = hw.value();
  fmt::print(out, "GEMM {:.1f} GFLOP/s, copy {:.2f} GB/s, all-gather bus bandwidth {:.2f} GB/s over {} rank(s)\n",
             j["peak_flops"]["fp32"].get<double>() / 1e9, j["memory_bandwidth_bytes_per_s"].get<double>() / 1e9,
             j["intra_node_link"]["bandwidth_bytes_per_s"].get<double>() * 0.8 / 1e9, comm.size());
  const std::string path = f.json_path.empty() ? "calibrated-cpu.json" : f.json_path;
  if (Status s = sim::WriteText(path, j.dump(2) + "\n"); !s.ok()) return s;
  fmt::print(out, "wrote {} (use it with --gpu {})\n", path, path);
  return {};
}

}  // namespace fsdp
