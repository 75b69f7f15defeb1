// The logistic function of the CPU reference kernels (gates, SwiGLU, SiTU, KDA's beta and gates).
#pragma once

#include <cmath>

namespace moetrain::kernels::cpu {

// exp(-x) overflows to inf for very negative x, which correctly gives 0.
template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

}  // namespace moetrain::kernels::cpu
