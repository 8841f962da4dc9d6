// cuflash backward kernels, mirroring cuflash/reference.py:blocked_backward.
//
// Algorithm (float16/bfloat16, order "kv_outer", FlashAttention-2 backward):
//   flash_bwd_preprocess_kernel  [bwd 0] D = rowsum(dO * O), float32 (batch, heads_q, seqlen_q); the workspace's
//       accumulators zeroed in the same launch.
//   flash_bwd_dkdv_kernel        one thread block per key/value tile of kBlockN rows of one (batch, query
//       head), FlashAttention-2's two-dimensional warp tiling: the key rows come in groups of 32 and the
//       kNWarps / (kBlockN / 32) warps of a group split the query columns of S^T, dP^T and the head-dim
//       columns of dK, dV (float32 registers). It streams the query tiles (Q, dO, lse, D through a ring of
//       kStages cp.async buffers), recomputes P^T = exp(scale K Q^T - lse) from the saved lse, writes P^T
//       (cast to the input dtype) and dS^T = P^T (dP^T - D) with dP^T = V dO^T to shared memory, then
//       forms dV += P^T dO and dK += dS^T Q. With Has_dQ the block also forms dS K for its query tile and
//       adds it to a float32 dQ workspace (red.global.add.v2.f32 on sm_90, atomicAdd before).
//   flash_bwd_dq_kernel          (order "split", deterministic) one thread block per query tile, key tiles
//       streamed, dQ in float32 registers: S, P, dP = dO V^T, dS, dQ += dS K; no atomics. Used together
//       with flash_bwd_dkdv_kernel<Has_dQ = false>.
//   flash_bwd_convert_dq_kernel  dQ = scale * dq_accum, cast to the input dtype, written with dq's strides.
//   flash_bwd_reduce_dkv_kernel  GQA/MQA: dK, dV were written per *query* head into a float32 workspace
//       (batch, heads_q, seqlen_k, d); this sums each group in a fixed order (deterministic) and casts.
//   flash_bwd_*_f32_kernel        float32 path, plain SIMT float32 arithmetic: key/value tiles through
//       shared memory (dQ by atomicAdd in order "kv_outer"), or for "split" a row-wise dQ kernel.
//
// Grid: dkdv (ceil(seqlen_k / kBlockN), heads_q, batch); dq (ceil(seqlen_q / kBlockM), heads_q, batch).
// Shared memory of dkdv (16-bit elements): K, V kBlockN x d; kStages x (Q, dO) kBlockM x d; P^T, dS^T
// kBlockN x kBlockM; float32 lse, D per stage. E.g. d = 128, kBlockN = 128, kBlockM = 64, 2 stages: 161 KiB.
#include "cuflash_tiles.cuh"
#include "user_mods.cuh"
#include "variants.cuh"
#include "f32_tiles.cuh"

