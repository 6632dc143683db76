#include "runtime/loss_scaler.h"

#include <cmath>
#include <limits>

#include <doctest/doctest.h>

namespace fsdp::runtime {
namespace {

LossScalerOptions Dynamic(float init, int64_t interval) {
  LossScalerOptions o;
  o.mode = LossScaling::kDynamic;
  o.init_scale = init;
  o.growth_interval = interval;
  return o;
}

TEST_CASE("auto loss scaling is dynamic exactly for fp16 parameters") {
  CHECK(ParseLossScaling("auto", DType::kFp16).value() == LossScaling::kDynamic);
  CHECK(ParseLossScaling("auto", DType::kBf16).value() == LossScaling::kNone);
  CHECK(ParseLossScaling("auto", DType::kFp32).value() == LossScaling::kNone);
  CHECK(ParseLossScaling("dynamic", DType::kBf16).value() == LossScaling::kDynamic);
  CHECK(ParseLossScaling("none", DType::kFp16).value() == LossScaling::kNone);
  auto bad = ParseLossScaling("static", DType::kFp16);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().message.find("'static'") != std::string::npos);
}

TEST_CASE("loss scaler options are checked") {
  CHECK(CheckLossScalerOptions(Dynamic(65536.0f, 2000)).ok());
  CHECK(CheckLossScalerOptions(Dynamic(1.0f, 1)).ok());
  CHECK_FALSE(CheckLossScalerOptions(Dynamic(1000.0f, 2000)).ok());  // not a power of two
  CHECK_FALSE(CheckLossScalerOptions(Dynamic(0.5f, 2000)).ok());
  CHECK_FALSE(CheckLossScalerOptions(Dynamic(std::numeric_limits<float>::infinity(), 2000)).ok());
  CHECK_FALSE(CheckLossScalerOptions(Dynamic(std::nanf(""), 2000)).ok());
  CHECK_FALSE(CheckLossScalerOptions(Dynamic(65536.0f, 0)).ok());
  LossScalerOptions o = Dynamic(65536.0f, 10);
  o.backoff_factor = 1.0f;
  CHECK_FALSE(CheckLossScalerOptions(o).ok());
  o.backoff_factor = 0.5f;
  o.growth_factor = 1.0f;
  CHECK_FALSE(CheckLossScalerOptions(o).ok());
}

TEST_CASE("a disabled scaler scales by 1 and never skips") {
  LossScaler s(LossScalerOptions{});
  CHECK(s.scale() == 1.0f);
  CHECK(s.Update(true));
  CHECK(s.scale() == 1.0f);
  CHECK(s.skipped_steps().empty());
}

TEST_CASE("dynamic scaling halves on inf, doubles after growth_interval clean steps, as GradScaler") {
  LossScaler s(Dynamic(65536.0f, 3));
  CHECK(s.scale() == 65536.0f);
  CHECK_FALSE(s.Update(true));   // step 0: skipped, 32768
  CHECK_FALSE(s.Update(true));   // step 1: skipped, 16384
  CHECK(s.scale() == 16384.0f);
  CHECK(s.Update(false));        // step 2: tracker 1
  CHECK(s.Update(false));        // step 3: tracker 2
  CHECK(s.scale() == 16384.0f);
  CHECK(s.Update(false));        // step 4: tracker 3 == interval: 32768, tracker 0
  CHECK(s.scale() == 32768.0f);
  CHECK(s.Update(false));        // step 5: tracker 1
  CHECK_FALSE(s.Update(true));   // step 6: skipped, tracker reset, 16384
  CHECK(s.Update(false));
  CHECK(s.Update(false));
  CHECK(s.scale() == 16384.0f);  // the inf restarted the count
  CHECK(s.Update(false));
  CHECK(s.scale() == 32768.0f);
  CHECK(s.skipped_steps() == std::vector<int64_t>{0, 1, 6});
}

TEST_CASE("CheckAndUpdate asks the ranks only when enabled, and passes their error on") {
  int asked = 0;
  auto clean = [&]() -> Result<bool> { ++asked; return false; };
  LossScaler off{LossScalerOptions{}};
  CHECK(off.CheckAndUpdate(clean).value());
  CHECK(asked == 0);  // a disabled scaler runs no collective
  LossScaler on(Dynamic(1024.0f, 2000));
  CHECK(on.CheckAndUpdate(clean).value());
  CHECK_FALSE(on.CheckAndUpdate([&]() -> Result<bool> { ++asked; return true; }).value());
  CHECK(asked == 2);
  CHECK(on.scale() == 512.0f);
  auto failed = on.CheckAndUpdate([]() -> Result<bool> { return Error::RunFailed("a peer died"); });
  REQUIRE_FALSE(failed.ok());
  CHECK(failed.error().message == "a peer died");
  CHECK(on.scale() == 512.0f);  // nothing recorded
}

TEST_CASE("the scale does not grow past float's range") {
  LossScaler s(Dynamic(std::ldexp(1.0f, 127), 1));
  CHECK(s.Update(false));
  CHECK(s.scale() == std::ldexp(1.0f, 127));
}

}  // namespace
}  // namespace fsdp::runtime
