#include "cli/recommend_cli.h"

#include <algorithm>
#include <chrono>
#include <iostream>

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include "cli/cli_util.h"
#include "core/catalog.h"
#include "planner/export.h"
#include "planner/memory_model.h"
#include "planner/plan_report.h"
#include "planner/search.h"
#include "planner/step_model.h"
#include "core/vocabulary.h"

namespace fsdp {
namespace {

// --price GPU_ID=USD for GPUs of the search (`searched`): an id it does not search is a typo.
Status ParsePrices(const std::vector<std::string>& prices, const std::vector<HardwareSpec>& searched, std::map<std::string, double>& out) {
  std::vector<std::string> ids;
  for (const HardwareSpec& hw : searched) ids.push_back(hw.id);
  for (const auto& p : prices) {
    auto eq = p.find('=');
    char* end = nullptr;
    double usd = eq == std::string::npos ? -1 : std::strtod(p.c_str() + eq + 1, &end);
    if (eq == std::string::npos || end == p.c_str() + eq + 1 || *end != '\0' || !(usd >= 0) || usd > 1e4) {
      return Error::BadInput(fmt::format("--price expects GPU_ID=USD_PER_GPU_HOUR (e.g. h100-sxm=2.5), got '{}'", p));
    }
    const std::string id = p.substr(0, eq);
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) {
      const auto close = ClosestIds(id, ids);
      return Error::BadInput(fmt::format("--price: '{}' is not a GPU of this search{}", id,
                                         close.empty() ? "" : fmt::format(" (did you mean {}?)", fmt::join(close, ", "))));
    }
    out[id] = usd;
  }
  return {};
}

Result<SearchOptions> OptionsFromFlags(const RecommendFlags& f, const ModelSpec& model) {
  SearchOptions o;
  std::vector<std::string> ids = f.gpu_types.empty() ? ListCatalogIds("hardware") : Split(f.gpu_types, ',');
  for (const auto& id : ids) {
    auto hw = LoadHardware(id);
    if (!hw.ok()) return hw.error();
    o.gpu_types.push_back(hw.value());
  }
  if (Status s = ParsePrices(f.prices, o.gpu_types, o.price_per_gpu_hour); !s.ok()) return s.error();
  if (f.top < 1 || f.top > 1000) return Error::BadInput(fmt::format("--top must be between 1 and 1000, got {}", f.top));
  if (f.gpus_max < 1 || f.gpus_max > 100000) return Error::BadInput(fmt::format("--gpus-max must be between 1 and 100000, got {}", f.gpus_max));
  o.gpus_max = f.gpus_max;
  o.gpus_min = f.gpus_min;
  o.base.seq_len = f.seq_len > 0 ? f.seq_len : std::min<int64_t>(4096, model.max_position_embeddings);
  if (f.seq_len < 0 || o.base.seq_len > 10'000'000) return Error::BadInput(fmt::format("--seq-len must be positive, got {}", f.seq_len));
  if (f.global_batch && f.global_batch_tokens) return Error::BadInput("give --global-batch or --global-batch-tokens, not both");
  if (f.global_batch) {
    if (*f.global_batch < 1) return Error::BadInput(fmt::format("--global-batch must be at least 1, got {}", *f.global_batch));
    o.global_batch_seqs = *f.global_batch;
  } else {
    // Default: Llama 2's 4M-token batch (Touvron et al. 2023, Table 1)
    const int64_t tokens = f.global_batch_tokens.value_or(4 * 1024 * 1024);
    if (tokens < 1 || tokens % o.base.seq_len != 0) {
      return Error::BadInput(fmt::format("--global-batch-tokens {} is not a whole number of {}-token sequences", tokens, o.base.seq_len));
    }
    o.global_batch_seqs = tokens / o.base.seq_len;
  }
  if (f.budget_per_hour) {
    if (!(*f.budget_per_hour > 0 && *f.budget_per_hour <= 1e9)) {
      return Error::BadInput(fmt::format("--budget-per-hour must be between 0 and 1e9 USD, got {}", *f.budget_per_hour));
    }
    o.budget_per_hour = f.budget_per_hour;
  }
  auto objective = ParseObjective(f.objective);
  if (!objective.ok()) return objective.error();
  o.objective = objective.value();
  if (f.tokens) {
    // 1e18 tokens is ~100,000 x a frontier model's training set
    if (!(*f.tokens > 0 && *f.tokens <= 1e18)) return Error::BadInput(fmt::format("--tokens must be between 0 and 1e18, got {}", *f.tokens));
    o.train_tokens = *f.tokens;
  }
  auto fw = ParseFramework(f.framework);
  if (!fw.ok()) return fw.error();
  o.base.framework = fw.value();
  auto impl = ParseImpl(f.impl);
  if (!impl.ok()) return impl.error();
  o.base.impl = impl.value();
  auto transformers = ParseTransformersVersion(f.transformers_version);
  if (!transformers.ok()) return transformers.error();
  o.base.transformers = transformers.value();
  if (IsTorchtitan(o.base.impl)) {
    if (const std::string why = TorchtitanRuledOut(model, o.base.impl); !why.empty()) return Error::BadInput(why);
  }
  auto att = ParseAttention(f.attention.empty() ? (SdpaRuledOut(model).empty() ? "flash" : "eager") : f.attention);
  if (!att.ok()) return att.error();
  o.base.attention = att.value();
  o.base.loop_holds_outputs = f.loop_holds_outputs;
  o.base.use_cache = f.use_cache;
  o.base.lora = f.lora;
  if (!f.qlora_compute_dtype.empty()) {
    auto compute = ParseDType(f.qlora_compute_dtype, "--qlora-compute-dtype");
    if (!compute.ok()) return compute.error();
    o.base.lora.compute_dtype = compute.value();
  }
  if (f.use_cache && f.loop_holds_outputs) {
    return Error::BadInput("recommend --use-cache --loop-holds-outputs: the search's un-checkpointed candidates would hold their saved keys and values "
                           "past their backward, which is not modelled; plan that pair with fsdp-plan --ac full");
  }
  if (o.base.lora != LoraConfig{} || IsTorchtitan(o.base.impl) || o.base.transformers != TransformersVersion{} || o.base.use_cache) {
    // the LoRA, torchtitan and transformers-release settings' errors once, from the configuration
    // every candidate shares (ResolveAndValidate: TransformersRuledOut, and the release's attention)
    FsdpConfig probe = o.base;
    probe.gpus = probe.gpus_per_node = 1;
    if (probe.framework == Framework::kFsdp1 && probe.lora.rank > 0) probe.wrap = WrapPolicy::kPeft;
    if (auto w = BuildWorkload(model, o.gpu_types.front(), probe); !w.ok()) return w.error();
  }
  if (IsTorchtitan(o.base.impl)) {
    if (!f.export_format.empty()) {
      return Error::BadInput(fmt::format("--export writes code around transformers' modules; --impl {} is planned, not exported", ImplName(o.base.impl)));
    }
  }
  if (!f.export_format.empty() && o.base.transformers != TransformersVersion{}) return Error::BadInput(ExportNeedsCurrentTransformers(o.base.transformers));
  o.top = f.top;
  o.exhaustive = f.exhaustive;
  return o;
}

std::string Describe(const Candidate& c) {
  return fmt::format("{:>4} x {:<14} {:<13} AC {:<9} mb {:>2} x ga {:>4} {:<7}{}", c.config.gpus, c.gpu_id, StrategyName(c.config.strategy),
                     CheckpointingName(c.config.checkpointing), c.config.micro_batch, c.config.grad_accum, WrapPolicyName(c.config.wrap),
                     c.config.cpu_offload ? " offload" : "");
}

void PrintRow(const Candidate& c, std::ostream& out) {
  fmt::print(out, "  {}  {:>9.0f} tok/s {:>6.0f}/GPU  MFU {:>4.1f}%  {:>6.2f}/{:<6.2f} GiB  ${:>8.2f}/h  ${:>6.2f}/Mtok", Describe(c),
             c.tokens_per_s, c.tokens_per_s_per_gpu, 100 * c.mfu, c.peak_bytes / kGiB, c.capacity_bytes / kGiB, c.usd_per_hour,
             c.usd_per_million_tokens);
  if (c.time_to_train_s > 0) fmt::print(out, "  {:.1f} days ${:.0f}", c.time_to_train_s / 86400, c.usd_to_train);
  fmt::print(out, "\n");
}

Json CandidateJson(const Candidate& c) {
  Json j = {{"gpu", c.gpu_id}, {"config", ConfigToJson(c.config)}, {"feasible", c.feasible}, {"peak_bytes", c.peak_bytes},
            {"capacity_bytes", c.capacity_bytes}, {"step_s", c.step_s}, {"tokens_per_s", c.tokens_per_s},
            {"tokens_per_s_per_gpu", c.tokens_per_s_per_gpu}, {"mfu", c.mfu}, {"usd_per_hour", c.usd_per_hour},
            {"usd_per_million_tokens", c.usd_per_million_tokens}};
  if (c.time_to_train_s > 0) {
    j["time_to_train_s"] = c.time_to_train_s;
    j["usd_to_train"] = c.usd_to_train;
  }
  if (!c.feasible) j["rejection"] = c.rejection;
  return j;
}

// Progress on stderr once a search has run for more than a second.
class Progress {
 public:
  explicit Progress(bool quiet) : quiet_(quiet), start_(std::chrono::steady_clock::now()) {}
  ~Progress() { if (shown_) std::cerr << "\n"; }
  void operator()(int64_t done, int64_t total) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (quiet_ || elapsed < 1.0) return;
    shown_ = true;
    std::cerr << fmt::format("\rfsdp-plan: searched {}/{} configurations ({:.0f}%), {:.1f} s", done, total, 100.0 * done / total, elapsed)
              << std::flush;
  }