namespace cuflash {

// The workspace's accumulators zeroed by the preprocess launch (a planned backward's, in place of a memset of its own):
// `count` float4 from `zero`, a grid-stride share a block (none where zero is null).
__device__ __forceinline__ void zero_share(float4* __restrict__ zero, i64 count) {
    const i64 block = ((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const i64 step = (i64)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    for (i64 i = block * blockDim.x + threadIdx.x; i < count; i += step) zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// [bwd 0] D = rowsum(dO * O), and the accumulators zeroed. 16-bit rows read 16 bytes a lane: kLanes lanes a row
// (the head dim's 8-element chunks rounded up to a power of two), 32 / kLanes rows a warp at a time, each warp
// kRowsPerWarp rows a step, all of a step's loads issued before its sums; blocks stride over the rows (any grid.x).
// Where dO's or O's rows are not all 16-byte aligned (a base address or a row stride), an element at a time.
// Grid (x, heads_q, batch), 256 threads; four blocks an SM asked (64 registers at most: sm_80's ptxas otherwise picks
// 40 and spills 8 bytes; sm_90a's takes 62-64 either way).
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256, 4)
flash_bwd_preprocess_kernel(const u16* __restrict__ dout, const u16* __restrict__ out, float* __restrict__ delta,
                            int seqlen_q, int heads_q, i64 do_sb, i64 do_ss, i64 do_sh,
                            i64 o_sb, i64 o_ss, i64 o_sh, float4* __restrict__ zero, i64 zero_count) {
    constexpr int kChunks = (kHeadDim + 7) / 8;
    constexpr int kLanes = kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
    constexpr int kPerWarp = 32 / kLanes, kIters = (kChunks + kLanes - 1) / kLanes;
    constexpr int kSteps = kIters == 1 ? 4 : 2;  // (rows of kPerWarp a warp loads at once: 8 or 16 loads in flight)
    constexpr int kRowsPerWarp = kSteps * kPerWarp;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = lane / kLanes, chunk = lane % kLanes;
    const int h = blockIdx.y, b = blockIdx.z;
    const u16* dbase = dout + b * do_sb + h * do_sh;
    const u16* obase = out + b * o_sb + h * o_sh;
    const bool aligned = kHeadDim % 8 == 0 && ((((unsigned long long)dbase | (unsigned long long)obase) & 15) == 0)
                         && do_ss % 8 == 0 && o_ss % 8 == 0;
    for (i64 row0 = ((i64)blockIdx.x * 8 + warp) * kRowsPerWarp; row0 < seqlen_q;
         row0 += (i64)gridDim.x * 8 * kRowsPerWarp) {
        float acc[kSteps];
        if (aligned) {
            uint4 x[kSteps][kIters], y[kSteps][kIters];
#pragma unroll
            for (int s = 0; s < kSteps; ++s) {
                const i64 row = row0 + s * kPerWarp + sub;
#pragma unroll
                for (int it = 0; it < kIters; ++it) {
                    const int c = chunk + it * kLanes;
                    x[s][it] = y[s][it] = make_uint4(0u, 0u, 0u, 0u);
                    if (row < seqlen_q && c < kChunks) {
                        x[s][it] = *reinterpret_cast<const uint4*>(dbase + (i64)row * do_ss + 8 * c);
                        y[s][it] = *reinterpret_cast<const uint4*>(obase + (i64)row * o_ss + 8 * c);
                    }
                }
            }
#pragma unroll
            for (int s = 0; s < kSteps; ++s) {
                acc[s] = 0.f;
#pragma unroll
                for (int it = 0; it < kIters; ++it) {
                    const u32 xs[4] = {x[s][it].x, x[s][it].y, x[s][it].z, x[s][it].w};
                    const u32 ys[4] = {y[s][it].x, y[s][it].y, y[s][it].z, y[s][it].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        acc[s] = fmaf(Elem<T>::to_float(u16(xs[j] & 0xffff)), Elem<T>::to_float(u16(ys[j] & 0xffff)),
                                      acc[s]);
                        acc[s] = fmaf(Elem<T>::to_float(u16(xs[j] >> 16)), Elem<T>::to_float(u16(ys[j] >> 16)), acc[s]);
                    }
                }
            }
        } else {
#pragma unroll
            for (int s = 0; s < kSteps; ++s) {
                const i64 row = row0 + s * kPerWarp + sub;
                acc[s] = 0.f;
                if (row >= seqlen_q) continue;
                for (int e = chunk; e < kHeadDim; e += kLanes)
                    acc[s] = fmaf(Elem<T>::to_float(dbase[(i64)row * do_ss + e]),
                                  Elem<T>::to_float(obase[(i64)row * o_ss + e]), acc[s]);
            }
        }
#pragma unroll
        for (int s = 0; s < kSteps; ++s) {
#pragma unroll
            for (int o = kLanes / 2; o > 0; o >>= 1) acc[s] += __shfl_xor_sync(0xffffffffu, acc[s], o);
            const i64 row = row0 + s * kPerWarp + sub;
            if (chunk == 0 && row < seqlen_q) delta[((i64)b * heads_q + h) * seqlen_q + row] = acc[s];
        }
    }
    if (zero != nullptr) zero_share(zero, zero_count);
}

// ... float32: one warp a query row, 4 rows a block (128 threads); grid (ceil(seqlen_q / 4), heads_q, batch).
template <int kHeadDim>
__global__ void __launch_bounds__(128, 1)
flash_bwd_preprocess_f32_kernel(const float* __restrict__ dout, const float* __restrict__ out,
                                float* __restrict__ delta, int seqlen_q, int heads_q,
                                i64 do_sb, i64 do_ss, i64 do_sh, i64 o_sb, i64 o_ss, i64 o_sh,
                                float4* __restrict__ zero, i64 zero_count) {
    if (zero != nullptr) zero_share(zero, zero_count);
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int h = blockIdx.y, b = blockIdx.z;
    if (row >= seqlen_q) return;
    const float* dr = dout + b * do_sb + h * do_sh + (i64)row * do_ss;
    const float* orow = out + b * o_sb + h * o_sh + (i64)row * o_ss;
    float acc = 0.f;
    for (int d = lane; d < kHeadDim; d += 32) acc = fmaf(dr[d], orow[d], acc);
    acc = warp_sum(acc);
    if (lane == 0) delta[((i64)b * heads_q + h) * seqlen_q + row] = acc;
}

// lse in log2 units for the exp2 recomputation of P; +inf where P must be 0 (rows past the end of the
// query sequence, and rows that saw no key, whose lse is -inf).
__device__ __forceinline__ float lse_log2(const float* lse_row, int i, int seqlen_q) {
    if (i >= seqlen_q) return CUFLASH_INF;
    const float x = lse_row[i];
    return x == -CUFLASH_INF ? CUFLASH_INF : x * kLog2e;
}

// dQ accumulation into the float32 workspace: two neighbouring columns in one vector reduction on sm_90
// (red.global.add.v2.f32), two scalar atomics before.
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}

// Store an A fragment (16 x 16, rows r..r+15 of which this lane holds r + g and r + g + 8, column
// chunks c, c + 1) into a swizzled row-major tile: the inverse of load_a.
template <int kWidth>
__device__ __forceinline__ void store_a_frag(u16* tile, const u32 (&a)[4], int row, int c, int t) {
    *reinterpret_cast<u32*>(tile + Swizzle<kWidth>::offset(row, c) + 2 * t) = a[0];
    *reinterpret_cast<u32*>(tile + Swizzle<kWidth>::offset(row + 8, c) + 2 * t) = a[1];
    *reinterpret_cast<u32*>(tile + Swizzle<kWidth>::offset(row, c + 1) + 2 * t) = a[2];
    *reinterpret_cast<u32*>(tile + Swizzle<kWidth>::offset(row + 8, c + 1) + 2 * t) = a[3];
}

// The two products of the dK/dV kernel's warp tile: 32 rows (two mma row tiles, a_row0 and a_row0 + 16, of
// a swizzled shared-memory tile sA) times kNT n8 columns; every B fragment read feeds both row tiles. The
// k16 loops are unrolled by 4 (see flash_bwd_dkdv_kernel).
// c = A B^T over the head dimension, B = rows b_row0 .. b_row0 + 8 kNT - 1 of a [n][kHeadDim] tile:
// S^T = K Q^T and dP^T = V dO^T.
template <class T, int kHeadDim, int kNT>
__device__ __forceinline__ void warp_mma_abt_x2(float (&c)[2][kNT][4], const u16* sA, int a_row0, const u16* sB,
                                                int b_row0, int lane) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) c[i][nt][0] = c[i][nt][1] = c[i][nt][2] = c[i][nt][3] = 0.f;
    }
#pragma unroll 4
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) load_a<kHeadDim>(a[i], sA, a_row0 + 16 * i, kk, lane);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            u32 b[4];
            load_b_nk<kHeadDim>(b, sB, b_row0 + np * 16, kk, lane);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                Elem<T>::mma(c[i][2 * np], a[i], b[0], b[1]);
                Elem<T>::mma(c[i][2 * np + 1], a[i], b[2], b[3]);
            }
        }
    }
}

