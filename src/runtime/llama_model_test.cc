#include "runtime/llama_model.h"

#include <doctest/doctest.h>

#include <random>

namespace fsdp::runtime {
namespace {

TEST_CASE("a whole decoder block: backward against finite differences") {
  LlamaDims d{11, 8, 12, 4, 2, 2, 1};
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0.0f, 0.3f);
  std::vector<float> params(static_cast<size_t>(d.BlockNumel()));
  for (auto& v : params) v = n(rng);
  const auto o = d.Offsets();
  for (int64_t i = 0; i < d.hidden; ++i) params[o.in_norm + i] = params[o.post_norm + i] = 1.0f + 0.1f * n(rng);
  const int64_t batch = 2, seq = 3;
  Mat x(batch * seq, d.hidden), r(batch * seq, d.hidden);
  for (Eigen::Index i = 0; i < x.size(); ++i) { x.data()[i] = n(rng); r.data()[i] = n(rng); }
  auto loss = [&] { return static_cast<double>(BlockForward(d, params.data(), x, batch, seq, nullptr).cwiseProduct(r).sum()); };
  BlockCache cache;
  BlockForward(d, params.data(), x, batch, seq, &cache);
  std::vector<float> grads(params.size(), 0.0f);
  Mat dx = BlockBackward(d, params.data(), grads.data(), r, cache, batch, seq);
  const float eps = 1e-2f;
  std::uniform_int_distribution<size_t> pick_p(0, params.size() - 1);
  for (int k = 0; k < 40; ++k) {
    const size_t i = pick_p(rng);
    const float saved = params[i];
    params[i] = saved + eps;
    const double up = loss();
    params[i] = saved - eps;
    const double down = loss();
    params[i] = saved;
    const double fd = (up - down) / (2 * eps);
    CAPTURE(i);
    CHECK(std::abs(grads[i] - fd) <= 2e-2 * std::abs(fd) + 2e-3);
  }
  std::uniform_int_distribution<Eigen::Index> pick_x(0, x.size() - 1);
  for (int k = 0; k < 20; ++k) {
    const Eigen::Index i = pick_x(rng);
    const float saved = x.data()[i];
    x.data()[i] = saved + eps;
    const double up = loss();
    x.data()[i] = saved - eps;
    const double down = loss();
    x.data()[i] = saved;
    const double fd = (up - down) / (2 * eps);
    CHECK(std::abs(dx.data()[i] - fd) <= 2e-2 * std::abs(fd) + 2e-3);
  }
}

TEST_CASE("the flat block layout matches the checkpoint inventory") {
  auto m = LoadModel("tiny-llama");
  REQUIRE(m.ok());
  auto d = DimsOf(m.value());
  REQUIRE(d.ok());
  CHECK(d.value().BlockNumel() == m.value().BlockParams(0));
  auto gpt2 = LoadModel("gpt2");
  CHECK_FALSE(DimsOf(gpt2.value()).ok());
}

}  // namespace
}  // namespace fsdp::runtime
