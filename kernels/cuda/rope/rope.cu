// Rope has two kernels.
// The vector kernel (rope_dim a multiple of 16 up to 512, rows and columns 16-byte aligned, x and
// out of one dtype: the MLA case): each thread owns 8 rotation pairs i = 8k .. 8k+7 of kRows rows
// of one token (heads h, h + head_groups, ...), so a row takes rope_dim / 16 threads of one warp.
// It loads the token's position, its rows' rotated columns (two 16-byte chunks per row, kept raw
// in registers; nothing else of the row is read in place), then its 8 cos and 8 sin values once
// for all its rows, rotates, and stores two 16-byte chunks per row. Its index math is 32-bit:
// shapes with 2^31 threads or rows or more go to the staged kernel. In place with the
// interleaved layout, its outputs land on other threads' inputs of the same row: every thread
// loads first, __syncwarp, then stores. It is launched as a programmatic dependent launch (a rope
// launched right after another starts as the other ends). On the H200 (8 back-to-back launches
// timed as moetrain-bench does), MLA's layout (64 of 192 BF16 columns: a 128-byte slice every 384
// bytes) caps even a plain in-place copy of those slices at about 0.80 of the 4.2 TB/s copy
// ceiling, well below the same bytes contiguous; the kernel runs close to that cap there and near
// the copy ceiling over whole heads of 64, a contiguous stream (moetrain-bench ops; docs/PERF.md).
// Its index math is 32-bit and its layout a template argument for that reason.
// The staged kernel covers every other shape: each block owns `rows_per_block` whole rows. It
// stages their rope columns in shared memory (as F32), waits, then writes the rotated pairs, so
// the interleaved layout is safe in place. Out of place, both kernels also copy the row's other
// columns.
#include "kernels/cuda/rope/rope.h"

#include <cmath>
#include <type_traits>

#include "kernels/cuda/common/cuda_check.h"
#include "kernels/cuda/common/element_access.cuh"
#include "kernels/cuda/common/raw_chunk.cuh"

