// Element types and devices of tensors, with their names as safetensors spells them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moetrain {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kI32, kI64, kU8, kBool };

enum class Device : uint8_t { kCPU, kCUDA };

size_t dtype_size(DType dtype);
// "F32", "F64", "BF16", "F16", "I32", "I64", "U8", "BOOL" (the safetensors spelling).
const char* dtype_name(DType dtype);
// Parses the safetensors spelling; false for anything else.
bool parse_dtype(std::string_view name, DType* dtype);
bool is_floating(DType dtype);
const char* device_name(Device device);

// The DType of a C++ element type, for typed access to tensor data.
template <typename T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::kF32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kF64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kI64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::kU8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::kBool; };

}  // namespace moetrain
