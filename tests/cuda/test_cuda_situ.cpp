// CUDA SiTU (Kimi K3's gated activation) against the CPU reference (F64), in F32 and BF16, at
// widths that take the vector path (multiples of 8) and ones that do not, with and without the
// up branch's cap; the backward also in place (dgate_up over gate_up).
#include <string>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

TEST_CASE("cuda situ forward and backward match the CPU") {
  uint64_t seed = 5500;
  for (double linear_beta : {25.0, 0.0})
    for (int64_t width : {int64_t{13}, int64_t{64}})
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        const int64_t rows = 21;
        // Magnitudes up to 30: gates past beta 4 and up values past linear_beta 25.
        const Operand gate_up = random_operand({rows, 2 * width}, dtype, ++seed, 0.05, 30.0);
        Operand h = output_operand({rows, width}, dtype);
        gpu().situ_forward({h.dev, gate_up.dev, 4.0, linear_beta});
        cpu().situ_forward({h.host, gate_up.host, 4.0, linear_beta});
        const std::string tag = std::string(dtype_name(dtype)) + " width " + std::to_string(width) +
                                " linear_beta " + std::to_string(linear_beta);
        CUDA_TEST_EXPECT_CLOSE(h.dev, h.host.view(), tolerance_for(dtype), "situ forward " + tag);

        const Operand dh = random_operand({rows, width}, dtype, ++seed);
        Operand dgate_up = output_operand({rows, 2 * width}, dtype);
        gpu().situ_backward({dgate_up.dev, dh.dev, gate_up.dev, 4.0, linear_beta});
        cpu().situ_backward({dgate_up.host, dh.host, gate_up.host, 4.0, linear_beta});
        CUDA_TEST_EXPECT_CLOSE(dgate_up.dev, dgate_up.host.view(), tolerance_for(dtype), "situ backward " + tag);

        // In place: dgate_up over gate_up (a device copy of it).
        const Tensor inplace = upload(gate_up.host.view(), dtype);
        gpu().situ_backward({inplace, dh.dev, inplace, 4.0, linear_beta});
        CUDA_TEST_EXPECT_CLOSE(inplace, dgate_up.host.view(), tolerance_for(dtype), "situ backward in place " + tag);
      }
}

}  // namespace
}  // namespace moetrain::cuda_test