namespace moetrain::kernels::cuda_ops {
namespace {

constexpr int kThreads = 256;

struct RopeShape {
  int64_t rows, width, heads, col_offset, rope_dim, max_position, rows_per_block;
  bool interleaved, inverse, in_place;
};

__global__ void rope_staged_kernel(MutOperand out, ConstOperand x, const int32_t* __restrict__ positions,
                            const float* __restrict__ cos_table, const float* __restrict__ sin_table, RopeShape s) {
  extern __shared__ float staged[];  // [rows_per_block, rope_dim]
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * s.rows_per_block;
  const int64_t rows_here = min(s.rows_per_block, s.rows - row0);
  const int64_t half = s.rope_dim / 2;

  if (!s.in_place) {
    for (int64_t e = threadIdx.x; e < rows_here * s.width; e += blockDim.x) {
      const int64_t col = e % s.width;
      if (col < s.col_offset || col >= s.col_offset + s.rope_dim) {
        const int64_t at = row0 * s.width + e;
        store_one(out, at, load_one(x, at));
      }
    }
  }
  for (int64_t e = threadIdx.x; e < rows_here * s.rope_dim; e += blockDim.x) {
    const int64_t r = e / s.rope_dim, i = e % s.rope_dim;
    staged[e] = load_one(x, (row0 + r) * s.width + s.col_offset + i);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < rows_here * half; e += blockDim.x) {
    const int64_t r = e / half, i = e % half;
    const int64_t row = row0 + r;
    const float* in = staged + r * s.rope_dim;
    const int64_t out_base = row * s.width + s.col_offset;
    const int32_t position = positions[row / s.heads];
    float first, second;  // the values for out[i] and out[i + half] (forward) or the two layout slots
    if (position < 0 || position >= s.max_position) {
      first = second = nanf("");
    } else {
      const float c = cos_table[static_cast<int64_t>(position) * half + i];
      const float sn = sin_table[static_cast<int64_t>(position) * half + i];
      if (!s.inverse) {
        const float a = s.interleaved ? in[2 * i] : in[i];
        const float b = s.interleaved ? in[2 * i + 1] : in[i + half];
        first = a * c - b * sn;
        second = b * c + a * sn;
      } else {
        const float xa = in[i], xb = in[i + half];
        first = xa * c + xb * sn;
        second = xb * c - xa * sn;
      }
    }
    if (!s.inverse || !s.interleaved) {
      store_one(out, out_base + i, first);
      store_one(out, out_base + i + half, second);
    } else {
      store_one(out, out_base + 2 * i, first);
      store_one(out, out_base + 2 * i + 1, second);
    }
  }
}

// The vector kernel's shape. Its index math is 32-bit (the launch keeps it for shapes whose
// thread and row counts fit in 31 bits): 64-bit divisions are a long instruction sequence each.
struct RopeVectorShape {
  uint32_t tokens, heads, head_groups;  // head_groups: heads per thread-row slot (rows / thread)
  uint32_t group_multiplier, group_shift;  // slot / head_groups, see group_divider
  uint32_t width, col_offset, rope_dim, max_position;
  uint64_t group_stride;  // head_groups * width: from a thread's row j to its row j + 1
  bool in_place;
};

// n / d for n < 2^31 as (umulhi(n, multiplier) + n) >> shift, with shift = ceil(log2 d) and
// multiplier = floor(2^32 (2^shift - d) / d) + 1 (Granlund and Montgomery's round-up method:
// (2^32 + multiplier) d - 2^(32 + shift) lies in (0, d], at most 2^shift, which makes the
// quotient exact for every n < 2^32; n < 2^31 keeps the 32-bit sum from overflowing).
void group_divider(uint32_t d, uint32_t& multiplier, uint32_t& shift) {
  shift = 0;
  while ((uint64_t{1} << shift) < d) ++shift;
  multiplier = static_cast<uint32_t>((((uint64_t{1} << shift) - d) << 32) / d + 1);
}

// The vector kernel; kSets = rope_dim / 16 threads per row, a power of two up to 32 (so a row
// never straddles warps). Thread g: pair set k = g % kSets of token (g / kSets) / head_groups,
// heads (g / kSets) % head_groups + j * head_groups for j < kRows. The layout is a template
// argument so that the loads, the rotation and the stores have no run-time choices. At least 5
// blocks per multiprocessor for BF16 (48 registers, none spilled; 53 unbounded would give 4, and
// 6 blocks spill) and 4 for F32: the kernel only moves bytes, so more 16-byte loads in flight.
template <bool kBf16, int kSets, int kRows, bool kInterleaved, bool kInverse>
__global__ void __launch_bounds__(kThreads, kBf16 ? 5 : 4)
    rope_vector_kernel(void* out, const void* x, const int32_t* __restrict__ positions,
                       const float* __restrict__ cos_table, const float* __restrict__ sin_table, RopeVectorShape s) {
  // The forward reads interleaved pairs and writes half-split ones; the inverse the other way.
  constexpr bool kInterleavedIn = kInterleaved && !kInverse, kInterleavedOut = kInterleaved && kInverse;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent launch: wait until the kernel before it in the stream
  // has finished and its writes are visible (before any load), then let the next kernel's blocks
  // be scheduled as this one's finish.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const uint32_t g = blockIdx.x * kThreads + threadIdx.x;
  const uint32_t k = g % kSets, slot = g / kSets;
  const uint32_t token = (__umulhi(slot, s.group_multiplier) + slot) >> s.group_shift;
  const uint32_t head0 = slot - token * s.head_groups;
  const bool token_ok = token < s.tokens;
  // The position first: the cos/sin loads wait on it while the rows' loads are in flight.
  const int32_t position = token_ok ? positions[token] : 0;
  const uint32_t half = s.rope_dim / 2;
  // Where a thread's two input and two output chunks sit in the row's rope columns.
  const uint32_t in_lo = kInterleavedIn ? 16 * k : 8 * k, in_hi = kInterleavedIn ? in_lo + 8 : half + 8 * k;
  const uint32_t out_lo = kInterleavedOut ? 16 * k : 8 * k, out_hi = kInterleavedOut ? out_lo + 8 : half + 8 * k;
  bool row_ok[kRows];
  int64_t at[kRows];  // the element where row j's rope columns start (one offset for x and out)
  const uint64_t first_row = static_cast<uint64_t>(token * s.heads + head0) * s.width + s.col_offset;
  RawChunk<kBf16> lo[kRows], hi[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    row_ok[j] = token_ok && head0 + j * s.head_groups < s.heads;
    at[j] = static_cast<int64_t>(first_row + j * s.group_stride);
    if (row_ok[j]) {
      load_raw(lo[j], x, at[j] + in_lo);
      load_raw(hi[j], x, at[j] + in_hi);
    }
  }
  // A position outside the table rotates by NaN: every output of the row is NaN, with no
  // per-value choice below.
  const bool position_ok = token_ok && position >= 0 && static_cast<uint32_t>(position) < s.max_position;
  float4 c0, c1, s0, s1;
  if (position_ok) {
    const uint32_t at = static_cast<uint32_t>(position) * half + 8 * k;
    const float4* cos4 = reinterpret_cast<const float4*>(cos_table + at);
    const float4* sin4 = reinterpret_cast<const float4*>(sin_table + at);
    c0 = __ldg(cos4), c1 = __ldg(cos4 + 1), s0 = __ldg(sin4), s1 = __ldg(sin4 + 1);
  } else {
    const float nan = nanf("");
    c0 = c1 = s0 = s1 = make_float4(nan, nan, nan, nan);
  }
  const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
  const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
  // Every lane of the warp gets here (no early return above): the rows' loads are done before
  // any of their stores, which in place may overwrite another thread's inputs.
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if (!row_ok[j]) continue;
    float fl[8], fh[8], a[8], b[8];  // a[e], b[e]: the pair 8k + e
    unpack(lo[j], fl);
    unpack(hi[j], fh);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (kInterleavedIn) {
        a[e] = e < 4 ? fl[2 * e] : fh[2 * e - 8];
        b[e] = e < 4 ? fl[2 * e + 1] : fh[2 * e - 7];
      } else {
        a[e] = fl[e];
        b[e] = fh[e];
      }
    }
    float first[8], second[8];  // the values for pair slot i and i + half (or 2i and 2i + 1)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (!kInverse) {
        first[e] = a[e] * c[e] - b[e] * sn[e];
        second[e] = b[e] * c[e] + a[e] * sn[e];
      } else {
        first[e] = a[e] * c[e] + b[e] * sn[e];
        second[e] = b[e] * c[e] - a[e] * sn[e];
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if constexpr (kInterleavedOut) {
        (e < 4 ? fl[2 * e] : fh[2 * e - 8]) = first[e];
        (e < 4 ? fl[2 * e + 1] : fh[2 * e - 7]) = second[e];
      } else {
        fl[e] = first[e];
        fh[e] = second[e];
      }
    }
    pack(lo[j], fl);
    pack(hi[j], fh);
  }
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if (!row_ok[j]) continue;
    store_raw(out, at[j] + out_lo, lo[j]);
    store_raw(out, at[j] + out_hi, hi[j]);
  }
  if (s.in_place) return;
  // Out of place: the columns rope leaves alone, 8 at a time (the rope columns are whole chunks).
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if (!row_ok[j]) continue;
    const int64_t row_start = at[j] - s.col_offset;
    for (uint32_t col = 8 * k; col < s.width; col += 8 * kSets) {
      if (col >= s.col_offset && col < s.col_offset + s.rope_dim) continue;
      RawChunk<kBf16> v;
      load_raw(v, x, row_start + col);
      store_raw(out, row_start + col, v);
    }
  }
}