// c += A B over kK, B = column chunk pairs np0 .. np0 + kNT / 2 - 1 of a [kK][kHeadDim] tile:
// dV += P^T dO and dK += dS^T Q.
template <class T, int kK, int kHeadDim, int kNT>
__device__ __forceinline__ void warp_mma_ab_x2(float (&c)[2][kNT][4], const u16* sA, int a_row0, const u16* sB,
                                               int np0, int lane) {
#pragma unroll 4
    for (int kk = 0; kk < kK / 16; ++kk) {
        u32 a[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i) load_a<kK>(a[i], sA, a_row0 + 16 * i, kk, lane);
#pragma unroll
        for (int np = 0; np < kNT / 2; ++np) {
            u32 b[4];
            load_b_kn<kHeadDim>(b, sB, kk * 16, np0 + np, lane);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                Elem<T>::mma(c[i][2 * np], a[i], b[0], b[1]);
                Elem<T>::mma(c[i][2 * np + 1], a[i], b[2], b[3]);
            }
        }
    }
}

// dK/dV (and, with Has_dQ, dQ by atomics) with FlashAttention-2's two-dimensional warp tiling.
// The k16 loops are unrolled by 4, not fully: full unrolling lets ptxas hoist every fragment load and
// spill at d = 128, and the swizzled chunk offsets repeat every 4 steps anyway.
// The block holds kBlockN key rows, in groups of 32; the kWM = kNWarps / (kBlockN / 32) warps of a key
// group split the query columns of S^T and dP^T (kQW each) and the head-dim columns of dK and dV (kDW
// each). Every Q / dO fragment read from shared memory therefore feeds two key row tiles (4 mma), and
// every P^T / dS^T fragment read feeds kDW / 8 mma. P^T and dS^T go through shared memory (16-bit), which
// also makes dS^T available to the dQ product. Per query tile: two barriers (stage ready, P^T/dS^T
// written); the next tile's cp.async is issued after the first barrier, into the buffer every warp has
// finished with.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ>
__device__ __forceinline__ void flash_bwd_dkdv(CUFLASH_BWD_DKDV_PARAMS, const VariantParams vp) {
    constexpr int kThreads = kNWarps * 32;
    constexpr int kWN = kBlockN / 32;        // key groups of 32 rows (2 mma row tiles)
    static_assert(kBlockN % 32 == 0 && kNWarps % kWN == 0, "warps come in whole key groups");
    constexpr int kWM = kNWarps / kWN;       // warps per key group
    constexpr int kQW = kBlockM / kWM;       // query columns of S^T, dP^T per warp
    constexpr int kDW = kHeadDim / kWM;      // head-dim columns of dK, dV per warp
    static_assert(kBlockM % 32 == 0 && kQW % 16 == 0 && kDW % 16 == 0, "tile shape");
    static_assert(kStages >= 2, "the next query tile is loaded while this one is used");
    static_assert(!V::Bias::kStaged, "reads the bias from global memory (the wgmma kernels stage it)");
    constexpr int kQN8 = kQW / 8, kDN8 = kDW / 8;
    constexpr int kQTile = kBlockM * kHeadDim;
    // dQ phase: the kBlockM x d tile of dS K over a kWQM x kWQD warp grid of kQMW x kQDW warp tiles
    // (32 x 32 where the shape allows: 4 fragment loads per 8 mma).
    constexpr int kQMW = (kNWarps % (kBlockM / 32) == 0 && kHeadDim % (16 * (kNWarps / (kBlockM / 32))) == 0) ? 32 : 16;
    constexpr int kWQM = kBlockM / kQMW;
    constexpr int kWQD = kNWarps / kWQM > 0 ? kNWarps / kWQM : 1;
    constexpr int kQDW = kHeadDim / kWQD;
    static_assert(!Has_dQ || (kNWarps % kWQM == 0 && kQDW % 16 == 0), "dQ phase warp split");

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sK = reinterpret_cast<u16*>(smem_raw);
    u16* sV = sK + kBlockN * kHeadDim;
    u16* sQ = sV + kBlockN * kHeadDim;
    u16* sdO = sQ + kStages * kQTile;
    u16* sPt = sdO + kStages * kQTile;                                  // P^T, kBlockN x kBlockM
    u16* sdSt = sPt + kBlockN * kBlockM;                                // dS^T, kBlockN x kBlockM
    float* sLse = reinterpret_cast<float*>(sdSt + kBlockN * kBlockM);  // kStages x kBlockM, raw lse
    float* sD = sLse + kStages * kBlockM;                               // kStages x kBlockM, D

    // (interleave: the sm_90a kernel's block order; here the plain order, whose coordinates cost no registers:
    // this kernel has none to spare)
    const int n_block = blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = n_block * kBlockN;
    const int wn = warp % kWN, wm = warp / kWN;  // key group, column slice (queries in S^T, d in dK/dV)

    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if (bi.past_keys(n0)) return;  // keys of a shorter sequence (padding keys' dK, dV are zeroed by the launcher)
    const int len_q = bi.len_q, len_k = bi.len_k;

    const u16* qg = bi.q_rows(q, b, h, q_sb, q_sh, q_ss);
    const u16* dog = bi.q_rows(dout, b, h, do_sb, do_sh, do_ss);
    const int qk8 = bi.template qk_cols8<kHeadDim>(), v8 = bi.template v_cols8<kHeadDim>();  // [variant head dim]
    const float* lse_row = lse + bi.row_index(h, heads_q, seqlen_q, 0);
    const float* delta_row = delta + bi.row_index(h, heads_q, seqlen_q, 0);
    // The m_count query tiles q_tile(0), q_tile(1), ... hold the queries that see this key tile (causal, window).
    const TileLoop<V> queries = bi.template query_loop<kBlockM, kBlockN>(n_block);  // [variant mask] a block map's list
    const int m_count = queries.count;
    const auto q_tile = [&](int it) { return queries.tile(it); };

    // One query tile: Q, dO, and its rows' lse and D (rows past seqlen_q read as zeros: with dO = 0 and
    // D = 0 they add nothing to dV, dK or dQ whatever P is).
    auto load_q_stage = [&](int stage, int mi) {
        load_tile_async<kBlockM, kHeadDim, kThreads>(sQ + stage * kQTile, qg, q_ss, mi * kBlockM, len_q, tid, qk8);
        load_tile_async<kBlockM, kHeadDim, kThreads>(sdO + stage * kQTile, dog, do_ss, mi * kBlockM, len_q, tid, v8);
        load_row_stats_async<kBlockM, kThreads>(sLse + stage * kBlockM, sD + stage * kBlockM, lse_row, delta_row,
                                                mi * kBlockM, len_q, tid);
    };

    load_tile_async<kBlockN, kHeadDim, kThreads>(sK, k + b * k_sb + h_kv * k_sh + (i64)bi.k0 * k_ss, k_ss, n0, len_k, tid, qk8);
    load_tile_async<kBlockN, kHeadDim, kThreads>(sV, v + b * v_sb + h_kv * v_sh + (i64)bi.k0 * v_ss, v_ss, n0, len_k, tid, v8);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < m_count) load_q_stage(st, q_tile(st));
        cp_async_commit();
    }

    float dk_acc[2][kDN8][4], dv_acc[2][kDN8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int dt = 0; dt < kDN8; ++dt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[i][dt][e] = dv_acc[i][dt][e] = 0.f;
        }
    }
    const float scale_log2 = scale * kLog2e;
    const int key_base = n0 + wn * 32;

    for (int it = 0; it < m_count; ++it) {
        const int mi = q_tile(it);
        const u16* tQ = sQ + (it % kStages) * kQTile;
        const u16* tdO = sdO + (it % kStages) * kQTile;
        const float* tLse = sLse + (it % kStages) * kBlockM;
        const float* tD = sD + (it % kStages) * kBlockM;
        const int m0 = mi * kBlockM;

        cp_async_wait<kStages - 2>();
        __syncthreads();  // this tile's stage landed; every warp is done with the previous tile
        {
            const int itn = it + kStages - 1;
            if (itn < m_count) load_q_stage(itn % kStages, q_tile(itn));
            cp_async_commit();
        }

        // [bwd 1] P^T = exp(scale mod(K Q^T) - lse): this warp's 32 keys x kQW queries.
        float st[2][kQN8][4];
        warp_mma_abt_x2<T, kHeadDim, kQN8>(st, sK, wn * 32, tQ, wm * kQW, lane);
        u32 dmod[V::Has_grad ? 2 : 1][V::Has_grad ? kQN8 : 1][2];  // [variant grad] d mod / d s
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if constexpr (V::Has_grad) {
                mod_scores_grad<true>(st[i], dmod[i], bi, key_base + 16 * i, m0 + wm * kQW, lane, queries.partial(it));
            } else {
                mod_scores<true>(st[i], bi, key_base + 16 * i, m0 + wm * kQW, lane, queries.partial(it));  // [variant mod]
            }
        }
        // A row that saw no key has lse = -inf: its P here is +inf, but all its keys are masked below
        // (such a row sees no key, so every tile it meets crosses an edge of its band and is masked).
