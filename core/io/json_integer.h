// Integers from untrusted JSON (headers, indexes, manifests, config.json, adapter_config.json).
//
// nlohmann's get<int64_t>() converts whatever number is there with a plain cast: 1e300 or 3e9 read
// as an int is undefined behaviour, a negative number read as unsigned wraps, and `true` reads
// as 1 (all found by tests/fuzz). json_integer takes an integer only when the value is a JSON
// number with an integral value that Int holds exactly: 4096 and 4096.0 are 4096; 1.5, 1e300,
// -1 (for an unsigned Int), true and "4096" are not integers.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace moetrain {

template <typename Int, typename Json>
bool json_integer(const Json& value, Int* out) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>);
  using Limits = std::numeric_limits<Int>;
  if (value.is_number_unsigned()) {
    const uint64_t u = value.template get<uint64_t>();
    if (u > static_cast<uint64_t>(Limits::max())) return false;
    *out = static_cast<Int>(u);
    return true;
  }
  if (value.is_number_integer()) {
    const int64_t i = value.template get<int64_t>();
    if constexpr (std::is_signed_v<Int>) {
      if (i < static_cast<int64_t>(Limits::min()) || i > static_cast<int64_t>(Limits::max())) return false;
    } else {
      if (i < 0 || static_cast<uint64_t>(i) > static_cast<uint64_t>(Limits::max())) return false;
    }
    *out = static_cast<Int>(i);
    return true;
  }
  if (value.is_number_float()) {
    const double d = value.template get<double>();
    // [min, 2^digits) is exactly Int's range; both bounds are powers of two (or 0), exact in double.
    if (!std::isfinite(d) || d != std::trunc(d) || d < static_cast<double>(Limits::min()) ||
        d >= std::ldexp(1.0, Limits::digits)) {
      return false;
    }
    *out = static_cast<Int>(d);
    return true;
  }
  return false;
}

}  // namespace moetrain
