// The CUDA backend: the public entry of every op on the GPU. Each method checks its arguments
// against the op's contract (kernels/op_contracts.h) under the GPU's rules (DeviceRules: device
// placement, dtypes under the CUDA dtype policy of kernels/ops.h), then what only its kernels
// need (size limits, alignment): a failed check is a bug in the caller, Error(kInternal) naming
// the op, the argument and its shape. Then it calls the op family's launcher on the backend's
// stream.
//
// File convention, shared by every op family of kernels/cuda (docs/ARCHITECTURE.md §4):
//   kernels/cuda/<family>/<op>.h   declarations of the launchers (may include <cuda_runtime.h>);
//   kernels/cuda/<family>/<op>.cu  file-static kernels -> launchers;
//   launchers: namespace moetrain::kernels::cuda_ops {
//                void <backend_method_name>(const <Args>& args, cudaStream_t stream); }
//   (methods with plain arguments: the same parameters, then the stream; launchers that need
//   backend resources, such as cuBLAS handles or scratch, take them before the stream).
// Launchers assume checked arguments; they return at once on empty work and check every launch.
//
// Index tensors that stay on the device (rope positions, labels, expert indices) are not read
// back for checks; the kernels never read or write out of bounds because of them (see each
// family's header for what they do instead). Token ids (embedding) are copied to the host and
// checked, as the CPU backend does, which waits for the stream, unless the caller has checked them
// (embedding_forward_checked_ids: the model's batches). Group offsets (grouped_gemm) stay
// on the device (the kernel clamps them, grouped_gemm.h); a caller's host copy is checked.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/training/adamw.h"
#include "kernels/cuda/attention/attention.h"
#include "kernels/cuda/training/cross_entropy.h"
#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/gemm/gemm.h"
#include "kernels/cuda/common/device.h"
#include "kernels/cuda/dsa/dsa_indexer.h"
#include "kernels/cuda/dsa/dsa_norm_gate.h"
#include "kernels/cuda/dsa/sparse_attention.h"
#include "kernels/cuda/training/embedding.h"
#include "kernels/cuda/kda/kda.h"
#include "kernels/cuda/kda/kda_gate.h"
#include "kernels/cuda/kda/kda_norms.h"
#include "kernels/cuda/common/memory.h"
#include "kernels/cuda/moe/moe_dispatch.h"
#include "kernels/cuda/training/random_mxfp4.h"
#include "kernels/cuda/norm/rmsnorm.h"
#include "kernels/cuda/rope/rope.h"
#include "kernels/cuda/moe/router.h"
#include "kernels/cuda/common/scratch.h"
#include "kernels/cuda/kda/short_conv.h"
#include "kernels/cuda/attention/attn_res.h"
#include "kernels/cuda/moe/swiglu.h"
#include "kernels/arg_checks.h"
#include "kernels/op_contracts.h"
#include "kernels/ops.h"

namespace moetrain::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks: each op's contract is kernels/op_contracts.h; these are the GPU's rules.

// Operands on the GPU under the CUDA dtype policy of kernels/ops.h. Index tensors stay on the
// device (no read-back, no wait): see the file comment.
class DeviceRules final : public OperandRules {
 public:
  DeviceRules() : OperandRules(Device::kCUDA) {}

  // BF16 or F32, each operand on its own.
  void activation(const char* op, const char* name, const TensorView& t) override {
    placed(op, name, t);
    expect(t.dtype == DType::kBF16 || t.dtype == DType::kF32, op,
           std::string(name) + " is " + dtype_name(t.dtype) + ", expected BF16 or F32");
  }
  void accumulation(const char* op, const char* name, const TensorView& t) override {
    fixed_dtype(op, name, t, DType::kF32);
  }