#pragma unroll
        for (int nt = 0; nt < kQN8; ++nt) {
            const float2 l2 = *reinterpret_cast<const float2*>(tLse + wm * kQW + nt * 8 + 2 * t);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    st[i][nt][e] = fast_exp2(fmaf(st[i][nt][e], scale_log2, bi.neg_lse_log2(e & 1 ? l2.y : l2.x)));
                }
            }
        }
        const bool mask_mod = queries.mask_mod_in_mask(it);  // [variant mask]
        if (bi.needs_mask(m0, kBlockM, n0, kBlockN) || mask_mod) {
#pragma unroll
            for (int i = 0; i < 2; ++i) mask_block<true>(st[i], bi, key_base + 16 * i, m0 + wm * kQW, lane, 0.f, mask_mod);
        }
        // P^T in the input dtype, as A fragments: to shared memory for dV, and kept (16 bits, half the
        // registers of float32) for dS^T. [variant dropout] dV takes P^T dropped and times 1 / (1 - p).
        u32 pt[2][kQN8 / 2][4];
        // [variant dropout] The keep bits of both 16-key tiles in one draw (a Philox call covers 32 keys).
        u32 keep_bits[V::Has_dropout ? 2 : 1][(4 * kQN8 + 31) / 32];
        if constexpr (V::Has_dropout) dropout_bits_tiles<true, kQN8, 2>(keep_bits, bi, key_base, m0 + wm * kQW, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int kk = 0; kk < kQN8 / 2; ++kk) {
                c_to_a<T, kQN8>(pt[i][kk], st[i], kk);
                if constexpr (V::Has_dropout) {
                    float sd[2][4];
#pragma unroll
                    for (int hn = 0; hn < 2; ++hn) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            sd[hn][e] = kept<kQN8>(keep_bits[i], 2 * kk + hn, e) ? st[i][2 * kk + hn][e] * bi.keep_scale : 0.f;
                        }
                    }
                    u32 pd[4];
                    c_to_a<T, 2>(pd, sd, 0);
                    store_a_frag<kBlockM>(sPt, pd, wn * 32 + 16 * i + g, wm * (kQW / 8) + 2 * kk, t);
                } else {
                    store_a_frag<kBlockM>(sPt, pt[i][kk], wn * 32 + 16 * i + g, wm * (kQW / 8) + 2 * kk, t);
                }
            }
        }

        // [bwd 3] dP^T = V dO^T.
        float dpt[2][kQN8][4];
        warp_mma_abt_x2<T, kHeadDim, kQN8>(dpt, sV, wn * 32, tdO, wm * kQW, lane);
        // [bwd 4] dS^T = P^T (dP^T - D), with P^T as cast to the input dtype (as it enters dV), to shared
        // memory in the input dtype.
