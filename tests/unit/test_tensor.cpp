#include <cmath>
#include <cstring>
#include <limits>

#include "catch.h"
#include "core/base/bf16.h"
#include "core/base/tensor.h"

using namespace moetrain;

TEST_CASE("bf16 rounds to nearest even", "[tensor]") {
  CHECK(float_to_bf16(1.0f) == 0x3f80);
  // 1 + 2^-8 is exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): rounds up.
  CHECK(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  // Just above halfway rounds up.
  CHECK(float_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) == 0x3f81);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(bf16_to_float(float_to_bf16(std::numeric_limits<float>::infinity()))));
  CHECK(bf16_to_float(float_to_bf16(-2.5f)) == -2.5f);
}

TEST_CASE("f16 conversion round-trips representable values", "[tensor]") {
  for (float f : {0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f, 0.333251953125f}) {
    CHECK(f16_to_float(float_to_f16(f)) == f);
  }
  CHECK(float_to_f16(1e6f) == 0x7c00);  // overflow to inf
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even.
  CHECK(float_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
}

TEST_CASE("tensor owns and slices its memory", "[tensor]") {
  Tensor t({4, 3}, DType::kF32);
  REQUIRE(t.numel() == 12);
  REQUIRE(t.nbytes() == 48);
  for (int i = 0; i < 12; ++i) t.ptr<float>()[i] = static_cast<float>(i);
  TensorView rows = t.view().slice_rows(1, 3);
  CHECK(rows.shape == Shape({2, 3}));
  CHECK(static_cast<float*>(rows.data)[0] == 3.0f);
  CHECK_THROWS_AS(t.ptr<double>(), Error);
  CHECK_THROWS_AS(t.view().reshaped({5, 3}), Error);
  Tensor moved = std::move(t);
  CHECK(moved.numel() == 12);
  CHECK_FALSE(t.defined());
}
