#include "core/base/dtype.h"

namespace moetrain {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kU8:
    case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF64: return "F64";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* dtype) {
  static constexpr DType kAll[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16,
                                   DType::kI32, DType::kI64, DType::kU8,   DType::kBool};
  for (DType d : kAll) {
    if (name == dtype_name(d)) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

bool is_floating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBF16 || dtype == DType::kF16;
}

const char* device_name(Device device) { return device == Device::kCPU ? "cpu" : "cuda"; }

}  // namespace moetrain
