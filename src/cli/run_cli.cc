#include "cli/run_cli.h"

#include <chrono>
#include <cstdlib>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ostream.h>

#include "core/json_io.h"
#include "planner/plan_report.h"
#include "runtime/fsdp_engine.h"
#include "sim/sim_report.h"

namespace fsdp {

void AddRunFlags(CLI::App& app, RunFlags& f) {
  AddPlanFlags(app, f.plan);
  app.add_option("--steps", f.steps, "optimizer steps to run")->capture_default_str();
  app.add_option("--seed", f.seed, "seed of the initialisation and the synthetic tokens")->capture_default_str();
  app.add_option("--lr", f.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--out", f.json_path, "write the results as JSON (measured.loss per step, measured.time.step_s)");
  app.add_flag("--quiet", f.quiet, "no progress on stderr");
  app.add_option("--fail-rank", f.fail_rank, "fault injection: this rank exits abruptly at --fail-step (tests)");
  app.add_option("--fail-step", f.fail_step, "fault injection: the step at which --fail-rank dies");
}

Status RunTraining(const RunFlags& f, runtime::Comm& comm, std::ostream& out) {
  if (f.steps < 1 || f.steps > 1000000) return Error::BadInput(fmt::format("--steps must be between 1 and 1000000, got {}", f.steps));
  if (!(f.lr > 0) || f.lr > 1) return Error::BadInput(fmt::format("--lr must be in (0, 1], got {}", f.lr));
  PlanFlags plan = f.plan;
  if (plan.config.gpus_per_node == 0) plan.config.gpus_per_node = plan.config.gpus;  // CPU ranks: one "node"
  auto w = WorkloadFromFlags(plan);
  if (!w.ok()) return w.error();
  runtime::TrainOptions options;
  options.seed = f.seed;
  options.lr = f.lr;
  auto engine = runtime::FsdpEngine::Create(w.value(), comm, options);
  if (!engine.ok()) return engine.error();
  Json losses = Json::array(), times = Json::array();
  double total_s = 0;
  for (int64_t step = 0; step < f.steps; ++step) {
    if (comm.rank() == f.fail_rank && step == f.fail_step) {
      std::cerr << fmt::format("fsdp-run (rank {}): injected failure at step {}\n", comm.rank(), step + 1);
      std::_Exit(3);  // dies like a crashed rank: no cleanup, no MPI_Finalize
    }
    const auto start = std::chrono::steady_clock::now();
    auto loss = engine.value()->Step(step);
    if (!loss.ok()) return loss.error();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total_s += s;
    losses.push_back(loss.value());
    times.push_back(s);
    if (comm.rank() == 0 && !f.quiet) std::cerr << fmt::format("fsdp-run: step {}/{} loss {:.6f} {:.3f} s\n", step + 1, f.steps, loss.value(), s);
  }
  if (comm.rank() != 0) return {};
  fmt::print(out, "{} on {} rank(s), {}: losses", w.value().model.id, comm.size(), StrategyName(w.value().config.strategy));
  for (const auto& l : losses) fmt::print(out, " {:.6f}", l.get<double>());
  fmt::print(out, "; mean step {:.3f} s\n", total_s / static_cast<double>(f.steps));
  if (!f.json_path.empty()) {
    Json doc = {{"model", w.value().model.id},
                {"ranks", comm.size()},
                {"config", ConfigToJson(w.value().config)},
                {"measured", {{"loss", losses}, {"time", {{"step_s", total_s / static_cast<double>(f.steps)}, {"steps_s", times}}}}}};
    return sim::WriteText(f.json_path, doc.dump(2) + "\n");
  }
  return {};
}

}  // namespace fsdp
