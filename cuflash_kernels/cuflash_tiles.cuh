// cuflash tile primitives shared by the forward and backward kernels.
//
// Header-only and free of CUDA toolkit headers, so NVRTC compiles it with no include path: the 16-bit
// element types are stored as `unsigned short` and converted with PTX `cvt`, the matrix products are
// `mma.sync.m16n8k16` with float32 accumulators, shared-memory tiles are read with `ldmatrix`, and
// global tiles are copied with `cp.async` (zero-fill for rows past the end of the sequence).
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   A (16x16, row major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B (16x8, "col"):      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C (16x8, float32):    c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1)
// Two neighbouring C tiles (16 x 16 of a score block) are exactly one A fragment once packed to 16 bits,
// which is how P stays in registers as the A operand of P @ V (and dS of dS @ K).
#pragma once

#if defined(CUFLASH_DEBUG)
#define CUFLASH_TRACE(...) printf(__VA_ARGS__)
#else
#define CUFLASH_TRACE(...)
#endif

namespace cuflash {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
typedef long long i64;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// [pdl] Programmatic dependent launch (sm_90 on): a kernel launched with programmatic stream serialization may start
// while the kernel before it on the stream still runs. grid_dependency_wait() waits until that kernel has completed
// and its writes are visible (a no-op in a kernel launched the ordinary way); launch_dependents() lets such a kernel
// after this one start as soon as every block of this one has issued it (or exited).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define CUFLASH_INF __int_as_float(0x7f800000)
#define CUFLASH_NAN __int_as_float(0x7fffffff)

// ---------------------------------------------------------------------------------------------------
// Element types. Both are 16 bits in memory; only the conversions and the mma opcode differ.
struct fp16 {};
struct bf16 {};
// float32 on TF32 fragments (forward.cu's flash_fwd_kernel: one TF32 product, or the 3xTF32 split; forward_sm90.cu's
// [tf32]: one product)
struct tf32 {};
struct tf32x3 {};
// float32 as two float16 parts on the Hopper forward ([f16x2]: x * 2^s = hi + lo, three fp16 products a matrix product)
struct f16x2 {};

// A float32 rounded to TF32 (to nearest, ties away from zero: cvt.rna), as its bits.
__device__ __forceinline__ u32 tf32_round(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// The same rounding on a float32's bits in an integer register (half of TF32's last place added to the magnitude,
// the 13 bits below it cleared): for copies that move bits, not floats (forward_sm90.cu's V^T and [tf32 qk]).
__device__ __forceinline__ u32 tf32_round_bits(u32 bits) { return (bits + 0x1000u) & 0xFFFFE000u; }

template <class T> struct Elem;

template <> struct Elem<fp16> {
    // Pack two floats (lo -> bits 0..15, hi -> bits 16..31), round to nearest even.
    __device__ __forceinline__ static u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    __device__ __forceinline__ static float to_float(u16 x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
        return f;
    }
    __device__ __forceinline__ static void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

template <> struct Elem<bf16> {
    __device__ __forceinline__ static u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    __device__ __forceinline__ static float to_float(u16 x) { return __uint_as_float(u32(x) << 16); }
    __device__ __forceinline__ static void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// ---------------------------------------------------------------------------------------------------
// Small math helpers.
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0, never NaN for finite/-inf
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float quad_max(float x) {  // reduce over the 4 lanes holding one mma row
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// ---------------------------------------------------------------------------------------------------
// Swizzled shared-memory tile of kRows x kWidth 16-bit elements, row major, addressed in 16-byte
// chunks (8 elements). ldmatrix reads one chunk from each of 8 consecutive rows; the swizzle puts those
// 8 chunks in 8 different bank groups, so neither ldmatrix nor the cp.async stores conflict.
//   - rows of a multiple of 8 chunks (width 64, 128, 256): chunk c -> c ^ (row % 8) (flips low 3 bits)
//   - a tail of 4 chunks (width 32, and the last 4 chunks of width 96): chunk -> c ^ ((row / 2) % 4);
//     rows are then 64 bytes (mod 128) apart, and the (row / 2) term separates rows two apart.
template <int kWidth> struct Swizzle {
    static_assert(kWidth % 32 == 0, "tile width must be a multiple of 32 elements");
    static constexpr int kChunks = kWidth / 8;
    static constexpr int kFull = kChunks & ~7;
    __device__ __forceinline__ static int chunk(int row, int c) {
        return c < kFull ? (c ^ (row & 7)) : kFull + ((c - kFull) ^ ((row >> 1) & 3));
    }
    // Element offset of chunk c of row `row`.
    __device__ __forceinline__ static int offset(int row, int c) { return row * kWidth + chunk(row, c) * 8; }
};

// Block order of the backward's key-tile grid (nx key tiles, ny heads, nz sequences): the GPU starts blocks in
// linear blockIdx order. ``interleave`` (batch, head) pairs at a time have their key tiles interleaved, the tile
// index outermost: under causal masking key tile 0 sees the most queries, so the longest blocks of those pairs
// start first and the short ones fill the end of the wave (longest-processing-time order), while only that many
// heads' Q, dO and dQ accumulator share the L2 cache at once. interleave = 1: plain (tile, head, sequence) order.
// interleaved_tile: the same order for tile `linear` of a grid of (nx, ny, nz) tiles that a persistent kernel walks.
__device__ __forceinline__ void interleaved_tile(int interleave, int linear, int nx, int ny, int nz, int& x, int& y,
                                                 int& z) {
    const int pairs = ny * nz;
    const int first = linear / (nx * interleave) * interleave;  // the group's first pair
    const int size = min(interleave, pairs - first);
    const int r = linear - first * nx;
    x = r / size;
    const int pair = first + r % size;
    y = pair % ny;
    z = pair / ny;
}
__device__ __forceinline__ void interleaved_block(int interleave, int& x, int& y, int& z) {
    interleaved_tile(interleave, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x, gridDim.y,
                     gridDim.z, x, y, z);
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ldmatrix: four 8x8 16-bit matrices; lane l supplies the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// A fragment (16 rows x 16 cols at (row0, col chunk 2*kk)) of a row-major tile: non-transposed ldmatrix.
template <int kWidth>
__device__ __forceinline__ void load_a(u32 (&a)[4], const u16* tile, int row0, int kk, int lane) {
    ldsm_x4(a, smem_u32(tile + Swizzle<kWidth>::offset(row0 + (lane & 15), 2 * kk + (lane >> 4))));
}

// B fragments for two n8 tiles (rows n0..n0+15 of a tile stored [n][k], k chunk pair 2*kk):
// b[0], b[1] for rows n0..n0+7 and b[2], b[3] for rows n0+8..n0+15. Used for K in Q K^T.
template <int kWidth>
__device__ __forceinline__ void load_b_nk(u32 (&b)[4], const u16* tile, int n0, int kk, int lane) {
    ldsm_x4(b, smem_u32(tile + Swizzle<kWidth>::offset(n0 + (lane & 7) + ((lane >> 4) << 3),
                                                         2 * kk + ((lane >> 3) & 1))));
}

// B fragments for two n8 tiles of a tile stored [k][n] (rows k0..k0+15, column chunks 2*np, 2*np+1):
// transposed ldmatrix. Used for V in P V.
template <int kWidth>
__device__ __forceinline__ void load_b_kn(u32 (&b)[4], const u16* tile, int k0, int np, int lane) {
    ldsm_x4_trans(b, smem_u32(tile + Swizzle<kWidth>::offset(k0 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                                               2 * np + (lane >> 4))));
}

// A fragment (16 x 16) of the transpose of a tile stored [k][m]: rows k0..k0+15, column chunks
// m0/8, m0/8+1. Used for dS (stored as dS^T) in dS @ K.
template <int kWidth>
__device__ __forceinline__ void load_a_trans(u32 (&a)[4], const u16* tile, int k0, int m0, int lane) {
    ldsm_x4_trans(a, smem_u32(tile + Swizzle<kWidth>::offset(k0 + (lane & 7) + ((lane >> 4) << 3),
                                                               (m0 >> 3) + ((lane >> 3) & 1))));
}

// ---------------------------------------------------------------------------------------------------
// cp.async tile copies (global -> shared, 16 bytes per thread per step, bypassing L1).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    // src-size 0 reads nothing and fills the 16 bytes with zeros.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// 4-byte variant for per-row float vectors (lse, D); rows past the end read as 0.
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

// Copy rows [row0, row0 + kRows) of a (rows, kCols) global matrix with row stride `stride` (elements)
// into a swizzled tile of kWidth-element rows (kCols <= kWidth; columns past kCols are neither written nor
// meant to be read); rows at or past `nrows` become zeros, and so do the 8-column chunks at or past `cols8`
// ([variant head dim]: a matrix of fewer columns than the kernel's head dim, read in place; kCols / 8
// otherwise, a constant that leaves the copy as it was).
template <int kRows, int kWidth, int kThreads, int kCols = kWidth>
__device__ __forceinline__ void load_tile_async(u16* tile, const u16* g, i64 stride, int row0, int nrows, int tid,
                                                int cols8 = kCols / 8) {
    constexpr int kChunks = kCols / 8;
    constexpr int kTotal = kRows * kChunks;
#pragma unroll
    for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
        const int i = tid + it * kThreads;
        if (kTotal % kThreads != 0 && i >= kTotal) break;
        const int r = i / kChunks, c = i % kChunks;
        const bool valid = row0 + r < nrows && (cols8 == kChunks || c < cols8);
        const u16* src = valid ? g + (i64)(row0 + r) * stride + c * 8 : g;
        cp_async_16(smem_u32(tile + Swizzle<kWidth>::offset(r, c)), src, valid);
    }
}

// ---------------------------------------------------------------------------------------------------
// Causal loop bounds, the kernels' side of cuflash/_blocks.py (one copy of the arithmetic for every
// kernel): query row i sees key column j iff j <= i + causal_offset, and tiles lying wholly above the
// diagonal are never visited. The reference's `causal_offset is None` branch is the caller's Is_causal
// test (`Is_causal ? causal_key_block_end(...) : seqlen_k`): written outside the helper, it leaves the
// non-causal kernels compiled exactly as before (an inlined call that folds to 0 still moved ptxas's
// register allocation of flash_bwd_dkdv_kernel by up to 5 registers).

// The backward's per-row statistics of one query tile: lse and D of rows [row0, row0 + kBlockM) to
// sLse[0 .. kBlockM) and sD[0 .. kBlockM) with 4-byte cp.async; rows at or past seqlen_q read as zeros.
template <int kBlockM, int kThreads>
__device__ __forceinline__ void load_row_stats_async(float* sLse, float* sD, const float* lse_row, const float* delta_row,
                                                     int row0, int seqlen_q, int tid) {
    for (int r = tid; r < 2 * kBlockM; r += kThreads) {
        const int row = row0 + (r % kBlockM);
        const bool valid = row < seqlen_q;
        const float* src = r < kBlockM ? lse_row : delta_row;
        float* dst = (r < kBlockM ? sLse : sD) + (r % kBlockM);
        cp_async_4(smem_u32(dst), valid ? src + row : src, valid);
    }
}

// How many blocks of kBlock rows cover n rows, n >= 0 (cuflash/_blocks.py:num_blocks).
template <int kBlock>
__device__ __forceinline__ int num_blocks(int n) { return (n + kBlock - 1) / kBlock; }

// cuflash/_blocks.py:causal_key_block_end: the end (exclusive) of the keys that query rows
// [q_start, q_stop) need, in [0, seqlen_k]. The last row q_stop - 1 sees keys up to
// q_stop - 1 + causal_offset and every earlier row fewer, so the key loop runs over the tiles
// [0, num_blocks<kBlockN>(end)). q_stop is clipped to seqlen_q by the caller, as iter_blocks clips it.
__device__ __forceinline__ int causal_key_block_end(int q_stop, int causal_offset, int seqlen_k) {
    return min(max(q_stop + causal_offset, 0), seqlen_k);
}

// cuflash/_blocks.py:causal_query_block_start: the first query row that sees key k_start (row i does
// iff i >= k_start - causal_offset), so the query loop of the key tile starting at k_start begins at
// tile causal_query_block_start(k_start, ...) / kBlockM. Unlike the reference it is not clamped at
// seqlen_q: the callers' loops stop at num_blocks(seqlen_q), so where no query row sees the key tile
// (top-left alignment with seqlen_k > seqlen_q) the partial last query tile may still be visited, wholly
// masked, where the reference visits none.
__device__ __forceinline__ int causal_query_block_start(int k_start, int causal_offset) {
    return max(0, k_start - causal_offset);
}

// ---------------------------------------------------------------------------------------------------
// Visit every element of a score block held as mma C fragments (kNT n8 tiles of 16 rows): element e of
// tile nt sits at row row_base + g + 8 (e / 2), column col_base + 8 nt + 2 t + e % 2 (g = lane / 4,
// t = lane % 4). With kTransposed the block is S^T (rows = keys, columns = queries) and f is still
// called as f(value, query, key, nt, e).
template <bool kTransposed, int kNT, class F>
__device__ __forceinline__ void for_each_score(float (&s)[kNT][4], int row_base, int col_base, int lane, F&& f) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row_base + g + 8 * (e >> 1);
            const int col = col_base + nt * 8 + 2 * t + (e & 1);
            if constexpr (kTransposed) {
                f(s[nt][e], col, row, nt, e);
            } else {
                f(s[nt][e], row, col, nt, e);
            }
        }
    }
}

// Masking of a score block (the FA1 kernels; the FA2 kernels mask through variants.cuh): a column is kept
// iff col < col_limit and (not causal, or col <= row + causal_offset); others := fill. mask_scores_t is the
// same for blocks stored as S^T (rows = keys, columns = queries).
template <int kNT, bool Is_causal>
__device__ __forceinline__ void mask_scores(float (&s)[kNT][4], int row_base, int col_base, int col_limit,
                                            int causal_offset, int lane, float fill) {
    for_each_score<false>(s, row_base, col_base, lane, [&](float& x, int query, int key, int, int) {
        if (!(key < col_limit && (!Is_causal || key <= query + causal_offset))) x = fill;
    });
}
template <int kNT, bool Is_causal>
__device__ __forceinline__ void mask_scores_t(float (&s)[kNT][4], int key_base, int query_base, int key_limit,
                                              int causal_offset, int lane, float fill) {
    for_each_score<true>(s, key_base, query_base, lane, [&](float& x, int query, int key, int, int) {
        if (!(key < key_limit && (!Is_causal || key <= query + causal_offset))) x = fill;
    });
}

// Pack C fragments of two neighbouring n8 tiles (2 kk, 2 kk + 1) into one A fragment.
template <class T, int kNT>
__device__ __forceinline__ void c_to_a(u32 (&a)[4], const float (&s)[kNT][4], int kk) {
    a[0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
    a[1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
    a[2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// ---------------------------------------------------------------------------------------------------
// P = exp2(S - m_use) in place for row half h (rows g, g + 8) of a score block; returns this lane's part of the row
// sum.
template <int kNT>
__device__ __forceinline__ float exp_row(float (&s)[kNT][4], int h, float m_use) {
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
        s[nt][2 * h] = fast_exp2(s[nt][2 * h] - m_use);
        s[nt][2 * h + 1] = fast_exp2(s[nt][2 * h + 1] - m_use);
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
    }
    return sum;
}

// Online softmax state of the two rows (g and g+8) that one lane holds in a 16-row mma tile.
// Scores arrive already multiplied by scale * log2(e) (so exp(scale * (s - m)) = exp2(s' - m')) and
// masked; m is the running max in those units, l the lane-partial running sum (summed over the quad
// only once, at the end).
struct OnlineSoftmax {
    float m[2];
    float l[2];
    __device__ __forceinline__ void init() {
        m[0] = m[1] = -CUFLASH_INF;
        l[0] = l[1] = 0.f;
    }
    // [fa2-fwd 3] new row max, rescale acc and l by exp(m_old - m_new);
    // [fa2-fwd 4] P = exp(S - m_new) (in place of S), l += rowsum(P).
    template <int kNT, int kDT>
    __device__ __forceinline__ void update(float (&s)[kNT][4], float (&acc)[kDT][4]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[h];
#pragma unroll
            for (int nt = 0; nt < kNT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            mx = quad_max(mx);
            // A row that has seen only masked keys keeps m = -inf; subtracting 0 instead keeps
            // exp2(-inf - 0) = 0 and avoids (-inf) - (-inf) = NaN.
            const float m_use = mx == -CUFLASH_INF ? 0.f : mx;
            const float corr = fast_exp2(m[h] - m_use);
            m[h] = mx;
            l[h] = l[h] * corr + exp_row(s, h, m_use);
#pragma unroll
            for (int dt = 0; dt < kDT; ++dt) {
                acc[dt][2 * h] *= corr;
                acc[dt][2 * h + 1] *= corr;
            }
        }
    }
};

template <int kNT>
__device__ __forceinline__ void scale_scores(float (&s)[kNT][4], float scale) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= scale;
    }
}

}  // namespace cuflash
