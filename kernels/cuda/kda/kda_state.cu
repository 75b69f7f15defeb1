// The sequential part of KDA: one CTA (4 warps) per (segment, head, 32 value columns) walks the
// segment's chunks with its slice of the state in F32 registers (the recurrence never mixes value
// columns, so slices are independent). Each chunk's inputs from kda_intra.cu arrive by cp.async
// one chunk ahead (double-buffered); the state is rounded to BF16 into shared memory once per
// chunk as the tensor-core operand.
//
// Forward, per chunk (S the state entering it; 0 at a segment start, the caller's initial_state at
// the first segment's):
//   v_new = u - w S,  out = qg S + Aqk v_new,  S <- diag(decay) S + kt^T v_new
// (with `save`, for the backward: S entering each chunk and v_new are written instead of out).
// The last segment's S after its last chunk goes to final_state when given.
// Backward, chunks in reverse, dS the gradient of the state leaving the chunk (0 after the last
// chunk of a segment; dfinal_state after the last segment's when given):
//   dv_new = Aqk^T dout + kt dS,  dS <- diag(decay) dS + qg^T dout - w^T dv_new
// writing dS (as it leaves each chunk) and dv_new for kda_backward.cu; the first segment's dS
// entering its first chunk goes to dinitial_state when given.
//
// Warp w owns rows [16 w, 16 w + 16) of the chunk for the token-major products and state rows
// [w Dk / 4, (w + 1) Dk / 4) for the state update.
#include <cuda_bf16.h>

#include "kernels/cuda/kda/kda_common.cuh"

