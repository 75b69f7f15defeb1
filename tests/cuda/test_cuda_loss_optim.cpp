// CUDA cross-entropy and AdamW against the CPU reference (F64).
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

TEST_CASE("cuda cross_entropy matches the CPU: ignored labels, no gradient, aliasing") {
  uint64_t seed = 6000;
  for (int64_t vocab : {int64_t{37}, int64_t{128}, int64_t{5003}})
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const int64_t rows = 9;
      std::vector<int32_t> label_values;
      for (int64_t r = 0; r < rows; ++r)
        label_values.push_back(r % 4 == 1 ? -1 : static_cast<int32_t>((r * 31 + 5) % vocab));
      label_values.back() = static_cast<int32_t>(vocab - 1);
      const Operand labels = int_operand(label_values, {rows});
      // Logits of a few units: a realistic spread for softmax.
      const Operand logits = random_operand({rows, vocab}, dtype, ++seed, 0.01, 8.0);
      const std::string tag = std::string(dtype_name(dtype)) + " vocab " + std::to_string(vocab);
      // 0: dlogits separate, 1: no dlogits, 2: dlogits over logits, 3: BF16 dlogits of F32 logits
      for (int mode = 0; mode < 4; ++mode) {
        if (mode == 3 && dtype != DType::kF32) continue;
        const DType grad_dtype = mode == 3 ? DType::kBF16 : dtype;
        Operand loss = output_operand({rows}, DType::kF32);
        Operand dlogits = output_operand({rows, vocab}, grad_dtype);
        const auto loss_args = [&](BackendSide on) {
          kernels::CrossEntropyArgs args;
          args.grad_scale = 0.25;
          args.loss = on(loss);
          args.logits = on(logits);
          args.labels = on(labels);
          args.dlogits = mode == 1 ? TensorView{} : on(dlogits);
          return args;
        };
        kernels::CrossEntropyArgs on_gpu = loss_args(kGpu);
        Tensor logits_copy;
        if (mode == 2) {  // the GPU writes dlogits over (a copy of) the logits
          logits_copy = upload(logits.host.view(), dtype);
          on_gpu.logits = logits_copy;
          on_gpu.dlogits = logits_copy;
        }
        gpu().cross_entropy(on_gpu);
        cpu().cross_entropy(loss_args(kCpu));
        const std::string mtag = tag + (mode == 1 ? " no grad" : mode == 2 ? " aliased" : mode == 3 ? " bf16 grad" : "");
        CUDA_TEST_EXPECT_CLOSE(loss.dev, loss.host.view(), tolerance_for(DType::kF32), "cross_entropy loss " + mtag);
        if (mode == 0 || mode == 3)
          CUDA_TEST_EXPECT_CLOSE(dlogits.dev, dlogits.host.view(), tolerance_for(grad_dtype), "dlogits " + mtag);
        if (mode == 2) CUDA_TEST_EXPECT_CLOSE(logits_copy, dlogits.host.view(), tolerance_for(dtype), "dlogits " + mtag);
      }
    }
}

TEST_CASE("cuda adamw matches the CPU over several steps") {
  uint64_t seed = 7000;
  for (int64_t n : {int64_t{1001}, int64_t{4096}}) {
    Operand param = random_operand({n}, DType::kF32, ++seed);
    Operand exp_avg = random_operand({n}, DType::kF32, ++seed, 1e-3, 0.1);
    // A second moment is never negative (random_operand draws both signs).
    Tensor squares = testing::random_tensor({n}, DType::kF64, ++seed, 1e-4, 1e-2);
    for (int64_t i = 0; i < n; ++i) squares.ptr<double>()[i] = std::fabs(squares.ptr<double>()[i]);
    Operand exp_avg_sq = operand_from_host(std::move(squares), DType::kF32);
    for (int64_t step = 1; step <= 3; ++step) {
      const Operand grad = random_operand({n}, DType::kF32, ++seed);
      const auto adamw_args = [&](BackendSide on) {
        kernels::AdamWArgs args;
        args.lr = 1e-2;
        args.weight_decay = 0.1;
        args.step = step;
        args.param = on(param);
        args.grad = on(grad);
        args.exp_avg = on(exp_avg);
        args.exp_avg_sq = on(exp_avg_sq);
        return args;
      };
      gpu().adamw(adamw_args(kGpu));
      cpu().adamw(adamw_args(kCpu));
    }
    const std::string tag = "adamw n " + std::to_string(n);
    CUDA_TEST_EXPECT_CLOSE(param.dev, param.host.view(), tolerance_for(DType::kF32), tag + " param");
    CUDA_TEST_EXPECT_CLOSE(exp_avg.dev, exp_avg.host.view(), tolerance_for(DType::kF32), tag + " exp_avg");
    CUDA_TEST_EXPECT_CLOSE(exp_avg_sq.dev, exp_avg_sq.host.view(), tolerance_for(DType::kF32), tag + " exp_avg_sq");
  }
}

}  // namespace
}  // namespace moetrain::cuda_test
