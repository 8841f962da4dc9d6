// cuflash float32 tensor-core primitives: TF32 mma.sync (m16n8k8) fragments of float32 shared-memory tiles, and the
// 3xTF32 split that keeps float32 accuracy. Include after cuflash_tiles.cuh (cp.async, ldmatrix, smem_u32).
//
// TF32 has float32's exponent and a 10-bit mantissa. A float32 x splits into big = tf32(x) (round to nearest) and
// small = x - big (exact in float32; the tensor core reads its top 10 mantissa bits), and
//   a * b ~= big(a) * big(b) + big(a) * small(b) + small(a) * big(b)
// drops only small(a) * small(b) (~2^-22 |a b|) and small's own truncation (~2^-21 |x|): float32-level products at
// three tensor-core products each (NVIDIA's "3xTF32", CUTLASS's OpMultiplyAddFastF32). One product (big * big, the
// plain TF32 mode) has operands rounded to ~2^-11 relative: fast, not float32-accurate.
//
// Fragment layouts (PTX ISA, mma.m16n8k8 .tf32, g = lane / 4, t = lane % 4), one 32-bit element per register:
//   A (16x8, row major): a0 = (g, t), a1 = (g+8, t), a2 = (g, t+4), a3 = (g+8, t+4)
//   B (8x8, "col"):      b0 = (k t, n g), b1 = (k t+4, n g)
//   C (16x8, float32):   c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)   (as m16n8k16's: the score code is shared)
// An 8x4 block of float32 is an 8x8 block of 16-bit halves, so non-transposed ldmatrix gives lane (g, t) element
// (g, t) of each 8-row, 4-float matrix: exactly A's and the [n][k] B's element order (Q and K tiles).
// P V needs no transposed load: the k order inside a k8 step is free as long as A and B agree, so logical k = t is
// key 2t and k = t + 4 is key 2t + 1, which makes the C fragment of S (c0, c2, c1, c3) P's A fragment in registers;
// and the n order (V's columns, the output's) is free as long as the store agrees, so column n of n8 tile dt is
// head-dim column 32 (dt / 4) + 4 n + dt % 4: lane (g, t) reads B elements of 4 consecutive n8 tiles with one
// 16-byte load (V[key][32 c + 4 g .. + 3]) and writes 4 consecutive output columns with one 16-byte store.
#pragma once

namespace cuflash {

// (The element tags tf32 and tf32x3: cuflash_tiles.cuh.)

// ---------------------------------------------------------------------------------------------------
// Swizzled float32 shared-memory tile, kWidth floats per row (a multiple of 32), addressed in 16-byte chunks of
// 4 floats. Row reads (Q, K: ldmatrix over 8 consecutive rows of one chunk): chunk c -> c ^ (row % 8). Column reads
// (V: lanes of a quarter warp read rows 2t (+1), t = 0..3, at chunks 8 c + g, g = 2p, 2p + 1): chunk
// c -> c ^ (row & 6), which puts those 8 reads in 8 different bank groups. Both permute chunks within aligned groups
// of 8, so the cp.async stores of a row (8 threads, 8 consecutive chunks) do not conflict either.
template <int kWidth, bool kColumnRead>
struct SwizzleF32 {
    static_assert(kWidth % 32 == 0, "float32 tile rows must be a multiple of 32 floats");
    __device__ __forceinline__ static int offset(int row, int c) {
        return row * kWidth + 4 * (c ^ (row & (kColumnRead ? 6 : 7)));
    }
};

// Copy rows [row0, row0 + kRows) of a (rows, kWidth) float32 matrix with row stride `stride` (elements, a multiple
// of 4, 16-byte aligned base) into a swizzled tile with 16-byte cp.async; rows at or past `nrows` become zeros.
template <int kRows, int kWidth, int kThreads, bool kColumnRead>
__device__ __forceinline__ void load_tile_f32_async(float* tile, const float* g, i64 stride, int row0, int nrows, int tid) {
    constexpr int kChunks = kWidth / 4;
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int i = tid + it * kThreads;
        if (kTotal % kThreads != 0 && i >= kTotal) break;
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = row0 + r < nrows;
        const float* src = valid ? g + (i64)(row0 + r) * stride + c * 4 : g;
        cp_async_16(smem_u32(tile + SwizzleF32<kWidth, kColumnRead>::offset(r, c)), src, valid);
    }
}