namespace moetrain::kernels::cuda_ops::kda {
namespace {

constexpr int kStateThreads = 128;
constexpr int kSlice = 32;  // value columns per CTA
constexpr int kSliceTiles = kSlice / 8;
constexpr int kSliceStride = kSlice + kPad;
constexpr int kAqkStride = kChunk + kPad;

// One chunk's inputs in shared memory. `kTokenMajorInputs`: qg and Aqk (the forward's output
// and every backward sweep); `slice` holds u (forward) or dout (backward).
template <int kDk, bool kWithQgAqk>
struct StageLayout {
  static constexpr int kKStride = kDk + kPad;
  static constexpr size_t kTileBytes = sizeof(bf16) * kChunk * kKStride;
  static constexpr size_t kW = 0;
  static constexpr size_t kKt = kW + kTileBytes;
  static constexpr size_t kQg = kKt + kTileBytes;
  static constexpr size_t kAqk = kQg + (kWithQgAqk ? kTileBytes : 0);
  static constexpr size_t kSlicePart = kAqk + (kWithQgAqk ? sizeof(bf16) * kChunk * kAqkStride : 0);
  static constexpr size_t kDecay = kSlicePart + sizeof(bf16) * kChunk * kSliceStride;
  static constexpr size_t kBytes = kDecay + sizeof(float) * kDk;
  static_assert(kBytes % 16 == 0, "stages stay 16-byte aligned");
};

template <int kDk, bool kWithQgAqk>
struct StateSmem {
  using Stage = StageLayout<kDk, kWithQgAqk>;
  static constexpr size_t kStages = 0;
  static constexpr size_t kState = kStages + 2 * Stage::kBytes;  // BF16 [Dk][kSliceStride]
  static constexpr size_t kVnew = kState + sizeof(bf16) * kDk * kSliceStride;  // BF16 [64][kSliceStride]
  static constexpr size_t kBytes = kVnew + sizeof(bf16) * kChunk * kSliceStride;
  static_assert(kBytes <= kMaxSmemBytes, "fits one CTA");
};

template <int kDk, bool kWithQgAqk>
struct StagePointers {
  bf16* w;
  bf16* kt;
  bf16* qg;
  bf16* aqk;
  bf16* slice;
  float* decay;
  __device__ StagePointers(unsigned char* smem, int index) {
    using Stage = StageLayout<kDk, kWithQgAqk>;
    unsigned char* base = smem + index * Stage::kBytes;
    w = reinterpret_cast<bf16*>(base + Stage::kW);
    kt = reinterpret_cast<bf16*>(base + Stage::kKt);
    qg = reinterpret_cast<bf16*>(base + Stage::kQg);
    aqk = reinterpret_cast<bf16*>(base + Stage::kAqk);
    slice = reinterpret_cast<bf16*>(base + Stage::kSlicePart);
    decay = reinterpret_cast<float*>(base + Stage::kDecay);
  }
};

// The chunk a CTA's step works on: global number, first token, tokens.
struct StepChunk {
  int id;
  int t0;
  int len;
};

// Issues the cp.async copies of chunk `ch` into `st` (slice: `slice_src` rows of `slice_width`
// elements, columns [col0, col0 + 32)), then commits a group (an empty one when !valid, so that
// every step commits exactly one group).
template <int kDk, bool kWithQgAqk>
__device__ __forceinline__ void issue_stage(const KdaParams& p, const StagePointers<kDk, kWithQgAqk>& st,
                                            const StepChunk& ch, bool valid, int head, const bf16* slice_src,
                                            int slice_width, int col0) {
  if (valid) {
    constexpr int kKS = kDk + kPad;
    const int64_t row0 = static_cast<int64_t>(ch.t0) * p.heads + head;
    const int64_t k_rows = static_cast<int64_t>(p.heads) * kDk;
    load_tile_async<bf16, kDk>(st.w, kKS, p.w + row0 * kDk, k_rows, ch.len);
    load_tile_async<bf16, kDk>(st.kt, kKS, p.kt + row0 * kDk, k_rows, ch.len);
    if constexpr (kWithQgAqk) {
      load_tile_async<bf16, kDk>(st.qg, kKS, p.qg + row0 * kDk, k_rows, ch.len);
      load_tile_async<bf16, kChunk>(st.aqk, kAqkStride, p.aqk + row0 * kChunk, static_cast<int64_t>(p.heads) * kChunk,
                                    ch.len);
    }
    load_tile_async<bf16, kSlice>(st.slice, kSliceStride, slice_src + row0 * slice_width + col0,
                                  static_cast<int64_t>(p.heads) * slice_width, ch.len);
    load_tile_async<float, kDk>(st.decay, 0, p.decay + (static_cast<int64_t>(ch.id) * p.heads + head) * kDk, 0, 1,
                                1);
  }
  cp_async_commit();
}

// State (or state gradient) registers: warp w's rows [w Dk / 4, ...) as kDk / 64 m-tiles of 16
// rows by the slice's 4 n-tiles.
template <int kDk>
struct StateRegs {
  static constexpr int kMTiles = kDk / 64;
  float acc[kMTiles][kSliceTiles][4];
};

template <int kDk>
__device__ __forceinline__ int state_row0(int warp, int mt) {
  return warp * (kDk / 4) + 16 * mt;
}

// s = diag(decay) s: rows g and g + 8 of each m-tile.
template <int kDk>
__device__ __forceinline__ void decay_rows(StateRegs<kDk>& s, const float* decay, int warp, int lane) {
#pragma unroll
  for (int mt = 0; mt < StateRegs<kDk>::kMTiles; ++mt) {
    const int r = state_row0<kDk>(warp, mt) + (lane >> 2);
    const float top = decay[r], bottom = decay[r + 8];
#pragma unroll
    for (int j = 0; j < kSliceTiles; ++j) {
      s.acc[mt][j][0] *= top;
      s.acc[mt][j][1] *= top;
      s.acc[mt][j][2] *= bottom;
      s.acc[mt][j][3] *= bottom;
    }
  }
}

// The registers, rounded to BF16, into the shared [Dk][kSliceStride] operand tile.
template <int kDk>
__device__ __forceinline__ void store_state(bf16* st, const StateRegs<kDk>& s, int warp, int lane) {
#pragma unroll
  for (int mt = 0; mt < StateRegs<kDk>::kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kSliceTiles; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = state_row0<kDk>(warp, mt) + (lane >> 2) + 8 * h, col = 8 * j + 2 * (lane & 3);
        store_bf16x2(st + r * kSliceStride + col, s.acc[mt][j][2 * h], s.acc[mt][j][2 * h + 1]);
      }
}

// The registers' elements: row r, column col of the CTA's slice (col0 + col in the head's state).
template <int kDk, typename Body>
__device__ __forceinline__ void for_each_state_element(int warp, int lane, Body&& body) {
#pragma unroll
  for (int mt = 0; mt < StateRegs<kDk>::kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kSliceTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        body(mt, j, e, state_row0<kDk>(warp, mt) + (lane >> 2) + 8 * (e >> 1), 8 * j + 2 * (lane & 3) + (e & 1));
}

// The registers from a caller's state ([H, state_dk, state_dv] F32, see KdaParams), zero where
// `src` is null and in the padded rows and columns.
template <int kDk>
__device__ __forceinline__ void load_caller_state(StateRegs<kDk>& s, const float* src, const KdaParams& p, int head,
                                                  int col0, int warp, int lane) {
  for_each_state_element<kDk>(warp, lane, [&](int mt, int j, int e, int r, int col) {
    const int cc = col0 + col;
    s.acc[mt][j][e] = src != nullptr && r < p.state_dk && cc < p.state_dv
                          ? src[(static_cast<int64_t>(head) * p.state_dk + r) * p.state_dv + cc]
                          : 0.0f;
  });
}

// The registers into a caller's state (nothing when `dst` is null; the padding is dropped).
template <int kDk>
__device__ __forceinline__ void store_caller_state(float* dst, const StateRegs<kDk>& s, const KdaParams& p, int head,
                                                   int col0, int warp, int lane) {
  if (dst == nullptr) return;
  for_each_state_element<kDk>(warp, lane, [&](int mt, int j, int e, int r, int col) {
    const int cc = col0 + col;
    if (r < p.state_dk && cc < p.state_dv)
      dst[(static_cast<int64_t>(head) * p.state_dk + r) * p.state_dv + cc] = s.acc[mt][j][e];
  });
}

// The shared [Dk][kSliceStride] tile into rows of a [chunks, H, Dk, Dv] buffer at columns col0...
template <int kDk, int kDv>
__device__ __forceinline__ void write_state_tile(bf16* dst, const bf16* st, int chunk_id, int heads, int head,
                                                 int col0) {
  constexpr int kPieces = kSlice / 8;  // 16-byte pieces per row
  bf16* base = dst + (static_cast<int64_t>(chunk_id) * heads + head) * kDk * kDv + col0;
  for (int i = threadIdx.x; i < kDk * kPieces; i += kStateThreads) {
    const int r = i / kPieces, piece = i - r * kPieces;
    *reinterpret_cast<uint4*>(base + static_cast<int64_t>(r) * kDv + piece * 8) =
        *reinterpret_cast<const uint4*>(st + r * kSliceStride + piece * 8);
  }
}

template <int kDk, int kDv, bool kSave>
__global__ void __launch_bounds__(kStateThreads, 1) kda_state_forward_sm80_bf16_kernel(KdaParams p) {
  constexpr bool kOut = !kSave;
  using Smem = StateSmem<kDk, kOut>;
  constexpr int kKS = kDk + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* s_st = reinterpret_cast<bf16*>(smem + Smem::kState);
  bf16* vnew_st = reinterpret_cast<bf16*>(smem + Smem::kVnew);

  const int seg = blockIdx.x, head = blockIdx.y, col0 = blockIdx.z * kSlice;
  const Span span = segment_span(p.cu_seqlens, seg, p.tokens);
  const int first = p.chunk_offsets[seg];
  const int chunks = p.chunk_offsets[seg + 1] - first;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const bool last_segment = seg == p.segments - 1;

  StateRegs<kDk> s;
  load_caller_state<kDk>(s, seg == 0 ? p.initial_state : nullptr, p, head, col0, warp, lane);
  if (chunks <= 0) {  // an empty last segment ends with the state it starts from
    if (last_segment) store_caller_state<kDk>(p.final_state, s, p, head, col0, warp, lane);
    return;
  }

  auto chunk_at = [&](int j) {
    StepChunk ch;
    ch.id = first + j;
    ch.t0 = span.begin + j * kChunk;
    ch.len = min(kChunk, span.end - ch.t0);
    return ch;
  };
  auto issue = [&](int j) {
    issue_stage<kDk, kOut>(p, StagePointers<kDk, kOut>(smem, j & 1), chunk_at(j), j < chunks, head, p.u, kDv, col0);
  };

  store_state<kDk>(s_st, s, warp, lane);
  issue(0);
  issue(1);

  for (int j = 0; j < chunks; ++j) {
    const StepChunk ch = chunk_at(j);
    const StagePointers<kDk, kOut> st(smem, j & 1);
    const int64_t row0 = static_cast<int64_t>(ch.t0) * p.heads + head;
    cp_async_wait<1>();
    __syncthreads();  // this chunk's stage and the state tile are visible

    // v_new = u - w S for the warp's 16 rows.
    {
      float acc[kSliceTiles][4];
      zero_tiles(acc);
      warp_mma<ALayout::kMK, BLayout::kKN, kDk / 16, kSliceTiles>(acc, st.w, kKS, 16 * warp, 0, s_st, kSliceStride,
                                                                  0, 0, lane);
#pragma unroll
      for (int nt = 0; nt < kSliceTiles; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * warp + g + 8 * h, col = 8 * nt + 2 * c;
          const float2 u = unpack_bf16x2(*reinterpret_cast<const uint32_t*>(st.slice + r * kSliceStride + col));
          const float lo = u.x - acc[nt][2 * h], hi = u.y - acc[nt][2 * h + 1];
          store_bf16x2(vnew_st + r * kSliceStride + col, lo, hi);
          if (kSave && r < ch.len) store_bf16x2(p.vnew + (row0 + static_cast<int64_t>(r) * p.heads) * kDv + col0 + col, lo, hi);
        }
    }
    __syncthreads();  // v_new visible

    if constexpr (kOut) {
      // out = qg S + Aqk v_new (Aqk is zero above the diagonal).
      float acc[kSliceTiles][4];
      zero_tiles(acc);
      warp_mma<ALayout::kMK, BLayout::kKN, kDk / 16, kSliceTiles>(acc, st.qg, kKS, 16 * warp, 0, s_st, kSliceStride,
                                                                  0, 0, lane);
      warp_mma<ALayout::kMK, BLayout::kKN, kChunk / 16, kSliceTiles>(acc, st.aqk, kAqkStride, 16 * warp, 0, vnew_st,
                                                                     kSliceStride, 0, 0, lane);
#pragma unroll
      for (int nt = 0; nt < kSliceTiles; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * warp + g + 8 * h;
          if (r < ch.len)
            store_pair(p.out, (row0 + static_cast<int64_t>(r) * p.heads) * kDv + col0 + 8 * nt + 2 * c,
                       acc[nt][2 * h], acc[nt][2 * h + 1]);
        }
    } else {
      write_state_tile<kDk, kDv>(p.state, s_st, ch.id, p.heads, head, col0);
    }

    // S = diag(decay) S + kt^T v_new.
    decay_rows<kDk>(s, st.decay, warp, lane);
#pragma unroll
    for (int mt = 0; mt < StateRegs<kDk>::kMTiles; ++mt)
      warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kSliceTiles>(s.acc[mt], st.kt, kKS, state_row0<kDk>(warp, mt),
                                                                     0, vnew_st, kSliceStride, 0, 0, lane);
    __syncthreads();  // every read of the state tile and of this stage is done
    store_state<kDk>(s_st, s, warp, lane);
    issue(j + 2);
  }
  if (last_segment) store_caller_state<kDk>(p.final_state, s, p, head, col0, warp, lane);
  cp_async_wait<0>();  // nothing may still land in shared memory when the CTA exits
}

template <int kDk, int kDv>
__global__ void __launch_bounds__(kStateThreads, 1) kda_state_backward_sm80_bf16_kernel(KdaParams p) {
  using Smem = StateSmem<kDk, true>;
  constexpr int kKS = kDk + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* ds_st = reinterpret_cast<bf16*>(smem + Smem::kState);
  bf16* dvnew_st = reinterpret_cast<bf16*>(smem + Smem::kVnew);

  const int seg = blockIdx.x, head = blockIdx.y, col0 = blockIdx.z * kSlice;
  const Span span = segment_span(p.cu_seqlens, seg, p.tokens);
  const int first = p.chunk_offsets[seg];
  const int chunks = p.chunk_offsets[seg + 1] - first;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const bool first_segment = seg == 0;

  StateRegs<kDk> ds;
  load_caller_state<kDk>(ds, seg == p.segments - 1 ? p.dfinal_state : nullptr, p, head, col0, warp, lane);
  if (chunks <= 0) {  // an empty first segment passes its final state's gradient on unchanged
    if (first_segment) store_caller_state<kDk>(p.dinitial_state, ds, p, head, col0, warp, lane);
    return;
  }

  // Step i works on chunk chunks - 1 - i.
  auto chunk_at = [&](int i) {
    const int j = chunks - 1 - i;
    StepChunk ch;
    ch.id = first + j;
    ch.t0 = span.begin + j * kChunk;
    ch.len = min(kChunk, span.end - ch.t0);
    return ch;
  };
  auto issue = [&](int i) {
    issue_stage<kDk, true>(p, StagePointers<kDk, true>(smem, i & 1), chunk_at(i), i < chunks, head, p.dout, kDv,
                           col0);
  };

  store_state<kDk>(ds_st, ds, warp, lane);
  issue(0);
  issue(1);

  for (int i = 0; i < chunks; ++i) {
    const StepChunk ch = chunk_at(i);
    const StagePointers<kDk, true> st(smem, i & 1);
    const int64_t row0 = static_cast<int64_t>(ch.t0) * p.heads + head;
    cp_async_wait<1>();
    __syncthreads();  // this chunk's stage and dS (leaving the chunk) are visible

    write_state_tile<kDk, kDv>(p.dstate, ds_st, ch.id, p.heads, head, col0);
    // dv_new = Aqk^T dout + kt dS for the warp's 16 rows (tokens).
    {
      float acc[kSliceTiles][4];
      zero_tiles(acc);
      warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kSliceTiles>(acc, st.aqk, kAqkStride, 16 * warp, 0, st.slice,
                                                                     kSliceStride, 0, 0, lane);
      warp_mma<ALayout::kMK, BLayout::kKN, kDk / 16, kSliceTiles>(acc, st.kt, kKS, 16 * warp, 0, ds_st, kSliceStride,
                                                                  0, 0, lane);
#pragma unroll
      for (int nt = 0; nt < kSliceTiles; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * warp + g + 8 * h, col = 8 * nt + 2 * c;
          store_bf16x2(dvnew_st + r * kSliceStride + col, acc[nt][2 * h], acc[nt][2 * h + 1]);
          if (r < ch.len)
            store_bf16x2(p.dvnew + (row0 + static_cast<int64_t>(r) * p.heads) * kDv + col0 + col, acc[nt][2 * h],
                         acc[nt][2 * h + 1]);
        }
    }
    __syncthreads();  // dv_new visible

    // dS = diag(decay) dS + qg^T dout - w^T dv_new.
    decay_rows<kDk>(ds, st.decay, warp, lane);
#pragma unroll
    for (int mt = 0; mt < StateRegs<kDk>::kMTiles; ++mt) {
      const int d0 = state_row0<kDk>(warp, mt);
      warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kSliceTiles>(ds.acc[mt], st.qg, kKS, d0, 0, st.slice,
                                                                     kSliceStride, 0, 0, lane);
      warp_mma<ALayout::kKM, BLayout::kKN, kChunk / 16, kSliceTiles>(ds.acc[mt], st.w, kKS, d0, 0, dvnew_st,
                                                                     kSliceStride, 0, 0, lane, /*negate=*/true);
    }
    __syncthreads();  // every read of the dS tile and of this stage is done
    store_state<kDk>(ds_st, ds, warp, lane);
    issue(i + 2);
  }
  if (first_segment) store_caller_state<kDk>(p.dinitial_state, ds, p, head, col0, warp, lane);
  cp_async_wait<0>();
}

}  // namespace

void launch_kda_state_forward(const KdaParams& p, int dk, int dv, bool save, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.segments), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(dv / kSlice));
  dispatch_head_dims(dk, dv, [&](auto k_dim, auto v_dim) {
    constexpr int kDk = decltype(k_dim)::value, kDv = decltype(v_dim)::value;
    if (save) {
      launch_kda_kernel(kda_state_forward_sm80_bf16_kernel<kDk, kDv, true>, grid, kStateThreads,
                        StateSmem<kDk, false>::kBytes, stream, p);
    } else {
      launch_kda_kernel(kda_state_forward_sm80_bf16_kernel<kDk, kDv, false>, grid, kStateThreads,
                        StateSmem<kDk, true>::kBytes, stream, p);
    }
  });
}

void launch_kda_state_backward(const KdaParams& p, int dk, int dv, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.segments), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>(dv / kSlice));
  dispatch_head_dims(dk, dv, [&](auto k_dim, auto v_dim) {
    constexpr int kDk = decltype(k_dim)::value, kDv = decltype(v_dim)::value;
    launch_kda_kernel(kda_state_backward_sm80_bf16_kernel<kDk, kDv>, grid, kStateThreads, StateSmem<kDk, true>::kBytes,
                      stream, p);
  });
}

}  // namespace moetrain::kernels::cuda_ops::kda
