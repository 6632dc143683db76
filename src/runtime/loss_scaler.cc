#include "runtime/loss_scaler.h"

#include <cmath>

#include <fmt/format.h>

namespace fsdp::runtime {

Result<LossScaling> ParseLossScaling(std::string_view text, DType param_dtype) {
  if (text == "auto") return param_dtype == DType::kFp16 ? LossScaling::kDynamic : LossScaling::kNone;
  if (text == "none") return LossScaling::kNone;
  if (text == "dynamic") return LossScaling::kDynamic;
  return Error::BadInput(fmt::format("--loss-scale must be auto, none or dynamic, got '{}'", text));
}

std::string_view LossScalingName(LossScaling mode) { return mode == LossScaling::kDynamic ? "dynamic" : "none"; }

Status CheckLossScalerOptions(const LossScalerOptions& o) {
  int exponent = 0;
  const bool power_of_two = std::isfinite(o.init_scale) && o.init_scale > 0 && std::frexp(o.init_scale, &exponent) == 0.5f;
  if (!power_of_two || o.init_scale < 1.0f) {
    return Error::BadInput(fmt::format("--loss-scale-init must be a power of two of at least 1 (scaling by it is then exact), got {}", o.init_scale));
  }
  if (!(o.growth_factor > 1.0f) || !std::isfinite(o.growth_factor)) return Error::BadInput(fmt::format("loss scaler growth factor must be above 1, got {}", o.growth_factor));
  if (!(o.backoff_factor > 0.0f && o.backoff_factor < 1.0f)) return Error::BadInput(fmt::format("loss scaler backoff factor must be in (0, 1), got {}", o.backoff_factor));
  if (o.growth_interval < 1 || o.growth_interval > 1'000'000'000) {
    return Error::BadInput(fmt::format("--loss-scale-interval must be between 1 and 1e9 steps, got {}", o.growth_interval));
  }
  return {};
}

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options), scale_(options.init_scale) {}

bool LossScaler::Update(bool found_inf) {
  const int64_t step = steps_++;
  if (!enabled()) return true;
  if (found_inf) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
    skipped_.push_back(step);
    return false;
  }
  if (++growth_tracker_ == options_.growth_interval) {
    const float grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  return true;
}

Result<bool> LossScaler::CheckAndUpdate(const std::function<Result<bool>()>& found_non_finite) {
  bool found_inf = false;
  if (enabled()) {
    auto found = found_non_finite();
    if (!found.ok()) return found.error();
    found_inf = found.value();
  }
  return Update(found_inf);  // GradScaler.step skips, GradScaler.update rescales
}

}  // namespace fsdp::runtime
