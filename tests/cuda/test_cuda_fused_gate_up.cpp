// PEFT's fused expert adapter (lora.expert_gate_up: fused) on the GPU: routed experts with one
// rank-2r adapter on the whole gate_up output and a down adapter, forward and backward under the
// CUDA dtype policy (BF16 activations and frozen weights, F32 adapters and gradients), against the
// CPU reference in F64 from the same values. Skewed expert sizes with an empty expert; the
// tolerances are BF16-sized (the activations are rounded to BF16 between the grouped GEMMs).
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/model/swiglu_experts.h"
#include "cuda_test_support.h"

namespace moetrain::cuda_test {
namespace {

constexpr int64_t kExperts = 4, kHidden = 64, kWidth = 32;
const std::vector<int32_t> kOffsets = {0, 40, 40, 47, 120};  // expert 1 gets no rows
const LoraSettings kLora{8, 16.0, false};                  // fused: rank 16, alpha 32

struct Side {
  kernels::Backend& backend;
  DType dtype;
  BatchTensors batch;
  SwigluExperts mlp{"model.layers.1.mlp.experts", kExperts, kHidden, kWidth, /*routed=*/true};
  Tensor offsets;

  Side(kernels::Backend& b, DType activations) : backend(b), dtype(activations) {}
  LayerContext ctx() { return LayerContext{backend, dtype, batch}; }
  GroupOffsets groups() const { return GroupOffsets{offsets.view(), kOffsets.data()}; }
  std::vector<Parameter*> params() {
    std::vector<Parameter*> out;
    mlp.collect_parameters(out);
    return out;
  }
};

// F64 host values into a tensor of either backend.
void put(kernels::Backend& backend, Tensor& dst, const Tensor& host64) {
  Tensor staged(dst.shape(), dst.dtype());
  convert_host(staged.view(), host64.view());
  backend.copy(dst, staged);
}

}  // namespace

TEST_CASE("cuda: fused gate_up adapter forward and backward against the CPU reference", "[cuda][fused]") {
  const int64_t rows = kOffsets.back();
  Side cpu_side(cpu(), DType::kF64), gpu_side(gpu(), DType::kBF16);
  // Inputs and frozen weights as BF16 holds them, adapters as F32 holds them: both sides start equal.
  Operand x = random_operand({rows, kHidden}, DType::kBF16, 1);
  Operand dout = random_operand({rows, kHidden}, DType::kBF16, 2);
  Operand gate_up = random_operand({kExperts, 2 * kWidth, kHidden}, DType::kBF16, 3, 0.02, 0.2);
  Operand down = random_operand({kExperts, kHidden, kWidth}, DType::kBF16, 4, 0.02, 0.2);
  cpu_side.mlp.gate_up = Tensor(gate_up.host.shape(), DType::kF64);
  std::memcpy(cpu_side.mlp.gate_up.data(), gate_up.host.data(), gate_up.host.nbytes());
  cpu_side.mlp.down = Tensor(down.host.shape(), DType::kF64);
  std::memcpy(cpu_side.mlp.down.data(), down.host.data(), down.host.nbytes());
  gpu_side.mlp.gate_up = std::move(gate_up.dev);
  gpu_side.mlp.down = std::move(down.dev);
  cpu_side.offsets = int_operand(kOffsets, {kExperts + 1}).host;
  gpu_side.offsets = int_operand(kOffsets, {kExperts + 1}).dev;
  for (Side* side : {&cpu_side, &gpu_side}) {
    const DType param = side->dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    side->mlp.add_fused_gate_up_lora(kLora, param, side->backend, 5);
    side->mlp.add_lora(SwigluExperts::kDown, kLora, param, side->backend, 6);
  }
  std::vector<Parameter*> cpu_params = cpu_side.params(), gpu_params = gpu_side.params();
  REQUIRE(cpu_params.size() == 4);
  REQUIRE(gpu_params[0]->value.shape() == Shape({kExperts, 16, kHidden}));
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    Tensor values = testing::random_tensor(cpu_params[i]->value.shape(), DType::kF64, 10 + i, 0.02, 0.2);
    round_host(values.view(), DType::kF32);  // a full B: every entry non-zero
    put(cpu(), cpu_params[i]->value, values);
    put(gpu(), gpu_params[i]->value, values);
    cpu().fill(cpu_params[i]->grad, 0.0);
    gpu().fill(gpu_params[i]->grad, 0.0);
  }

  Operand out = output_operand({rows, kHidden}, DType::kBF16);
  cpu_side.mlp.forward(cpu_side.ctx(), out.host, x.host, cpu_side.groups());
  gpu_side.mlp.forward(gpu_side.ctx(), out.dev, x.dev, gpu_side.groups());
  Operand dx = output_operand({rows, kHidden}, DType::kBF16);
  cpu_side.mlp.backward(cpu_side.ctx(), dx.host, dout.host, x.host, cpu_side.groups(), false);
  gpu_side.mlp.backward(gpu_side.ctx(), dx.dev, dout.dev, x.dev, gpu_side.groups(), false);

  // BF16 activations between the GEMMs (the pre-activations, SwiGLU's output, x A): a few
  // roundings of 2^-9 each, accumulated over sums of 16-64 terms.
  const Tolerance tol{2e-2, 1e-1, 2e-2};
  CUDA_TEST_EXPECT_CLOSE(out.dev, out.host.view(), tol, "out");
  CUDA_TEST_EXPECT_CLOSE(dx.dev, dx.host.view(), tol, "dx");
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    CUDA_TEST_EXPECT_CLOSE(gpu_params[i]->grad, cpu_params[i]->grad.view(), tol, gpu_params[i]->name + " grad");
  }
}

}  // namespace moetrain::cuda_test