__device__ __forceinline__ float4 lds128(const float* p) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(smem_u32(p)));
    return v;
}

// ---------------------------------------------------------------------------------------------------
// TF32 operands: big (round to nearest, ties away: cuflash_tiles.cuh's tf32_round) and, for 3xTF32, small = x - big.

template <int kProducts, int kN>
struct Tf32Frag {
    static_assert(kProducts == 1 || kProducts == 3, "one TF32 product, or 3xTF32");
    u32 big[kN];
    u32 small[kProducts == 3 ? kN : 1];
    __device__ __forceinline__ void set(int i, float x) {
        big[i] = tf32_round(x);
        if constexpr (kProducts == 3) small[i] = __float_as_uint(x - __uint_as_float(big[i]));
    }
};

__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += a b in TF32. b: elements (b0, b1) of frag b at i, i + 1. 3xTF32: the two small cross terms first, then big * big,
// summed from zero and added to d in float32 (round to nearest): the tensor cores truncate every sum they return (round
// toward zero), so d taken as the accumulator would shrink by up to an ulp of itself three times per k8 step, a bias
// that grows with the head dim (S) and the sequence (O: 4x float32's error at 333 keys, 100x at 4096, in a NumPy model
// of that rounding; summed per step, within 2x of naive float32 attention). One TF32 product accumulates in d: its
// operands' rounding dominates.
template <int kProducts, int kNB>
__device__ __forceinline__ void mma_tf32(float (&d)[4], const Tf32Frag<kProducts, 4>& a, const Tf32Frag<kProducts, kNB>& b,
                                         int i) {
    if constexpr (kProducts == 3) {
        float t[4] = {0.f, 0.f, 0.f, 0.f};
        mma_m16n8k8_tf32(t, a.small, b.big[i], b.big[i + 1]);
        mma_m16n8k8_tf32(t, a.big, b.small[i], b.small[i + 1]);
        mma_m16n8k8_tf32(t, a.big, b.big[i], b.big[i + 1]);
#pragma unroll
        for (int e = 0; e < 4; ++e) d[e] += t[e];
    } else {
        mma_m16n8k8_tf32(d, a.big, b.big[i], b.big[i + 1]);
    }
}

// ---------------------------------------------------------------------------------------------------
// What float32 inputs change in flash_fwd_kernel (forward.cu, FwdMma<tf32> and FwdMma<tf32x3>): float32 tiles through
// cp.async, S = Q K^T and O += P V on TF32 fragments, and the output stored as float32 in the permuted column order.
template <int kProducts>
struct Tf32FwdMma {
    using Storage = float;
    static constexpr int kHeadDimStep = 32;   // head dims the tiles take (rows of whole 8-chunk swizzle groups)
    static constexpr bool kExactMods = true;  // softcap and score_mod with tanhf: float32's budget
    static constexpr bool kTf32 = true;       // the kernel takes qk, pv and store_row from here

    template <int kRows, int kW, int kThreads, int kCols, bool kIsV>
    __device__ __forceinline__ static void load(float* tile, const float* g, i64 stride, int row0, int nrows, int tid, int) {
        static_assert(kCols == kW, "float32 rows are read whole (head dims are multiples of 32)");
        load_tile_f32_async<kRows, kW, kThreads, kIsV>(tile, g, stride, row0, nrows, tid);
    }