#pragma unroll
        for (int kk = 0; kk < kQN8 / 2; ++kk) {
#pragma unroll
            for (int hn = 0; hn < 2; ++hn) {
                const int nt = 2 * kk + hn;
                const float2 d2 = *reinterpret_cast<const float2*>(tD + wm * kQW + nt * 8 + 2 * t);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 w = pt[i][kk][2 * hn + (e >> 1)];
                        const float p = Elem<T>::to_float(static_cast<u16>(e & 1 ? w >> 16 : w & 0xffffu));
                        float dp = dpt[i][nt][e];
                        if constexpr (V::Has_dropout) dp = kept<kQN8>(keep_bits[i], nt, e) ? dp * bi.keep_scale : 0.f;
                        dpt[i][nt][e] = p * (dp - (e & 1 ? d2.y : d2.x));
                    }
                }
            }
        }
        // [variant grad] dbias = dS (the bias is added after softcap), then dS times softcap's derivative.
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if constexpr (V::Has_bias) {
                for_each_score<true>(dpt[i], key_base + 16 * i, m0 + wm * kQW, lane,
                                     [&](float& x, int qi, int kj, int nt, int e) {
                                         // (a score_mod comes after the bias: its derivative is in dbias)
                                         if constexpr (V::Mod::Has_score_mod) {
                                             bi.store_dbias(qi, kj, x * grad_at(dmod[i], nt, e));
                                         } else {
                                             bi.store_dbias(qi, kj, x);
                                         }
                                     });
            }
            if constexpr (V::Has_grad) {
                for_each_score<true>(dpt[i], 0, 0, lane, [&](float& x, int, int, int nt, int e) { x *= grad_at(dmod[i], nt, e); });
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int kk = 0; kk < kQN8 / 2; ++kk) {
                u32 a[4];
                c_to_a<T, kQN8>(a, dpt[i], kk);
                store_a_frag<kBlockM>(sdSt, a, wn * 32 + 16 * i + g, wm * (kQW / 8) + 2 * kk, t);
            }
        }
        __syncthreads();  // P^T and dS^T of the whole block are in shared memory

        // [bwd 2] dV += P^T dO and [bwd 6] dK += dS^T Q (scale applied once at the end): this warp's 32
        // keys x kDW head-dim columns, over the kBlockM queries.
        warp_mma_ab_x2<T, kBlockM, kHeadDim, kDN8>(dv_acc, sPt, wn * 32, tdO, wm * (kDW / 16), lane);
        warp_mma_ab_x2<T, kBlockM, kHeadDim, kDN8>(dk_acc, sdSt, wn * 32, tQ, wm * (kDW / 16), lane);

        if (Has_dQ) {
            // [bwd 5] dQ += dS K: this warp's kQMW query rows x kQDW columns, added to the workspace.
            const int qm = warp % kWQM, qd = warp / kWQM;
            float dq[kQMW / 16][kQDW / 8][4];
#pragma unroll
            for (int i = 0; i < kQMW / 16; ++i) {
#pragma unroll
                for (int dt = 0; dt < kQDW / 8; ++dt) dq[i][dt][0] = dq[i][dt][1] = dq[i][dt][2] = dq[i][dt][3] = 0.f;
            }
#pragma unroll 4
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                u32 a[kQMW / 16][4];
#pragma unroll
                for (int i = 0; i < kQMW / 16; ++i) load_a_trans<kBlockM>(a[i], sdSt, kk * 16, qm * kQMW + 16 * i, lane);
#pragma unroll
                for (int np = 0; np < kQDW / 16; ++np) {
                    u32 bf[4];
                    load_b_kn<kHeadDim>(bf, sK, kk * 16, qd * (kQDW / 16) + np, lane);
#pragma unroll
                    for (int i = 0; i < kQMW / 16; ++i) {
                        Elem<T>::mma(dq[i][2 * np], a[i], bf[0], bf[1]);
                        Elem<T>::mma(dq[i][2 * np + 1], a[i], bf[2], bf[3]);
                    }
                }
            }
            float* dqg = dq_accum + bi.row_index(h, heads_q, seqlen_q, 0) * kHeadDim;
#pragma unroll
            for (int i = 0; i < kQMW / 16; ++i) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int row = m0 + qm * kQMW + 16 * i + g + 8 * hh;
                    if (row < len_q) {
                        float* dst = dqg + (i64)row * kHeadDim + qd * kQDW + 2 * t;
#pragma unroll
                        for (int dt = 0; dt < kQDW / 8; ++dt) red_add_f32x2(dst + dt * 8, dq[i][dt][2 * hh], dq[i][dt][2 * hh + 1]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();

    // Write dK = scale * dK_acc and dV: straight to dk/dv (group == 1) or per query head to the float32
    // workspace that flash_bwd_reduce_dkv_kernel sums over the group.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int row = key_base + 16 * i + g + 8 * hh;
            if (row >= len_k) continue;
            const int col0 = wm * kDW + 2 * t;
            if (group == 1) {
                u16* dkr = dk + b * dk_sb + h * dk_sh + (i64)(bi.k0 + row) * dk_ss + col0;
                u16* dvr = dv + b * dv_sb + h * dv_sh + (i64)(bi.k0 + row) * dv_ss + col0;
#pragma unroll
                for (int dt = 0; dt < kDN8; ++dt) {
                    const int chunk = wm * kDN8 + dt;  // [variant head dim] the arrays' columns only
                    if (!V::Pads_head_dim || chunk < qk8) {
                        *reinterpret_cast<u32*>(dkr + dt * 8) =
                            Elem<T>::pack(dk_acc[i][dt][2 * hh] * scale, dk_acc[i][dt][2 * hh + 1] * scale);
                    }
                    if (!V::Pads_head_dim || chunk < v8) {
                        *reinterpret_cast<u32*>(dvr + dt * 8) = Elem<T>::pack(dv_acc[i][dt][2 * hh], dv_acc[i][dt][2 * hh + 1]);
                    }
                }
            } else {
                const i64 plane = (i64)(V::Is_varlen ? 1 : gridDim.z) * heads_q * seqlen_k * kHeadDim;
                float* dkr = dkv_accum + bi.key_row_index(h, heads_q, seqlen_k, row) * kHeadDim + col0;
#pragma unroll
                for (int dt = 0; dt < kDN8; ++dt) {
                    *reinterpret_cast<float2*>(dkr + dt * 8) =
                        make_float2(dk_acc[i][dt][2 * hh] * scale, dk_acc[i][dt][2 * hh + 1] * scale);
                    *reinterpret_cast<float2*>(dkr + plane + dt * 8) = make_float2(dv_acc[i][dt][2 * hh], dv_acc[i][dt][2 * hh + 1]);
                }
            }
        }
    }
}

