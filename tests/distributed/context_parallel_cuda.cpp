// KDA across a context-parallel group on the CUDA backend (core/model/kda_context_parallel.h):
// the ranks share one GPU through the host-staged communicator (device buffers, exchanged through
// host memory), each runs its shard of a packed window on the CUDA KDA with the states passed
// between shards, and every shard's outputs and input gradients are held against the CPU
// backend's KDA over the whole window in F64 from the same F32 values: documents across every
// shard, inside one and across two, one starting at a shard's start, an uneven split; head dims the
// kernels pad (4/3) and 128. The CUDA KDA runs on BF16 tensor cores, so the limit is a BF16-operand
// one (the largest error relative to the largest value, as tests/cuda/test_cuda_kda.cpp allows).
// The short convolutions before KDA (ShortConvAcrossRanks: their halos and the halos' gradients)
// run in F32 against the CPU's in F64, on the same windows and one of shards shorter than their
// reach. Both layouts (core/data/context_shards.h): the contiguous cases above, and balanced ones
// (rank r holding chunks r and 2 cp - 1 - r) with documents starting inside chunks and running
// through a rank's pair, and chunks shorter than the convolution's reach.
// Prints "EQUAL" on rank 0 when every case of every rank agrees; exits 77 (skipped) without a GPU.
#include <fmt/format.h>
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/base/log.h"
#include "core/model/kda_context_parallel.h"
#include "kda_inputs.h"
#include "kernels/ops.h"
#include "mpi_cuda_ranks.h"
#include "parallel/host_staged_comm.h"
#include "parallel/runtime.h"

