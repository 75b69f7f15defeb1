// Cross-entropy over a chunk of rows, CPU reference (contract: kernels/ops.h, CrossEntropyArgs).
//   loss[r] = lse(logits[r]) - logits[r, label],  lse computed after subtracting the row max
//   dlogits[r] = (softmax(logits[r]) - onehot(label)) * grad_scale
// Rows with label < 0: loss 0, gradient 0. dlogits may alias logits; an empty dlogits view
// (no data) computes the loss only.
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace moetrain::kernels::cpu {

template <typename T>
void cross_entropy(const CrossEntropyArgs& args) {
  const int64_t vocab = args.logits.size(-1);
  const int64_t rows = args.labels.numel();
  const T* logits = args.logits.ptr<T>();
  const int32_t* labels = args.labels.ptr<int32_t>();
  T* loss = args.loss.ptr<T>();
  T* dlogits = args.dlogits.data != nullptr ? args.dlogits.ptr<T>() : nullptr;
  const T grad_scale = static_cast<T>(args.grad_scale);
  for (int64_t r = 0; r < rows; ++r) {
    const T* lr = logits + r * vocab;
    T* dr = dlogits ? dlogits + r * vocab : nullptr;
    const int32_t label = labels[r];
    MOETRAIN_ASSERT(label < vocab, "cross_entropy: label " + std::to_string(label) + " of row " +
                                       std::to_string(r) + " >= vocab " + std::to_string(vocab));
    if (label < 0) {
      loss[r] = 0;
      if (dr) std::fill(dr, dr + vocab, T(0));
      continue;
    }
    T max_logit = lr[0];
    for (int64_t j = 1; j < vocab; ++j) max_logit = std::max(max_logit, lr[j]);
    T sum_exp = 0;
    for (int64_t j = 0; j < vocab; ++j) sum_exp += std::exp(lr[j] - max_logit);
    const T lse = max_logit + std::log(sum_exp);
    loss[r] = lse - lr[label];  // before dlogits (which may alias logits) is written
    if (dr) {
      for (int64_t j = 0; j < vocab; ++j) dr[j] = std::exp(lr[j] - lse) * grad_scale;
      dr[label] -= grad_scale;
    }
  }
}

MOETRAIN_CPU_INSTANTIATE(cross_entropy, const CrossEntropyArgs&)

}  // namespace moetrain::kernels::cpu