// flash_bwd_dkdv's entry points: the launcher's (VariantParams by value) and the flat one (CUFLASH_VARIANT_FLAT_PARAMS)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_kernel(CUFLASH_BWD_DKDV_PARAMS, const VariantParams vp) {
    flash_bwd_dkdv<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, Has_dQ>(CUFLASH_BWD_DKDV_ARGS, vp);
}
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V, bool Has_dQ>
__global__ void __launch_bounds__(kNWarps * 32, 1)
flash_bwd_dkdv_flat_kernel(CUFLASH_BWD_DKDV_PARAMS, CUFLASH_VARIANT_FLAT_PARAMS) {
    flash_bwd_dkdv<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V, Has_dQ>(CUFLASH_BWD_DKDV_ARGS,
                                                                               CUFLASH_VARIANT_FLAT_ARGS);
}

// Deterministic dQ (order "split"): query tile outer, key tiles streamed, dQ in registers.
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__device__ __forceinline__ void flash_bwd_dq(CUFLASH_BWD_DQ_PARAMS, const VariantParams vp) {
    static_assert(kBlockM == 16 * kNWarps, "each warp owns 16 query rows");
    static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "tile shape");
    static_assert(!V::Bias::kStaged, "reads the bias from global memory (the wgmma kernels stage it)");
    constexpr int kThreads = kNWarps * 32;
    constexpr int kNT = kBlockN / 8;
    constexpr int kDT = kHeadDim / 8;
    constexpr int kKT = kHeadDim / 16;
    constexpr int kTile = kBlockN * kHeadDim;

    extern __shared__ __align__(128) unsigned char smem_raw[];
    u16* sQ = reinterpret_cast<u16*>(smem_raw);
    u16* sdO = sQ + kBlockM * kHeadDim;
    u16* sK = sdO + kBlockM * kHeadDim;
    u16* sV = sK + kStages * kTile;

    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = m_block * kBlockM;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if (bi.past_queries(m0)) return;  // a shorter sequence of a packed batch
    const int len_q = bi.len_q;

    // Key tiles [n_begin, n_begin + n_end) hold the keys this query tile sees (causal, window); the K/V
    // pointers start at tile n_begin, so the loop counts tiles from there (as flash_fwd_kernel).
    const TileLoop<V> keys = bi.template key_loop<kBlockN, kBlockM>(m_block);  // [variant mask] a block map's list
    const int n_begin = keys.first, n_end = keys.count;
    const auto tile_row = [&](int j) { return (keys.tile(j) - n_begin) * kBlockN; };  // from tile n_begin on
    const int n_shift = n_begin * kBlockN;
    const int len_k = bi.len_k - n_shift;
    const u16* kg = bi.k_rows(k, b, h_kv, k_sb, k_sh, k_ss) + (i64)n_shift * k_ss;
    const u16* vg = bi.k_rows(v, b, h_kv, v_sb, v_sh, v_ss) + (i64)n_shift * v_ss;

    const int qk8 = bi.template qk_cols8<kHeadDim>(), v8 = bi.template v_cols8<kHeadDim>();  // [variant head dim]
    load_tile_async<kBlockM, kHeadDim, kThreads>(sQ, q + b * q_sb + h * q_sh + (i64)bi.q0 * q_ss, q_ss, m0, len_q, tid, qk8);
    load_tile_async<kBlockM, kHeadDim, kThreads>(sdO, dout + b * do_sb + h * do_sh + (i64)bi.q0 * do_ss, do_ss, m0, len_q, tid, v8);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
        if (st < n_end) {
            load_tile_async<kBlockN, kHeadDim, kThreads>(sK + st * kTile, kg, k_ss, tile_row(st), len_k, tid, qk8);
            load_tile_async<kBlockN, kHeadDim, kThreads>(sV + st * kTile, vg, v_ss, tile_row(st), len_k, tid, v8);
        }
        cp_async_commit();
    }

    const float* lse_row = lse + bi.row_index(h, heads_q, seqlen_q, 0);
    const float* delta_row = delta + bi.row_index(h, heads_q, seqlen_q, 0);
    const int row_base = m0 + warp * 16;
    float lse_r[2], d_r[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int i = row_base + g + 8 * hh;
        lse_r[hh] = lse_log2(lse_row, i, len_q);
        d_r[hh] = i < len_q ? delta_row[i] : 0.f;
    }
    const float scale_log2 = scale * kLog2e;

    float dq_acc[kDT][4];
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) dq_acc[dt][0] = dq_acc[dt][1] = dq_acc[dt][2] = dq_acc[dt][3] = 0.f;

    for (int j = 0; j < n_end; ++j) {
        const int jn = j + kStages - 1;
        if (jn < n_end) {
            load_tile_async<kBlockN, kHeadDim, kThreads>(sK + (jn % kStages) * kTile, kg, k_ss, tile_row(jn), len_k, tid, qk8);
            load_tile_async<kBlockN, kHeadDim, kThreads>(sV + (jn % kStages) * kTile, vg, v_ss, tile_row(jn), len_k, tid, v8);
        }
        cp_async_commit();
        const u16* tK = sK + (j % kStages) * kTile;
        const u16* tV = sV + (j % kStages) * kTile;
        cp_async_wait<kStages - 1>();
        __syncthreads();

        // [bwd 1] P = exp(scale Q K^T - lse)
        float s[kNT][4], dp[kNT][4];
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = dp[nt][e] = 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < kKT; ++kk) {
            u32 a[4], ad[4];
            load_a<kHeadDim>(a, sQ, warp * 16, kk, lane);
            load_a<kHeadDim>(ad, sdO, warp * 16, kk, lane);
#pragma unroll
            for (int np = 0; np < kNT / 2; ++np) {
                u32 bf[4];
                load_b_nk<kHeadDim>(bf, tK, np * 16, kk, lane);
                Elem<T>::mma(s[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(s[2 * np + 1], a, bf[2], bf[3]);
                // [bwd 3] dP = dO V^T
                load_b_nk<kHeadDim>(bf, tV, np * 16, kk, lane);
                Elem<T>::mma(dp[2 * np], ad, bf[0], bf[1]);
                Elem<T>::mma(dp[2 * np + 1], ad, bf[2], bf[3]);
            }
        }
        const int n0 = n_shift + tile_row(j);  // the tile's first key in the sequence
        u32 dmod[V::Has_grad ? kNT : 1][2];  // [variant grad] d mod / d s
        if constexpr (V::Has_grad) {
            mod_scores_grad<false>(s, dmod, bi, row_base, n0, lane, keys.partial(j));
        } else {
            mod_scores<false>(s, bi, row_base, n0, lane, keys.partial(j));  // [variant mod]
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -lse_r[e >> 1]));
        }
        const bool mask_mod = keys.mask_mod_in_mask(j);  // [variant mask]
        if (bi.needs_mask(m0, kBlockM, n0, kBlockN) || mask_mod) mask_block<false>(s, bi, row_base, n0, lane, 0.f, mask_mod);
        dropout_scores<false>(dp, bi, row_base, n0, lane, V::Has_dropout ? bi.keep_scale : 1.f);  // [variant dropout] on dP
        // [bwd 4] dS = P (dP - D), in place of dP ([variant grad]: times d mod / d s).
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                dp[nt][e] = s[nt][e] * (dp[nt][e] - d_r[e >> 1]);
                if constexpr (V::Has_grad) dp[nt][e] *= grad_at(dmod, nt, e);
            }
        }
        // [bwd 5] dQ += dS K (scale applied once at the end).
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
            u32 a[4];
            c_to_a<T, kNT>(a, dp, kk);