    // [fa2-fwd 2] s[mt] += Q[row0 + 16 mt ..] K^T, k8 steps over the head dim, B fragments of two n8 tiles per ldmatrix.
    template <int kMT, int kNT, int kHeadDim, int kW>
    __device__ __forceinline__ static void qk(float (&s)[kMT][kNT][4], const float* sQ, const float* tK, int row0, int lane) {
        using Swz = SwizzleF32<kW, false>;
#pragma unroll
        for (int kk = 0; kk < kHeadDim / 8; ++kk) {
            Tf32Frag<kProducts, 4> a[kMT];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                u32 r[4];
                ldsm_x4(r, smem_u32(sQ + Swz::offset(row0 + mt * 16 + (lane & 15), 2 * kk + (lane >> 4))));
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt].set(i, __uint_as_float(r[i]));
            }
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                u32 r[4];
                ldsm_x4(r, smem_u32(tK + Swz::offset(np * 16 + (lane & 7) + ((lane >> 4) << 3), 2 * kk + ((lane >> 3) & 1))));
                Tf32Frag<kProducts, 4> b;
#pragma unroll
                for (int i = 0; i < 4; ++i) b.set(i, __uint_as_float(r[i]));
#pragma unroll
                for (int mt = 0; mt < kMT; ++mt) {
                    mma_tf32(s[mt][2 * np], a[mt], b, 0);
                    mma_tf32(s[mt][2 * np + 1], a[mt], b, 2);
                }
            }
        }
    }

    // [fa2-fwd 5] acc[mt] += P V: P straight from the score registers (k8 step kk = n8 tile kk of S, keys in the order
    // 0, 2, 4, 6, 1, 3, 5, 7), V's B fragments of 4 n8 tiles per pair of 16-byte loads (rows 2t, 2t + 1 of the step).
    template <int kMT, int kNT, int kDT, int kW>
    __device__ __forceinline__ static void pv(float (&acc)[kMT][kDT][4], const float (&s)[kMT][kNT][4], const float* tV,
                                              int lane) {
        using Swz = SwizzleF32<kW, true>;
        const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int kk = 0; kk < kNT; ++kk) {
            Tf32Frag<kProducts, 4> a[kMT];
#pragma unroll
            for (int mt = 0; mt < kMT; ++mt) {
                a[mt].set(0, s[mt][kk][0]);
                a[mt].set(1, s[mt][kk][2]);
                a[mt].set(2, s[mt][kk][1]);
                a[mt].set(3, s[mt][kk][3]);
            }
#pragma unroll
            for (int c = 0; c < kDT / 4; ++c) {
                const float4 v0 = lds128(tV + Swz::offset(kk * 8 + 2 * t, 8 * c + g));
                const float4 v1 = lds128(tV + Swz::offset(kk * 8 + 2 * t + 1, 8 * c + g));
                Tf32Frag<kProducts, 8> b;  // (b0, b1) of n8 tile 4 c + i at 2 i, 2 i + 1
                b.set(0, v0.x); b.set(1, v1.x); b.set(2, v0.y); b.set(3, v1.y);
                b.set(4, v0.z); b.set(5, v1.z); b.set(6, v0.w); b.set(7, v1.w);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#pragma unroll
                    for (int mt = 0; mt < kMT; ++mt) mma_tf32(acc[mt][4 * c + i], a[mt], b, 2 * i);
                }
            }
        }
    }

    // [fa2-fwd 6] Row g + 8 hh of one 16-row tile, times inv: lane t holds columns 32 c + 4 (2t + s) + i in
    // acc[4 c + i][2 hh + s] (pv's column order), 16-byte stores.
    template <bool kPads, int kDT>
    __device__ __forceinline__ static void store_row(float* orow, const float (&acc)[kDT][4], int hh, float inv, int t, int) {
#pragma unroll
        for (int c = 0; c < kDT / 4; ++c) {
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int e = 2 * hh + s;
                *reinterpret_cast<float4*>(orow + 32 * c + 4 * (2 * t + s)) =
                    make_float4(acc[4 * c][e] * inv, acc[4 * c + 1][e] * inv, acc[4 * c + 2][e] * inv, acc[4 * c + 3][e] * inv);
            }
        }
    }
};

}  // namespace cuflash