namespace moetrain {
namespace {

using testing::KdaInputs;

struct Case {
  std::string name;
  std::vector<int32_t> cu;  // the window's documents, split evenly over the ranks
  bool balanced = false;    // the balanced layout over one window of cu.back() tokens
};

ContextShards shards_of(const Case& c, int ranks) {
  return c.balanced ? ContextShards::balanced(c.cu, ranks, c.cu.back()) : ContextShards::even(c.cu, ranks);
}

// Every result of one KDA call (forward and backward), in `allocator`'s memory.
struct Results {
  Tensor out, dq, dk, dv, dg, dbeta;
  Results(const KdaInputs& in, DType dtype, Allocator& allocator)
      : out({in.tokens, in.heads, in.vd}, dtype, allocator), dq({in.tokens, in.heads, in.kd}, dtype, allocator),
        dk({in.tokens, in.heads, in.kd}, dtype, allocator), dv({in.tokens, in.heads, in.vd}, dtype, allocator),
        dg({in.tokens, in.heads, in.kd}, dtype, allocator), dbeta({in.tokens, in.heads}, dtype, allocator) {}
  kernels::KdaArgs forward(const KdaInputs& in) const {
    return {out, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale};
  }
  kernels::KdaBackwardArgs backward(const KdaInputs& in) const {
    return {dq, dk, dv, dg, dbeta, in.dout, in.q, in.k, in.v, in.g, in.beta, in.cu_seqlens, in.scale};
  }
  std::vector<std::pair<const char*, const Tensor*>> named() const {
    return {{"out", &out}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}, {"dg", &dg}, {"dbeta", &dbeta}};
  }
};

// The inputs with every tensor copied (through `backend`) into `backend`'s memory in `dtype`
// (cu_seqlens stays I32).
KdaInputs moved(const KdaInputs& in, kernels::Backend& backend, DType dtype) {
  auto to = [&](const Tensor& t, DType want) {
    const Tensor host = testing::copy_as(t.view(), want);
    Tensor placed(host.shape(), want, backend.allocator());
    backend.copy(placed, host);
    return placed;
  };
  KdaInputs out;
  out.tokens = in.tokens;
  out.heads = in.heads;
  out.kd = in.kd;
  out.vd = in.vd;
  out.scale = in.scale;
  out.q = to(in.q, dtype);
  out.k = to(in.k, dtype);
  out.v = to(in.v, dtype);
  out.g = to(in.g, dtype);
  out.beta = to(in.beta, dtype);
  out.dout = to(in.dout, dtype);
  out.cu_seqlens = to(in.cu_seqlens, DType::kI32);
  return out;
}

int run_case(const Case& c, int64_t kd, int64_t vd, double tolerance, kernels::Backend& gpu, kernels::Backend& cpu,
             Communicator& cp) {
  const int me = cp.rank();
  const ContextShards shards = shards_of(c, cp.size());
  // F32 values, the reference computing on exactly those in F64.
  const KdaInputs values = testing::make_kda_inputs(c.cu, 2, kd, vd, 3000 + c.cu.size() + kd, DType::kF32);
  const KdaInputs whole = moved(values, cpu, DType::kF64);
  const Results want(whole, DType::kF64, cpu.allocator());
  cpu.kda_forward(want.forward(whole));
  cpu.kda_backward(want.backward(whole));

  const KdaInputs shard = moved(testing::shard_of(values, shards, me), gpu, DType::kF32);
  const Results got(shard, DType::kF32, gpu.allocator());
  KdaAcrossRanks kda(gpu, cp, shards);
  KdaShardState saved;
  kda.forward(got.forward(shard), &saved);
  kda.backward(got.backward(shard), saved);

  int failures = 0;
  const auto wanted = want.named();
  const auto gotten = got.named();
  for (size_t i = 0; i < gotten.size(); ++i) {
    Tensor host(gotten[i].second->shape(), DType::kF32);
    gpu.copy(host, *gotten[i].second);
    const double worst = testing::worst_shard_difference(host, testing::shard_rows(*wanted[i].second, shards, me), 0);
    if (!(worst <= tolerance)) {
      ++failures;
      log::error(fmt::format("kda on CUDA: {} (head dims {}/{}), rank {} ({} tokens): {} differs from the CPU's "
                             "whole window by {:.3e} (relative to its largest value; at most {:.0e})",
                             c.name, kd, vd, me, shards.tokens(me), gotten[i].first, worst, tolerance));
    }
  }
  return failures;
}

// ShortConvAcrossRanks (the convolutions before KDA) on CUDA in F32 against the CPU's convolution
// over the whole window in F64 from the same F32 values: y, dx (the later shards' halo gradients
// included) and dweight summed over the group.
int run_short_conv_case(const Case& c, double tolerance, kernels::Backend& gpu, kernels::Backend& cpu,
                        Communicator& cp) {
  constexpr int64_t kChannels = 6, kWidth = 4;
  const int me = cp.rank();
  const ContextShards shards = shards_of(c, cp.size());
  const int64_t tokens = c.cu.back(), own = shards.tokens(me);
  const uint64_t seed = 5000 + c.cu.size();
  const Tensor x = testing::random_tensor({tokens, kChannels}, DType::kF32, seed + 1);
  const Tensor weight = testing::random_tensor({kChannels, kWidth}, DType::kF32, seed + 2);
  const Tensor dy = testing::random_tensor({tokens, kChannels}, DType::kF32, seed + 3);

  const Tensor x64 = testing::copy_as(x.view(), DType::kF64), w64 = testing::copy_as(weight.view(), DType::kF64),
               dy64 = testing::copy_as(dy.view(), DType::kF64), cu = testing::make_i32(c.cu);
  Tensor want_y({tokens, kChannels}, DType::kF64), want_dx({tokens, kChannels}, DType::kF64),
      want_dw({kChannels, kWidth}, DType::kF64);
  cpu.short_conv_forward({want_y, x64, w64, cu, true});
  cpu.short_conv_backward({want_dx, want_dw, dy64, x64, w64, cu, true});

  auto on_gpu = [&](const TensorView& host) {
    Tensor t(host.shape, host.dtype, gpu.allocator());
    gpu.copy(t, host);
    return t;
  };
  const Tensor sx = on_gpu(testing::shard_rows(x, shards, me).view()),
               sdy = on_gpu(testing::shard_rows(dy, shards, me).view()),
               sw = on_gpu(weight.view()), scu = on_gpu(testing::make_i32(shards.local_cu(me)).view());
  Tensor y({own, kChannels}, DType::kF32, gpu.allocator()), dx(y.shape(), DType::kF32, gpu.allocator()),
      dw({kChannels, kWidth}, DType::kF32, gpu.allocator());
  ShortConvAcrossRanks conv(gpu, cp, shards, kWidth);
  conv.forward({y, sx, sw, scu, true});
  conv.backward({dx, dw, sdy, sx, sw, scu, true});
  cp.all_reduce(dw.view());

  int failures = 0;
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> results[] = {
      {"y", {&y, &want_y}}, {"dx", {&dx, &want_dx}}, {"dweight", {&dw, &want_dw}}};
  for (const auto& [name, pair] : results) {
    Tensor host(pair.first->shape(), DType::kF32);
    gpu.copy(host, *pair.first);
    const bool rows = std::string(name) != "dweight";
    const double worst =
        rows ? testing::worst_shard_difference(host, testing::shard_rows(*pair.second, shards, me), 0)
             : testing::worst_shard_difference(host, *pair.second, 0);
    if (!(worst <= tolerance)) {
      ++failures;
      log::error(fmt::format("short conv on CUDA: {}, rank {} ({} tokens): {} differs from the CPU's whole "
                             "window by {:.3e} (relative to its largest value; at most {:.0e})",
                             c.name, me, own, name, worst, tolerance));
    }
  }
  return failures;
}

int run_test(Runtime& runtime, int, char**) {
  if (!testing::every_rank_sees_a_gpu()) {
    if (runtime.is_root()) std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  HostStagedCommunicator cp(MPI_COMM_WORLD);
  std::unique_ptr<kernels::Backend> gpu = kernels::make_cuda_backend(), cpu = kernels::make_cpu_backend();
  const int ranks = cp.size();
  const int32_t window = 2 * ranks * 37;  // balanced chunks of 37
  const std::vector<Case> cases = {
      {"one document over every shard, uneven split", {0, 301}},
      {"documents inside one shard and across two", {0, 40, 100, 130, 150}},
      {"a document starting at a shard's start", {0, 200 / ranks, 200}},
      {"balanced: one document over every chunk", {0, window}, true},
      {"balanced: documents starting inside chunks, through a rank's pair", {0, 5, window / 2 + 3, window - 4, window},
       true},
  };
  // BF16 operands put the largest error near 1e-2 of the largest value in one call; a missing or
  // wrong state passed between shards moves outputs by their own size.
  const double tolerance = 5e-2;
  int failures = 0;
  for (const Case& c : cases)
    for (const auto& [kd, vd] : {std::make_pair(int64_t{4}, int64_t{3}), std::make_pair(int64_t{128}, int64_t{128})})
      failures += run_case(c, kd, vd, tolerance, *gpu, *cpu, cp);
  // The short convolutions in F32: F32 rounding against F64 (2e-5 of the largest value, the F32
  // limit of tests/cuda); a missing or misplaced halo row moves outputs by their own size. One more
  // window has shards shorter than the convolution's reach, so that at cp 3 a halo comes from two
  // ranks back.
  std::vector<Case> conv_cases = cases;
  conv_cases.push_back({"shards shorter than the convolution's reach", {0, 2 * ranks - 1}});
  conv_cases.push_back({"balanced: chunks of one token", {0, 1, 2 * ranks}, true});
  for (const Case& c : conv_cases) failures += run_short_conv_case(c, 2e-5, *gpu, *cpu, cp);
  cp.barrier();
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (runtime.is_root())
    std::printf("context_parallel_cuda cp %d, kda, %zu cases at 2 head dims, short conv, %zu cases: %s\n", ranks,
                cases.size(), conv_cases.size(), failures == 0 ? "EQUAL" : "DIFFERENT");
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace moetrain

int main(int argc, char** argv) { return moetrain::run_main(argc, argv, moetrain::run_test); }