 private:
  bool quiet_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

void AddRecommendFlags(CLI::App& app, RecommendFlags& f) {
  // not ->required(): CLI11 would report a missing --model before an unknown flag
  app.add_option("--model", f.model, "catalog id, or a HuggingFace config.json or the directory holding it");
  app.add_option("--gpu-types", f.gpu_types, "comma-separated GPU ids to consider (default: the whole catalog)");
  app.add_option("--seq-len", f.seq_len, "sequence length (default: min(4096, max positions))");
  app.add_option("--global-batch-tokens", f.global_batch_tokens, "tokens per optimizer step (default 4194304)");
  app.add_option("--global-batch", f.global_batch, "sequences per optimizer step");
  app.add_option("--gpus-min", f.gpus_min, "smallest GPU count to consider")->capture_default_str();
  app.add_option("--gpus-max", f.gpus_max, "largest GPU count to consider")->capture_default_str();
  app.add_option("--budget-per-hour", f.budget_per_hour, "USD per hour for the whole cluster");
  app.add_option("--objective", f.objective, "throughput | cost | time-to-train")->capture_default_str();
  app.add_option("--tokens", f.tokens, "tokens to train on (time-to-train and cost to train)");
  app.add_option("--price", f.prices, "override a price: GPU_ID=USD_PER_GPU_HOUR (repeatable)");
  app.add_option("--framework", f.framework, "fsdp1 | fsdp2")->capture_default_str();
  app.add_option("--impl", f.impl, "transformers | torchtitan | torchtitan-2025-01 (torchtitan's Llama 3 or, 0.2.2's, dense Qwen3 and wrap units; needs --framework fsdp2)")->capture_default_str();
  app.add_option("--transformers-version", f.transformers_version, "the transformers release the run uses (4.31 to 4.57, or 5.x), for its loss path (fsdp-plan --help)")->capture_default_str();
  app.add_option("--attention", f.attention, "eager | flash (default: flash; eager for a model SDPA cannot run, Gemma 2's)");
  app.add_flag("--loop-holds-outputs", f.loop_holds_outputs, "the training loop keeps `outputs`: its logits live through the step");
  app.add_flag("--use-cache", f.use_cache, "the forward runs with use_cache=True (transformers 4.31 to 4.35): every layer's keys and values live through the loss");
  app.add_option("--lora-rank", f.lora.rank, "LoRA rank r for every candidate (peft); 0 is full fine-tuning")->capture_default_str();
  app.add_option("--lora-targets", f.lora.targets, "target_modules: module names or all-linear (default: peft's for the model type)");
  app.add_option("--lora-dropout", f.lora.dropout, "lora_dropout p")->capture_default_str();
  app.add_flag("--qlora", f.lora.qlora, "QLoRA: the blocks' linears in bitsandbytes NF4 (needs --lora-rank)");
  app.add_flag("--qlora-double-quant", f.lora.double_quant, "bnb_4bit_use_double_quant=True");
  app.add_option("--qlora-compute-dtype", f.qlora_compute_dtype, "bnb_4bit_compute_dtype: fp32 | bf16 | fp16 (default: the param dtype)");
  app.add_option("--top", f.top, "how many configurations to list")->capture_default_str();
  app.add_option("--export", f.export_format, "print the best configuration as pytorch | fsdp2 | accelerate | lightning");
  app.add_flag("--json", f.json, "print one JSON object");
  app.add_flag("--quiet", f.quiet, "no progress on stderr");
  app.add_flag("--exhaustive", f.exhaustive, "replay every candidate's memory (an exact count of those that fit; same results, slower)");
}

Status RunRecommend(const RecommendFlags& f, std::ostream& out) {
  if (f.model.empty()) return Error::BadInput("--model is required");
  auto model = LoadModel(f.model);
  if (!model.ok()) return model.error();
  auto options = OptionsFromFlags(f, model.value());
  if (!options.ok()) return options.error();
  std::optional<ExportFormat> format;
  if (!f.export_format.empty()) {
    auto ef = ParseExportFormat(f.export_format);
    if (!ef.ok()) return ef.error();
    format = ef.value();
  }
  Progress progress(f.quiet);
  auto result = Recommend(model.value(), options.value(), [&](int64_t d, int64_t t) { progress(d, t); });
  if (!result.ok()) return result.error();
  const SearchResult& r = result.value();
  if (f.json) {
    Json j = {{"model", model.value().id}, {"evaluated", r.evaluated}, {"memory_checked", r.memory_checked},
              {"memory_checked_feasible", r.memory_checked_feasible}, {"feasible", r.feasible ? Json(*r.feasible) : Json(nullptr)}};
    for (const char* key : {"top", "pareto", "best_rejected"}) j[key] = Json::array();
    for (const auto& c : r.top) j["top"].push_back(CandidateJson(c));
    for (const auto& c : r.pareto) j["pareto"].push_back(CandidateJson(c));
    for (const auto& c : r.best_rejected) j["best_rejected"].push_back(CandidateJson(c));
    out << DumpJson(j, 2) << "\n";
    return {};
  }
  fmt::print(out, "{}: {} configurations evaluated, {}; global batch {} sequences of {} tokens; objective {}\n\n", model.value().id, r.evaluated,
             r.feasible ? fmt::format("{} feasible", *r.feasible)
                        : fmt::format("memory replayed for the {} that could rank ({} fit within budget; --exhaustive replays all)", r.memory_checked,
                                      r.memory_checked_feasible),
             options.value().global_batch_seqs, options.value().base.seq_len, f.objective);
  fmt::print(out, "best configurations:\n");
  for (const auto& c : r.top) PrintRow(c, out);
  fmt::print(out, "\nPareto front (cheaper per token or faster than every other):\n");
  for (const auto& c : r.pareto) PrintRow(c, out);
  if (!r.best_rejected.empty()) {
    fmt::print(out, "\nbetter-scoring configurations that were rejected:\n");
    for (const auto& c : r.best_rejected) fmt::print(out, "  {}  {}\n", Describe(c), c.rejection);
  }
  if (format) {
    const Candidate& best = r.top.front();
    auto hw = LoadHardware(best.gpu_id);
    auto w = BuildWorkload(model.value(), hw.value(), best.config);
    if (!w.ok()) return w.error();
    fmt::print(out, "\n{}", ExportConfig(w.value(), *format));
  }
  return {};
}

Status RunAdvise(const PlanFlags& flags, std::ostream& out) {
  auto config = ConfigFromFlags(flags);
  if (!config.ok()) return config.error();
  auto model = LoadModel(flags.model);
  if (!model.ok()) return model.error();
  ApplyModelDefaults(flags, model.value(), config.value());
  auto hw = LoadHardware(flags.gpu);
  if (!hw.ok()) return hw.error();
  auto w = BuildWorkload(model.value(), hw.value(), config.value());
  if (!w.ok()) return w.error();
  const MemoryEstimate m = EstimateMemory(AsPyTorchRuns(w.value()));
  const std::string verdict = m.fits                  ? std::string("fits")
                              : m.headroom_bytes < 0 ? fmt::format("does not fit by {} GiB", Gib(-m.headroom_bytes))
                                                     : std::string("does not fit: the caching allocator runs out of memory on the card");
  if (!flags.json) fmt::print(out, "{} on {} x {}: peak {} GiB of {} GiB ({})\n", model.value().id, config.value().gpus, hw.value().id, Gib(m.peak_bytes),
             Gib(m.capacity_bytes), verdict);
  std::vector<Advice> advice = AdviseFit(w.value());
  // The tensors fit and the allocator's cache does not: its settings first, with what each saves.
  // (Under a per_process_memory_fraction the tensors must fit its cap too.)
  const bool cache_is_over = !m.fits && m.allocated_peak_bytes + OutsideAllocatorBytes(w.value(), m.overheads) <= m.capacity_bytes &&
                             (m.allocator_cap_bytes < 0 || m.allocated_peak_bytes <= m.allocator_cap_bytes);
  const std::vector<Advice> allocator = cache_is_over ? AllocatorAdvice(w.value()) : std::vector<Advice>{};
  const std::vector<Advice> fine_tuning = m.fits ? std::vector<Advice>{} : FineTuningAdvice(w.value());
  auto to_json = [](const std::vector<Advice>& list) {
    Json changes = Json::array();
    for (const Advice& a : list) {
      changes.push_back({{"change", a.change}, {"fits", a.fits}, {"peak_bytes", a.peak_bytes}, {"saves_bytes", a.saves_bytes}, {"step_s", a.step_s},
                         {"slowdown_pct", a.slowdown_pct}});
    }
    return changes;
  };
  if (flags.json) {
    out << DumpJson(Json{{"model", model.value().id}, {"gpu", hw.value().id}, {"gpus", config.value().gpus}, {"peak_bytes", m.peak_bytes},
                         {"capacity_bytes", m.capacity_bytes}, {"fits", m.fits}, {"fragmentation_bytes", m.fragmentation_bytes},
                         {"reserved_over_allocated_peak_bytes", ReservedOverAllocatedPeakBytes(m)}, {"changes", to_json(advice)}, {"allocator_changes", to_json(allocator)},
                         {"fine_tuning_changes", to_json(fine_tuning)}}, 2) << "\n";
    return {};
  }
  if (cache_is_over) {
    fmt::print(out, "The tensors fit ({} GiB allocated); the caching allocator's reserve does not ({} GiB over the tensors' peak; {} GiB "
                    "unallocated when reserved peaks). Its settings, by the bytes each saves:\n", Gib(m.allocated_peak_bytes),
               Gib(ReservedOverAllocatedPeakBytes(m)), Gib(m.fragmentation_bytes));
    for (const Advice& a : allocator) {
      fmt::print(out, "  {:<44} peak {:>7} GiB  saves {:>6} GiB  {}\n", a.change, Gib(a.peak_bytes), Gib(a.saves_bytes), a.fits ? "fits" : "does not fit");
    }
  }
  if (m.fits) fmt::print(out, "It already fits; changes that also fit, by their cost in tokens/s per GPU:\n");
  else fmt::print(out, "Smallest changes that make it fit, by their cost in tokens/s per GPU:\n");
  if (advice.empty()) fmt::print(out, "  none of the single or paired changes fits: more GPUs with CPU offload, or a larger GPU, is needed\n");
  for (const Advice& a : advice) {
    fmt::print(out, "  {:<44} peak {:>7} GiB  step {:>8.1f} ms  {:+6.1f}% tokens/s per GPU\n", a.change, Gib(a.peak_bytes), a.step_s * 1e3, -a.slowdown_pct);
  }
  if (fine_tuning.empty()) return {};
  fmt::print(out, "Or train fewer parameters (LoRA adapters on a frozen base: a different training, not ranked with the above):\n");
  for (const Advice& a : fine_tuning) {
    if (a.peak_bytes == 0) continue;  // a configuration the change makes invalid
    fmt::print(out, "  {:<80} peak {:>7} GiB  {:<12}  step {:>8.1f} ms  {:+6.1f}% tokens/s per GPU\n", a.change, Gib(a.peak_bytes),
               a.fits ? "fits" : "does not fit", a.step_s * 1e3, -a.slowdown_pct);
  }
  return {};
}

}  // namespace fsdp
