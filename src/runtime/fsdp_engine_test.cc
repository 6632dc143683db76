#include "runtime/fsdp_engine.h"

#include <cmath>
#include <limits>

#include <doctest/doctest.h>

namespace fsdp::runtime {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Expected: torch 2.11's torch.optim.AdamW on the CPU (_single_tensor_adamw), for dtype bf16 and fp32:
//   p = torch.tensor([0.1234, -0.5, 2.0, 1e-3, -7.25], dtype=dtype, requires_grad=True)
//   opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
//   for g in grads: p.grad = torch.tensor(g, dtype=dtype); opt.step()
// then p, state["exp_avg"] and state["exp_avg_sq"] printed as floats. In bf16, 2.0 and -7.25 do
// not move: their updates are below half their spacing.
TEST_CASE("AdamWUpdate is torch.optim.AdamW's step, op by op, in bf16 and in fp32") {
  TrainOptions o;
  o.lr = 1e-2;
  const float start[5] = {0.1234f, -0.5f, 2.0f, 1e-3f, -7.25f};
  const float grads[3][5] = {{0.5f, -0.25f, 1e-4f, 3.0f, -0.0625f}, {0.3f, 0.3f, -2.0f, 1e-3f, 0.5f}, {-1.0f, 0.125f, 0.7f, -0.2f, 4.0f}};
  struct Expected {
    DType dtype;
    double p[5], m[5], v[5];
  };
  const Expected expected[] = {
      {DType::kBf16,
       {0.10546875, -0.49609375, 2.0, -0.020751953125, -7.25},
       {-0.0322265625, 0.019287109375, -0.1103515625, 0.224609375, 0.439453125},
       {0.0654296875, 0.0079345703125, 0.21484375, 0.40625, 0.8125}},
      {DType::kFp32,
       {0.10550278425216675, -0.4943007528781891, 2.00006103515625, -0.02065305784344673, -7.251104354858398},
       {-0.0325000025331974, 0.01925000175833702, -0.1099919006228447, 0.22308999300003052, 0.4399375021457672},
       {0.06555625051259995, 0.007876562885940075, 0.21449999511241913, 0.4081250727176666, 0.8120512962341309}}};
  for (const Expected& e : expected) {
    CAPTURE(DTypeName(e.dtype));
    for (int i = 0; i < 5; ++i) {
      float p = RoundTo(start[i], e.dtype), m = 0, v = 0;
      for (int step = 0; step < 3; ++step) AdamWUpdate(AdamWStepScalars(o, step), e.dtype, RoundTo(grads[step][i], e.dtype), p, m, v);
      CAPTURE(i);
      CHECK(p == static_cast<float>(e.p[i]));
      CHECK(m == static_cast<float>(e.m[i]));
      CHECK(v == static_cast<float>(e.v[i]));
    }
  }
}

TEST_CASE("MasterBuffer: bf16 elements in 2 bytes each, rounded when set") {
  MasterBuffer b(DType::kBf16, 3, 1.0f);
  CHECK(b.Bytes() == 6);
  CHECK(b.Get(2) == 1.0f);
  b.Set(0, 1.00390625f);  // 1 + 2^-8: a tie between 1 and 1 + 2^-7, to even
  CHECK(b.Get(0) == 1.0f);
  b.Set(1, 0.1234f);
  CHECK(b.Get(1) == RoundTo(0.1234f, DType::kBf16));
  CHECK(MasterBuffer(DType::kFp32, 3).Bytes() == 12);
  b.Release();
  CHECK(b.empty());
}

// LoRA's base frozen in bf16 beside fp32 adapters: 3 frozen elements (2 bytes), then 2 trained (4 bytes)
TEST_CASE("ShardBuffer: the frozen group in its dtype, then the trained group in the master dtype") {
  ShardBuffer b(DType::kBf16, 3, DType::kFp32, 2);
  CHECK(b.size() == 5);
  CHECK(b.Bytes() == 3 * 2 + 2 * 4);
  b.Set(2, 0.1234f);  // the frozen group's last element: rounded to bf16
  b.Set(3, 0.1234f);  // the trained group's first: kept in fp32
  CHECK(b.Get(2) == RoundTo(0.1234f, DType::kBf16));
  CHECK(b.Get(2) != 0.1234f);
  CHECK(b.Get(3) == 0.1234f);
  CHECK(ShardBuffer(DType::kFp32, 0, DType::kBf16, 4).Bytes() == 8);
}

TEST_CASE("RoundTo fp16: 11 significant bits, ties to even, 65504 the largest, subnormals in steps of 2^-24") {
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -11), DType::kFp16) == 1.0f);                           // tie: to even
  CHECK(RoundTo(1.0f + 3 * std::ldexp(1.0f, -11), DType::kFp16) == 1.0f + std::ldexp(1.0f, -9));  // tie: to even, up
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -10), DType::kFp16) == 1.0f + std::ldexp(1.0f, -10));     // representable
  CHECK(RoundTo(65504.0f, DType::kFp16) == 65504.0f);
  CHECK(RoundTo(65519.0f, DType::kFp16) == 65504.0f);
  CHECK(RoundTo(65520.0f, DType::kFp16) == kInf);  // halfway to 65536: rounds to even, which is beyond the range
  CHECK(RoundTo(-1e6f, DType::kFp16) == -kInf);
  CHECK(RoundTo(std::ldexp(1.0f, -24), DType::kFp16) == std::ldexp(1.0f, -24));   // the smallest subnormal
  CHECK(RoundTo(std::ldexp(1.0f, -26), DType::kFp16) == 0.0f);                    // underflows
  CHECK(RoundTo(3 * std::ldexp(1.0f, -25), DType::kFp16) == std::ldexp(1.0f, -23));  // 1.5 quanta: tie to even (2)
  CHECK(RoundTo(1.3f * std::ldexp(1.0f, -20), DType::kFp16) == 21 * std::ldexp(1.0f, -24));  // 20.8 quanta of 2^-24
  CHECK(std::isnan(RoundTo(std::nanf(""), DType::kFp16)));
  CHECK(RoundTo(kInf, DType::kFp16) == kInf);
}

TEST_CASE("RoundTo bf16: 8 significant bits, ties to even, overflow to inf, NaN stays NaN") {
  CHECK(RoundTo(1.0f + std::ldexp(1.0f, -8), DType::kBf16) == 1.0f);
  CHECK(RoundTo(1.0f + 3 * std::ldexp(1.0f, -8), DType::kBf16) == 1.0f + std::ldexp(1.0f, -6));
  CHECK(RoundTo(std::numeric_limits<float>::max(), DType::kBf16) == kInf);
  CHECK(std::isnan(RoundTo(std::nanf(""), DType::kBf16)));
  CHECK(RoundTo(0.1f, DType::kFp32) == 0.1f);
}

}  // namespace
}  // namespace fsdp::runtime