// Rows per thread: 2 rows of one token share its position and cos/sin loads (four 16-byte loads
// in flight per thread for BF16). More rows per thread cost registers and so threads per
// multiprocessor: 2 was the fastest measured at the MLA shape (docs/PERF.md).
int64_t rope_rows_per_thread(int64_t heads) { return heads >= 2 ? 2 : 1; }

// Calls f(sets, rows, interleaved, inverse) as std::integral_constants; false for other values.
template <typename F>
bool with_rope_shape(int64_t sets, int64_t rows_per_thread, bool interleaved, bool inverse, F&& f) {
  using std::integral_constant;
  auto with_layout = [&](auto set, auto rows) {
    if (interleaved) {
      if (inverse) return f(set, rows, std::true_type{}, std::true_type{});
      return f(set, rows, std::true_type{}, std::false_type{});
    }
    if (inverse) return f(set, rows, std::false_type{}, std::true_type{});
    return f(set, rows, std::false_type{}, std::false_type{});
  };
  auto with_rows = [&](auto set) {
    switch (rows_per_thread) {
      case 1:
        with_layout(set, integral_constant<int, 1>{});
        return true;
      case 2:
        with_layout(set, integral_constant<int, 2>{});
        return true;
      default:
        return false;
    }
  };
  switch (sets) {
    case 1:
      return with_rows(integral_constant<int, 1>{});
    case 2:
      return with_rows(integral_constant<int, 2>{});
    case 4:
      return with_rows(integral_constant<int, 4>{});
    case 8:
      return with_rows(integral_constant<int, 8>{});
    case 16:
      return with_rows(integral_constant<int, 16>{});
    case 32:
      return with_rows(integral_constant<int, 32>{});
    default:
      return false;
  }
}

// The vector kernel's thread count, or 0 where its 32-bit index math would not hold (a thread,
// row or cos/sin table index of 2^31 or more).
int64_t rope_vector_threads(const RopeShape& s, int64_t rows_per_thread) {
  const int64_t head_groups = (s.heads + rows_per_thread - 1) / rows_per_thread;
  const int64_t threads = s.rows / s.heads * head_groups * (s.rope_dim / 16);
  constexpr int64_t kLimit = int64_t{1} << 31;
  const bool fits = threads + kThreads < kLimit && s.rows < kLimit && s.width < kLimit &&
                    s.max_position * (s.rope_dim / 2) < kLimit;
  return fits ? threads : 0;
}

