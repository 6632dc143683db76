// Dynamic loss scaling, as PyTorch's GradScaler / FSDP's ShardedGradScaler does it for fp16
// training: the loss (so every gradient) is multiplied by a power of two, the gradients are
// unscaled before the optimizer step, and a step whose gradients hold an inf or NaN on any rank is
// skipped and halves the scale; after `growth_interval` clean steps in a row the scale doubles.
// Defaults from torch/distributed/fsdp/sharded_grad_scaler.py (ShardedGradScaler.__init__):
// init_scale 2^16, backoff_factor 0.5, growth_factor 2, growth_interval 2000. The update follows
// _amp_update_scale_cpu_ there and aten/src/ATen/native/cuda/AmpKernels.cu (_amp_update_scale_),
// which keeps the old scale when growing it would overflow float.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "core/fsdp_config.h"
#include "core/status.h"

namespace fsdp::runtime {

enum class LossScaling { kNone, kDynamic };

struct LossScalerOptions {
  LossScaling mode = LossScaling::kNone;
  float init_scale = 65536.0f;     ///< 2^16
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int64_t growth_interval = 2000;  ///< clean steps in a row before the scale grows
};

/// "auto" (dynamic when param_dtype is fp16, as a fp16 training loop needs; none otherwise),
/// "none" or "dynamic"; BadInput naming the text otherwise.
Result<LossScaling> ParseLossScaling(std::string_view text, DType param_dtype);
std::string_view LossScalingName(LossScaling mode);  ///< "none" | "dynamic"

/// BadInput when an option is impossible: init_scale not a positive finite power of two (the
/// engines rely on scaling being exact), growth_factor <= 1, backoff_factor outside (0, 1),
/// growth_interval < 1.
Status CheckLossScalerOptions(const LossScalerOptions& options);

class LossScaler {
 public:
  explicit LossScaler(const LossScalerOptions& options);
  LossScaling mode() const { return options_.mode; }
  bool enabled() const { return options_.mode == LossScaling::kDynamic; }
  /// The factor the loss's gradient is multiplied by this step (1 when disabled).
  float scale() const { return enabled() ? scale_ : 1.0f; }
  /// Records the step's outcome (found_inf: some rank's unscaled gradients hold an inf or NaN) and
  /// returns whether the optimizer may step. Disabled: always true and nothing changes.
  bool Update(bool found_inf);
  /// The optimizer step's decision: when enabled, asks `found_non_finite` (every rank's inf/NaN
  /// check, a collective) and updates; returns whether the optimizer may step, or its error.
  Result<bool> CheckAndUpdate(const std::function<Result<bool>()>& found_non_finite);
  /// Steps recorded so far (Update calls), and those skipped, 0-based, in the order they happened.
  int64_t steps() const { return steps_; }
  const std::vector<int64_t>& skipped_steps() const { return skipped_; }

 private:
  LossScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
  int64_t steps_ = 0;
  std::vector<int64_t> skipped_;
};

}  // namespace fsdp::runtime
