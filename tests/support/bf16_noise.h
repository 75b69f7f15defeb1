// How far bf16 rounding alone moves a golden fixture's results: the CPU reference in F32 with the
// CUDA path's bf16 roundings applied, stochastically. Bf16Noise wraps the CPU backend and rounds
// each op output the CUDA backend stores in BF16 (activations and activation gradients; GEMM
// outputs other than the router's and the head's F32 logits) with stochastic rounding, so each
// seed draws an independent error of a bf16 rounding's size; round_weights() rounds the frozen
// weights and the LoRA parameters as the CUDA path's GEMM operands are. A result that moves far
// under several seeds is ill-conditioned in bf16: the GPU cannot be held closer to the fp32
// reference there than this spread (tests/cuda/test_cuda_golden_model.cpp). CPU only; F32 models.
#pragma once

#include <cstdint>
#include <cstring>
#include <set>
#include <vector>

#include "core/model/model.h"
#include "kernels/ops.h"
#include "kernels/timing_backend.h"

namespace moetrain::testing {

class Bf16Noise : public kernels::TimingBackend {
 public:
  // f32_widths: the column counts of GEMM outputs the CUDA path keeps in F32 (router logits:
  // the number of routed experts; the logits: the vocabulary).
  Bf16Noise(kernels::Backend& cpu, uint64_t seed, std::vector<int64_t> f32_widths)
      : TimingBackend(cpu), state_(0x9E3779B97F4A7C15ull * (seed + 1)), f32_widths_(std::move(f32_widths)) {
    disable();
  }

  // Stochastic rounding to bf16: up with probability equal to the dropped fraction.
  void round(const TensorView& t) {
    if (t.data == nullptr || t.dtype != DType::kF32) return;
    float* p = static_cast<float*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, &p[i], 4);
      bits = (bits + static_cast<uint32_t>(next() & 0xffffu)) & 0xffff0000u;
      std::memcpy(&p[i], &bits, 4);
    }
  }

  // Also notes the parameter gradients, which GEMMs accumulate in F32.
  void round_weights(Model& model) {
    for (const auto& slot : model.weight_slots())
      if (slot.tensor != nullptr) round(*slot.tensor);
    for (Parameter* p : model.parameters()) {
      round(p->value);
      gradients_.insert(p->grad.data());
    }
  }

  // Forward: the outputs stored in BF16.
  void gemm(const kernels::GemmArgs& a) override {
    TimingBackend::gemm(a);
    if (gradients_.count(a.c.data) > 0) return;
    for (int64_t w : f32_widths_)
      if (a.c.ndim() == 2 && a.c.size(1) == w) return;
    round(a.c);
  }
  void grouped_gemm(const kernels::GroupedGemmArgs& a) override { TimingBackend::grouped_gemm(a); round(a.c); }
  void rmsnorm_forward(const kernels::RmsNormArgs& a) override { TimingBackend::rmsnorm_forward(a); round(a.y); }
  void attention_forward(const kernels::AttentionArgs& a) override { TimingBackend::attention_forward(a); round(a.out); }
  void attention_merge(const kernels::AttentionMergeArgs& a) override { TimingBackend::attention_merge(a); round(a.out); }
  void attention_gate_forward(const kernels::AttentionGateArgs& a) override {
    TimingBackend::attention_gate_forward(a);
    round(a.y);
  }
  void situ_forward(const kernels::SituArgs& a) override { TimingBackend::situ_forward(a); round(a.h); }
  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    TimingBackend::swiglu_forward(h, gate_up);
    round(h);
  }
  void moe_combine(const kernels::MoeCombineArgs& a) override { TimingBackend::moe_combine(a); round(a.out); }
  void short_conv_forward(const kernels::ShortConvArgs& a) override { TimingBackend::short_conv_forward(a); round(a.y); }
  void l2norm_forward(const kernels::L2NormArgs& a) override { TimingBackend::l2norm_forward(a); round(a.y); }
  void kda_forward(const kernels::KdaArgs& a) override { TimingBackend::kda_forward(a); round(a.out); }
  void gated_rmsnorm_forward(const kernels::GatedRmsNormArgs& a) override {
    TimingBackend::gated_rmsnorm_forward(a);
    round(a.y);
  }
  void attn_res_forward(const kernels::AttnResArgs& a) override { TimingBackend::attn_res_forward(a); round(a.out); }
  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override {
    TimingBackend::axpby(y, x, alpha, beta);
    round(y);
  }

  // Backward: the activation gradients stored in BF16 (KDA's dg and dbeta are F32 there).
  void rmsnorm_backward(const kernels::RmsNormBackwardArgs& a) override { TimingBackend::rmsnorm_backward(a); round(a.dx); }
  void attention_backward(const kernels::AttentionBackwardArgs& a) override {
    TimingBackend::attention_backward(a);
    round(a.dq);
    round(a.dk);
    round(a.dv);
  }
  void attention_gate_backward(const kernels::AttentionGateBackwardArgs& a) override {
    TimingBackend::attention_gate_backward(a);
    round(a.dx);
    round(a.dgate);
  }
  void situ_backward(const kernels::SituBackwardArgs& a) override { TimingBackend::situ_backward(a); round(a.dgate_up); }
  void swiglu_backward(const kernels::SwigluBackwardArgs& a) override { TimingBackend::swiglu_backward(a); round(a.dgate_up); }
  void moe_combine_backward(const kernels::MoeCombineBackwardArgs& a) override {
    TimingBackend::moe_combine_backward(a);
    round(a.drows);
  }
  void short_conv_backward(const kernels::ShortConvBackwardArgs& a) override {
    TimingBackend::short_conv_backward(a);
    round(a.dx);
  }
  void l2norm_backward(const kernels::L2NormBackwardArgs& a) override { TimingBackend::l2norm_backward(a); round(a.dx); }
  void kda_gate_backward(const kernels::KdaGateBackwardArgs& a) override { TimingBackend::kda_gate_backward(a); round(a.df); }
  void kda_backward(const kernels::KdaBackwardArgs& a) override {
    TimingBackend::kda_backward(a);
    round(a.dq);
    round(a.dk);
    round(a.dv);
  }
  void gated_rmsnorm_backward(const kernels::GatedRmsNormBackwardArgs& a) override {
    TimingBackend::gated_rmsnorm_backward(a);
    round(a.dx);
    round(a.dgate);
  }
  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override {
    TimingBackend::sigmoid_backward(dx, dy, y);
    round(dx);
  }

 private:
  uint64_t next() {  // xorshift64
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return state_;
  }
  uint64_t state_;
  std::vector<int64_t> f32_widths_;
  std::set<const void*> gradients_;
};

}  // namespace moetrain::testing