  // Only the shape: the kernels read the entries on the device.
  void offsets(const char* op, const char* name, const TensorView& t, int64_t, const char* count_name) override {
    fixed_dtype(op, name, t, DType::kI32);
    expect(t.ndim() == 1 && t.numel() >= 1, op,
           describe(name, t) + " should be [" + std::string(count_name) + " + 1]");
  }
  void indices_below(const char*, const char*, const TensorView&, int64_t) override {}
  void selection(const char*, const TensorView&, int64_t) override {}
  // The kernel reads the offsets on the device (no read-back, no wait): the caller's host copy is
  // checked on its own.
  void host_offsets(const char* op, const char* name, const int32_t* host, const TensorView& device,
                    int64_t total) override {
    expect_offsets(op, name, host, device.numel(), total);
  }
};

// Times the host waited for a backend's stream (BackendStats::host_waits), over the process.
std::atomic<int64_t> host_waits{0};

// An int32 device tensor read back to the host (waits for the stream).
std::vector<int32_t> download_i32(const TensorView& t, cudaStream_t stream) {
  std::vector<int32_t> host(static_cast<size_t>(t.numel()));
  if (!host.empty()) {
    ++host_waits;
    CUDA_CHECK(cudaMemcpyAsync(host.data(), t.data, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return host;
}

// cuBLASLt's recommended workspace on Hopper.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// Page-locked host memory (Backend::pinned_allocator): the device copies to and from it without
// the host staging or waiting. cudaFreeHost waits for the device, so callers keep such buffers.
class PinnedAllocator final : public Allocator {
 public:
  Device device() const override { return Device::kCPU; }
  void* allocate(size_t bytes) override {
    void* ptr = nullptr;
    const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault);
    if (status != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      throw Error(ExitCode::kInternal, "cannot allocate " + std::to_string(bytes) +
                                           " bytes of page-locked host memory: " + cudaGetErrorString(status));
    }
    return ptr;
  }
  void deallocate(void* ptr) override { cudaFreeHost(ptr); }
};

// A cudaEvent recorded on the backend's stream (Backend::record_event).
class StreamEvent final : public QueueEvent {
 public:
  explicit StreamEvent(cudaStream_t stream) {
    CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~StreamEvent() override { cudaEventDestroy(event_); }  // fine while pending: freed once it completes
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;
  // Makes `stream` wait for the event on the device (no host wait).
  void queue_wait(cudaStream_t stream) { CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0)); }
  void wait() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaSuccess) return;  // done: no wait
    if (status != cudaErrorNotReady) CUDA_CHECK(status);
    ++host_waits;
    CUDA_CHECK(cudaEventSynchronize(event_));
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// ---------------------------------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    // A blocking stream: work on the legacy default stream (cuda::copy_host_to_device and other
    // plain cudaMemcpy calls) stays ordered with the backend's work.
    CUDA_CHECK(cudaStreamCreate(&stream_));
    CUBLAS_CHECK(cublasLtCreate(&blas_.lt));
    CUBLAS_CHECK(cublasCreate(&blas_.blas));
    CUBLAS_CHECK(cublasSetStream(blas_.blas, stream_));
    CUDA_CHECK(cudaMalloc(&blas_.workspace, kCublasWorkspaceBytes));
    blas_.workspace_bytes = kCublasWorkspaceBytes;
    blas_.scratch = &gemm_scratch_;
    blas_.plans = &gemm_plans_;
    // The kernels' stream-ordered scratch (cudaMallocAsync: attention's rows and work counters,
    // the router's and the MoE dispatch's counts) comes from the device's default pool. With its
    // default release threshold of 0, every synchronisation hands the pool's memory back and the
    // next cudaMallocAsync maps it again, a cost on every op (docs/PERF.md); so the pool keeps
    // what it holds, a few MB (the scratch in flight at once).
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool = nullptr;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t keep_all = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
  }

  ~CudaBackend() override {
    // Destructors must not throw: errors here are left (the process is usually ending).
    cudaStreamSynchronize(stream_);
    if (blas_.workspace) cudaFree(blas_.workspace);
    if (blas_.blas) cublasDestroy(blas_.blas);
    if (blas_.lt) cublasLtDestroy(blas_.lt);
    cudaStreamDestroy(stream_);
    if (side_stream_) {
      cudaStreamSynchronize(side_stream_);
      cudaStreamDestroy(side_stream_);
    }
  }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::kCUDA; }
  const char* name() const override { return "cuda"; }
  Allocator& allocator() override { return cuda::device_allocator(); }
  void synchronize() override {
    ++host_waits;
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void* stream() override { return stream_; }

  BackendStats stats() override {
    const cuda::MemoryStats memory = cuda::memory_stats();
    BackendStats out;
    out.host_waits = host_waits.load();
    out.device_allocations = memory.allocations;
    out.allocated_bytes = memory.allocated_bytes;
    out.peak_bytes = memory.peak_bytes;
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    out.device_used_bytes = total_bytes - free_bytes;
    out.device_total_bytes = total_bytes;
    out.peak_bf16_flops = cuda::peak_bf16_flops();
    return out;
  }
  void reset_peak_memory() override { cuda::reset_peak_memory(); }

  // The checks copy and copy_async share; false when there is nothing to move.
  static bool check_copy(const char* op, const TensorView& dst, const TensorView& src) {
    expect(dst.data != nullptr || dst.numel() == 0, op, describe("dst", dst) + " has no data");
    expect(src.data != nullptr || src.numel() == 0, op, describe("src", src) + " has no data");
    expect(src.dtype == dst.dtype, op, describe("src", src) + " and " + describe("dst", dst) + " differ in dtype");
    expect_numel(op, "src", src, dst.numel());
    return dst.nbytes() != 0 && dst.data != src.data;
  }
  static cudaMemcpyKind copy_kind(const TensorView& dst, const TensorView& src) {
    const bool host_src = src.device == Device::kCPU, host_dst = dst.device == Device::kCPU;
    return host_src ? (host_dst ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice)
                    : (host_dst ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice);
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    if (!check_copy("copy", dst, src)) return;
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), copy_kind(dst, src), stream_));
    // Host memory involved: the caller may read or reuse it as soon as we return.
    if (src.device == Device::kCPU || dst.device == Device::kCPU) synchronize();
  }

  // One for the process, like the device allocator: a tensor from it may outlive this backend.
  Allocator& pinned_allocator() override {
    static PinnedAllocator pinned;
    return pinned;
  }

  void copy_async(const TensorView& dst, const TensorView& src) override {
    const char* op = "copy_async";
    if (!check_copy(op, dst, src)) return;
    check_pinned(op, dst, src);
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), copy_kind(dst, src), stream_));
  }
  // From or to pageable memory the driver would stage an async copy and wait: refuse it.
  static void check_pinned(const char* op, const TensorView& dst, const TensorView& src) {
    for (const TensorView* host : {src.device == Device::kCPU ? &src : nullptr,
                                   dst.device == Device::kCPU ? &dst : nullptr}) {
      if (host == nullptr) continue;
      cudaPointerAttributes attributes{};
      CUDA_CHECK(cudaPointerGetAttributes(&attributes, host->data));
      expect(attributes.type == cudaMemoryTypeHost, op,
             describe(host == &src ? "src" : "dst", *host) + " is host memory not from pinned_allocator()");
    }
  }
  // The copies' queue, made on first use (most runs never offload).
  cudaStream_t side_stream() {
    if (side_stream_ == nullptr) CUDA_CHECK(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking));
    return side_stream_;
  }
  static StreamEvent& stream_event(QueueEvent& event, const char* op) {
    auto* stream_event = dynamic_cast<StreamEvent*>(&event);
    expect(stream_event != nullptr, op, "the event is not one of the CUDA backend's (record_event, record_side_event)");
    return *stream_event;
  }

  std::unique_ptr<QueueEvent> record_event() override { return std::make_unique<StreamEvent>(stream_); }

  void side_copy_async(const TensorView& dst, const TensorView& src) override {
    const char* op = "side_copy_async";
    if (!check_copy(op, dst, src)) return;
    check_pinned(op, dst, src);
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), copy_kind(dst, src), side_stream()));
  }
  void side_wait(QueueEvent& ops_event) override { stream_event(ops_event, "side_wait").queue_wait(side_stream()); }
  std::unique_ptr<QueueEvent> record_side_event() override { return std::make_unique<StreamEvent>(side_stream()); }
  void ops_wait(QueueEvent& side_event) override { stream_event(side_event, "ops_wait").queue_wait(stream_); }

  void convert(const TensorView& dst, const TensorView& src) override {
    check_convert(rules_, dst, src);
    auto floating = [](DType d) { return d == DType::kF32 || d == DType::kF64 || d == DType::kBF16 || d == DType::kF16; };
    auto integer = [](DType d) { return d == DType::kI32 || d == DType::kI64; };
    expect(src.dtype == dst.dtype || (floating(src.dtype) && floating(dst.dtype)) ||
               (integer(src.dtype) && integer(dst.dtype)),
           "convert", "from " + describe("src", src) + " to " + describe("dst", dst) +
                          ": the GPU converts among F32/F64/BF16/F16 and between I32/I64 only");
    cuda_ops::convert(dst, src, stream_);
  }

  void fill(const TensorView& dst, double value) override {
    check_fill(rules_, dst);
    if (dst.numel() == 0) return;
    // The element's bytes come from the CPU reference's fill (the spec of the rounding).
    Tensor one(Shape{1}, dst.dtype);
    cpu_->fill(one.view(), value);
    uint64_t pattern = 0;
    std::memcpy(&pattern, one.data(), dtype_size(dst.dtype));
    cuda_ops::fill_pattern(dst, pattern, stream_);
  }

  void random_mxfp4(const RandomMxfp4Args& args) override {
    check_random_mxfp4(rules_, args);
    expect(reinterpret_cast<uintptr_t>(args.codes.data) % 16 == 0, "random_mxfp4", "codes must be 16-byte aligned");
    cuda_ops::random_mxfp4(args, stream_);
  }

  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override {
    check_axpby(rules_, y, x);
    cuda_ops::axpby(y, x, alpha, beta, stream_);
  }

  double sum_squares(const TensorView& x) override {
    check_sum_squares(rules_, x);
    ++host_waits;  // the sum is read back
    return cuda_ops::sum_squares(x, scratch_, stream_);
  }

  void copy_columns(const CopyColumnsArgs& args) override {
    check_copy_columns(rules_, args);
    cuda_ops::copy_columns(args, stream_);
  }

  void copy_block(const CopyBlockArgs& args) override {
    check_copy_block(rules_, args);
    cuda_ops::copy_block(args, stream_);
  }

  void sum_over_heads(const TensorView& dst, const TensorView& src) override {
    check_sum_over_heads(rules_, dst, src);
    cuda_ops::sum_over_heads(dst, src, stream_);
  }

  void gemm(const GemmArgs& args) override {
    check_gemm(rules_, args);
    cuda_ops::gemm(args, blas_, stream_);
  }

  void gemm_fp8(const GemmFp8Args& args) override {
    check_gemm_fp8(rules_, args);
    cuda_ops::gemm_fp8(args, blas_, stream_);
  }

  void grouped_gemm(const GroupedGemmArgs& args) override {
    check_grouped_gemm(rules_, args);
    cuda_ops::grouped_gemm(args, blas_, stream_);
  }

  void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    check_embedding_forward(rules_, "embedding_forward", out, table, ids);
    check_token_ids(download_i32(ids, stream_), table.size(0));
    cuda_ops::embedding_forward(out, table, ids, stream_);
  }

  // The caller checked the ids on the host (ops.h): no read-back, no wait.
  void embedding_forward_checked_ids(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    check_embedding_forward(rules_, "embedding_forward_checked_ids", out, table, ids);
    cuda_ops::embedding_forward(out, table, ids, stream_);
  }

  void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) override {
    check_embedding_backward(rules_, dtable, dout, ids);
    const std::vector<int32_t> host_ids = download_i32(ids, stream_);
    check_token_ids(host_ids, dtable.size(0));
    cuda_ops::embedding_backward(dtable, dout, host_ids, scratch_, stream_);
  }

  void rmsnorm_forward(const RmsNormArgs& args) override {
    check_rmsnorm_forward(rules_, args);
    cuda_ops::rmsnorm_forward(args, stream_);
  }

  void rmsnorm_backward(const RmsNormBackwardArgs& args) override {
    check_rmsnorm_backward(rules_, args);
    cuda_ops::rmsnorm_backward(args, scratch_, stream_);
  }

  void rope(const RopeArgs& args) override {
    check_rope(rules_, args, cuda_ops::kMaxRopeDim);
    expect(args.layout != RopeLayout::kAdjacent, "rope", "the kAdjacent layout has no CUDA kernel yet");
    cuda_ops::rope(args, stream_);
  }

  void attention_forward(const AttentionArgs& args) override {
    check_attention_forward(rules_, args);
    expect(args.causal, "attention_forward", "non-causal attention has no CUDA kernel yet");
    cuda_ops::attention_forward(args, stream_);
  }

  void attention_backward(const AttentionBackwardArgs& args) override {
    check_attention_backward(rules_, args);
    expect(args.causal, "attention_backward", "non-causal attention has no CUDA kernel yet");
    cuda_ops::attention_backward(args, stream_);
  }

  // The vision tower's ops have no CUDA kernels yet: the model refuses a vision config on CUDA
  // before it gets here (core/model/vision_tower.cpp), so these only catch a direct call.
  void gelu_forward(const GeluArgs&) override { fail("gelu_forward", "no CUDA kernel yet"); }
  void gelu_backward(const GeluBackwardArgs&) override { fail("gelu_backward", "no CUDA kernel yet"); }
  void vision_pos_embed(const VisionPosEmbedArgs&) override { fail("vision_pos_embed", "no CUDA kernel yet"); }
  void patch_merge(const PatchMergeArgs&) override { fail("patch_merge", "no CUDA kernel yet"); }
  void attention_merge(const AttentionMergeArgs& args) override {
    check_attention_merge(rules_, args);
    cuda_ops::attention_merge(args, stream_);
  }

  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    check_swiglu_forward(rules_, h, gate_up);
    cuda_ops::swiglu_forward(h, gate_up, stream_);
  }

  void swiglu_backward(const SwigluBackwardArgs& args) override {
    check_swiglu_backward(rules_, args);
    cuda_ops::swiglu_backward(args, stream_);
  }

  void attn_res_forward(const AttnResArgs& args) override {
    check_attn_res_forward(rules_, args);
    cuda_ops::attn_res_forward(args, stream_);
  }

  void attn_res_backward(const AttnResBackwardArgs& args) override {
    check_attn_res_backward(rules_, args);
    cuda_ops::attn_res_backward(args, stream_);
  }

  void situ_forward(const SituArgs& args) override {
    check_situ_forward(rules_, args);
    cuda_ops::situ_forward(args, stream_);
  }

  void situ_backward(const SituBackwardArgs& args) override {
    check_situ_backward(rules_, args);
    cuda_ops::situ_backward(args, stream_);
  }

  void router_forward(const RouterArgs& args) override {
    check_router_forward(rules_, args);
    cuda_ops::router_forward(args, stream_);
  }

  void router_backward(const RouterBackwardArgs& args) override {
    check_router_backward(rules_, args);
    cuda_ops::router_backward(args, stream_);
  }

  void aux_loss(const AuxLossArgs& args) override {
    check_aux_loss(rules_, args);
    cuda_ops::aux_loss(args, stream_);
  }

  void moe_permutation(const MoePermutationArgs& args) override {
    check_moe_permutation(rules_, args);
    cuda_ops::moe_permutation(args, stream_);
  }

  void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                   int64_t top_k) override {
    check_moe_permute(rules_, out, x, sorted_pair, top_k);
    cuda_ops::moe_permute(out, x, sorted_pair, top_k, stream_);
  }

  void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                         bool accumulate) override {
    check_moe_unpermute_sum(rules_, dx, drows, pair_row, top_k);
    cuda_ops::moe_unpermute_sum(dx, drows, pair_row, top_k, accumulate, stream_);
  }

  void moe_combine(const MoeCombineArgs& args) override {
    check_moe_combine(rules_, args);
    cuda_ops::moe_combine(args, stream_);
  }

  void moe_combine_backward(const MoeCombineBackwardArgs& args) override {
    check_moe_combine_backward(rules_, args);
    cuda_ops::moe_combine_backward(args, stream_);
  }

  void cross_entropy(const CrossEntropyArgs& args) override {
    check_cross_entropy(rules_, args);
    cuda_ops::cross_entropy(args, stream_);
  }

  void adamw(const AdamWArgs& args) override {
    check_adamw(rules_, args);
    cuda_ops::adamw(args, stream_);
  }

  // ---- KDA (kernels/cuda/kda*.cu, short_conv.cu)
  void short_conv_forward(const ShortConvArgs& args) override {
    check_short_conv_forward(rules_, args);
    check_conv_width("short_conv_forward", args.weight);
    cuda_ops::short_conv_forward(args, stream_);
  }

  void short_conv_backward(const ShortConvBackwardArgs& args) override {
    check_short_conv_backward(rules_, args);
    check_conv_width("short_conv_backward", args.weight);
    cuda_ops::short_conv_backward(args, stream_);
  }

  void l2norm_forward(const L2NormArgs& args) override {
    check_l2norm_forward(rules_, args);
    cuda_ops::l2norm_forward(args, stream_);
  }

  void l2norm_backward(const L2NormBackwardArgs& args) override {
    check_l2norm_backward(rules_, args);
    cuda_ops::l2norm_backward(args, stream_);
  }

  void kda_gate_forward(const KdaGateArgs& args) override {
    check_kda_gate_forward(rules_, args);
    cuda_ops::kda_gate_forward(args, stream_);
  }

  void kda_gate_backward(const KdaGateBackwardArgs& args) override {
    check_kda_gate_backward(rules_, args);
    cuda_ops::kda_gate_backward(args, stream_);
  }

  void kda_forward(const KdaArgs& args) override {
    check_kda_forward(rules_, args);
    check_kda_head_dims("kda_forward", args.q, args.v);
    cuda_ops::kda_forward(args, stream_);
  }

  void kda_backward(const KdaBackwardArgs& args) override {
    check_kda_backward(rules_, args);
    check_kda_head_dims("kda_backward", args.q, args.v);
    cuda_ops::kda_backward(args, stream_);
  }

  void gated_rmsnorm_forward(const GatedRmsNormArgs& args) override {
    check_gated_rmsnorm_forward(rules_, args);
    cuda_ops::gated_rmsnorm_forward(args, stream_);
  }

  void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) override {
    check_gated_rmsnorm_backward(rules_, args);
    cuda_ops::gated_rmsnorm_backward(args, stream_);
  }

  void sigmoid_forward(const TensorView& y, const TensorView& x) override {
    check_sigmoid_forward(rules_, y, x);
    cuda_ops::sigmoid_forward(y, x, stream_);
  }

  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override {
    check_sigmoid_backward(rules_, dx, dy, y);
    cuda_ops::sigmoid_backward(dx, dy, y, stream_);
  }
  // ---- KDA end

  // ---- DSA (kernels/cuda/dsa*.cu, sparse_attention.cu; the CPU reference is kernels/cpu/dsa.cpp) ----
  void layernorm_forward(const LayerNormArgs& args) override {
    check_layernorm_forward(rules_, args);
    cuda_ops::layernorm_forward(args, stream_);
  }

  void dsa_indexer_topk(const DsaIndexerArgs& args) override {
    const char* op = "dsa_indexer_topk";
    check_dsa_indexer_topk(rules_, args);
    expect(args.q.size(2) <= cuda_ops::kDsaMaxIndexerDim, op,
           describe("q", args.q) + ": the CUDA indexer takes head dims up to " +
               std::to_string(cuda_ops::kDsaMaxIndexerDim));
    expect(args.q.size(0) <= kMaxInt32 && args.k.size(0) <= kMaxInt32, op,
           describe("q", args.q) + ", " + describe("k", args.k) + ": more tokens than int32 topk_index can name");
    cuda_ops::dsa_indexer_topk(args, scratch_, stream_);
  }

  void sparse_attention_forward(const SparseAttentionArgs& args) override {
    check_sparse_attention_forward(rules_, args);
    check_sparse_attention_limits("sparse_attention_forward", args.q, args.kv, args.out);
    cuda_ops::sparse_attention_forward(args, stream_);
  }

  void sparse_attention_backward(const SparseAttentionBackwardArgs& args) override {
    const char* op = "sparse_attention_backward";
    check_sparse_attention_backward(rules_, args);
    check_sparse_attention_limits(op, args.q, args.kv, args.out);
    expect(args.q.size(0) * args.topk_index.size(1) <= kMaxInt32, op,
           describe("topk_index", args.topk_index) +
               ": tokens x top_k is past the int32 inverse index (2^31 - 1 entries); shard the "
               "sequence over more context-parallel ranks (parallel.cp) or lower model.dsa.index_topk");
    cuda_ops::sparse_attention_backward(args, scratch_, stream_);
  }

  void attention_gate_forward(const AttentionGateArgs& args) override {
    check_attention_gate_forward(rules_, args);
    cuda_ops::attention_gate_forward(args, stream_);
  }

  void attention_gate_backward(const AttentionGateBackwardArgs& args) override {
    check_attention_gate_backward(rules_, args);
    cuda_ops::attention_gate_backward(args, stream_);
  }

  // Token indices and inverse-index positions are int32.
  static constexpr int64_t kMaxInt32 = 2147483647;

  // Head dims within what the sparse attention kernels hold; kv rows (key_offset + tokens) that
  // int32 indices can name.
  static void check_sparse_attention_limits(const char* op, const TensorView& q, const TensorView& kv,
                                            const TensorView& out) {
    expect(q.size(2) <= cuda_ops::kSparseMaxQkDim && out.size(2) <= cuda_ops::kSparseMaxVDim, op,
           describe("q", q) + ", " + describe("out", out) + ": the CUDA sparse attention takes qk_dim up to " +
               std::to_string(cuda_ops::kSparseMaxQkDim) + " and v_dim up to " +
               std::to_string(cuda_ops::kSparseMaxVDim));
    expect(kv.size(0) <= kMaxInt32, op, describe("kv", kv) + ": more rows than int32 topk_index can name");
  }
  // ---- DSA end

 private:
  // The one user-data error of the backend, as on the CPU: ids from another tokenizer.
  static void check_token_ids(const std::vector<int32_t>& ids, int64_t rows) {
    for (size_t t = 0; t < ids.size(); ++t) {
      MOETRAIN_CHECK(ids[t] >= 0 && ids[t] < rows, ExitCode::kBadData,
                     "token id " + std::to_string(ids[t]) + " at token position " + std::to_string(t) +
                         " is outside the embedding table's " + std::to_string(rows) +
                         " rows: the data was tokenised for another vocabulary, or vocab_size is too small");
    }
  }

  static void check_conv_width(const char* op, const TensorView& weight) {
    expect(weight.size(1) <= cuda_ops::kShortConvMaxWidth, op,
           describe("weight", weight) + ": the CUDA short convolution takes widths up to " +
               std::to_string(cuda_ops::kShortConvMaxWidth));
  }

  static void check_kda_head_dims(const char* op, const TensorView& q, const TensorView& v) {
    expect(cuda_ops::kda_head_dims_supported(q.size(2), v.size(2)), op,
           "head dims " + describe("q", q) + ", " + describe("v", v) + ": the CUDA KDA takes up to 128 for each");
  }

  DeviceRules rules_;  // stateless: one for every call
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // side_copy_async and its events
  cuda_ops::BlasContext blas_;
  cuda_ops::DeviceScratch gemm_scratch_;  // BF16 copies of F32 GEMM operands
  cuda_ops::GemmPlanCache gemm_plans_;    // cuBLASLt descriptors and algorithms per GEMM shape
  cuda_ops::DeviceScratch scratch_;       // everything else (partials, index tables)
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();  // fill's element encoding
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace moetrain::kernels
