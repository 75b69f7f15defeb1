// CUDA Block Attention Residuals mix against the CPU reference (F64): F32 and BF16 values, a
// dim that takes the 8-wide path and one that does not, 1 to 9 values (K3's most: 8 summaries +
// the partial sum), and the backward adding into F32 and BF16 gradient buffers that already hold
// values (the model accumulates block summaries' gradients across layers).
#include <string>
#include <vector>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

// Each operand's tensor on one side.
std::vector<TensorView> views(BackendSide on, const std::vector<Operand>& ops) {
  std::vector<TensorView> out;
  for (const Operand& op : ops) out.push_back(on(op));
  return out;
}

TEST_CASE("cuda attn_res forward and backward match the CPU") {
  uint64_t seed = 7100;
  for (int64_t dim : {int64_t{40}, int64_t{1000}, int64_t{7168}})
    for (int m : {1, 3, 9})
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        const int64_t rows = dim == 7168 ? 5 : 37;
        const std::string tag = std::string(dtype_name(dtype)) + " dim " + std::to_string(dim) + " values " +
                                std::to_string(m);
        std::vector<Operand> values;
        for (int i = 0; i < m; ++i) values.push_back(random_operand({rows, dim}, dtype, ++seed, 0.05, 3.0));
        const Operand norm_weight = random_operand({dim}, dtype, ++seed, 0.5, 1.5);
        const Operand query = random_operand({dim}, dtype, ++seed, 0.01, 0.2);
        Operand out = output_operand({rows, dim}, dtype);
        Operand probs = output_operand({rows, m}, DType::kF32);
        const auto forward_args = [&](BackendSide on) {
          return kernels::AttnResArgs{on(out), on(probs), views(on, values), on(norm_weight), on(query), 1e-5};
        };
        gpu().attn_res_forward(forward_args(kGpu));
        cpu().attn_res_forward(forward_args(kCpu));
        CUDA_TEST_EXPECT_CLOSE(probs.dev, probs.host.view(), tolerance_for(DType::kF32), "attn_res probs " + tag);
        CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tolerance_for(dtype), "attn_res forward " + tag);

        // Gradients into buffers that already hold values: F32 for the summaries, dtype for the
        // last (the partial sum's, in the activation dtype as the model passes it).
        const Operand dout = random_operand({rows, dim}, dtype, ++seed);
        std::vector<Operand> grads;
        for (int i = 0; i < m; ++i) grads.push_back(random_operand({rows, dim}, i + 1 < m ? DType::kF32 : dtype, ++seed));
        const auto backward_args = [&](BackendSide on) {
          return kernels::AttnResBackwardArgs{views(on, grads), on(dout),  views(on, values), on(norm_weight),
                                              on(query),        on(probs), 1e-5};
        };
        gpu().attn_res_backward(backward_args(kGpu));
        cpu().attn_res_backward(backward_args(kCpu));
        for (int i = 0; i < m; ++i) {
          const DType grad_dtype = i + 1 < m ? DType::kF32 : dtype;
          // The F32 buffers add a BF16-input gradient: the inputs' rounding dominates, as for dtype.
          CUDA_TEST_EXPECT_CLOSE(grads[i].dev, grads[i].host.view(), tolerance_for(dtype == DType::kBF16 ? dtype : grad_dtype),
                                 "attn_res backward value " + std::to_string(i) + " " + tag);
        }
      }
}

}  // namespace
}  // namespace moetrain::cuda_test
