// Token embedding lookup and its backward, CPU reference (contract: kernels/ops.h).
#include "kernels/cpu/reference.h"

#include <algorithm>
#include <string>

namespace moetrain::kernels::cpu {
namespace {

void check_token_ids(const int32_t* ids, int64_t tokens, int64_t rows) {
  for (int64_t t = 0; t < tokens; ++t) {
    MOETRAIN_CHECK(ids[t] >= 0 && ids[t] < rows, ExitCode::kBadData,
                   "token id " + std::to_string(ids[t]) + " at token position " + std::to_string(t) +
                       " is outside the embedding table's " + std::to_string(rows) +
                       " rows: the data was tokenised for another vocabulary, or vocab_size is too small");
  }
}

}  // namespace

// out [tokens, dim] = table [rows, dim] at ids (int32 [tokens]). An id outside [0, rows) is bad
// training data: Error(kBadData) naming the token position and the id.
template <typename T>
void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) {
  const int64_t tokens = ids.numel(), rows = table.size(0), dim = table.size(1);
  const int32_t* id = ids.ptr<int32_t>();
  check_token_ids(id, tokens, rows);
  const T* tab = table.ptr<T>();
  T* o = out.ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) std::copy(tab + id[t] * dim, tab + (id[t] + 1) * dim, o + t * dim);
}

// dtable[ids[t], :] += dout[t, :] in token order: it accumulates (several tokens share a row).
template <typename T>
void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) {
  const int64_t tokens = ids.numel(), rows = dtable.size(0), dim = dtable.size(1);
  const int32_t* id = ids.ptr<int32_t>();
  check_token_ids(id, tokens, rows);
  T* dtab = dtable.ptr<T>();
  const T* dy = dout.ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    T* row = dtab + id[t] * dim;
    const T* g = dy + t * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += g[d];
  }
}

MOETRAIN_CPU_INSTANTIATE(embedding_forward, const TensorView&, const TensorView&, const TensorView&)
MOETRAIN_CPU_INSTANTIATE(embedding_backward, const TensorView&, const TensorView&, const TensorView&)

}  // namespace moetrain::kernels::cpu
