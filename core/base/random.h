// Deterministic randomness: splitmix64 and our own sampling, so data order, synthetic data and
// random initialisation are the same on every platform and standard library (std::
// distributions are not), and a run resumed anywhere reproduces what an uninterrupted run saw.
#pragma once

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "core/base/host_device.h"

namespace moetrain {

MOETRAIN_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random initialisation: the value of weight element `counter` (seed + its index), uniform in
// [-half_width, half_width). A pure function of the counter, so any slice of a tensor (a rank's
// shard or experts) holds what the whole tensor would, and the GPU can make the same values.
MOETRAIN_HOST_DEVICE inline double uniform_weight(uint64_t counter, double half_width) {
  const double unit = static_cast<double>(mix64(counter + 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53;  // [0, 1)
  return (2.0 * unit - 1.0) * half_width;
}

// splitmix64 (Steele, Lea, Flood 2014): a tiny generator with a fully specified output.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() { return mix64(state_ += 0x9e3779b97f4a7c15ull); }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  // Uniform in [0, n) by rejection, so no residue class is favoured.
  uint64_t below(uint64_t n) {
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % n;
    uint64_t x;
    do x = next(); while (x >= limit);
    return x % n;
  }

 private:
  uint64_t state_;
};

// A seed for one purpose from a base seed and a few integers (dataset, epoch, stream).
inline uint64_t derive_seed(uint64_t base, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  return mix64(mix64(mix64(mix64(base) ^ a) ^ b) ^ c);
}

// A uniformly random permutation of [0, n) (Fisher-Yates).
inline std::vector<int64_t> random_permutation(int64_t n, uint64_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  SplitMix64 rng(seed);
  for (int64_t i = n - 1; i > 0; --i) {
    std::swap(order[static_cast<size_t>(i)], order[rng.below(static_cast<uint64_t>(i) + 1)]);
  }
  return order;
}

}  // namespace moetrain
