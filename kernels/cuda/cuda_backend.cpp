// The CUDA backend: the public entry of every op on the GPU. Each method checks its arguments
// (device placement, dtypes under the CUDA dtype policy of kernels/ops.h, shapes: a failed check
// is a bug in the caller, Error(kInternal) naming the op, the argument and its shape), then
// calls the op family's launcher on the backend's stream.
//
// File convention, shared by every op family of kernels/cuda:
//   kernels/cuda/<family>.h   declarations of the launchers (may include <cuda_runtime.h>);
//   kernels/cuda/<family>.cu  file-static kernels -> launchers;
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
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/adamw.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cross_entropy.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dense.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/dsa.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/kda.h"
#include "kernels/cuda/kda_gate.h"
#include "kernels/cuda/kda_norms.h"
#include "kernels/cuda/memory.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/random_mxfp4.h"
#include "kernels/cuda/rmsnorm.h"
#include "kernels/cuda/rope.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/scratch.h"
#include "kernels/cuda/short_conv.h"
#include "kernels/cuda/attn_res.h"
#include "kernels/cuda/swiglu.h"
#include "kernels/arg_checks.h"
#include "kernels/ops.h"

namespace moetrain::kernels {
namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks

// On the GPU, with memory unless it has no elements.
void expect_device(const char* op, const char* name, const TensorView& t) { expect_on(op, name, t, Device::kCUDA); }

void expect_dtype(const char* op, const char* name, const TensorView& t, DType dtype) {
  expect_device(op, name, t);
  expect_dtype_is(op, name, t, dtype);
}

// An activation/weight operand: BF16 or F32.
void expect_float(const char* op, const char* name, const TensorView& t) {
  expect_device(op, name, t);
  expect(t.dtype == DType::kBF16 || t.dtype == DType::kF32, op,
         std::string(name) + " is " + dtype_name(t.dtype) + ", expected BF16 or F32");
}

// An accumulation operand (parameter gradients, statistics, losses, optimizer state): F32.
void expect_f32(const char* op, const char* name, const TensorView& t) { expect_dtype(op, name, t, DType::kF32); }

// An in-place call (the same memory for an output and an input) needs one dtype for both.
void expect_alias_same_dtype(const char* op, const char* out_name, const TensorView& out, const char* in_name,
                             const TensorView& in) {
  expect(out.data != in.data || out.data == nullptr || out.dtype == in.dtype, op,
         describe(out_name, out) + " aliases " + describe(in_name, in) + " with another dtype");
}

// int32 prefix sums read back to the host: 0 first, non-decreasing, `total` last.
void expect_offsets(const char* op, const char* name, const std::vector<int32_t>& p, int64_t total) {
  kernels::expect_offsets(op, name, p.data(), static_cast<int64_t>(p.size()), total);
}

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
  }

  ~CudaBackend() override {
    // Destructors must not throw: errors here are left (the process is usually ending).
    cudaStreamSynchronize(stream_);
    if (blas_.workspace) cudaFree(blas_.workspace);
    if (blas_.blas) cublasDestroy(blas_.blas);
    if (blas_.lt) cublasLtDestroy(blas_.lt);
    cudaStreamDestroy(stream_);
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
    // From or to pageable memory the driver would stage the copy and wait: refuse it.
    for (const TensorView* host : {src.device == Device::kCPU ? &src : nullptr,
                                   dst.device == Device::kCPU ? &dst : nullptr}) {
      if (host == nullptr) continue;
      cudaPointerAttributes attributes{};
      CUDA_CHECK(cudaPointerGetAttributes(&attributes, host->data));
      expect(attributes.type == cudaMemoryTypeHost, op,
             describe(host == &src ? "src" : "dst", *host) + " is host memory not from pinned_allocator()");
    }
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), copy_kind(dst, src), stream_));
  }

  std::unique_ptr<QueueEvent> record_event() override { return std::make_unique<StreamEvent>(stream_); }

  void convert(const TensorView& dst, const TensorView& src) override {
    const char* op = "convert";
    expect_device(op, "dst", dst);
    expect_device(op, "src", src);
    expect_numel(op, "src", src, dst.numel());
    auto floating = [](DType d) { return d == DType::kF32 || d == DType::kF64 || d == DType::kBF16 || d == DType::kF16; };
    auto integer = [](DType d) { return d == DType::kI32 || d == DType::kI64; };
    expect(src.dtype == dst.dtype || (floating(src.dtype) && floating(dst.dtype)) ||
               (integer(src.dtype) && integer(dst.dtype)),
           op, "from " + describe("src", src) + " to " + describe("dst", dst) +
                   ": the GPU converts among F32/F64/BF16/F16 and between I32/I64 only");
    cuda_ops::convert(dst, src, stream_);
  }

  void fill(const TensorView& dst, double value) override {
    expect_device("fill", "dst", dst);
    if (dst.numel() == 0) return;
    // The element's bytes come from the CPU reference's fill (the spec of the rounding).
    Tensor one(Shape{1}, dst.dtype);
    cpu_->fill(one.view(), value);
    uint64_t pattern = 0;
    std::memcpy(&pattern, one.data(), dtype_size(dst.dtype));
    cuda_ops::fill_pattern(dst, pattern, stream_);
  }

  void random_mxfp4(const RandomMxfp4Args& args) override {
    const char* op = "random_mxfp4";
    expect_device(op, "codes", args.codes);
    expect_device(op, "scales", args.scales);
    expect_random_mxfp4_shapes(op, args);
    expect(reinterpret_cast<uintptr_t>(args.codes.data) % 16 == 0, op, "codes must be 16-byte aligned");
    cuda_ops::random_mxfp4(args, stream_);
  }

  void axpby(const TensorView& y, const TensorView& x, double alpha, double beta) override {
    const char* op = "axpby";
    expect_float(op, "y", y);
    expect_float(op, "x", x);
    expect_numel(op, "x", x, y.numel());
    expect_alias_same_dtype(op, "y", y, "x", x);
    cuda_ops::axpby(y, x, alpha, beta, stream_);
  }

  double sum_squares(const TensorView& x) override {
    expect_float("sum_squares", "x", x);
    ++host_waits;  // the sum is read back
    return cuda_ops::sum_squares(x, scratch_, stream_);
  }

  void copy_columns(const CopyColumnsArgs& args) override {
    const char* op = "copy_columns";
    expect_float(op, "dst", args.dst);
    expect_float(op, "src", args.src);
    expect_copy_columns_shapes(op, args);
    expect(args.dst.data != args.src.data || args.dst.data == nullptr, op, "dst and src are the same memory");
    cuda_ops::copy_columns(args, stream_);
  }

  void copy_block(const CopyBlockArgs& args) override {
    const char* op = "copy_block";
    expect_float(op, "dst", args.dst);
    expect_float(op, "src", args.src);
    expect_copy_block_shapes(op, args);
    expect(args.dst.data != args.src.data || args.dst.data == nullptr, op, "dst and src are the same memory");
    cuda_ops::copy_block(args, stream_);
  }

  void sum_over_heads(const TensorView& dst, const TensorView& src) override {
    const char* op = "sum_over_heads";
    expect_float(op, "dst", dst);
    expect_float(op, "src", src);
    const int64_t dim = last_dim(op, "dst", dst);
    expect(last_dim(op, "src", src) == dim, op,
           describe("src", src) + " and " + describe("dst", dst) + " differ in the last dimension");
    const int64_t tokens = rows_of(dst);
    expect(tokens == 0 ? src.numel() == 0 : rows_of(src) % tokens == 0, op,
           describe("src", src) + " is not [tokens, heads, dim] for " + describe("dst", dst));
    cuda_ops::sum_over_heads(dst, src, stream_);
  }

  void gemm(const GemmArgs& args) override {
    const char* op = "gemm";
    expect_float(op, "c", args.c);
    expect_float(op, "a", args.a);
    expect_float(op, "b", args.b);
    expect_gemm_shapes(op, args);
    cuda_ops::gemm(args, blas_, stream_);
  }

  void grouped_gemm(const GroupedGemmArgs& args) override {
    const char* op = "grouped_gemm";
    expect_float(op, "c", args.c);
    expect_float(op, "a", args.a);
    if (given(args.b_scale)) {  // an MXFP4 b (ops.h), decoded inside the kernel
      expect_dtype(op, "b", args.b, DType::kU8);
      expect_dtype(op, "b_scale", args.b_scale, DType::kU8);
    } else {
      expect_float(op, "b", args.b);
    }
    if (given(args.a2)) expect_float(op, "a2", args.a2);
    if (given(args.b2)) expect_float(op, "b2", args.b2);
    expect_ndim(op, "a", args.a, 2);
    expect_dtype(op, "group_offsets", args.group_offsets, DType::kI32);
    expect(args.group_offsets.ndim() == 1 && args.group_offsets.numel() >= 1, op,
           describe("group_offsets", args.group_offsets) + " should be [groups + 1]");
    const int64_t rows = args.a.size(0);
    expect_grouped_gemm_shapes(op, args, args.group_offsets.numel() - 1);
    // The offsets are read on the device (no read-back, no wait); the caller's host copy, when it
    // has one, is checked here.
    if (args.host_group_offsets != nullptr) {
      const std::vector<int32_t> offsets(args.host_group_offsets,
                                         args.host_group_offsets + args.group_offsets.numel());
      expect_offsets(op, "group_offsets", offsets, rows);
    }
    cuda_ops::grouped_gemm(args, blas_, stream_);
  }

  void embedding_forward(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    const char* op = "embedding_forward";
    expect_float(op, "out", out);
    expect_float(op, "table", table);
    check_embedding(op, out, table, ids);
    check_token_ids(download_i32(ids, stream_), table.size(0));
    cuda_ops::embedding_forward(out, table, ids, stream_);
  }

  // The caller checked the ids on the host (ops.h): no read-back, no wait.
  void embedding_forward_checked_ids(const TensorView& out, const TensorView& table, const TensorView& ids) override {
    const char* op = "embedding_forward_checked_ids";
    expect_float(op, "out", out);
    expect_float(op, "table", table);
    check_embedding(op, out, table, ids);
    cuda_ops::embedding_forward(out, table, ids, stream_);
  }

  void embedding_backward(const TensorView& dtable, const TensorView& dout, const TensorView& ids) override {
    const char* op = "embedding_backward";
    expect_float(op, "dtable", dtable);
    expect_float(op, "dout", dout);
    check_embedding(op, dout, dtable, ids);
    const std::vector<int32_t> host_ids = download_i32(ids, stream_);
    check_token_ids(host_ids, dtable.size(0));
    cuda_ops::embedding_backward(dtable, dout, host_ids, scratch_, stream_);
  }

  void rmsnorm_forward(const RmsNormArgs& args) override {
    const char* op = "rmsnorm_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_float(op, "weight", args.weight);
    expect_f32(op, "rstd", args.rstd);
    const int64_t dim = last_dim(op, "x", args.x);
    expect_numel(op, "weight", args.weight, dim);
    expect_shape(op, "y", args.y, args.x.shape);
    expect_numel(op, "rstd", args.rstd, rows_of(args.x));
    expect_alias_same_dtype(op, "y", args.y, "x", args.x);
    cuda_ops::rmsnorm_forward(args, stream_);
  }

  void rmsnorm_backward(const RmsNormBackwardArgs& args) override {
    const char* op = "rmsnorm_backward";
    expect_float(op, "dx", args.dx);
    expect_float(op, "dy", args.dy);
    expect_float(op, "x", args.x);
    expect_float(op, "weight", args.weight);
    expect_f32(op, "rstd", args.rstd);
    const int64_t dim = last_dim(op, "x", args.x);
    expect_numel(op, "weight", args.weight, dim);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dy", args.dy, args.x.shape);
    expect_numel(op, "rstd", args.rstd, rows_of(args.x));
    expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
    if (given(args.dweight)) {
      expect_f32(op, "dweight", args.dweight);
      expect_numel(op, "dweight", args.dweight, dim);
      // dweight is summed after dx is written, from dy and x.
      expect(args.dx.data != args.dy.data && args.dx.data != args.x.data, op,
             "dx must not overwrite dy or x when dweight is wanted");
    }
    cuda_ops::rmsnorm_backward(args, scratch_, stream_);
  }

  void rope(const RopeArgs& args) override {
    const char* op = "rope";
    expect_float(op, "out", args.out);
    expect_float(op, "x", args.x);
    expect_f32(op, "cos", args.cos);
    expect_f32(op, "sin", args.sin);
    expect_dtype(op, "positions", args.positions, DType::kI32);
    expect_shape(op, "out", args.out, args.x.shape);
    expect_alias_same_dtype(op, "out", args.out, "x", args.x);
    const int64_t width = last_dim(op, "x", args.x);
    expect(args.rope_dim > 0 && args.rope_dim % 2 == 0 && args.rope_dim <= cuda_ops::kMaxRopeDim, op,
           "rope_dim " + std::to_string(args.rope_dim) + " must be positive, even and at most " +
               std::to_string(cuda_ops::kMaxRopeDim));
    expect_rope_shapes(op, args, width);
    cuda_ops::rope(args, stream_);
  }

  void attention_forward(const AttentionArgs& args) override {
    const char* op = "attention_forward";
    expect_float(op, "out", args.out);
    expect_float(op, "q", args.q);
    expect_float(op, "k", args.k);
    expect_float(op, "v", args.v);
    expect_f32(op, "lse", args.lse);
    check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens);
    cuda_ops::attention_forward(args, stream_);
  }

  void attention_backward(const AttentionBackwardArgs& args) override {
    const char* op = "attention_backward";
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &args.dq},
                                  {"dk", &args.dk}, {"dv", &args.dv}, {"dout", &args.dout}, {"q", &args.q},
                                  {"k", &args.k}, {"v", &args.v}, {"out", &args.out}})
      expect_float(op, name, *t);
    expect_f32(op, "lse", args.lse);
    check_attention(op, args.q, args.k, args.v, args.out, args.lse, args.cu_seqlens);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dk", args.dk, args.k.shape);
    expect_shape(op, "dv", args.dv, args.v.shape);
    expect_shape(op, "dout", args.dout, args.out.shape);
    cuda_ops::attention_backward(args, stream_);
  }

  void swiglu_forward(const TensorView& h, const TensorView& gate_up) override {
    const char* op = "swiglu_forward";
    expect_float(op, "h", h);
    expect_float(op, "gate_up", gate_up);
    expect_swiglu_shapes(op, h, gate_up);
    cuda_ops::swiglu_forward(h, gate_up, stream_);
  }

  void swiglu_backward(const SwigluBackwardArgs& args) override {
    const char* op = "swiglu_backward";
    expect_float(op, "dgate_up", args.dgate_up);
    expect_float(op, "dh", args.dh);
    expect_float(op, "gate_up", args.gate_up);
    expect_swiglu_shapes(op, args.dh, args.gate_up);
    expect_shape(op, "dgate_up", args.dgate_up, args.gate_up.shape);
    expect_alias_same_dtype(op, "dgate_up", args.dgate_up, "gate_up", args.gate_up);
    cuda_ops::swiglu_backward(args, stream_);
  }

  void attn_res_forward(const AttnResArgs& args) override {
    const char* op = "attn_res_forward";
    expect_float(op, "out", args.out);
    expect_f32(op, "probs", args.probs);
    expect_float(op, "norm_weight", args.norm_weight);
    expect_float(op, "query", args.query);
    for (const TensorView& v : args.values) expect_float(op, "value", v);
    expect_attn_res_shapes(op, "out", args.out, args.values, nullptr, args.probs, args.norm_weight, args.query);
    cuda_ops::attn_res_forward(args, stream_);
  }

  void attn_res_backward(const AttnResBackwardArgs& args) override {
    const char* op = "attn_res_backward";
    expect_float(op, "dout", args.dout);
    expect_f32(op, "probs", args.probs);
    expect_float(op, "norm_weight", args.norm_weight);
    expect_float(op, "query", args.query);
    for (const TensorView& v : args.values) expect_float(op, "value", v);
    for (const TensorView& g : args.dvalues) expect_float(op, "dvalue", g);
    expect_attn_res_shapes(op, "dout", args.dout, args.values, &args.dvalues, args.probs, args.norm_weight,
                           args.query);
    cuda_ops::attn_res_backward(args, stream_);
  }

  void situ_forward(const SituArgs& args) override {
    const char* op = "situ_forward";
    expect_float(op, "h", args.h);
    expect_float(op, "gate_up", args.gate_up);
    expect_swiglu_shapes(op, args.h, args.gate_up);
    expect_situ_betas(op, args.beta, args.linear_beta);
    cuda_ops::situ_forward(args, stream_);
  }

  void situ_backward(const SituBackwardArgs& args) override {
    const char* op = "situ_backward";
    expect_float(op, "dgate_up", args.dgate_up);
    expect_float(op, "dh", args.dh);
    expect_float(op, "gate_up", args.gate_up);
    expect_swiglu_shapes(op, args.dh, args.gate_up);
    expect_shape(op, "dgate_up", args.dgate_up, args.gate_up.shape);
    expect_alias_same_dtype(op, "dgate_up", args.dgate_up, "gate_up", args.gate_up);
    expect_situ_betas(op, args.beta, args.linear_beta);
    cuda_ops::situ_backward(args, stream_);
  }

  void router_forward(const RouterArgs& args) override {
    const char* op = "router_forward";
    expect_f32(op, "logits", args.logits);
    expect_f32(op, "scores", args.scores);
    expect_f32(op, "topk_weight", args.topk_weight);
    expect_ndim(op, "logits", args.logits, 2);
    const int64_t tokens = args.logits.size(0), experts = args.logits.size(1);
    expect_shape(op, "scores", args.scores, args.logits.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_shape(op, "topk_index", args.topk_index, Shape{tokens, args.top_k});
    expect_shape(op, "topk_weight", args.topk_weight, Shape{tokens, args.top_k});
    if (given(args.bias)) {
      expect_float(op, "bias", args.bias);
      expect_numel(op, "bias", args.bias, experts);
    }
    if (given(args.noise)) {
      expect_float(op, "noise", args.noise);
      expect_shape(op, "noise", args.noise, args.logits.shape);
    }
    expect_router_groups(op, args, experts);
    cuda_ops::router_forward(args, stream_);
  }

  void router_backward(const RouterBackwardArgs& args) override {
    const char* op = "router_backward";
    expect_f32(op, "dlogits", args.dlogits);
    expect_f32(op, "dtopk_weight", args.dtopk_weight);
    expect_f32(op, "scores", args.scores);
    expect_ndim(op, "scores", args.scores, 2);
    const int64_t tokens = args.scores.size(0);
    expect_shape(op, "dlogits", args.dlogits, args.scores.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    expect(args.topk_index.size(0) == tokens, op,
           describe("topk_index", args.topk_index) + " for " + std::to_string(tokens) + " tokens");
    expect_shape(op, "dtopk_weight", args.dtopk_weight, args.topk_index.shape);
    if (given(args.dscores_extra)) {
      expect_f32(op, "dscores_extra", args.dscores_extra);
      expect_shape(op, "dscores_extra", args.dscores_extra, args.scores.shape);
    }
    cuda_ops::router_backward(args, stream_);
  }

  void aux_loss(const AuxLossArgs& args) override {
    const char* op = "aux_loss";
    expect_f32(op, "loss", args.loss);
    expect_f32(op, "dscores", args.dscores);
    expect_f32(op, "scores", args.scores);
    expect_ndim(op, "scores", args.scores, 2);
    const int64_t tokens = args.scores.size(0);
    expect_numel(op, "loss", args.loss, 1);
    expect_shape(op, "dscores", args.dscores, args.scores.shape);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    expect(args.topk_index.size(0) == tokens, op,
           describe("topk_index", args.topk_index) + " for " + std::to_string(tokens) + " tokens");
    expect(args.tokens_per_segment >= 1 && tokens % args.tokens_per_segment == 0, op,
           std::to_string(tokens) + " tokens do not split into segments of " + std::to_string(args.tokens_per_segment));
    cuda_ops::aux_loss(args, stream_);
  }

  void moe_permutation(const MoePermutationArgs& args) override {
    const char* op = "moe_permutation";
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_ndim(op, "topk_index", args.topk_index, 2);
    const int64_t pairs = args.topk_index.numel();
    expect(args.num_experts >= 1, op, "num_experts " + std::to_string(args.num_experts));
    expect_dtype(op, "expert_offsets", args.expert_offsets, DType::kI32);
    expect_numel(op, "expert_offsets", args.expert_offsets, args.num_experts + 1);
    expect_dtype(op, "sorted_pair", args.sorted_pair, DType::kI32);
    expect_numel(op, "sorted_pair", args.sorted_pair, pairs);
    expect_dtype(op, "pair_row", args.pair_row, DType::kI32);
    expect_numel(op, "pair_row", args.pair_row, pairs);
    cuda_ops::moe_permutation(args, stream_);
  }

  void moe_permute(const TensorView& out, const TensorView& x, const TensorView& sorted_pair,
                   int64_t top_k) override {
    const char* op = "moe_permute";
    expect_float(op, "out", out);
    expect_float(op, "x", x);
    expect(top_k >= 1, op, "top_k " + std::to_string(top_k));
    expect_dtype(op, "sorted_pair", sorted_pair, DType::kI32);
    expect(out.ndim() >= 1 && x.ndim() >= 1, op, describe("out", out) + " and " + describe("x", x) + " need rows");
    expect_numel(op, "sorted_pair", sorted_pair, out.size(0));
    expect(out.numel() == sorted_pair.numel() * (x.size(0) == 0 ? 0 : x.numel() / x.size(0)), op,
           describe("out", out) + " should have one row of " + describe("x", x) + " per sorted pair");
    cuda_ops::moe_permute(out, x, sorted_pair, top_k, stream_);
  }

  void moe_unpermute_sum(const TensorView& dx, const TensorView& drows, const TensorView& pair_row, int64_t top_k,
                         bool accumulate) override {
    const char* op = "moe_unpermute_sum";
    expect_float(op, "dx", dx);
    expect_float(op, "drows", drows);
    expect(top_k >= 1, op, "top_k " + std::to_string(top_k));
    expect(dx.ndim() >= 1 && drows.ndim() >= 1, op,
           describe("dx", dx) + " and " + describe("drows", drows) + " need rows");
    expect_dtype(op, "pair_row", pair_row, DType::kI32);
    expect_numel(op, "pair_row", pair_row, dx.size(0) * top_k);
    expect(drows.numel() * dx.size(0) == dx.numel() * drows.size(0), op,
           describe("drows", drows) + " and " + describe("dx", dx) + " differ in row width");
    cuda_ops::moe_unpermute_sum(dx, drows, pair_row, top_k, accumulate, stream_);
  }

  void moe_combine(const MoeCombineArgs& args) override {
    const char* op = "moe_combine";
    expect_float(op, "out", args.out);
    expect_float(op, "rows", args.rows);
    expect_float(op, "weight", args.weight);
    check_combine(op, args.out, args.rows, args.weight, args.pair_row);
    cuda_ops::moe_combine(args, stream_);
  }

  void moe_combine_backward(const MoeCombineBackwardArgs& args) override {
    const char* op = "moe_combine_backward";
    expect_float(op, "drows", args.drows);
    expect_float(op, "dweight", args.dweight);
    expect_float(op, "dout", args.dout);
    expect_float(op, "rows", args.rows);
    expect_float(op, "weight", args.weight);
    check_combine(op, args.dout, args.rows, args.weight, args.pair_row);
    expect_shape(op, "drows", args.drows, args.rows.shape);
    expect_shape(op, "dweight", args.dweight, args.weight.shape);
    cuda_ops::moe_combine_backward(args, stream_);
  }

  void cross_entropy(const CrossEntropyArgs& args) override {
    const char* op = "cross_entropy";
    expect_float(op, "logits", args.logits);
    expect_f32(op, "loss", args.loss);
    expect_ndim(op, "logits", args.logits, 2);
    const int64_t rows = args.logits.size(0);
    expect(args.logits.size(1) >= 1, op, describe("logits", args.logits) + " has no vocabulary");
    expect_dtype(op, "labels", args.labels, DType::kI32);
    expect_numel(op, "labels", args.labels, rows);
    expect_numel(op, "loss", args.loss, rows);
    if (given(args.dlogits)) {  // may be BF16 next to F32 logits: the head's GEMM takes it as is
      expect_float(op, "dlogits", args.dlogits);
      expect_alias_same_dtype(op, "dlogits", args.dlogits, "logits", args.logits);
      expect_shape(op, "dlogits", args.dlogits, args.logits.shape);
    }
    cuda_ops::cross_entropy(args, stream_);
  }

  void adamw(const AdamWArgs& args) override {
    const char* op = "adamw";
    expect_f32(op, "param", args.param);
    expect_f32(op, "grad", args.grad);
    expect_f32(op, "exp_avg", args.exp_avg);
    expect_f32(op, "exp_avg_sq", args.exp_avg_sq);
    expect_numel(op, "grad", args.grad, args.param.numel());
    expect_numel(op, "exp_avg", args.exp_avg, args.param.numel());
    expect_numel(op, "exp_avg_sq", args.exp_avg_sq, args.param.numel());
    expect(args.step >= 1, op, "step " + std::to_string(args.step) + " (steps are 1-based)");
    cuda_ops::adamw(args, stream_);
  }

  // ---- KDA (kernels/cuda/kda*.cu, short_conv.cu)
  void short_conv_forward(const ShortConvArgs& args) override {
    const char* op = "short_conv_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_float(op, "weight", args.weight);
    expect_short_conv_shapes(op, "y", args.y, args.x, args.weight);
    check_conv(op, args.weight, args.cu_seqlens);
    // A tile of tokens reads the inputs of the tokens before it.
    expect(args.y.data != args.x.data || args.x.numel() == 0, op, "y must not share memory with x");
    cuda_ops::short_conv_forward(args, stream_);
  }

  void short_conv_backward(const ShortConvBackwardArgs& args) override {
    const char* op = "short_conv_backward";
    expect_float(op, "dx", args.dx);
    expect_float(op, "dy", args.dy);
    expect_float(op, "x", args.x);
    expect_float(op, "weight", args.weight);
    expect_short_conv_shapes(op, "dy", args.dy, args.x, args.weight);
    expect_shape(op, "dx", args.dx, args.x.shape);
    if (given(args.dweight)) {
      expect_f32(op, "dweight", args.dweight);
      expect_shape(op, "dweight", args.dweight, args.weight.shape);
    }
    check_conv(op, args.weight, args.cu_seqlens);
    expect((args.dx.data != args.dy.data && args.dx.data != args.x.data) || args.x.numel() == 0, op,
           "dx must not share memory with dy or x");
    cuda_ops::short_conv_backward(args, stream_);
  }

  void l2norm_forward(const L2NormArgs& args) override {
    const char* op = "l2norm_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_f32(op, "inv_norm", args.inv_norm);
    last_dim(op, "x", args.x);
    expect_shape(op, "y", args.y, args.x.shape);
    expect_numel(op, "inv_norm", args.inv_norm, rows_of(args.x));
    expect_alias_same_dtype(op, "y", args.y, "x", args.x);
    cuda_ops::l2norm_forward(args, stream_);
  }

  void l2norm_backward(const L2NormBackwardArgs& args) override {
    const char* op = "l2norm_backward";
    expect_float(op, "dx", args.dx);
    expect_float(op, "dy", args.dy);
    expect_float(op, "x", args.x);
    expect_f32(op, "inv_norm", args.inv_norm);
    last_dim(op, "x", args.x);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dy", args.dy, args.x.shape);
    expect_numel(op, "inv_norm", args.inv_norm, rows_of(args.x));
    expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
    cuda_ops::l2norm_backward(args, stream_);
  }

  void kda_gate_forward(const KdaGateArgs& args) override {
    const char* op = "kda_gate_forward";
    expect_f32(op, "g", args.g);
    expect_float(op, "f", args.f);
    expect_f32(op, "a_log", args.a_log);
    expect_f32(op, "dt_bias", args.dt_bias);
    expect_kda_gate_shapes(op, "g", args.g, args.f, args.a_log, args.dt_bias, args.lower_bound);
    cuda_ops::kda_gate_forward(args, stream_);
  }

  void kda_gate_backward(const KdaGateBackwardArgs& args) override {
    const char* op = "kda_gate_backward";
    expect_float(op, "df", args.df);
    expect_f32(op, "dg", args.dg);
    expect_float(op, "f", args.f);
    expect_f32(op, "a_log", args.a_log);
    expect_f32(op, "dt_bias", args.dt_bias);
    expect_kda_gate_shapes(op, "dg", args.dg, args.f, args.a_log, args.dt_bias, args.lower_bound);
    expect_shape(op, "df", args.df, args.f.shape);
    cuda_ops::kda_gate_backward(args, stream_);
  }

  void kda_forward(const KdaArgs& args) override {
    const char* op = "kda_forward";
    expect_float(op, "out", args.out);
    expect_float(op, "q", args.q);
    expect_float(op, "k", args.k);
    expect_float(op, "v", args.v);
    expect_f32(op, "g", args.g);
    expect_f32(op, "beta", args.beta);
    expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
    expect_shape(op, "out", args.out, args.v.shape);
    check_kda(op, args.q, args.v, args.cu_seqlens);
    cuda_ops::kda_forward(args, stream_);
  }

  void kda_backward(const KdaBackwardArgs& args) override {
    const char* op = "kda_backward";
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &args.dq},
                                  {"dk", &args.dk}, {"dv", &args.dv}, {"dout", &args.dout}, {"q", &args.q},
                                  {"k", &args.k}, {"v", &args.v}})
      expect_float(op, name, *t);
    expect_f32(op, "dg", args.dg);
    expect_f32(op, "dbeta", args.dbeta);
    expect_f32(op, "g", args.g);
    expect_f32(op, "beta", args.beta);
    expect_kda_shapes(op, args.q, args.k, args.v, args.g, args.beta);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dk", args.dk, args.k.shape);
    expect_shape(op, "dv", args.dv, args.v.shape);
    expect_shape(op, "dg", args.dg, args.g.shape);
    expect_shape(op, "dbeta", args.dbeta, args.beta.shape);
    expect_shape(op, "dout", args.dout, args.v.shape);
    check_kda(op, args.q, args.v, args.cu_seqlens);
    cuda_ops::kda_backward(args, stream_);
  }

  void gated_rmsnorm_forward(const GatedRmsNormArgs& args) override {
    const char* op = "gated_rmsnorm_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_float(op, "gate", args.gate);
    expect_float(op, "weight", args.weight);
    expect_f32(op, "rstd", args.rstd);
    expect_gated_rmsnorm_shapes(op, "y", args.y, args.x, args.gate, args.weight, args.rstd);
    expect_alias_same_dtype(op, "y", args.y, "x", args.x);
    expect_alias_same_dtype(op, "y", args.y, "gate", args.gate);
    cuda_ops::gated_rmsnorm_forward(args, stream_);
  }

  void gated_rmsnorm_backward(const GatedRmsNormBackwardArgs& args) override {
    const char* op = "gated_rmsnorm_backward";
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dx", &args.dx},
                                  {"dgate", &args.dgate}, {"dy", &args.dy}, {"x", &args.x}, {"gate", &args.gate},
                                  {"weight", &args.weight}})
      expect_float(op, name, *t);
    expect_f32(op, "rstd", args.rstd);
    expect_gated_rmsnorm_shapes(op, "dy", args.dy, args.x, args.gate, args.weight, args.rstd);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dgate", args.dgate, args.x.shape);
    expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
    expect_alias_same_dtype(op, "dgate", args.dgate, "dy", args.dy);
    expect(args.dx.data != args.dgate.data || args.dx.data == nullptr, op, "dx and dgate are the same memory");
    if (given(args.dweight)) {
      expect_f32(op, "dweight", args.dweight);
      expect_numel(op, "dweight", args.dweight, args.weight.numel());
      // dweight is summed after dx and dgate are written, from dy, x and gate.
      for (const void* written : {args.dx.data, args.dgate.data})
        expect(written != args.dy.data && written != args.x.data && written != args.gate.data, op,
               "dx and dgate must not overwrite dy, x or gate when dweight is wanted");
    }
    cuda_ops::gated_rmsnorm_backward(args, stream_);
  }

  void sigmoid_forward(const TensorView& y, const TensorView& x) override {
    const char* op = "sigmoid_forward";
    expect_float(op, "y", y);
    expect_float(op, "x", x);
    expect_numel(op, "y", y, x.numel());
    expect_alias_same_dtype(op, "y", y, "x", x);
    cuda_ops::sigmoid_forward(y, x, stream_);
  }

  void sigmoid_backward(const TensorView& dx, const TensorView& dy, const TensorView& y) override {
    const char* op = "sigmoid_backward";
    expect_float(op, "dx", dx);
    expect_float(op, "dy", dy);
    expect_float(op, "y", y);
    expect_numel(op, "dx", dx, y.numel());
    expect_numel(op, "dy", dy, y.numel());
    expect_alias_same_dtype(op, "dx", dx, "dy", dy);
    expect_alias_same_dtype(op, "dx", dx, "y", y);
    cuda_ops::sigmoid_backward(dx, dy, y, stream_);
  }
  // ---- KDA end

  // ---- DSA (kernels/cuda/dsa*.cu, sparse_attention.cu; the CPU reference is kernels/cpu/dsa.h) ----
  void layernorm_forward(const LayerNormArgs& args) override {
    const char* op = "layernorm_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_float(op, "weight", args.weight);
    expect_float(op, "bias", args.bias);
    expect_layernorm_shapes(op, args);
    expect_alias_same_dtype(op, "y", args.y, "x", args.x);
    cuda_ops::layernorm_forward(args, stream_);
  }

  void dsa_indexer_topk(const DsaIndexerArgs& args) override {
    const char* op = "dsa_indexer_topk";
    expect_float(op, "q", args.q);
    expect_float(op, "k", args.k);
    expect_f32(op, "weights", args.weights);
    expect_dtype(op, "topk_index", args.topk_index, DType::kI32);
    expect_dsa_indexer_shapes(op, args);
    check_segments(op, args.cu_seqlens);
    expect(args.q.size(2) <= cuda_ops::kDsaMaxIndexerDim, op,
           describe("q", args.q) + ": the CUDA indexer takes head dims up to " +
               std::to_string(cuda_ops::kDsaMaxIndexerDim));
    expect(args.q.size(0) <= kMaxInt32, op, describe("q", args.q) + ": more tokens than int32 topk_index can name");
    cuda_ops::dsa_indexer_topk(args, scratch_, stream_);
  }

  void sparse_attention_forward(const SparseAttentionArgs& args) override {
    const char* op = "sparse_attention_forward";
    expect_float(op, "out", args.out);
    expect_float(op, "q", args.q);
    expect_float(op, "kv", args.kv);
    expect_f32(op, "lse", args.lse);
    check_sparse_attention(op, args.q, args.kv, args.out, args.lse, args.topk_index);
    cuda_ops::sparse_attention_forward(args, stream_);
  }

  void sparse_attention_backward(const SparseAttentionBackwardArgs& args) override {
    const char* op = "sparse_attention_backward";
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dq", &args.dq},
                                  {"dkv", &args.dkv}, {"dout", &args.dout}, {"q", &args.q}, {"kv", &args.kv},
                                  {"out", &args.out}})
      expect_float(op, name, *t);
    expect_f32(op, "lse", args.lse);
    check_sparse_attention(op, args.q, args.kv, args.out, args.lse, args.topk_index);
    expect_shape(op, "dout", args.dout, args.out.shape);
    expect_shape(op, "dq", args.dq, args.q.shape);
    expect_shape(op, "dkv", args.dkv, args.kv.shape);
    // dq is written while other queries still read their inputs, and an F32 dkv is zeroed first
    // (it is the accumulator): neither may share memory with an input.
    for (const TensorView* written : {&args.dq, &args.dkv})
      for (const TensorView* read : {&args.dout, &args.q, &args.kv, &args.out, &args.lse})
        expect(written->data == nullptr || written->data != read->data, op,
               "dq and dkv must not share memory with dout, q, kv, out or lse");
    expect(args.q.size(0) * args.topk_index.size(1) <= kMaxInt32, op,
           describe("topk_index", args.topk_index) + ": more entries than the int32 inverse index holds");
    cuda_ops::sparse_attention_backward(args, scratch_, stream_);
  }

  void attention_gate_forward(const AttentionGateArgs& args) override {
    const char* op = "attention_gate_forward";
    expect_float(op, "y", args.y);
    expect_float(op, "x", args.x);
    expect_float(op, "gate", args.gate);
    expect_attention_gate_shapes(op, "y", args.y, args.x, args.gate, args.headwise);
    expect_alias_same_dtype(op, "y", args.y, "x", args.x);
    // A headwise gate is read by a whole row of y: y must not overwrite it.
    expect(args.y.data != args.gate.data || args.y.data == nullptr, op, "y and gate are the same memory");
    cuda_ops::attention_gate_forward(args, stream_);
  }

  void attention_gate_backward(const AttentionGateBackwardArgs& args) override {
    const char* op = "attention_gate_backward";
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"dx", &args.dx},
                                  {"dgate", &args.dgate}, {"dy", &args.dy}, {"x", &args.x}, {"gate", &args.gate}})
      expect_float(op, name, *t);
    expect_attention_gate_shapes(op, "dy", args.dy, args.x, args.gate, args.headwise);
    expect_shape(op, "dx", args.dx, args.x.shape);
    expect_shape(op, "dgate", args.dgate, args.gate.shape);
    expect_alias_same_dtype(op, "dx", args.dx, "dy", args.dy);
    // dx may overwrite dy (each element is read before it is written), nothing else may alias.
    for (const void* input : {args.x.data, args.gate.data, args.dgate.data})
      expect(args.dx.data != input || args.dx.data == nullptr, op, "dx shares memory with x, gate or dgate");
    for (const void* input : {args.dy.data, args.x.data, args.gate.data})
      expect(args.dgate.data != input || args.dgate.data == nullptr, op, "dgate shares memory with dy, x or gate");
    cuda_ops::attention_gate_backward(args, stream_);
  }

  // Token indices and inverse-index positions are int32.
  static constexpr int64_t kMaxInt32 = 2147483647;

  // q [tokens, heads, qk_dim], kv [tokens, qk_dim], out [tokens, heads, v_dim], lse, int32 topk_index;
  // head dims within what the kernels hold.
  static void check_sparse_attention(const char* op, const TensorView& q, const TensorView& kv, const TensorView& out,
                                     const TensorView& lse, const TensorView& topk_index) {
    expect_dtype(op, "topk_index", topk_index, DType::kI32);
    expect_sparse_attention_shapes(op, q, kv, "out", out, lse, topk_index);
    expect(q.size(2) <= cuda_ops::kSparseMaxQkDim && out.size(2) <= cuda_ops::kSparseMaxVDim, op,
           describe("q", q) + ", " + describe("out", out) + ": the CUDA sparse attention takes qk_dim up to " +
               std::to_string(cuda_ops::kSparseMaxQkDim) + " and v_dim up to " +
               std::to_string(cuda_ops::kSparseMaxVDim));
    expect(q.size(0) <= kMaxInt32, op, describe("q", q) + ": more tokens than int32 topk_index can name");
  }
  // ---- DSA end

 private:
  static void check_embedding(const char* op, const TensorView& rows_out, const TensorView& table,
                              const TensorView& ids) {
    expect_dtype(op, "ids", ids, DType::kI32);
    expect_embedding_shapes(op, rows_out, table, ids);
  }

  // The one user-data error of the backend, as on the CPU: ids from another tokenizer.
  static void check_token_ids(const std::vector<int32_t>& ids, int64_t rows) {
    for (size_t t = 0; t < ids.size(); ++t) {
      MOETRAIN_CHECK(ids[t] >= 0 && ids[t] < rows, ExitCode::kBadData,
                     "token id " + std::to_string(ids[t]) + " at token position " + std::to_string(t) +
                         " is outside the embedding table's " + std::to_string(rows) +
                         " rows: the data was tokenised for another vocabulary, or vocab_size is too small");
    }
  }

  static void check_attention(const char* op, const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& out, const TensorView& lse, const TensorView& cu_seqlens) {
    expect_attention_shapes(op, q, k, v, out, lse);
    expect_dtype(op, "cu_seqlens", cu_seqlens, DType::kI32);
    expect(cu_seqlens.ndim() == 1 && cu_seqlens.numel() >= 1, op,
           describe("cu_seqlens", cu_seqlens) + " should be [sequences + 1]");
  }

  static void check_combine(const char* op, const TensorView& out, const TensorView& rows, const TensorView& weight,
                            const TensorView& pair_row) {
    expect_dtype(op, "pair_row", pair_row, DType::kI32);
    expect_combine_shapes(op, out, rows, weight, pair_row);
  }

  static void check_segments(const char* op, const TensorView& cu_seqlens) {
    expect_dtype(op, "cu_seqlens", cu_seqlens, DType::kI32);
    expect(cu_seqlens.ndim() == 1 && cu_seqlens.numel() >= 1, op,
           describe("cu_seqlens", cu_seqlens) + " should be [sequences + 1]");
  }

  static void check_conv(const char* op, const TensorView& weight, const TensorView& cu_seqlens) {
    check_segments(op, cu_seqlens);
    expect(weight.size(1) <= cuda_ops::kShortConvMaxWidth, op,
           describe("weight", weight) + ": the CUDA short convolution takes widths up to " +
               std::to_string(cuda_ops::kShortConvMaxWidth));
  }

  static void check_kda(const char* op, const TensorView& q, const TensorView& v, const TensorView& cu_seqlens) {
    check_segments(op, cu_seqlens);
    expect(cuda_ops::kda_head_dims_supported(q.size(2), v.size(2)), op,
           "head dims " + describe("q", q) + ", " + describe("v", v) + ": the CUDA KDA takes up to 128 for each");
  }

  cudaStream_t stream_ = nullptr;
  cuda_ops::BlasContext blas_;
  cuda_ops::DeviceScratch gemm_scratch_;  // BF16 copies of F32 GEMM operands
  cuda_ops::GemmPlanCache gemm_plans_;    // cuBLASLt descriptors and algorithms per GEMM shape
  cuda_ops::DeviceScratch scratch_;       // everything else (partials, index tables)
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();  // fill's element encoding
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace moetrain::kernels
