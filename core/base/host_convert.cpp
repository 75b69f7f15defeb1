#include "core/base/host_convert.h"

#include <cstring>
#include <string>

#include "core/base/bf16.h"

namespace moetrain {
namespace {

double load_floating(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kF64: return static_cast<const double*>(t.data)[i];
    case DType::kF32: return static_cast<const float*>(t.data)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[i]);
    case DType::kF16: return f16_to_float(static_cast<const uint16_t*>(t.data)[i]);
    default: break;
  }
  MOETRAIN_ASSERT(false, std::string("not a floating dtype: ") + dtype_name(t.dtype));
  return 0;
}

void store_floating(const TensorView& t, int64_t i, double v) {
  switch (t.dtype) {
    case DType::kF64: static_cast<double*>(t.data)[i] = v; return;
    case DType::kF32: static_cast<float*>(t.data)[i] = static_cast<float>(v); return;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[i] = float_to_bf16(static_cast<float>(v)); return;
    case DType::kF16: static_cast<uint16_t*>(t.data)[i] = float_to_f16(static_cast<float>(v)); return;
    default: break;
  }
  MOETRAIN_ASSERT(false, std::string("not a floating dtype: ") + dtype_name(t.dtype));
}

int64_t load_integer(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kI64: return static_cast<const int64_t*>(t.data)[i];
    case DType::kI32: return static_cast<const int32_t*>(t.data)[i];
    case DType::kU8: return static_cast<const uint8_t*>(t.data)[i];
    case DType::kBool: return static_cast<const uint8_t*>(t.data)[i] != 0;
    default: break;
  }
  MOETRAIN_ASSERT(false, std::string("not an integer dtype: ") + dtype_name(t.dtype));
  return 0;
}

void store_integer(const TensorView& t, int64_t i, int64_t v) {
  auto fits = [&](int64_t lo, int64_t hi) {
    MOETRAIN_CHECK(v >= lo && v <= hi, ExitCode::kBadData,
                   "value " + std::to_string(v) + " at element " + std::to_string(i) + " does not fit " +
                       dtype_name(t.dtype));
  };
  switch (t.dtype) {
    case DType::kI64: static_cast<int64_t*>(t.data)[i] = v; return;
    case DType::kI32: fits(INT32_MIN, INT32_MAX); static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(v); return;
    case DType::kU8: fits(0, 255); static_cast<uint8_t*>(t.data)[i] = static_cast<uint8_t>(v); return;
    case DType::kBool: static_cast<uint8_t*>(t.data)[i] = v != 0; return;
    default: break;
  }
  MOETRAIN_ASSERT(false, std::string("not an integer dtype: ") + dtype_name(t.dtype));
}

}  // namespace

void convert_host(const TensorView& dst, const TensorView& src) {
  MOETRAIN_ASSERT(dst.device == Device::kCPU && src.device == Device::kCPU, "convert_host needs host tensors");
  MOETRAIN_ASSERT(dst.numel() == src.numel(),
                  "convert_host: " + src.shape.str() + " -> " + dst.shape.str() + " element counts differ");
  int64_t n = src.numel();
  if (dst.dtype == src.dtype) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
  bool dst_float = is_floating(dst.dtype);
  MOETRAIN_ASSERT(dst_float == is_floating(src.dtype), std::string("convert_host: ") + dtype_name(src.dtype) +
                                                           " -> " + dtype_name(dst.dtype) + " is not supported");
  if (dst_float) {
    for (int64_t i = 0; i < n; ++i) store_floating(dst, i, load_floating(src, i));
  } else {
    for (int64_t i = 0; i < n; ++i) store_integer(dst, i, load_integer(src, i));
  }
}

}  // namespace moetrain