#pragma unroll
            for (int np = 0; np < kDT / 2; ++np) {
                u32 bf[4];
                load_b_kn<kHeadDim>(bf, tK, kk * 16, np, lane);
                Elem<T>::mma(dq_acc[2 * np], a, bf[0], bf[1]);
                Elem<T>::mma(dq_acc[2 * np + 1], a, bf[2], bf[3]);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int row = row_base + g + 8 * hh;
        if (row >= len_q) continue;
        u16* dqr = dq + b * dq_sb + h * dq_sh + (i64)(bi.q0 + row) * dq_ss;
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
            if (V::Pads_head_dim && dt >= qk8) break;  // [variant head dim] dq's columns only
            *reinterpret_cast<u32*>(dqr + dt * 8 + 2 * t) =
                Elem<T>::pack(dq_acc[dt][2 * hh] * scale, dq_acc[dt][2 * hh + 1] * scale);
        }
    }
}

// flash_bwd_dq's entry points: the launcher's (VariantParams by value) and the flat one (CUFLASH_VARIANT_FLAT_PARAMS)
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_dq_kernel(CUFLASH_BWD_DQ_PARAMS, const VariantParams vp) {
    flash_bwd_dq<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_BWD_DQ_ARGS, vp);
}
template <class T, int kHeadDim, int kBlockM, int kBlockN, int kNWarps, int kStages, class V>
__global__ void __launch_bounds__(kNWarps * 32)
flash_bwd_dq_flat_kernel(CUFLASH_BWD_DQ_PARAMS, CUFLASH_VARIANT_FLAT_PARAMS) {
    flash_bwd_dq<T, kHeadDim, kBlockM, kBlockN, kNWarps, kStages, V>(CUFLASH_BWD_DQ_ARGS, CUFLASH_VARIANT_FLAT_ARGS);
}

// dQ = scale * dq_accum (float32, (batch, heads_q, seqlen_q, d)) cast to T with dq's strides; dq has the first
// `cols` of the workspace's kHeadDim columns ([variant head dim]: fewer when the kernels read dims below theirs).
// Grid (ceil(seqlen_q * d / 2 / 256), heads_q, batch); one thread per pair of elements.
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256)
flash_bwd_convert_dq_kernel(const float* __restrict__ dq_accum, u16* __restrict__ dq, int seqlen_q, int heads_q,
                            i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale, int cols) {
    const int h = blockIdx.y, b = blockIdx.z;
    const int e = (blockIdx.x * 256 + threadIdx.x) * 2;  // element within this head's seqlen_q x d plane
    if (e >= seqlen_q * kHeadDim) return;
    const int i = e / kHeadDim, d = e % kHeadDim;
    if (d >= cols) return;
    const float2 x = *reinterpret_cast<const float2*>(dq_accum + ((i64)b * heads_q + h) * seqlen_q * kHeadDim + e);
    *reinterpret_cast<u32*>(dq + b * dq_sb + h * dq_sh + (i64)i * dq_ss + d) = Elem<T>::pack(x.x * scale, x.y * scale);
}

// GQA/MQA: dK[b, :, hk] = sum over the group's query heads of the per-head workspace, in a fixed order; dk and dv
// have the first dk_cols and dv_cols of the workspace's kHeadDim columns ([variant head dim]).
// Grid (ceil(seqlen_k * d / 2 / 256), heads_kv, batch).
template <class T, int kHeadDim>
__global__ void __launch_bounds__(256, 4)  // (without the 4, ptxas kept 32 registers and spilled 8 bytes)
flash_bwd_reduce_dkv_kernel(const float* __restrict__ dkv_accum, u16* __restrict__ dk, u16* __restrict__ dv,
                            int seqlen_k, int group, i64 plane,
                            i64 dk_sb, i64 dk_ss, i64 dk_sh, i64 dv_sb, i64 dv_ss, i64 dv_sh, int dk_cols, int dv_cols) {
    const int hk = blockIdx.y, b = blockIdx.z;
    const int heads_q = gridDim.y * group;
    const int e = (blockIdx.x * 256 + threadIdx.x) * 2;
    if (e >= seqlen_k * kHeadDim) return;
    const int j = e / kHeadDim, d = e % kHeadDim;
    if (d >= dk_cols && d >= dv_cols) return;
    float2 sk = make_float2(0.f, 0.f), sv = make_float2(0.f, 0.f);
    for (int gi = 0; gi < group; ++gi) {
        const i64 off = ((i64)b * heads_q + hk * group + gi) * seqlen_k * kHeadDim + e;
        const float2 xk = *reinterpret_cast<const float2*>(dkv_accum + off);
        const float2 xv = *reinterpret_cast<const float2*>(dkv_accum + plane + off);
        sk.x += xk.x; sk.y += xk.y;
        sv.x += xv.x; sv.y += xv.y;
    }
    if (d < dk_cols) *reinterpret_cast<u32*>(dk + b * dk_sb + hk * dk_sh + (i64)j * dk_ss + d) = Elem<T>::pack(sk.x, sk.y);
    if (d < dv_cols) *reinterpret_cast<u32*>(dv + b * dv_sb + hk * dv_sh + (i64)j * dv_ss + d) = Elem<T>::pack(sv.x, sv.y);
}