// The vector kernel's launch of `threads` (rope_vector_threads). Launched as a programmatic
// dependent launch (see the kernel): a rope launched right after another starts its blocks while
// the first one's last blocks run.
template <bool kBf16>
bool launch_rope_vector(void* out, const void* x, const int32_t* positions, const float* cos_table,
                        const float* sin_table, const RopeShape& s, int64_t rows_per_thread, int64_t threads,
                        cudaStream_t stream) {
  RopeVectorShape v{};
  v.tokens = static_cast<uint32_t>(s.rows / s.heads);
  v.heads = static_cast<uint32_t>(s.heads);
  v.head_groups = static_cast<uint32_t>((s.heads + rows_per_thread - 1) / rows_per_thread);
  group_divider(v.head_groups, v.group_multiplier, v.group_shift);
  v.width = static_cast<uint32_t>(s.width);
  v.col_offset = static_cast<uint32_t>(s.col_offset);
  v.rope_dim = static_cast<uint32_t>(s.rope_dim);
  v.max_position = static_cast<uint32_t>(s.max_position);
  v.group_stride = static_cast<uint64_t>(v.head_groups) * v.width;
  v.in_place = s.in_place;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned int>((threads + kThreads - 1) / kThreads));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute dependent{};
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &dependent;
  config.numAttrs = 1;
  return with_rope_shape(s.rope_dim / 16, rows_per_thread, s.interleaved, s.inverse,
                         [&](auto set, auto rows, auto interleaved, auto inverse) {
                           CUDA_CHECK(cudaLaunchKernelEx(
                               &config,
                               rope_vector_kernel<kBf16, decltype(set)::value, decltype(rows)::value,
                                                  decltype(interleaved)::value, decltype(inverse)::value>,
                               out, x, positions, cos_table, sin_table, v));
                         });
}

ElemKind kind_of(DType dtype) { return dtype == DType::kBF16 ? ElemKind::kBF16 : ElemKind::kF32; }

}  // namespace

void rope(const RopeArgs& args, cudaStream_t stream) {
  RopeShape s{};
  s.width = args.x.size(-1);
  s.rows = s.width == 0 ? 0 : args.x.numel() / s.width;
  if (s.rows == 0) return;
  s.heads = args.heads;
  s.col_offset = args.col_offset;
  s.rope_dim = args.rope_dim;
  s.max_position = args.cos.size(0);
  s.interleaved = args.layout == RopeLayout::kInterleaved;
  s.inverse = args.inverse;
  s.in_place = args.out.data == args.x.data;
  const MutOperand out{args.out.data, kind_of(args.out.dtype)};
  const ConstOperand x{args.x.data, kind_of(args.x.dtype)};
  const auto* positions = static_cast<const int32_t*>(args.positions.data);
  const auto* cos_table = static_cast<const float*>(args.cos.data);
  const auto* sin_table = static_cast<const float*>(args.sin.data);
  const int64_t sets = s.rope_dim % 16 == 0 ? s.rope_dim / 16 : 0;
  const int64_t rows_per_thread = rope_rows_per_thread(s.heads);
  const int64_t vector_threads = rope_vector_threads(s, rows_per_thread);
  const bool vector = sets > 0 && sets <= 32 && (sets & (sets - 1)) == 0 && s.width % 8 == 0 &&
                      s.col_offset % 8 == 0 && out.kind == x.kind && aligned16(out.data) && aligned16(x.data) &&
                      aligned16(cos_table) && aligned16(sin_table) && vector_threads > 0;
  if (vector) {
    const bool launched = x.kind == ElemKind::kBF16
                              ? launch_rope_vector<true>(out.data, x.data, positions, cos_table, sin_table, s,
                                                         rows_per_thread, vector_threads, stream)
                              : launch_rope_vector<false>(out.data, x.data, positions, cos_table, sin_table, s,
                                                          rows_per_thread, vector_threads, stream);
    CUDA_CHECK_LAUNCH();
    if (!launched) throw Error(ExitCode::kInternal, "rope: no vector kernel for the shape");
    return;
  }
  // About 16 KiB of staging per block.
  s.rows_per_block = 4096 / s.rope_dim;
  if (s.rows_per_block < 1) s.rows_per_block = 1;
  if (s.rows_per_block > 32) s.rows_per_block = 32;
  const size_t shared_bytes = sizeof(float) * static_cast<size_t>(s.rows_per_block * s.rope_dim);
  const unsigned int blocks = static_cast<unsigned int>((s.rows + s.rows_per_block - 1) / s.rows_per_block);
  rope_staged_kernel<<<blocks, kThreads, shared_bytes, stream>>>(out, x, positions, cos_table, sin_table, s);
  CUDA_CHECK_LAUNCH();
}

}  // namespace moetrain::kernels::cuda_ops