// ---------------------------------------------------------------------------------------------------
// float32 path: SIMT. flash_bwd_dq_f32_kernel (order "split"): one warp per query row (lanes over keys for
// the scores, over the head dimension for dQ), no atomics; flash_bwd_dkdv_f32_kernel below.
template <int kHeadDim, class V>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dq_f32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                        const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                        float* __restrict__ dq, int seqlen_q, int seqlen_k, int heads_q, int group,
                        i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                        i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh,
                        i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale, const VariantParams vp) {
    constexpr int kPer = kHeadDim / 32;
    __shared__ float sq[4][kHeadDim], sdo[4][kHeadDim];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + warp;
    const int h = blockIdx.y, b = blockIdx.z, h_kv = h / group;
    const BlockInfo<V> bi(vp, b, h, seqlen_q, seqlen_k);
    if (row >= bi.len_q) return;
    const float* qrow = q + b * q_sb + h * q_sh + (i64)(bi.q0 + row) * q_ss;
    const float* dorow = dout + b * do_sb + h * do_sh + (i64)(bi.q0 + row) * do_ss;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
        sq[warp][lane + 32 * c] = qrow[lane + 32 * c];
        sdo[warp][lane + 32 * c] = dorow[lane + 32 * c];
    }
    __syncwarp();
    const float* kg = k + b * k_sb + h_kv * k_sh + (i64)bi.k0 * k_ss;
    const float* vg = v + b * v_sb + h_kv * v_sh + (i64)bi.k0 * v_ss;
    const i64 stat = bi.row_index(h, heads_q, seqlen_q, row);
    const float l = lse[stat];
    const float dd = delta[stat];
    // The keys [x, y) this row sees (none when its lse is -inf).
    const int2 keys = l == -CUFLASH_INF ? make_int2(0, 0) : bi.key_range(row, row + 1);
    float acc[kPer];
#pragma unroll
    for (int c = 0; c < kPer; ++c) acc[c] = 0.f;
    for (int j0 = keys.x; j0 < keys.y; j0 += 32) {
        const int key = j0 + lane;
        float ds = 0.f;
        if (key < keys.y) {
            const float* krow = kg + (i64)key * k_ss;
            const float* vrow = vg + (i64)key * v_ss;
            float s = 0.f, dp = 0.f;
#pragma unroll 8
            for (int d = 0; d < kHeadDim; ++d) {
                s = fmaf(sq[warp][d], krow[d], s);
                dp = fmaf(sdo[warp][d], vrow[d], dp);
            }
            float grad = 1.f;
            s = bi.template mod<true>(s, row, key, grad);  // [variant mod]
            const float p = expf(s * scale - l);  // [bwd 1]
            if constexpr (V::Has_dropout) dp = bi.keep(row, key) ? dp * bi.keep_scale : 0.f;  // [variant dropout]
            ds = p * (dp - dd) * grad;            // [bwd 3], [bwd 4], [variant grad]
        }
        const int nk = min(32, keys.y - j0);
        for (int jj = 0; jj < nk; ++jj) {  // [bwd 5]
            const float dsj = __shfl_sync(0xffffffffu, ds, jj);
            const float* krow = kg + (i64)(j0 + jj) * k_ss;
#pragma unroll
            for (int c = 0; c < kPer; ++c) acc[c] = fmaf(dsj, krow[lane + 32 * c], acc[c]);
        }
    }
    float* dqr = dq + b * dq_sb + h * dq_sh + (i64)(bi.q0 + row) * dq_ss;
#pragma unroll
    for (int c = 0; c < kPer; ++c) dqr[lane + 32 * c] = acc[c] * scale;
}

// dK/dV (+ dQ) of one key/value tile per thread block, grid (ceil(seqlen_k / kBlockN), heads_q, batch):
// bwd_f32_key_tile (f32_tiles.cuh, shared with fa1.cu's float32 backward). With Has_dQ (order
// "kv_outer") dQ_i += scale dS K_j goes to dq (float32, zeroed) by atomicAdd; without it (order "split")
// flash_bwd_dq_f32_kernel computes dQ. dK, dV go per query head to dkv; the launcher sums each GQA group.
template <int kHeadDim, int kBlockN, class V, bool Has_dQ>
__global__ void __launch_bounds__(128, 1)
flash_bwd_dkdv_f32_kernel(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                          const float* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
                          float* __restrict__ dq, float* __restrict__ dkv,
                          int seqlen_q, int seqlen_k, int heads_q, int group,
                          i64 q_sb, i64 q_ss, i64 q_sh, i64 k_sb, i64 k_ss, i64 k_sh,
                          i64 v_sb, i64 v_ss, i64 v_sh, i64 do_sb, i64 do_ss, i64 do_sh,
                          i64 dq_sb, i64 dq_ss, i64 dq_sh, float scale, const VariantParams vp) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const BlockInfo<V> bi(vp, blockIdx.z, blockIdx.y, seqlen_q, seqlen_k);
    if (bi.past_keys(blockIdx.x * kBlockN)) return;  // keys of a shorter sequence
    const F32BwdArgs args{q, k, v, dout, lse, delta, dq, dkv, seqlen_q, seqlen_k, heads_q, group,
                          V::Is_varlen ? 1 : (int)gridDim.z,
                          q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh, do_sb, do_ss, do_sh,
                          dq_sb, dq_ss, dq_sh, scale};
    bwd_f32_key_tile<kHeadDim, kBlockN, V, Has_dQ ? DqUpdate::kAtomic : DqUpdate::kNone>(
        args, bi, blockIdx.x, blockIdx.y, blockIdx.z, reinterpret_cast<float*>(smem_raw));
}

}  // namespace cuflash
